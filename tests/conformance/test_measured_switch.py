"""Conformance cells of ``stick_the_landing(guide, switch="measured")`` on every case of the registry.

Under Pyro's ``Trace_ELBO`` (the case's particles), every step of 12 must equal, on the same
seed, either Pyro's ``Trace_ELBO`` with the plain guide or the STL reference built from Pyro's
traces (``checks.stl_reference_grad``; the handler's own STL where the same-draw reference
does not cover the guide): the switch never mixes, and each run's choice comes from earlier
runs. The first step is ``Trace_ELBO``'s; the second half of the steps run in the switch's
STL state (set by the cell) and must be STL's. A case the switch cannot read
(a reparameterized site that is not a ``Normal``, or a ``Normal`` pushed forward by
parameter-free bijections, whose parameters read no earlier sample) raises a ``ValueError``
naming the site and ``trace_steps``: the cell checks that it does.
"""

from __future__ import annotations

import pytest
import torch

from pyro_gradroute.poutine import stick_the_landing

from .cases import CASES
from .checks import (
    NoSameDrawReference,
    _tols,
    cell,
    grad_of,
    pyro_trace,
    reference_grad,
    seeded,
    stl_reference_grad,
)

STEPS = 12


def _grad(c, guide, seed):
    elbo = pyro_trace("Trace", c.case)  # Pyro's Trace_ELBO with the case's particles
    return seeded(seed, lambda: grad_of(c, lambda: elbo.loss_and_grads(c.model, guide, *c.args)))[1]


def _stl(c, seed):
    try:
        return stl_reference_grad(c, "STL", seed, c.model, c.guide)
    except NoSameDrawReference:
        return _grad(c, stick_the_landing(c.guide), seed)


def check(case) -> str:
    with cell(case) as c:
        handler = stick_the_landing(switch="measured")
        switched = handler(c.guide)
        rtol, atol = _tols(case.dtype)
        ends = []
        for seed in range(STEPS):
            if seed == STEPS // 2:  # the second half in the switch's STL state
                handler._switch.stl = True
            try:
                g = _grad(c, switched, 300 + seed)
            except ValueError as e:
                assert "switch='measured'" in str(e) and "guide site '" in str(e), str(e)
                assert "trace_steps" in str(e), str(e)
                return "raised"
            trace = reference_grad(c, "Trace", 300 + seed, c.model, c.guide)
            stl = _stl(c, 300 + seed)
            is_trace = torch.allclose(g, trace, rtol=rtol * 10, atol=atol * 10)
            is_stl = torch.allclose(g, stl, rtol=rtol * 10, atol=atol * 10)
            assert is_trace or is_stl, f"{case.name}: step {seed} is neither Trace_ELBO's nor STL's"
            ends.append(is_trace)
        assert ends[0], f"{case.name}: the first step is not Trace_ELBO's"
        if not all(ends[STEPS // 2 :]):  # (a guide whose STL equals Trace_ELBO: both match)
            assert not any(
                e
                and not torch.allclose(
                    _stl(c, 300 + i), reference_grad(c, "Trace", 300 + i, c.model, c.guide)
                )
                for i, e in enumerate(ends)
                if i >= STEPS // 2
            ), f"{case.name}: a step in the STL state is Trace_ELBO's"
        return "checked"


#: the cases the switch reads (every reparameterized guide site a Normal, or a Normal pushed
#: forward by parameter-free bijections, whose parameters read no earlier sample); the others
#: raise, naming a site
READS = {
    "AutoNormal",
    "AutoDiagonalNormal",
    "AutoDelta",
    "AutoGuideList",
    "chain1",
    "nested_plates",
    "ComposeTransform",
    "LogNormal",
    "sigmoid_tail",
    "amortized",
    "subsample_all",
    "subsample_inner",
    "scale_tensor",
    "mask",
    "obs_mask",
    "LocScaleReparam",
    "TransformReparam",
    "sigmoid_tail_AutoNormal",
    "Bernoulli",
    "Poisson",
    "masked_nonreparam",
    "aux_nonreparam",
}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_measured_switch(case):
    assert check(case) == ("checked" if case.name in READS else "raised"), case.name
