"""Private Pyro API is used in ``pyro_gradroute/_compat.py`` only.

``PENDING`` lists the files that still use it directly, to be switched to ``_compat``; each must
really still do so, so that the list only shrinks."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pyro_gradroute"
PRIVATE = re.compile(
    r"param_store\(\)\._params|\._params\[|_Subsample|_compute_log_r|[\"']_deterministic[\"']"
    r"|\._pyro_name|\._pyro_context|_pyro_set_supermodule"
    r"|_will_engine_execute_node|\._backward_hooks|[\"']_backward_hooks[\"']|sys\._getframe"
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


def test_compat_functions_work_on_the_installed_versions():
    """Each private reach in ``_compat`` does what it stands for on this torch and Pyro."""
    import pyro
    import torch
    from pyro.infer import Trace_ELBO

    from pyro_gradroute import _compat

    x = torch.ones(2, requires_grad=True)
    m = x * 2
    other = (x * 5).sum()  # a graph the backward below does not run
    y = m.sum()
    seen = []

    def pre(grad_outputs):
        seen.append(_compat.will_engine_execute(m.grad_fn))
        seen.append(_compat.will_engine_execute(other.grad_fn))

    y.grad_fn.register_prehook(pre)
    y.backward()
    assert seen == [True, False]
    t = x * 3
    t.register_hook(lambda g: g)
    assert len(_compat.tensor_backward_hooks(t)) == 1

    found = []

    def guide():
        found.append(_compat.calling_elbo(depth=60))

    def model():
        pass

    elbo = Trace_ELBO()
    elbo.loss(model, guide)
    assert found and found[0] is elbo

    def inner():
        return _compat.find_frame({outer.__code__: "outer"})

    def outer():
        return inner()

    frame, hit = outer()
    assert hit == "outer" and frame.f_code is outer.__code__
    assert pyro.__version__.startswith("1.9"), pyro.__version__
