import math

import pyro.distributions as dist
import pytest

from pyro_gradroute.app.compare import compare_estimators, format_table
from pyro_gradroute.app.models import MODELS, load_problem


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


def test_forest_fallback_without_arviz_plotting(tmp_path, monkeypatch):
    from pyro_gradroute.app import plots

    rows = compare_estimators("eight_schools", ["trace", "stl"], steps=2, snr_draws=2,
                              num_samples=20, progress=False)  # fmt: skip
    monkeypatch.setattr(plots, "_arviz_forest", lambda *a: None)  # as on ArviZ 1.x
    path = plots.plot_forest(rows, str(tmp_path / "f.png"), ["mu", "theta"])
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG" and path.endswith("f.png")


@pytest.mark.parametrize("name", ["adaptive", "adaptive-dreg"])
def test_adaptive_estimators_report_weights_and_variance_reduction(name, tmp_path):
    from pyro_gradroute.app.plots import write_plots

    (r,) = compare_estimators(
        "gaussian_means", [name], steps=30, snr_draws=4, num_samples=20, progress=False
    )
    assert r.cv_weights and all(math.isfinite(v) for _, w in r.cv_weights for v in w.values())
    assert r.cv_weights[0][1] and all(v == 0 for v in r.cv_weights[0][1].values())  # warm-up: b = 0
    assert math.isfinite(r.variance_ratio) and r.variance_ratio > 0
    paths = write_plots([r], str(tmp_path))
    assert any(p.endswith("control_variates.png") for p in paths)
    (s,) = compare_estimators(
        "gaussian_means", ["stl"], steps=2, snr_draws=2, num_samples=20, progress=False
    )
    assert not s.cv_weights and math.isnan(s.variance_ratio)
