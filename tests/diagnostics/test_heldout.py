import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_gradroute.diagnostics.heldout import heldout_log_likelihood

from .models import fixed_normal_guide, gaussian, gaussian_posterior


def test_predictive_matches_closed_form():
    x, new = torch.tensor([0.3, -0.4, 0.8, 1.1]), torch.tensor([0.0, 2.0])
    m, s = gaussian_posterior(x)
    ll = heldout_log_likelihood(gaussian, fixed_normal_guide(m, s), (x,), (new,),
                                num_samples=4000)  # fmt: skip
    exact = dist.Normal(m, math.sqrt(1 + s**2)).log_prob(new).mean()
    assert ll == pytest.approx(float(exact), abs=0.02)


def test_marginal_matches_closed_form():
    x = torch.tensor([0.3, -0.4, 0.8])
    m, s = gaussian_posterior(x)
    ll = heldout_log_likelihood(gaussian, fixed_normal_guide(m, s), (x,), (x,), "marginal", 10)
    cov = torch.eye(3) + torch.ones(3, 3)  # x ~ N(0, I + 11^T)
    exact = dist.MultivariateNormal(torch.zeros(3), cov).log_prob(x) / 3
    assert ll == pytest.approx(float(exact), abs=1e-4)


def test_unknown_method():
    with pytest.raises(ValueError, match="predictive"):
        heldout_log_likelihood(gaussian, fixed_normal_guide(0, 1), (torch.zeros(2),),
                               (torch.zeros(2),), "bogus")  # fmt: skip


def test_no_observed_sites():
    with pytest.raises(ValueError, match="no observed"):
        heldout_log_likelihood(lambda: pyro.sample("z", dist.Normal(0.0, 1.0)),
                               lambda: pyro.sample("z", dist.Normal(0.0, 1.0)), (), ())  # fmt: skip
