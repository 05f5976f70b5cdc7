"""Diagnostics for a model that does not vectorize over draws: Pyro's Bayesian-regression
tutorial model (``PyroModule[nn.Linear]`` with ``PyroSample`` priors), drawn one at a time."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.infer.autoguide import AutoDiagonalNormal
from pyro.nn import PyroModule, PyroSample
from torch import nn

from pyro_gradroute.diagnostics import psis_khat, to_inference_data
from pyro_gradroute.diagnostics._arviz import arviz_major, import_arviz
from pyro_gradroute.diagnostics.draws import VectorizationError, importance_draws
from pyro_gradroute.infer import TraceSTL_ELBO


class BayesianRegression(PyroModule):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = PyroModule[nn.Linear](in_features, out_features)
        self.linear.weight = PyroSample(
            dist.Normal(0.0, 1.0).expand([out_features, in_features]).to_event(2)
        )
        self.linear.bias = PyroSample(dist.Normal(0.0, 10.0).expand([out_features]).to_event(1))

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", dist.Uniform(0.0, 10.0))
        mean = self.linear(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)
        return mean


@pytest.fixture(scope="module")
def fitted():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x = torch.randn(40, 3)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.3 * torch.randn(40)
    model = BayesianRegression(3, 1)
    guide = AutoDiagonalNormal(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), TraceSTL_ELBO())
    for _ in range(100):
        svi.step(x, y)
    return model, guide, x, y


def test_vectorize_true_says_what_to_do(fitted):
    model, guide, x, y = fitted
    with pytest.raises(VectorizationError, match="vectorize=False"):
        importance_draws(model, guide, x, y, num_samples=10, vectorize=True)


def test_falls_back_to_one_draw_at_a_time_with_a_warning(fitted):
    model, guide, x, y = fitted
    with pytest.warns(UserWarning, match="drawing one sample at a time"):
        draws = importance_draws(model, guide, x, y, num_samples=10, progress=False)
    assert not draws.vectorized and draws.log_ratios.shape == (10,)
    assert torch.isfinite(draws.log_ratios).all()


@pytest.mark.slow
def test_inference_data_follows_arviz_conventions_and_arviz_works(fitted, tmp_path):
    model, guide, x, y = fitted
    az = import_arviz()
    idata = to_inference_data(model, guide, x, y, num_samples=200, vectorize=False,
                              progress=False, coords={"data": list(range(100, 140))})  # fmt: skip
    post = idata.posterior
    assert post["sigma"].dims == ("chain", "draw")
    assert post["linear.weight"].dims[:2] == ("chain", "draw")
    assert post["linear.weight"].shape == (1, 200, 1, 3)
    assert idata.log_likelihood["obs"].dims == ("chain", "draw", "data")
    assert list(idata.log_likelihood["obs"].coords["data"].values[:2]) == [100, 101]
    assert idata.posterior_predictive["obs"].shape == (1, 200, 40)
    summary = az.summary(idata, kind="stats")
    assert abs(summary.loc["linear.weight[0, 1]", "mean"] + 2.0) < 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loo = az.loo(idata)
    assert (loo.elpd if arviz_major() >= 1 else loo.elpd_loo) < 0
    import matplotlib

    matplotlib.use("Agg")
    if arviz_major() >= 1:  # ArviZ 1.x: plot_dist, a PlotCollection with a panel per scalar
        pc = az.plot_dist(idata, var_names=["sigma", "linear.weight"], backend="matplotlib")
        assert pc.viz["plot"]["sigma"].size + pc.viz["plot"]["linear.weight"].size == 4
    else:
        axes = az.plot_posterior(idata, var_names=["sigma", "linear.weight"])
        assert len(axes.ravel()) == 4
    assert psis_khat(model, guide, x, y, num_samples=50, vectorize=False, progress=False) < 5


def test_one_at_a_time_matches_vectorized_on_a_model_that_vectorizes():
    def model():
        pyro.sample("z", dist.Normal(0.0, 1.0))

    def guide():
        pyro.sample("z", dist.Normal(0.0, 1.0))

    for vectorize in (True, False):
        d = importance_draws(model, guide, num_samples=20, vectorize=vectorize, progress=False)
        assert d.vectorized == vectorize and d.values["z"].shape == (20,)
        assert (d.log_ratios.abs() < 1e-6).all()  # guide == posterior


def test_heldout_log_likelihood_one_draw_at_a_time(fitted):
    from pyro_gradroute.diagnostics.heldout import heldout_log_likelihood

    model, guide, x, y = fitted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ll, se = heldout_log_likelihood(model, guide, (x, y), (x[:10], y[:10]), num_samples=30,
                                        with_se=True)  # fmt: skip
    assert -3.0 < ll < 0.0 and se > 0


@pytest.mark.slow
def test_compare_fits_and_measures_a_model_that_does_not_vectorize(fitted):
    from pyro_gradroute.app.compare import compare_estimators

    _, _, x, y = fitted

    def problem():
        model = BayesianRegression(3, 1)
        return dict(model=model, guide=AutoDiagonalNormal(model), args=(x, y),
                    heldout_args=(x[:10], y[:10]))  # fmt: skip

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (r,) = compare_estimators(problem, ["stl"], steps=3, snr_draws=2, num_samples=20,
                                  progress=False)  # fmt: skip
    assert len(r.losses) == 3 and r.idata is not None and r.heldout_ll is not None
