"""The guides' examples and benchmark run end to end with --smoke and print what they promise."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_swap_family_smoke(capsys):
    load("examples/swap_family.py").main(["--smoke"])
    out = capsys.readouterr().out
    assert "step 2 fails: RuntimeError: Trying to backward through the graph a second time" in out
    for family in ("Normal", "LogNormal", "Gamma"):
        assert f"   {family} " in out
    assert "family=Gamma   (Gamma" in out and "family=Normal  (TransformedDistribution" in out
    assert out.count("(smoke run: not converged)") == 5  # every fitted figure is labelled


@pytest.mark.slow
def test_hierarchical_positive_scale_smoke(capsys):
    load("examples/hierarchical_positive_scale.py").main(["--smoke"])
    out = capsys.readouterr().out
    for name in ("AutoNormal", "AutoMeanField(tau: Gamma)", "AutoMeanField(tau: LogNormal)"):
        assert name in out
    assert "['AutoMeanField.tau.loc', 'AutoMeanField.tau.scale']" in out
    assert out.count("(smoke run: not converged)") == 3


@pytest.mark.slow
def test_bench_guides_smoke(capsys):
    load("benchmarks/bench_guides.py").main(["--smoke"])
    out = capsys.readouterr().out
    ratios = [
        float(line.split("ratio ")[1].split()[0]) for line in out.splitlines() if "ratio" in line
    ]
    assert len(ratios) == 2 and all(r > 0 for r in ratios)


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
