import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_gradroute.diagnostics import PSISResult, pareto_khat, psis_khat
from tests.conjugate import fit, poisson_gamma

from .models import fixed_normal_guide, gaussian, gaussian_posterior


@pytest.mark.slow
def test_conjugate_model_fitted_with_exact_family_is_good():
    case = poisson_gamma()
    guide, _ = fit(case, "TraceSTL_ELBO")  # AutoMeanField with a Gamma factor
    k = psis_khat(case.model, guide, case.data, num_samples=2000)
    assert k < 0.5 and k.reading == "good"


def test_badly_mismatched_guide_is_unreliable():
    x = torch.tensor([0.3, -0.4, 0.8])
    m, s = gaussian_posterior(x)
    # two posterior sds off and 5x too narrow: k-hat was 0.75-1.29 over 20 seeds
    k = psis_khat(gaussian, fixed_normal_guide(m + 2 * s, 0.2 * s), x, num_samples=4000)
    assert k > 0.7 and k.reading == "unreliable"


def test_guide_equal_to_posterior_is_perfect_not_unreliable():
    x = torch.tensor([0.3, -0.4, 0.8])
    m, s = gaussian_posterior(x)
    k = psis_khat(gaussian, fixed_normal_guide(m, s), x, num_samples=500)
    assert k.khat == -math.inf and k.reading == "good"
    assert pareto_khat(torch.full((100,), -3.25)).reading == "good"


@pytest.mark.parametrize(
    "k, reading",
    [(0.2, "good"), (0.5, "usable"), (0.7, "usable"), (0.71, "unreliable"),
     (math.nan, "unreliable"), (math.inf, "unreliable")],
)  # fmt: skip
def test_readings(k, reading):
    r = PSISResult(k, 10)
    assert r.reading == reading and (math.isnan(k) or float(r) == k)


def test_nan_log_ratios_are_an_error():
    with pytest.raises(ValueError, match="NaN"):
        pareto_khat(torch.tensor([0.0, float("nan"), 1.0]))


def test_positive_infinite_ratio_is_unreliable():
    assert pareto_khat(torch.tensor([0.0, 1.0, float("inf")])).reading == "unreliable"


def test_pyro_fallback_agrees_with_arviz():
    from pyro_gradroute.diagnostics.psis import _pyro_khat

    lw = torch.distributions.StudentT(2.0).sample((4000,)).abs().log() * 2
    assert abs(_pyro_khat(lw.numpy()) - pareto_khat(lw).khat) < 0.15


def test_psis_khat_accepts_model_kwargs():
    def model(x=None):
        pyro.sample("z", dist.Normal(0.0, 1.0))

    k = psis_khat(model, lambda x=None: pyro.sample("z", dist.Normal(0.0, 1.0)), x=1.0)
    assert k.reading == "good"
