"""Flow guides in the conformance matrix: forward-carried pathwise parts.

Inverse-free flows (Planar, Radial), affine coupling, conditional flows (a conditioned
transform reading an upstream guide sample: a planar one without an inverse and an
autoregressive one), and flows at the exact posterior (an identity Planar flow over a
Gaussian base equal to the posterior; an IAF whose network outputs the posterior's mean
and log-scale), crossed with every estimator and check of ``checks.py``.
"""

import functools
import math

import pyro
import pyro.distributions as dist
import pyro.distributions.transforms as T
import pytest
import torch
from pyro.infer import autoguide as ag
from torch.distributions import constraints

from tests import conjugate

from .cases import Built, Case, Route, _init, set_params
from .checks import cells, run_cell


def _auto_flow(init):
    def build():
        m = conjugate.GaussianModel(D=2, n=3)
        guide = ag.AutoNormalizingFlow(m.model, init)
        _init(m.model, guide, ())
        return Built(m.model, guide)

    return build


def _planar_identity():
    """Planar flow set to the identity (u_hat = 0) over a Gaussian base equal to the posterior."""
    m = conjugate.GaussianModel(D=2, n=3)
    flow = T.Planar(2)

    def guide():
        pyro.module("pf", flow)
        loc = pyro.param("pf_loc", torch.tensor([0.2, -0.1]))
        scale = pyro.param("pf_scale", torch.tensor([0.7, 0.9]), constraint=constraints.positive)
        pyro.sample("z", dist.TransformedDistribution(dist.Normal(loc, scale).to_event(1), [flow]))

    _init(m.model, guide, ())

    def exact():
        mean, cov = m.posterior()
        set_params({"pf_loc": mean, "pf_scale": cov.diagonal().sqrt()})
        with torch.no_grad():
            w = flow.w
            flow.u.copy_(w * math.log(math.e - 1) / (w * w).sum())  # u_hat = 0

    return Built(m.model, guide, (), exact)


def _iaf_exact():
    m = conjugate.GaussianModel(D=2, n=3)
    guide = ag.AutoIAFNormal(m.model, hidden_dim=[4], num_transforms=1)
    _init(m.model, guide, ())

    def exact():
        mean, cov = m.posterior()
        iaf = guide.transform.parts[0] if hasattr(guide.transform, "parts") else guide.transform
        last = iaf.arn.layers[-1]
        with torch.no_grad():
            last.weight.zero_()
            last.bias.copy_(torch.cat([mean, 0.5 * cov.diagonal().log()]))

    return Built(m.model, guide, (), exact)


class _ChainModel:
    """``z1 ~ N(0, 1)``, ``z2 ~ N(z1, 1)`` (2 dims), two observations ``x_i ~ N(z2, 0.5)``."""

    x = torch.tensor([[1.0, 0.4], [0.6, 1.2]])

    def model(self):
        z1 = pyro.sample("z1", dist.Normal(0.0, 1.0))
        z2 = pyro.sample(
            "z2", dist.Normal(z1.unsqueeze(-1).expand(z1.shape + (2,)), 1.0).to_event(1)
        )
        loc = z2.unsqueeze(-2).expand(z2.shape[:-1] + (2, 2))
        pyro.sample("x", dist.Normal(loc, 0.5).to_event(2), obs=self.x)


def _conditional(make):
    def build():
        m = _ChainModel()
        cflow = make()

        def guide():
            pyro.module("cflow", cflow)
            a = pyro.param("c_a", torch.tensor(0.3))
            s = pyro.param("c_s", torch.tensor(0.8), constraint=constraints.positive)
            z1 = pyro.sample("z1", dist.Normal(a, s))
            base = dist.Normal(torch.zeros(2), 1.0).to_event(1)
            q2 = dist.ConditionalTransformedDistribution(base, [cflow]).condition(z1.unsqueeze(-1))
            pyro.sample("z2", q2)

        _init(m.model, guide, ())
        return Built(m.model, guide)

    return build


FLOW_CASES = [
    Case(
        "Flow-planar",
        _auto_flow(functools.partial(T.iterated, 2, T.planar)),
        Route(("x",), ("AutoNormalizingFlow.*",)),
    ),
    Case(
        "Flow-radial",
        _auto_flow(functools.partial(T.iterated, 2, T.radial)),
        Route(("x",), ("AutoNormalizingFlow.*",)),
    ),
    Case(
        "Flow-affine_coupling",
        _auto_flow(functools.partial(T.affine_coupling, hidden_dims=[4])),
        Route(("x",), ("AutoNormalizingFlow.*",)),
    ),
    Case("Flow-planar-identity-exact", _planar_identity, Route(("x",), ("pf_loc",))),
    Case("Flow-IAF-exact", _iaf_exact, Route(("x",), ("AutoIAFNormal.*",))),
    Case(
        "Flow-conditional-planar",
        _conditional(lambda: T.conditional_planar(2, 1, hidden_dims=[4])),
        Route(("x",), ("c_a",)),
    ),
    Case(
        "Flow-conditional-IAF",
        _conditional(lambda: T.conditional_affine_autoregressive(2, 1, hidden_dims=[4])),
        Route(("x",), ("c_a",)),
    ),
]

# Pyro's ReweightedWakeSleep (the RWS reference) scores detached guide samples, which needs
# the inverse: there is no reference for flows without one
NO_INVERSE = {"Flow-planar", "Flow-radial", "Flow-planar-identity-exact", "Flow-conditional-planar"}
CELLS = [
    (c, e, r, k)
    for c, e, r, k in cells(FLOW_CASES)
    if not (c.name in NO_INVERSE and e == "RWS" and k in ("grad", "loss"))
]


@pytest.mark.parametrize(
    "case, est, routed, check",
    CELLS,
    ids=[f"{c.name}-{e}{'+route' if r else ''}-{k}" for c, e, r, k in CELLS],
)
def test_flow_conformance(case, est, routed, check):
    run_cell(case, est, routed, check)
