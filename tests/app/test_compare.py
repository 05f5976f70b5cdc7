import math
import statistics

import pyro.distributions as dist
import pytest
import torch

from pyro_gradroute.app.compare import compare_estimators, format_table
from pyro_gradroute.app.models import MODELS, load_problem


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_bundled_model_runs_through_compare(name):
    (r,) = compare_estimators(name, ["stl"], steps=2, snr_draws=2, num_samples=20, progress=False)
    assert len(r.losses) == 2 and math.isfinite(r.elbo) and math.isfinite(r.log_px)
    assert (r.heldout_ll is not None) == (load_problem(name).heldout_args is not None)
    assert r.idata["posterior"] is not None and r.grads.guide_params
    assert format_table([r]).splitlines()[2].startswith("stl")


def test_gamma_to_normal_changes_one_argument():
    from pyro_gradroute.app.models.gamma_to_normal import problem

    for family in (dist.Gamma, dist.LogNormal, dist.Normal):
        assert isinstance(problem(family).guide.q(), family)
    with pytest.raises(ValueError, match="choose one of"):
        problem(dist.Beta)


def test_suggest_prefers_heldout_and_flags_unreliable_guides():
    from types import SimpleNamespace

    from pyro_gradroute.app.compare import suggest
    from pyro_gradroute.diagnostics.psis import PSISResult

    def row(name, heldout, log_px, k):
        return SimpleNamespace(name=name, heldout_ll=heldout, log_px=log_px, khat=PSISResult(k),
                               heldout_ll_se=0.01, log_px_se=0.01, diverged=False)  # fmt: skip

    line = suggest([row("trace", -1.2, -5.0, 0.3), row("stl", -1.1, -9.0, 0.9)])
    assert line.startswith("best held-out log-likelihood: stl") and "correlations" not in line
    line = suggest([row("trace", None, -5.0, 0.8), row("stl", None, -9.0, 0.9)])
    assert line.startswith("best log p(x) estimate: trace") and "AutoMultivariateNormal" in line
    assert "AutoMeanField" not in line  # mean-field, like AutoNormal: not a richer family
    # without held-out data, an unreliable importance estimate does not win
    line = suggest([row("trace", None, -5.0, 0.9), row("stl", None, -6.0, 0.6)])
    assert line.startswith("best log p(x) estimate among guides with k-hat <= 0.7: stl")


@pytest.mark.slow
def test_forest_plot_with_the_installed_arviz(tmp_path):
    """ArviZ's own forest plot (0.23: plot_forest on a list; 1.x: on a dict of DataTrees)."""
    from pyro_gradroute.app import plots

    rows = compare_estimators("eight_schools", ["trace", "stl"], steps=2, snr_draws=2,
                              num_samples=20, progress=False)  # fmt: skip
    path = plots.plot_forest(rows, str(tmp_path / "f.png"), ["mu", "theta"])
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG" and path.endswith("f.png")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adaptive", "adaptive-dreg"])
def test_adaptive_estimators_report_weights_and_variance_reduction(name, tmp_path):
    from pyro_gradroute.app.plots import write_plots

    (r,) = compare_estimators(
        "gaussian_means", [name], steps=30, snr_draws=4, num_samples=20, progress=False
    )
    assert r.cv_weights and all(math.isfinite(v) for _, w in r.cv_weights for v in w.values())
    # warm-up: b = 1 (the policy starts at Trace_ELBO / IWAE)
    assert r.cv_weights[0][1] and all(v == 1 for v in r.cv_weights[0][1].values())
    assert math.isfinite(r.variance_ratio) and r.variance_ratio > 0
    paths = write_plots([r], str(tmp_path))
    assert any(p.endswith("control_variates.png") for p in paths)
    (s,) = compare_estimators(
        "gaussian_means", ["stl"], steps=2, snr_draws=2, num_samples=20, progress=False
    )
    assert not s.cv_weights and math.isnan(s.variance_ratio)


def _zero_mean_stats(seed, D=20, P=30):
    """Gradient draws with a zero mean, as at a fit: the norm SNR sits near 1/sqrt(D)."""
    import torch

    from pyro_gradroute.diagnostics.gradients import GradientStats, ParamGradStats

    d = torch.randn(D, P, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.5, 2, P)
    stats = {"a": ParamGradStats(d[:, :10].mean(0), d[:, :10].var(0)),
             "b": ParamGradStats(d[:, 10:].mean(0), d[:, 10:].var(0))}  # fmt: skip
    return GradientStats(stats, ["a", "b"], [], D, draws={"a": d[:, :10], "b": d[:, 10:]}), d


