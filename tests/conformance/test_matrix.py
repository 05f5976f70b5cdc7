"""The conformance matrix: every case of the registry x every estimator x every check that applies.

Like Pyro's ``tests/infer/test_gradient.py``: one parametrized test. Cell ids read
``case-estimator[+route]-check``. See ``checks.py`` for what each check promises and
``python -m tests.conformance --full`` for the tier with 16x the draws.
"""

import pytest

from .cases import CASES
from .checks import cells, run_cell

CELLS = cells(CASES)


@pytest.mark.parametrize(
    "case, est, routed, check",
    CELLS,
    ids=[f"{c.name}-{e}{'+route' if r else ''}-{k}" for c, e, r, k in CELLS],
)
def test_conformance(case, est, routed, check):
    run_cell(case, est, routed, check)
