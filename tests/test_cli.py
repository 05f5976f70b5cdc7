import subprocess
import sys
import textwrap

import pytest
import torch

from pyro_gradroute.cli import main
from pyro_gradroute.models.registry import MODELS

TINY = ["--steps", "4", "--snr-draws", "3", "--samples", "40", "--no-progress"]
PLOTS = ["loss_curves.png", "gradient_snr.png", "forest.png"]


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def assert_pngs(folder):
    for name in PLOTS:
        data = (folder / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_python_m_runs_end_to_end(tmp_path):
    out = tmp_path / "plots"
    proc = subprocess.run(
        [sys.executable, "-m", "pyro_gradroute", "compare", "--model", "score_pathwise",
         "--estimators", "trace,stl", "--out", str(out), *TINY],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("estimator"))
    for col in ["train loss", "held-out ll", "SNR guide", "ms/step", "k-hat"]:
        assert col in lines[header]
    assert lines[header + 2].split()[0] == "trace" and lines[header + 3].split()[0] == "stl"
    assert_pngs(out)


def test_user_module_function(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_gr_problem.py").write_text(
        textwrap.dedent("""
        import pyro, pyro.distributions as dist, torch
        from pyro.infer.autoguide import AutoNormal

        def model(x):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            with pyro.plate("data", len(x)):
                pyro.sample("x", dist.Normal(z, 1.0), obs=x)

        def problem():
            return dict(model=model, guide=AutoNormal(model), args=(torch.ones(3),),
                        heldout_args=(torch.zeros(2),))
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["compare", "--model", "my_gr_problem:problem", "--estimators", "trace,iwae",
               "--out", str(tmp_path / "o"), *TINY])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "my_gr_problem:problem" in out and "\niwae " in out
    assert_pngs(tmp_path / "o")


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in MODELS) and "dreg" in out


@pytest.mark.parametrize(
    "model, expected",
    [("no_such_model", ["Unknown model 'no_such_model'", *MODELS]),
     ("no_such_module_xyz:problem", ["Cannot import module 'no_such_module_xyz'", *MODELS]),
     ("pyro_gradroute.models.eight_schools:nope",
      ["has no function 'nope'", "model", "problem"]),
     ("just:", ["must look like 'module:function'"])],
)  # fmt: skip
def test_bad_model_lists_what_exists(model, expected, capsys, tmp_path):
    assert main(["compare", "--model", model, "--out", str(tmp_path), *TINY]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pyro-gradroute: error:")
    for text in expected:
        assert text in err
    assert not list(tmp_path.iterdir())


def test_bad_estimator_lists_available(capsys, tmp_path):
    rc = main(["compare", "--model", "score_pathwise", "--estimators", "trace,reinforce",
               "--out", str(tmp_path), *TINY])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert "Unknown estimator 'reinforce'" in err and "trace, stl, iwae" in err


def test_problem_dict_with_unknown_keys_is_explained(tmp_path, monkeypatch, capsys):
    (tmp_path / "bad_gr_problem.py").write_text(
        "def problem():\n    return dict(model=print, guid=print)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["compare", "--model", "bad_gr_problem:problem", *TINY]) == 2
    err = capsys.readouterr().err
    assert "unknown keys ['guid']" in err and "missing keys ['guide']" in err
