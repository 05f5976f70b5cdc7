import numpy as np
import pytest
import torch
from pyro.infer.autoguide import AutoNormal

from pyro_gradroute.app.catalog import ESTIMATORS
from pyro_gradroute.diagnostics import from_pyro_svi, pareto_khat, to_inference_data
from pyro_gradroute.diagnostics._arviz import arviz_major, group_names, import_arviz

from .models import gaussian, gaussian_posterior, normal_normal_plates

az = import_arviz()
ARVIZ_1 = arviz_major() >= 1  # every test runs on the installed line: 0.23 or 1.x
S = 300


def _elpd(loo) -> float:
    return float(loo.elpd if ARVIZ_1 else loo.elpd_loo)


@pytest.fixture
def idata():
    x = torch.randn(5, 2)
    return x, to_inference_data(normal_normal_plates, AutoNormal(normal_normal_plates), x,
                                num_samples=S, coords={"group": ["a", "b"]})  # fmt: skip


def test_groups_dims_and_shapes(idata):
    x, idata = idata
    assert set(idata["sample_stats"].data_vars) == {"log_importance_ratio", "lp", "log_q"}
    assert set(group_names(idata)) == {
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
    # lp = log p(x, z) and log_q = log q(z), recomputed from the draws and the guide's parameters
    std = torch.distributions.Normal(0.0, 1.0)
    z = {k: torch.as_tensor(post[k].values[0]) for k in ("mu", "w", "t")}  # (S, ...)
    lp = sum(std.log_prob(v).reshape(S, -1).sum(-1) for v in z.values()) + expected.sum((-1, -2))
    np.testing.assert_allclose(idata["sample_stats"]["lp"].values[0], lp, rtol=1e-5)
    import pyro

    lq = sum(
        torch.distributions.Normal(pyro.param(f"AutoNormal.locs.{k}"),
                                   pyro.param(f"AutoNormal.scales.{k}")).log_prob(v)
        .reshape(S, -1).sum(-1)
        for k, v in z.items()
    ).detach()  # fmt: skip
    np.testing.assert_allclose(idata["sample_stats"]["log_q"].values[0], lq, rtol=1e-5)
    np.testing.assert_allclose(lw, (lp - lq).numpy(), rtol=1e-4, atol=1e-4)


def test_summary_and_loo_run(idata):
    _, idata = idata
    summary = az.summary(idata, var_names=["mu", "w", "t"], kind="stats")
    assert list(summary.index) == ["mu", "w[0]", "w[1]", "w[2]", "t[a]", "t[b]"]
    loo = az.loo(idata, pointwise=True)
    assert loo.n_data_points == 10 and np.isfinite(_elpd(loo))
    assert loo.pareto_k.shape == (5, 2)  # one k per observation (data, group)
    if ARVIZ_1:  # PSIS-LOO corrected for draws from the guide instead of the posterior
        stats = idata["sample_stats"]
        approx = az.loo_approximate_posterior(idata, log_p=stats["lp"], log_q=stats["log_q"])
        assert approx.n_data_points == 10 and np.isfinite(approx.elpd)
    if not ARVIZ_1:  # ArviZ 1.x has no waic
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
    """``fn()``'s result and the messages ArviZ 0.23 logged meanwhile (through its own
    ``Logger("arviz")`` object, outside the logging registry)."""
    import logging

    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = az._log
    logger.addHandler(handler)
    try:
        return fn(), records
    finally:
        logger.removeHandler(handler)


def test_summary_kind_stats_is_the_documented_summary_of_guide_draws(idata):
    """The draws are i.i.d., not a chain: kind="stats" gives mean, sd and an interval (HDI on
    0.23, ETI on 1.x) without the NaN r_hat (and, on 0.23, the one-chain warning) that plain
    az.summary gives."""
    _, idata = idata
    interval = ["eti89_lb", "eti89_ub"] if ARVIZ_1 else ["hdi_3%", "hdi_97%"]
    full = az.summary(idata, var_names=["mu"])
    assert np.isnan(full["r_hat"].astype(float)).all()  # why plain az.summary is not the call
    summary = az.summary(idata, var_names=["mu"], kind="stats")
    assert list(summary.columns) == ["mean", "sd", *interval]
    mu = idata["posterior"]["mu"].values.ravel()
    np.testing.assert_allclose(summary.loc["mu", "mean"], mu.mean(), atol=0.01)
    if not ARVIZ_1:
        _, logged = _arviz_log(lambda: az.summary(idata, var_names=["mu"], kind="stats"))
        assert logged == []
        _, logged = _arviz_log(lambda: az.summary(idata, var_names=["mu"]))
        assert any("chains=2" in m for m in logged)


def test_from_pyro_svi_is_to_inference_data_and_returns_this_arvizs_type(idata):
    _, idata = idata
    assert to_inference_data is from_pyro_svi
    if ARVIZ_1:
        import xarray as xr

        assert isinstance(idata, xr.DataTree)
    else:
        assert isinstance(idata, az.InferenceData)


def test_attributes_name_pyro_and_the_pareto_k(idata):
    _, idata = idata
    for group in group_names(idata):
        if group != "observed_data":
            assert idata[group].attrs["inference_library"] == "pyro"
    stats = idata["sample_stats"]
    lw = stats["log_importance_ratio"].values.ravel()
    assert stats.attrs["pareto_k"] == pareto_khat(lw).khat


@pytest.mark.parametrize("bad, error", [(2.5, TypeError), ("10", TypeError), (1, ValueError),
                                        (True, TypeError)])  # fmt: skip
def test_num_samples_must_be_an_integer_of_at_least_2(bad, error):
    x = torch.randn(5, 2)
    guide = AutoNormal(normal_normal_plates)
    with pytest.raises(error, match="from_pyro_svi: num_samples must be an integer"):
        from_pyro_svi(normal_normal_plates, guide, x, num_samples=bad)


@pytest.mark.parametrize("dims", [{"w": ["a", "b"]}, {"x": ["data"]}, {"t": []}])
def test_a_dims_entry_with_the_wrong_number_of_names_is_refused(dims):
    x = torch.randn(5, 2)
    guide = AutoNormal(normal_normal_plates)
    (name,) = dims
    with pytest.raises(ValueError, match=rf"dims\['{name}'\] names {len(dims[name])} dim"):
        from_pyro_svi(normal_normal_plates, guide, x, num_samples=10, dims=dims)


def test_dims_entry_renames_the_dimension(idata):
    x = torch.randn(5, 2)
    guide = AutoNormal(normal_normal_plates)
    out = from_pyro_svi(normal_normal_plates, guide, x, num_samples=10, dims={"w": "feature"})
    assert out["posterior"]["w"].dims == ("chain", "draw", "feature")


def test_posterior_and_predictive_plots_accept_it(idata):
    """ArviZ's posterior plot (0.23: plot_posterior, 1.x: plot_dist) and predictive check."""
    import matplotlib
    import matplotlib.pyplot as plt

    matplotlib.use("Agg")
    _, idata = idata
    if ARVIZ_1:  # PlotCollections: one panel per scalar, one per observed variable
        pc = az.plot_dist(idata, var_names=["mu", "t"], backend="matplotlib")
        assert pc.viz["plot"]["mu"].size == 1 and pc.viz["plot"]["t"].size == 2
        pc = az.plot_ppc_dist(idata, backend="matplotlib", num_samples=20)
        assert pc.viz["plot"]["x"].size == 1
    else:
        assert len(np.ravel(az.plot_posterior(idata, var_names=["mu", "t"]))) == 3
        assert len(np.ravel(az.plot_ppc(idata, num_pp_samples=20))) == 1
    plt.close("all")


@pytest.mark.slow
@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_a_users_session_fit_convert_summary_loo(estimator):
    """Fit with each estimator, convert, az.summary, az.loo: the conjugate posterior
    N(sum x / (n+1), 1/(n+1)) comes back (the guide family contains it, so every bound's
    optimum is it), and the summary's mean is the draws' mean (4 Monte Carlo SE)."""
    import pyro

    from pyro_gradroute.app.estimators import make_elbo

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x = torch.tensor([0.3, 1.2, 0.8, -0.4, 1.5, 0.9, 0.2, 1.1, 0.6, 0.7])
    m, s = gaussian_posterior(x)
    guide = AutoNormal(gaussian, init_scale=1.0)
    svi = pyro.infer.SVI(gaussian, guide, pyro.optim.ClippedAdam({"lr": 0.05, "lrd": 0.998}),
                         make_elbo(estimator, num_particles=8, max_plate_nesting=1))  # fmt: skip
    for _ in range(1500):
        svi.step(x)
    data = from_pyro_svi(gaussian, guide, x, num_samples=2000)
    stats = az.summary(data, kind="stats")
    draws = data["posterior"]["z"].values.ravel()
    assert abs(stats.loc["z", "mean"] - draws.mean()) < 4 * draws.std() / np.sqrt(draws.size)
    # the fit: a guide a quarter of a posterior sd off (or 25% too wide / narrow) fails
    assert abs(draws.mean() - m) < 0.25 * s and abs(draws.std() / s - 1) < 0.25, estimator
    assert np.isfinite(_elpd(az.loo(data)))


def test_readme_arviz_session_runs_on_this_arviz():
    """The README's ArviZ block (and the blocks of its section it builds on) on the installed
    ArviZ line: CI's compat stage runs this file under ArviZ 1.x, the main stage under 0.23."""
    from tests.readme import README, run_session, sessions

    (session,) = [
        s for s in sessions(README, per_heading=True) if any("from_pyro_svi(" in b.code for b in s)
    ]
    upto = next(i for i, b in enumerate(session) if "from_pyro_svi(" in b.code)
    ns = run_session(session[: upto + 1])
    assert "mean" in az.summary(ns["idata"], kind="stats").columns
    assert np.isfinite(_elpd(az.loo(ns["idata"])))
