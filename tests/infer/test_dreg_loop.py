"""TraceDReG_ELBO with ``vectorize_particles=False`` (the particles drawn in a loop): its
gradient is an unbiased estimate of the Renyi / IWAE bound's, so its mean over many seeded
draws matches that of Pyro's ``RenyiELBO`` (an independent reference, its own particle loop)
within 4.5 Monte Carlo standard errors of the difference, for model and guide parameters.

The test can fail: the same comparison separates the K-particle bound's gradient from the
ELBO's (``Trace_ELBO``) by many standard errors.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import RenyiELBO
from torch.distributions import constraints

from pyro_gradroute.infer import TraceDReG_ELBO

K = 3  # particles
DRAWS = 1500
TOL_SE = 4.5
X = torch.tensor([[0.8, -0.3], [1.4, 0.1], [0.5, -1.0], [1.1, 0.4]], dtype=torch.float64)


def model():
    theta = pyro.param("theta", torch.tensor([0.2, -0.1], dtype=torch.float64))
    z = pyro.sample("z", dist.Normal(theta, 1.0).to_event(1))
    with pyro.plate("data", len(X)):
        pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=X)


def guide():
    loc = pyro.param("q_loc", torch.tensor([0.3, 0.4], dtype=torch.float64))
    scale = pyro.param(
        "q_scale", torch.tensor([0.9, 0.3], dtype=torch.float64), constraint=constraints.positive
    )
    pyro.sample("z", dist.Normal(loc, scale).to_event(1))


NAMES = ("theta", "q_loc", "q_scale")


def gradient_draws(elbo, seed: int) -> torch.Tensor:
    """``DRAWS`` gradient estimates of all parameters (unconstrained), one row each."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide()
    model()
    params = [pyro.param(n).unconstrained() for n in NAMES]
    rows = []
    for _ in range(DRAWS):
        for p in params:
            p.grad = None
        elbo.loss_and_grads(model, guide)
        rows.append(torch.cat([p.grad.reshape(-1) for p in params]))
    return torch.stack(rows)


def z_scores(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Difference of the means over its Monte Carlo standard error, per element."""
    se = (a.var(0) / len(a) + b.var(0) / len(b)).sqrt()
    return (a.mean(0) - b.mean(0)) / se


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_dreg_loop_gradient_matches_renyi_elbo_in_expectation(alpha):
    loop = TraceDReG_ELBO(num_particles=K, vectorize_particles=False, alpha=alpha)
    assert not loop.vectorize_particles
    dreg = gradient_draws(loop, seed=0)
    renyi = gradient_draws(RenyiELBO(alpha=alpha, num_particles=K), seed=1)
    z = z_scores(dreg, renyi)
    assert z.abs().max() < TOL_SE, z
    # DReG's point: less guide-gradient variance than the bound's plain gradient
    guide_part = slice(2, None)
    assert dreg[:, guide_part].var(0).sum() < renyi[:, guide_part].var(0).sum()


@pytest.mark.slow
def test_the_comparison_has_the_power_to_fail():
    """The ELBO's gradient (K = 1) is not the K-particle bound's: many SEs apart."""
    renyi = gradient_draws(RenyiELBO(alpha=0.0, num_particles=K), seed=1)
    elbo = gradient_draws(pyro.infer.Trace_ELBO(), seed=2)
    assert z_scores(elbo, renyi).abs().max() > 2 * TOL_SE
