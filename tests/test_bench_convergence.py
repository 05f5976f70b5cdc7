"""The convergence benchmark's equal-time comparison: the chord between two evaluations."""

import importlib.util
import math
import sys

import pytest

from tests.test_examples_guides import ROOT


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    name = "bench_convergence"
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(str(ROOT / "benchmarks"))


def test_estimate_at_equal_time_is_linear_between_evaluations(bench):
    history = [(10, 1.0, -50.0), (20, 2.0, -40.0), (30, 3.0, -35.0)]  # (step, cpu s, ELBO)
    assert bench._at_time(history, 2.0) == -40.0
    assert bench._at_time(history, 2.5) == pytest.approx(-37.5)
    assert bench._at_time(history, 0.5) == -50.0  # before the first evaluation: the first
    assert bench._at_time(history, 9.0) == -35.0  # past the last: the last


def test_equal_time_difference_uses_the_baseline_total_time(bench):
    base = {"elbo": -35.0, "elbo_eq_time": -35.0, "cpu": 3.0, "ms_per_step": 100.0,
            "history": [(30, 3.0, -35.0)]}  # fmt: skip
    slower = {"elbo": -34.0, "elbo_eq_time": -36.5, "cpu": 4.0, "ms_per_step": 133.0,
              "history": [(10, 1.0, -50.0), (20, 2.5, -38.0), (30, 4.0, -34.0)]}  # fmt: skip
    rows = bench.summarize({"m": {"trace": [base, base], "other": [slower, slower]}})
    row = next(r for r in rows if r["estimator"] == "other")
    assert row["diff_eq_time"] == pytest.approx(-1.5)
    assert row["diff"] == pytest.approx(1.0)
    assert row["cpu_ratio"] == pytest.approx(4.0 / 3.0)


@pytest.mark.slow
def test_equal_time_elbo_is_read_between_kept_parameters(bench):
    """elbo_at evaluates the parameters kept around the time and leaves the final ones."""
    import pyro
    import torch

    r = bench._Run("eight_schools", "trace", 0)
    with r:
        for step in range(6):
            r.step(step, 6)
            r.snapshot()
        final = {k: v.detach().clone() for k, v in pyro.get_param_store().named_parameters()}
        (c1, s1), (c2, s2) = r.snapshots[2], r.snapshots[3]
        live = dict(pyro.get_param_store().named_parameters())

        def at(values):
            with torch.no_grad():
                for k, v in values.items():
                    live[k].copy_(v)
            return bench.elbo_estimate(r.p, 50, 0)

        e1, e2 = at(s1), at(s2)
        at(final)
        mid = 0.25 * c1 + 0.75 * c2
        got = r.elbo_at(mid, 50, 0)
        assert got == pytest.approx(e1 + (e2 - e1) * (mid - c1) / (c2 - c1), rel=1e-6)
        assert r.elbo_at(r.cpu + 10.0, 50, 0) == pytest.approx(bench.elbo_estimate(r.p, 50, 0))
        for k, v in pyro.get_param_store().named_parameters():  # the final parameters are back
            assert torch.equal(v.detach(), final[k])


def test_lockstep_runs_start_alike_and_evaluate_on_common_random_numbers(bench):
    """Two runs of one estimator from one seed, in lockstep, each end where a run alone ends
    (their parameters, optimizers and random streams do not mix)."""
    cfg = {"steps": lambda m, s: 8, "evals": 2, "eval_draws": 5, "final_draws": 20,
           "heldout_draws": 5}  # fmt: skip
    alone = bench.run_seed("eight_schools", ["trace"], 0, cfg)["trace"]
    bench.ESTIMATORS["trace_copy"] = bench.ESTIMATORS["trace"]
    try:
        out = bench.run_seed("eight_schools", ["trace", "trace_copy"], 0, cfg)
    finally:
        del bench.ESTIMATORS["trace_copy"]
    a, b = out["trace"], out["trace_copy"]
    assert a["elbo"] == b["elbo"] == alone["elbo"]
    assert [h[2] for h in a["history"]] == [h[2] for h in b["history"]]
    assert a["elbo_eq_time"] == a["elbo"]


def test_smoothed_elbo_is_the_mean_of_an_evaluation_and_its_neighbours(bench):
    history = [(10, 1.0, -50.0), (20, 2.0, -40.0), (30, 3.0, -36.0), (40, 4.0, -32.0)]
    assert bench.SMOOTH == 1
    assert bench.smoothed(history) == [(1.0, -45.0), (2.0, -42.0), (3.0, -36.0), (4.0, -34.0)]
    assert bench.time_to_result(history, -40.0) == 3.0  # the first smoothed value that reaches
    assert bench.time_to_result(history, -33.0) != bench.time_to_result(history, -33.0)  # nan
    line = [(i, float(i), -10.0 + i) for i in range(6)]  # a straight rise: no lag inside
    assert [e for _, e in bench.smoothed(line)[1:-1]] == [e for _, _, e in line[1:-1]]


