"""pyro-gradroute compare under divergence, NaN data, and the timing of steps.

A diverged fit gets a "diverged at step N; try a smaller --lr" row while the others go on
(a large --lr used to end in a raw traceback, or in unflagged losses of 1e13 with the IWAE
row called best); NaN in the data is an error naming the observed site, before any fitting.
"""

import math
import textwrap

import pytest

from pyro_gradroute.app import compare as compare_mod
from pyro_gradroute.app.catalog import DEFAULT_ESTIMATORS, DIVERGED, ESTIMATORS
from pyro_gradroute.app.cli import main
from pyro_gradroute.app.compare import divergence_step, suggest, time_interleaved

FAST = ["--snr-draws", "3", "--samples", "40", "--no-progress"]


def _run(capsys, tmp_path, *flags):
    rc = main(["compare", "--model", "gaussian_means", "--out", str(tmp_path / "o"), *FAST, *flags])
    return rc, capsys.readouterr()


@pytest.mark.slow
def test_lr_100_flags_every_estimator_and_exits_0(capsys, tmp_path):
    rc, cap = _run(capsys, tmp_path, "--lr", "100", "--steps", "40", "--estimators",
                   "trace,stl,iwae,dreg")  # fmt: skip
    assert rc == 0, cap.err
    assert "Traceback" not in cap.err and "Traceback" not in cap.out
    for name in ("trace", "stl", "iwae", "dreg"):
        assert f"{name}: diverged at step" in cap.out
    assert "try a smaller --lr" in cap.out
    assert "no estimator finished without diverging" in cap.out


def test_lr_1e6_exploding_iwae_and_dreg_are_flagged_never_best(capsys, tmp_path):
    rc, cap = _run(capsys, tmp_path, "--lr", "1e6", "--steps", "60", "--estimators", "iwae,dreg")
    assert rc == 0, cap.err
    assert "iwae: diverged at step" in cap.out and "dreg: diverged at step" in cap.out
    assert "no estimator finished without diverging" in cap.out
    assert not any(line.startswith("best") for line in cap.out.splitlines())


@pytest.mark.slow
def test_a_diverged_fit_is_never_called_best_while_the_others_go_on(capsys, tmp_path, monkeypatch):
    """One estimator explodes (finite losses of 1e13), the other fits: the fitted one is best."""
    real = compare_mod.make_elbo

    def make_elbo(name, *args, **kwargs):
        elbo = real(name, *args, **kwargs)
        if name == "iwae":  # its losses explode after the first step, as at --lr 1e6
            loss_and_grads = elbo.loss_and_grads
            calls = []

            def exploding(*a, **k):
                calls.append(1)
                value = loss_and_grads(*a, **k)
                return value if len(calls) == 1 else 1e13

            elbo.loss_and_grads = exploding
        return elbo

    monkeypatch.setattr(compare_mod, "make_elbo", make_elbo)
    rc, cap = _run(capsys, tmp_path, "--steps", "30", "--estimators", "iwae,stl")
    assert rc == 0, cap.err
    assert "iwae: diverged at step 11" in cap.out
    best = [line for line in cap.out.splitlines() if line.startswith("best")]
    assert len(best) == 1 and best[0].startswith("best held-out log-likelihood: stl"), best


def test_divergence_step_judges_from_the_first_loss():
    assert divergence_step([392.0] + [1e13] * 10) == 11  # exploded in the first window too
    assert divergence_step([392.0] + [1e13] * 9) is None  # not yet a window
    assert divergence_step([3.0, float("inf")]) == 2
    assert divergence_step([400.0] + [45.0] * 30) is None  # a fit that falls
    assert divergence_step([-1000.0] + [-2000.0] * 30) is None  # negative losses that fall
    assert f"{compare_mod.DIVERGENCE_FACTOR:g} x max(|L1|, 1)" in DIVERGED
    assert f"last {compare_mod._WINDOW} steps" in DIVERGED


def test_suggest_ignores_diverged_rows():
    from types import SimpleNamespace

    from pyro_gradroute.diagnostics.psis import PSISResult

    rows = [SimpleNamespace(name="iwae", heldout_ll=1e9, heldout_ll_se=0.0, log_px=0.0,
                            log_px_se=0.0, khat=PSISResult(0.1), diverged=True),
            SimpleNamespace(name="stl", heldout_ll=-1.0, heldout_ll_se=0.01, log_px=0.0,
                            log_px_se=0.0, khat=PSISResult(0.1), diverged=False)]  # fmt: skip
    assert suggest(rows).startswith("best held-out log-likelihood: stl")


