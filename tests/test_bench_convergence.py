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
    base = {"elbo": -35.0, "cpu": 3.0, "ms_per_step": 100.0, "history": [(30, 3.0, -35.0)]}
    slower = {
        "elbo": -34.0,
        "cpu": 4.0,
        "ms_per_step": 133.0,
        "history": [(10, 1.0, -50.0), (20, 2.5, -38.0), (30, 4.0, -34.0)],
    }
    rows = bench.summarize({"m": {"trace": [base, base], "other": [slower, slower]}})
    row = next(r for r in rows if r["estimator"] == "other")
    assert row["diff_eq_time"] == pytest.approx((-38.0 + 4.0 * 0.5 / 1.5) - (-35.0))