def _run(history, elbo, cpu):
    return {"elbo": elbo, "elbo_eq_time": elbo, "cpu": cpu, "ms_per_step": 1.0,
            "history": history}  # fmt: skip


def test_time_to_trace_result_is_a_fraction_of_trace_time_with_its_se(bench):
    """Target: Trace_ELBO's final ELBO of the seed minus the SE of its final ELBOs across the
    seeds; time: the first evaluation whose smoothed ELBO reaches it, over Trace_ELBO's total."""
    import math

    # Trace_ELBO's final ELBOs -10 and -12 (SE across seeds 1.0): targets -11 and -13
    base = [_run([(1, 2.0, -10.5), (2, 4.0, -10.0), (3, 8.0, -10.0)], -10.0, 8.0),
            _run([(1, 5.0, -20.0), (2, 10.0, -12.0)], -12.0, 10.0)]  # fmt: skip
    fast = [_run([(1, 2.0, -11.0), (2, 4.0, -11.0)], -9.0, 4.0),  # reaches at 2 s of 8
            _run([(1, 1.0, -14.5), (2, 2.0, -12.0), (3, 3.0, -12.0)], -12.0, 3.0)]  # fmt: skip
    # 2nd: smoothed -13.25, -12.83, -12 (reaches -13 at 2 s of 10)
    never = [_run([(1, 2.0, -30.0), (2, 4.0, -20.0)], -20.0, 4.0)] * 2
    rows = bench.summarize({"m": {"trace": base, "fast": fast, "never": never}})
    by = {r["estimator"]: r for r in rows}
    assert by["fast"]["to_result_range"] == pytest.approx((0.2, 0.25))
    assert by["fast"]["to_result"] == pytest.approx(0.225)
    assert by["fast"]["reached"] == "2/2"
    assert math.isnan(by["never"]["to_result"]) and by["never"]["reached"] == "0/2"
    # Trace_ELBO's own row: its 2nd seed's curve still rises (smoothed -16, -16: not reached)
    assert by["trace"]["to_result"] == pytest.approx(0.25) and by["trace"]["reached"] == "1/2"
    table = bench.markdown(rows)
    assert "to trace's result" in table.splitlines()[0]
    assert "0.23 (0.20-0.25, 2/2)" in table
    assert "not reached (0/2)" in table


