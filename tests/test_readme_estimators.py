"""The README's split_log_prob, TraceSTL_ELBO and TraceDReG_ELBO snippets run as written."""

import pytest
import torch

from tests.readme import python_snippets, run_snippet, stated_output


def test_split_snippet():
    (code,) = python_snippets("split")
    ns = run_snippet(code, "README split snippet")
    assert torch.equal(ns["log_prob"], ns["log_prob_detach"])
    assert not ns["log_prob_detach"].requires_grad or ns["log_prob_detach"].grad_fn is not None


def test_stl_snippet(capsys):
    (code,) = python_snippets("stl")
    ns = run_snippet(code, "README stl snippet")
    # the snippet is seeded: it prints exactly what its comment says
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert code.strip().splitlines()[-1].endswith(f"# {printed}")
    median = ns["guide"].median()
    assert median["loc"].item() == pytest.approx(ns["x"].mean().item(), abs=0.3)
    assert median["scale"].item() == pytest.approx(ns["x"].std().item(), abs=0.3)


def test_dreg_snippet():
    (code,) = python_snippets("dreg")
    ns = run_snippet(code, "README dreg snippet")
    assert 10 < ns["loss"] / 128 < 60


def test_stl_with_pyros_elbos_snippet_runs(capsys):
    (code,) = python_snippets("stl-pyro")
    ns = run_snippet(code, "stl-pyro snippet")
    # the snippet is seeded: it prints exactly what its comment says
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed == stated_output(code, 'print(pyro.param("m"))')
    m = ns["pyro"].param("m").detach().sort().values
    assert abs(m[0] + 3) < 0.7 and abs(m[1] - 3) < 0.7
