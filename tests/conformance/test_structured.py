"""Structured guides in the conformance matrix: AutoStructured and AutoGaussian (dense).

Their Delta sites carry a ``log_density`` that depends on the guide's parameters; the
pathwise estimators take the joint density's pathwise part through the guide's affine map
(``pyro_gradroute.distributions.structured``). Cases: an ``mvn`` block over a positive
latent at the exact posterior (``exp`` transform, ``scale_tril``), ``AutoGaussian`` at the
exact posterior, a non-linear dependency module, and an auxiliary Delta computed from
parameters and read by a conditional site (a clear error for the pathwise estimators).
The ``AutoStructured`` chain with a linear dependency is in ``cases.py``.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import autoguide as ag

from tests import conjugate

from .cases import DREG, Built, Case, Raises, Route, _init, set_params, site_name
from .checks import cells, run_cell


class PositiveModel:
    """``log z ~ N(0, I_2)``, ``log x_i ~ N(log z_1 + log z_2, s)``: a Gaussian posterior of ``log z``."""

    s = 0.8

    def __init__(self, n=3):
        g = torch.Generator().manual_seed(3)
        self.y = torch.randn(n, generator=g) * self.s + 0.5
        self.x = self.y.exp()

    def model(self):
        z = pyro.sample("z", dist.LogNormal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", len(self.x)):
            pyro.sample("x", dist.LogNormal(z.log().sum(-1), self.s), obs=self.x)

    def posterior_log(self):
        n = len(self.y)
        P = torch.eye(2) + n / self.s**2 * torch.ones(2, 2)
        cov = torch.linalg.inv(P)
        return cov @ torch.full((2,), self.y.sum().item() / self.s**2), cov


def _structured_mvn():
    m = PositiveModel()
    guide = ag.AutoStructured(m.model, conditionals="mvn")
    _init(m.model, guide, ())

    def exact():
        mean, cov = m.posterior_log()
        set_params(
            {
                "AutoStructured.locs.z": mean,
                "AutoStructured.scales.z": torch.ones(2),
                "AutoStructured.scale_trils.z": torch.linalg.cholesky(cov),
            }
        )

    return Built(m.model, guide, (), exact)


def _gaussian_dense():
    m = conjugate.GaussianModel(D=2, n=3)
    guide = ag.AutoGaussian(m.model)
    _init(m.model, guide, ())

    def exact():
        mean, cov = m.posterior()
        L = torch.linalg.cholesky(torch.linalg.inv(cov))
        p = "AutoGaussianDense"
        set_params(
            {
                f"{p}.locs.z": torch.zeros(2),
                f"{p}.scales.z": torch.ones(2),
                f"{p}.prec_sqrts.z": L,
                f"{p}.white_vecs.z": L.T @ mean,
                f"{p}.prec_sqrts.x": torch.zeros(2, 2),
                f"{p}.white_vecs.x": torch.zeros(2),
            }
        )

    return Built(m.model, guide, (), exact)


def _chain_model():
    x = torch.tensor([0.9, -0.4])
    z0 = pyro.sample("z0", dist.Normal(0.0, 1.0))
    z1 = pyro.sample("z1", dist.Normal(0.8 * z0, 1.0))
    pyro.sample("x0", dist.Normal(z0, 0.7), obs=x[0])
    pyro.sample("x1", dist.Normal(z1, 0.7), obs=x[1])


def _nonlinear_dep():
    net = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Tanh())
    guide = ag.AutoStructured(
        _chain_model,
        conditionals={"z0": "normal", "z1": "normal"},
        dependencies={"z1": {"z0": net}},
    )
    _init(_chain_model, guide, ())
    with torch.no_grad():
        net[0].weight.fill_(0.7)
        net[0].bias.fill_(0.1)
    return Built(_chain_model, guide, ())


def _aux_delta_chain():
    def model():
        z0 = pyro.sample("z0", dist.Normal(0.0, 1.0))
        z2 = pyro.sample("z2", dist.Normal(z0, 1.0))
        pyro.sample("x", dist.Normal(z2, 0.5), obs=torch.tensor(0.3))

    def guide():
        m0 = pyro.param("m0", torch.tensor(0.1))
        c = pyro.param("c", torch.tensor(0.2))
        d = pyro.param("d", torch.tensor(0.5))
        z0 = pyro.sample("z0", dist.Normal(m0, 1.0))
        w = pyro.sample("w", dist.Delta(c + d * z0), infer={"is_auxiliary": True})
        pyro.sample("z2", dist.Normal(w, 0.7))

    _init(model, guide, ())
    return Built(model, guide, ())


_RWS = {"RWS": Raises(ValueError, site_name("z"))}
_RWS0 = {"RWS": Raises(ValueError, site_name("z0"))}
_AUX = {e: Raises(ValueError, site_name("z2") + "|" + site_name("w")) for e in ("STL", *DREG)}

STRUCTURED_CASES = [
    Case(
        "AutoStructured-mvn-positive-exact",
        _structured_mvn,
        Route(("x",), ("AutoStructured.locs.z",)),
        raises=_RWS,
        routed_raises=_RWS,
    ),
    Case(
        "AutoGaussian-dense-exact",
        _gaussian_dense,
        Route(("x",), ("AutoGaussianDense.locs.z",)),
        raises=_RWS,
        routed_raises=_RWS,
    ),
    Case(
        "AutoStructured-nonlinear-dep",
        _nonlinear_dep,
        Route(("x1",), ("AutoStructured.locs.z0",)),
        raises=_RWS0,
        routed_raises=_RWS0,
    ),
    Case(
        "Aux-Delta-chain", _aux_delta_chain, Route(("x",), ("m0",)), raises=_AUX, routed_raises=_AUX
    ),
]
# ReweightedWakeSleepDReG refuses these guides: its wake-phi reference (Pyro's
# ReweightedWakeSleep, checks._hand) scores detached samples, which for them needs the joint
# density at a fixed z (the inverse of the guide's map), so the update has no reference.
CELLS = cells(STRUCTURED_CASES)


@pytest.mark.parametrize(
    "case, est, routed, check",
    CELLS,
    ids=[f"{c.name}-{e}{'+route' if r else ''}-{k}" for c, e, r, k in CELLS],
)
def test_structured_conformance(case, est, routed, check):
    run_cell(case, est, routed, check)