def test_ar1_log_density_is_the_stationary_gaussian(bench):
    """The centered model's AR(1) path against the multivariate normal with the stationary
    covariance sigma^2 / (1 - phi^2) phi^|i - j| (float64)."""
    import torch

    T, mu, phi, sigma = 7, -0.5, 0.8, 0.3
    d = bench.AR1(torch.tensor(mu, dtype=torch.float64), torch.tensor(phi, dtype=torch.float64),
                  torch.tensor(sigma, dtype=torch.float64), T)  # fmt: skip
    i = torch.arange(T, dtype=torch.float64)
    cov = sigma**2 / (1 - phi**2) * phi ** (i[:, None] - i[None, :]).abs()
    ref = torch.distributions.MultivariateNormal(torch.full((T,), mu, dtype=torch.float64), cov)
    x = torch.randn(5, T, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(d.log_prob(x), ref.log_prob(x), rtol=1e-12, atol=1e-10)
    assert d.event_shape == (T,) and d.expand((3,)).log_prob(x[:3]).shape == (3,)
    draws = d.sample((20000,))
    assert torch.allclose(draws.mean(0), ref.mean, atol=5 * (cov.diagonal() / 20000).sqrt().max())


def test_centered_stochastic_volatility_has_103_latents_and_trains(bench):
    """Both guides of the centered model: 3 global latents + the path of 100, the issue's lr
    and steps, and steps that run."""
    import pyro
    from pyro import poutine

    for name in ("sv_centered", "sv_centered_lowrank", "sv_centered_b", "sv_centered_b_lowrank"):
        pyro.clear_param_store()
        p = bench.MODELS[name](0)
        assert (p.steps, p.lr) == (5000, 0.05)
        tr = poutine.trace(p.model).get_trace(*p.args)
        latents = [s for s in tr.nodes.values() if s["type"] == "sample" and not s["is_observed"]]
        assert sum(s["value"].numel() for s in latents) == 103
        assert len(p.args[0]) == 100
        r = bench._Run(name, "trace", 0)
        with r:
            for step in range(3):
                r.step(step, 3)
        assert r.cpu > 0


def test_centered_sv_data_prior_draw_or_fixed_globals(bench):
    """The default data are the model's prior draw of seed 3; with fixed globals, the AR(1) path
    and the returns drawn given them (the same draws, in the same order, done by hand)."""
    import pyro
    import torch
    from pyro import poutine

    pyro.set_rng_seed(bench.SV_DATA_SEED)
    prior = poutine.trace(bench._sv_centered_model(100)).get_trace(None)
    assert torch.equal(bench._sv_centered_data(100), prior.nodes["returns"]["value"])
    kw = dict(bench.SV_B_DATA)
    pyro.set_rng_seed(kw.pop("seed"))
    t = {k: torch.tensor(v) for k, v in kw.items()}
    path = bench.AR1(t["mean_log_vol"], t["persistence"], t["shock_scale"], 100).sample()
    returns = torch.distributions.Normal(0.0, (path / 2).exp()).sample()
    rng = torch.get_rng_state()
    assert torch.equal(bench._sv_centered_data(100, **bench.SV_B_DATA), returns)
    assert torch.equal(torch.get_rng_state(), rng)  # the global stream left as it was
    assert not torch.equal(returns, prior.nodes["returns"]["value"])


@pytest.mark.slow
def test_a_tiny_run_writes_the_results_file_with_its_header(bench, tmp_path):
    out = tmp_path / "results" / "convergence.md"
    bench.main(["--quick", "--models", "eight_schools", "--estimators", "trace,stl",
                "--seeds", "2", "--steps", "20", "--final-draws", "20",
                "--json", str(tmp_path / "c.json"), "--results", str(out)])  # fmt: skip
    text = out.read_text()
    header, rest = text.split("\n", 1)
    for word in ("Command: `python benchmarks/bench_convergence.py --quick", "date: ",
                 "commit: `", "machine load"):  # fmt: skip
        assert word in header
    lines = [ln for ln in rest.splitlines() if ln.startswith("|")]
    assert "to trace's result" in lines[0]
    assert [ln.split("|")[2].strip() for ln in lines[2:]] == ["trace", "stl"]
    # the saved run re-summarized: the same table, the run's header kept
    bench.main(["--from-json", str(tmp_path / "c.json"), "--results", str(out)])
    again = out.read_text()
    assert again.split("\n", 1)[0] == header
    assert "re-summarized from the run's JSON" in again
    assert [ln for ln in again.splitlines() if ln.startswith("|")] == lines


def test_named_models_densities_and_runs(bench):
    """The bridge's walk is the sum of independent Normal increments, the Cox prior the GP with
    a squared-exponential kernel (float64 closed forms); each of the six problems trains and
    its ELBO estimate is vectorized over draws."""
    import pyro
    import pyro.distributions as dist
    import torch
    from pyro import poutine

    torch.set_default_dtype(torch.float64)  # (the priors' constants too)
    try:
        y = bench._bridge_data()
        tr = poutine.trace(bench._bridge_model).get_trace(y.double())
        x, sigma = tr.nodes["x"]["value"], tr.nodes["sigma"]["value"]
        steps = torch.diff(x, prepend=x.new_zeros(1))
        ref = dist.Normal(0.0, sigma).log_prob(steps).sum()
        assert torch.allclose(tr.nodes["x"]["fn"].log_prob(x), ref, rtol=1e-10)
        y = bench._cox_data()
        tr = poutine.trace(bench._cox_model).get_trace(y.double())
        t = torch.linspace(0, 1, len(y), dtype=torch.float64)
        amp, mu = tr.nodes["amp"]["value"], tr.nodes["mu"]["value"]
        cov = amp**2 * ((-((t[:, None] - t) ** 2) / 0.02).exp() + 1e-4 * torch.eye(len(y)))
        f = tr.nodes["f"]["value"]
        ref = torch.distributions.MultivariateNormal(mu.expand(len(y)), cov).log_prob(f)
        assert torch.allclose(tr.nodes["f"]["fn"].log_prob(f), ref, rtol=1e-8)
    finally:
        torch.set_default_dtype(torch.float32)
    for name in bench.NAMED:
        pyro.clear_param_store()
        p = bench.MODELS[name](0)
        assert (p.steps, p.lr) == (2000, 0.05)
        r = bench._Run(name, "adaptive", 0)
        with r:
            for step in range(3):
                r.step(step, 3)
            assert math.isfinite(bench.elbo_estimate(r.p, 4, 0))
