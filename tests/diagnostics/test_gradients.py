import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_gradroute.diagnostics import compare_gradients, gradient_stats
from pyro_gradroute.infer import Trace_ELBO, TraceSTL_ELBO

from .models import gaussian, gaussian_posterior


def param_guide(x, m0=0.3, s0=0.7):
    m = pyro.param("m", torch.tensor(m0))
    s = pyro.param("s", torch.tensor(s0), constraint=dist.constraints.positive)
    pyro.sample("z", dist.Normal(m, s))


def test_params_grads_and_rng_are_left_untouched():
    x = torch.tensor([0.5, 1.0])
    param_guide(x)
    store = pyro.get_param_store()
    before = {n: p.detach().clone() for n, p in store.named_parameters()}
    grad_m = torch.tensor(123.0)
    store._params["m"].grad = grad_m  # a pending gradient must survive
    rng = torch.get_rng_state()
    stats = gradient_stats(gaussian, param_guide, Trace_ELBO(), x, num_draws=10)
    assert set(stats) == {"m", "s"} and stats.guide_params == ["m", "s"]
    after = dict(store.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert after["m"].grad is grad_m and float(grad_m) == 123.0
    assert after["s"].grad is None
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.slow
def test_matches_hand_computed_mean_and_variance():
    # log p(x, z) = -z^2/2 - sum (x_i - z)^2 / 2 + c, z = m + s eps. Trace_ELBO's gradient of the
    # loss w.r.t. m is -(d/dz log p) = (n + 1) z - sum x  (the entropy does not depend on m),
    # so over eps: mean (n + 1) m - sum x and variance (n + 1)^2 s^2.
    x = torch.tensor([0.5, 1.0, -0.2])
    n, m, s = len(x), 0.3, 0.7
    stats = gradient_stats(gaussian, param_guide, Trace_ELBO(), x, num_draws=1000, seed=1)
    g = stats["m"]
    sd = (n + 1) * s
    assert abs(float(g.mean) - ((n + 1) * m - float(x.sum()))) < 4 * sd / math.sqrt(1000)
    assert abs(float(g.variance) / sd**2 - 1) < 0.2  # relative sd of the estimate: 4.5%
    assert float(g.snr) == pytest.approx(abs(float(g.mean)) / math.sqrt(float(g.variance)))


def test_stl_has_zero_variance_at_the_posterior_and_compare_side_by_side():
    x = torch.tensor([0.5, 1.0, -0.2])
    mean, sd = gaussian_posterior(x)

    def guide(x):
        param_guide(x, mean, sd)

    df = compare_gradients(
        gaussian, guide, {"trace": Trace_ELBO(), "stl": TraceSTL_ELBO()}, x, num_draws=50
    )
    assert list(df["variance"].columns) == ["trace", "stl"]
    assert df.loc["s", ("variance", "trace")] > 1e-3
    assert df["variance"]["stl"].max() < 1e-10  # STL's gradient is exactly 0 at the posterior
    assert df["mean_abs"]["stl"].max() < 1e-5
    assert set(df.index) == {"m", "s", "(guide)", "(model)", "(all)"}


def test_norm_snr_of_an_exactly_zero_gradient_is_nan():
    from pyro_gradroute.diagnostics.gradients import ParamGradStats

    assert math.isnan(ParamGradStats(torch.zeros(3), torch.zeros(3)).norm_snr)
    assert ParamGradStats(torch.ones(1), torch.zeros(1)).norm_snr == math.inf
    assert ParamGradStats(torch.tensor([3.0, 4.0]), torch.tensor([1.0, 3.0])).norm_snr == 2.5


def test_needs_two_draws():
    with pytest.raises(ValueError, match="gradient_stats: num_draws must be an integer >= 2"):
        gradient_stats(gaussian, param_guide, Trace_ELBO(), torch.zeros(2), num_draws=1)


def test_snr_takes_one_name_and_names_the_parameters_on_an_unknown_one():
    from pyro_gradroute.diagnostics.gradients import GradientStats, ParamGradStats

    d = torch.randn(10, 3, generator=torch.Generator().manual_seed(0))
    stats = GradientStats(
        {"loc": ParamGradStats(d.mean(0), d.var(0))}, ["loc"], [], 10, draws={"loc": d}
    )
    assert stats.snr("loc") == stats.snr(["loc"]) == stats.snr()  # a name, not its letters
    assert stats.snr_interval("loc") == stats.snr_interval(["loc"])
    with pytest.raises(KeyError, match=r"'scale': not a parameter .* hold \['loc'\]"):
        stats.snr(["scale"])
    with pytest.raises(KeyError, match="'scale'"):
        stats["scale"]
