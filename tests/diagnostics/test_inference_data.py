import numpy as np
import pytest
import torch
from pyro.infer.autoguide import AutoNormal

from pyro_gradroute.diagnostics import to_inference_data
from pyro_gradroute.diagnostics._arviz import import_arviz

from .models import gaussian, gaussian_posterior, normal_normal_plates

az = import_arviz()
S = 300


@pytest.fixture
def idata():
    x = torch.randn(5, 2)
    return x, to_inference_data(normal_normal_plates, AutoNormal(normal_normal_plates), x,
                                num_samples=S, coords={"group": ["a", "b"]})  # fmt: skip


def test_groups_dims_and_shapes(idata):
    x, idata = idata
    assert set(idata.groups()) == {
        "posterior", "posterior_predictive", "log_likelihood", "observed_data", "sample_stats",
    }  # fmt: skip
    post = idata["posterior"]
    assert post["mu"].dims == ("chain", "draw") and post["mu"].shape == (1, S)
    assert post["w"].dims == ("chain", "draw", "w_dim_0") and post["w"].shape == (1, S, 3)
    assert post["t"].dims == ("chain", "draw", "group") and post["t"].shape == (1, S, 2)
    assert post["m"].dims == ("chain", "draw", "group")  # pyro.deterministic
    np.testing.assert_allclose(post["m"].values, (post["mu"] + post["t"]).values, rtol=1e-5)
    assert list(post["group"].values) == ["a", "b"]  # user coords replace range(2)
    for group in ("posterior_predictive", "log_likelihood"):
        assert idata[group]["x"].dims == ("chain", "draw", "data", "group")
        assert idata[group]["x"].shape == (1, S, 5, 2)
    assert idata["observed_data"]["x"].dims == ("data", "group")
    np.testing.assert_allclose(idata["observed_data"]["x"].values, x.numpy(), rtol=1e-6)
    assert idata["sample_stats"]["log_importance_ratio"].shape == (1, S)
    # predictive draws are new data, not copies of the observations
    assert not np.allclose(idata["posterior_predictive"]["x"].values[0, 0], x.numpy())


def test_log_likelihood_and_ratios_are_the_densities(idata):
    x, idata = idata
    post = idata["posterior"]
    loc = (post["mu"] + post["t"] + post["w"].sum("w_dim_0")).values[0]  # (S, group)
    expected = torch.distributions.Normal(torch.as_tensor(loc)[:, None, :], 1.0).log_prob(x)
    np.testing.assert_allclose(idata["log_likelihood"]["x"].values[0], expected, rtol=1e-4)
    lw = idata["sample_stats"]["log_importance_ratio"].values[0]
    assert np.isfinite(lw).all() and np.ptp(lw) > 0


def test_summary_and_loo_run(idata):
    _, idata = idata
    summary = az.summary(idata, var_names=["mu", "w", "t"], kind="stats")
    assert list(summary.index) == ["mu", "w[0]", "w[1]", "w[2]", "t[a]", "t[b]"]
    loo = az.loo(idata, pointwise=True)
    assert loo.n_data_points == 10 and np.isfinite(loo.elpd_loo)
    assert np.isfinite(az.waic(idata).elpd_waic)


def test_exact_guide_gives_exact_posterior_and_constant_ratios():
    x = torch.tensor([0.5, 1.5, -0.2, 0.9])
    m, s = gaussian_posterior(x)

    def exact(x):
        import pyro
        import pyro.distributions as dist

        pyro.sample("z", dist.Normal(m, s))

    idata = to_inference_data(gaussian, exact, x, num_samples=4000)
    z = idata["posterior"]["z"].values
    assert abs(z.mean() - m) < 4 * s / np.sqrt(4000) and abs(z.std() / s - 1) < 0.05
    lw = idata["sample_stats"]["log_importance_ratio"].values
    assert np.ptp(lw) < 1e-4  # log p(x, z) - log q(z) = log p(x) for every draw


def _arviz_log(fn):
    """``fn()``'s result and the messages ArviZ logged meanwhile (ArviZ logs through its own
    ``Logger("arviz")`` object, outside the logging registry)."""
    import logging

    import arviz

    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = arviz._log
    logger.addHandler(handler)
    try:
        return fn(), records
    finally:
        logger.removeHandler(handler)


def test_summary_kind_stats_is_the_documented_summary_of_guide_draws(idata):
    """The draws are i.i.d., not a chain: kind="stats" gives mean, sd and HDI without the
    one-chain warning and NaN r_hat that plain az.summary gives."""
    _, idata = idata
    summary, logged = _arviz_log(lambda: az.summary(idata, var_names=["mu"], kind="stats"))
    assert list(summary.columns) == ["mean", "sd", "hdi_3%", "hdi_97%"]
    assert logged == []
    full, logged = _arviz_log(lambda: az.summary(idata, var_names=["mu"]))
    assert np.isnan(full["r_hat"]).all()  # why plain az.summary is not the documented call
    assert any("chains=2" in m for m in logged)
