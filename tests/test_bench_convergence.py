"""The convergence benchmark's equal-time comparison: the chord between two evaluations."""

import importlib.util
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
