"""Private Pyro API is used in ``pyro_gradroute/_compat.py`` only.

``PENDING`` lists the files that still use it directly, to be switched to ``_compat``; each must
really still do so, so that the list only shrinks."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pyro_gradroute"
PRIVATE = re.compile(
    r"param_store\(\)\._params|\._params\[|_Subsample|_compute_log_r|[\"']_deterministic[\"']"
    r"|\._pyro_name|\._pyro_context|_pyro_set_supermodule"
)
PENDING: set[str] = set()


def uses():
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        hits = PRIVATE.findall(path.read_text())
        if hits and rel != "_compat.py":
            found[rel] = sorted(set(hits))
    return found


def test_private_pyro_api_only_in_compat():
    found = uses()
    assert set(found) <= PENDING, {k: v for k, v in found.items() if k not in PENDING}
    assert set(found) == PENDING, f"switched to _compat, drop from PENDING: {PENDING - set(found)}"