NAN_MODEL = """
import pyro, pyro.distributions as dist, torch
from pyro.infer.autoguide import AutoNormal

def model(x):
    z = pyro.sample("z", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("obs_y", dist.Normal(z, 1.0), obs=x)

def problem():
    x = torch.ones(6)
    x[2] = float("nan")
    return dict(model=model, guide=AutoNormal(model), args=(x,))
"""


def test_nan_in_the_data_names_the_observed_site_before_fitting(capsys, tmp_path, monkeypatch):
    (tmp_path / "nan_data_gr.py").write_text(textwrap.dedent(NAN_MODEL))
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["--model", "nan_data_gr:problem", "--out", str(tmp_path / "o"), *FAST])
    cap = capsys.readouterr()
    assert rc == 2
    assert "observed site 'obs_y' hold NaN values (in 1 of 6 entries)" in cap.err
    assert "Traceback" not in cap.err and "vectorized" not in cap.err
    assert "steps in" not in cap.err  # no fitting


def test_masked_nan_is_not_an_error_and_unmasked_nan_is():
    import pyro
    import pyro.distributions as dist
    import torch

    from pyro_gradroute.app.models.problem import as_problem

    def masked(x):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(z, 1.0), obs=x, obs_mask=~x.isnan())

    def plain(x):
        pyro.sample("y", dist.Normal(0.0, 1.0).expand([3]).to_event(1), obs=x)

    x = torch.tensor([1.0, float("nan"), 0.5])
    compare_mod.check_data(as_problem(dict(model=masked, guide=masked, args=(x,)), where="t"))
    ok = torch.zeros(3)
    p = as_problem(dict(model=plain, guide=plain, args=(ok,), heldout_args=(x,)), where="t")
    with pytest.raises(ValueError, match="held-out data of observed site 'y' hold NaN"):
        compare_mod.check_data(p)


def test_the_default_comparison_holds_the_recommended_estimator():
    recommended = [n for n in DEFAULT_ESTIMATORS if ESTIMATORS[n][1] == "TraceAdaptiveSTL_ELBO"]
    assert recommended == ["adaptive"] and ESTIMATORS["adaptive"][2] == {}


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_time_interleaved_no_step_pays_for_its_position():
    """The first step of every round costs 50 more (a cold cache): rotating the order
    spreads that over the steps equally; the first 6 calls (a cold start) are untimed."""
    clock = _FakeClock()
    calls = []

    def step(i, cost):
        def run():
            calls.append(i)
            first_in_round = len(calls) % 3 == 1
            cold_start = len(calls) <= 6
            clock.now += cost + (50.0 if first_in_round else 0.0) + (1e4 if cold_start else 0.0)

        return run

    ms = time_interleaved([step(0, 10.0), step(1, 10.0), step(2, 10.0)], rounds=9,
                          clock=clock)  # fmt: skip
    assert ms == [10_000.0] * 3  # 10 s in ms: medians equal, no cold start, no position cost
    assert calls[:3] == [0, 1, 2] and calls[3:6] == [1, 2, 0]  # rotating


def test_time_interleaved_a_failing_step_gets_nan():
    def bad():
        raise ValueError("diverged")

    assert math.isnan(time_interleaved([bad, lambda: None], rounds=3)[0])


def test_compare_fills_ms_per_step_for_every_fitted_estimator():
    rows = compare_mod.compare_estimators("gaussian_means", ["trace", "stl"], steps=5,
                                          snr_draws=3, num_samples=30, progress=False,
                                          timing_rounds=3)  # fmt: skip
    assert all(math.isfinite(r.ms_per_step) and r.ms_per_step > 0 for r in rows)


SHAPE_BUG = """
import pyro, pyro.distributions as dist, torch
from pyro.infer.autoguide import AutoNormal

calls = []

def model(x):
    calls.append(1)
    z = pyro.sample("z", dist.Normal(0.0, 1.0))
    n = len(x) if len(calls) < 12 else len(x) + 1  # a bug that shows after some steps
    with pyro.plate("data", n):
        pyro.sample("obs", dist.Normal(z, 1.0), obs=x)

def problem():
    return dict(model=model, guide=AutoNormal(model), args=(torch.ones(4),), steps=30)
"""


def test_a_later_error_of_the_model_is_not_called_a_divergence(capsys, tmp_path, monkeypatch):
    (tmp_path / "shape_bug_gr.py").write_text(textwrap.dedent(SHAPE_BUG))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="Value is not broadcastable"):  # raised, as it is
        main(["--model", "shape_bug_gr:problem", "--estimators", "trace",
              "--out", str(tmp_path / "o"), *FAST])  # fmt: skip
    cap = capsys.readouterr()
    assert "diverged" not in cap.out + cap.err