def test_total_variance_is_the_trace_of_the_covariance():
    import numpy as np

    from pyro_gradroute.app.compare import total_variance

    stats, d = _zero_mean_stats(0)
    naive = np.cov(d.double().numpy(), rowvar=False).trace()  # two-pass covariance
    assert total_variance(stats, ["a", "b"]) == pytest.approx(naive, rel=1e-5)
    assert total_variance(stats, ["a"]) == pytest.approx(
        np.cov(d[:, :10].double().numpy(), rowvar=False).trace(), rel=1e-5
    )
    assert math.isnan(total_variance(stats, []))


def test_snr_interval_contains_the_estimate_where_percentiles_miss_it():
    missed = 0
    for seed in range(20):
        stats, _ = _zero_mean_stats(seed)
        est = stats.snr(["a", "b"])
        assert est == pytest.approx(1 / math.sqrt(20), rel=0.5)  # at the noise floor
        lo, hi = stats.snr_interval(["a", "b"], seed=seed)
        assert lo <= est <= hi and hi > lo
        # the bootstrap's plain percentiles, by hand: they lie above the estimate
        flat = torch.cat([stats.draws[n].reshape(20, -1) for n in ("a", "b")], 1).double()
        g = torch.Generator().manual_seed(seed)
        boot = flat[torch.randint(20, (200, 20), generator=g)]
        snr = boot.mean(1).pow(2).sum(-1).sqrt() / boot.var(1).sum(-1).sqrt()
        p_lo, p_hi = torch.quantile(snr, snr.new_tensor([0.16, 0.84])).tolist()
        missed += not (p_lo <= est <= p_hi)
        # the same spread on the log scale, centred on the estimate
        z = statistics.NormalDist().inv_cdf(0.84)
        assert lo == pytest.approx(est * math.exp(-z * float(snr.log().std())), rel=1e-9)
    assert missed >= 15


def test_compare_reports_variance_floor_and_intervals():
    (r,) = compare_estimators("gaussian_means", ["stl"], steps=3, snr_draws=4, num_samples=20,
                              progress=False)  # fmt: skip
    assert r.snr_floor == pytest.approx(0.5)
    assert r.grad_var_guide > 0 and math.isfinite(r.grad_var_guide)
    lo, hi = r.snr_guide_interval
    assert lo <= r.snr_guide <= hi
    table = format_table([r])
    assert (
        "tr Var guide" in table
        and "SNR noise floor 1/sqrt(draws) = 0.5 (4 gradient draws)" in table
    )


def test_warmup_starts_every_estimator_from_the_same_parameters():
    import pyro
    import torch

    from pyro_gradroute.app.compare import _builder, warm_start

    build = _builder("gaussian_means")

    def params():
        store = pyro.get_param_store()
        return {n: store[n].detach().clone() for n in store.keys()}

    p, _ = warm_start(build, 3, 0, None)
    p.guide(*p.args, **p.kwargs)  # the guide's parameters at the initialisation
    init = params()
    assert init
    _, losses = warm_start(build, 3, 15, None)
    first = params()
    _, again = warm_start(build, 3, 15, None)
    assert losses == again and len(losses) == 15
    assert all(torch.equal(first[n], v) for n, v in params().items())
    assert any(not torch.equal(init[n], first[n]) for n in init)  # the warm-up moved them
    rows = compare_estimators("gaussian_means", ["trace", "stl"], steps=2, snr_draws=2,
                              num_samples=20, progress=False, warmup_steps=15, seed=3)  # fmt: skip
    assert rows[0].warmup_losses == rows[1].warmup_losses == losses
    assert "after the same 15 Trace_ELBO warm-up steps" in format_table(rows)
    with pytest.raises(ValueError, match="warmup_steps must be an integer >= 0"):
        compare_estimators("gaussian_means", ["trace"], warmup_steps=-2)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"steps": 0}, "steps must be an integer >= 1"), ({"steps": 2.5}, "steps must be an integer"),
     ({"lr": -1.0}, "lr must be > 0.0"), ({"lr": float("nan")}, "lr must be a finite number"),
     ({"num_particles": 0}, "num_particles must be an integer >= 1"),
     ({"seed": -1}, "seed must be an integer >= 0"), ({"snr_draws": 1}, "snr_draws must be"),
     ({"num_samples": "10"}, "num_samples must be an integer"),
     ({"timing_rounds": 0}, "timing_rounds must be an integer >= 1")],
)  # fmt: skip
def test_bad_arguments_are_named_before_any_fitting(kwargs, message, monkeypatch):
    import pyro_gradroute.app.compare as compare

    monkeypatch.setattr(compare, "_run_one", lambda *a: pytest.fail("fitted before checking"))
    with pytest.raises(ValueError, match=f"iter_compare: {message}"):
        compare_estimators("gaussian_means", ["stl"], **kwargs)
