import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pyro_gradroute.app.catalog import ESTIMATORS, MODEL_DESCRIPTIONS
from pyro_gradroute.app.cli import main
from pyro_gradroute.app.models import MODELS

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


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "pyro_gradroute", *args], capture_output=True,
                          text=True, timeout=300, **kw)  # fmt: skip


def write_module(folder, name, body):
    (folder / f"{name}.py").write_text(textwrap.dedent(body))


USER_MODEL = """
import pyro, pyro.distributions as dist, torch
from pyro.infer.autoguide import AutoNormal

def model(x):
    z = pyro.sample("z", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.Normal(z, 1.0), obs=x)
"""


@pytest.mark.slow
def test_bare_form_runs_end_to_end(tmp_path):
    """``python -m pyro_gradroute --model X`` (no 'compare'): table on stdout, phases on stderr."""
    out = tmp_path / "plots"
    proc = run("--model", "gaussian_means", "--estimators", "trace,stl", "--out", str(out), *TINY)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("estimator"))
    for col in ["train loss (sum)", "held-out ll (per obs)", "SNR guide", "ms/step", "k-hat"]:
        assert col in lines[header]
    assert lines[header + 2].split()[0] == "trace" and lines[header + 3].split()[0] == "stl"
    assert "±" in lines[header + 2] and "scales (nats)" in proc.stdout
    assert "wall clock" in proc.stdout
    # no silent phases: a line per estimator, and the plotting announced
    assert "trace: 4 steps in" in proc.stderr and "stl: 4 steps in" in proc.stderr
    assert "writing plots to" in proc.stderr
    assert_pngs(out)


@pytest.mark.slow
def test_user_module_function(tmp_path, monkeypatch, capsys):
    write_module(
        tmp_path,
        "my_gr_problem",
        USER_MODEL
        + """
def problem():
    return dict(model=model, guide=AutoNormal(model), args=(torch.ones(3),),
                heldout_args=(torch.zeros(2),))
""",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["compare", "--model", "my_gr_problem:problem", "--estimators", "trace,iwae",
               "--out", str(tmp_path / "o"), *TINY])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "my_gr_problem:problem" in out and "\niwae " in out
    assert_pngs(tmp_path / "o")


def test_list_and_help_and_version_do_not_import_torch():
    code = (
        "import sys\nfrom pyro_gradroute.app.cli import main\n"
        "assert main(['list']) == 0\nassert main(['--help']) == 0\n"
        "assert main(['--version']) == 0\nassert main(['compare', '--help']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "gaussian_means" in proc.stdout and "pyro-gradroute 0.1.0" in proc.stdout


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in MODELS) and "dreg" in out


def test_catalog_names_the_registered_functions():
    assert list(MODEL_DESCRIPTIONS) == list(MODELS)
    assert all(callable(f) for f in MODELS.values())


def test_list_into_a_closed_pipe_has_no_broken_pipe_error():
    proc = subprocess.Popen([sys.executable, "-m", "pyro_gradroute", "list"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    proc.stdout.close()  # the reader is gone before anything is written, like '| head -0'
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and "BrokenPipe" not in err and "Traceback" not in err


@pytest.mark.parametrize(
    "flags, expected",
    [(["--steps", "0"], "argument --steps: must be at least 1, got 0"),
     (["--particles", "0"], "argument --particles: must be at least 1, got 0"),
     (["--threads", "-1"], "argument --threads: must be at least 1, got -1"),
     (["--steps", "two"], "argument --steps: must be a whole number"),
     (["--lr", "0"], "argument --lr: must be a positive number"),
     (["--estimators", ""], "argument --estimators: the list is empty"),
     (["--estimators", ","], "argument --estimators: the list is empty"),
     (["--estimators", "trace,stl,trace"], "argument --estimators: trace listed more than once"),
     (["--estimators", "trace,reinforce"], "unknown estimator 'reinforce'; available: trace, stl, iwae, dreg"),
     (["--alpha", "1"], "argument --alpha: must be a finite number other than 1"),
     (["--warmup-steps", "-1"], "argument --warmup-steps: must be at least 0, got -1")],
)  # fmt: skip
def test_bad_values_are_refused_before_fitting(flags, expected, capsys, tmp_path):
    out = tmp_path / "never"
    assert main(["compare", "--model", "gaussian_means", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert expected in err and "pyro-gradroute compare: error:" in err
    assert not out.exists()


def test_unwritable_out_folder_is_refused_before_fitting(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    assert (
        main(["compare", "--model", "gaussian_means", "--out", str(tmp_path / "file" / "o")]) == 2
    )
    err = capsys.readouterr().err
    assert "argument --out: cannot create" in err and "is not a folder" in err
    assert "loading" not in err  # refused before the model was even loaded


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_read_only_out_folder_is_refused(capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    assert main(["compare", "--out", str(ro / "plots")]) == 2
    err = capsys.readouterr().err
    assert f"argument --out: cannot create a folder in {str(ro)!r}: Permission denied" in err
    assert main(["compare", "--out", str(ro)]) == 2  # the folder exists: a file in it
    err = capsys.readouterr().err
    assert f"argument --out: cannot write to {str(ro)!r}: Permission denied" in err


@pytest.mark.parametrize(
    "model, expected",
    [("no_such_model", ["Unknown model 'no_such_model'", *MODELS]),
     ("no_such_module_xyz:problem", ["Cannot import module 'no_such_module_xyz'", *MODELS]),
     ("pyro_gradroute.app.models.eight_schools:nope",
      ["has no function 'nope'", "model", "problem"]),
     ("just:", ["must look like 'module:function'"])],
)  # fmt: skip
def test_bad_model_lists_what_exists(model, expected, capsys, tmp_path):
    assert main(["compare", "--model", model, "--out", str(tmp_path), *TINY]) == 2
    err = capsys.readouterr().err
    assert "pyro-gradroute: error:" in err
    for text in expected:
        assert text in err
    assert not list(tmp_path.iterdir())


def test_problem_dict_with_unknown_keys_is_explained(tmp_path, monkeypatch, capsys):
    (tmp_path / "bad_gr_problem.py").write_text(
        "def problem():\n    return dict(model=print, guid=print)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["compare", "--model", "bad_gr_problem:problem", *TINY]) == 2
    err = capsys.readouterr().err
    assert "unknown keys ['guid']" in err and "missing keys ['guide']" in err


BROKEN_MODEL = """
import pyro, pyro.distributions as dist, torch
from pyro.infer.autoguide import AutoNormal

def scale_of(z):
    if z.ndim > 0:
        raise ValueError("scale_of wants a scalar")
    return 1.0

def model(x):
    z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    pyro.sample("x", dist.Normal(z.sum(-1), scale_of(z)), obs=x)

def problem():
    return dict(model=model, guide=AutoNormal(model), args=(torch.tensor(1.0),))
"""


@pytest.mark.slow
def test_error_in_user_code_shows_the_users_frames(tmp_path):
    write_module(tmp_path, "broken_gr_model", BROKEN_MODEL)
    proc = run("--model", "broken_gr_model:problem", "--out", str(tmp_path / "o"), *TINY,
               cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr
    assert "error in your model code" in err
    assert 'broken_gr_model.py", line 7, in scale_of' in err
    assert 'raise ValueError("scale_of wants a scalar")' in err
    assert "line 12, in model" in err and "scale_of(z)" in err
    assert "ValueError: scale_of wants a scalar" in err and "--traceback" in err
    assert "site-packages" not in err and "pyro/poutine" not in err
    full = run("--model", "broken_gr_model:problem", "--traceback", *TINY, cwd=tmp_path)
    assert full.returncode == 1 and "Traceback (most recent call last)" in full.stderr
    assert "pyro/poutine" in full.stderr  # the full traceback, library frames included


DIVERGING = (
    USER_MODEL
    + """
def problem():
    return dict(model=model, guide=AutoNormal(model), args=(torch.ones(3),), lr=1e4, steps=60)
"""
)


def test_divergence_is_reported_per_estimator_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    write_module(tmp_path, "diverging_gr", DIVERGING)
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["--model", "diverging_gr:problem", "--estimators", "trace,stl", "--out",
               str(tmp_path / "o"), "--snr-draws", "3", "--samples", "40", "--no-progress"])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 0
    lines = captured.out.splitlines()
    assert any(line.startswith("trace ") for line in lines)  # a row for each estimator
    assert any(line.startswith("stl ") for line in lines)
    assert "trace: diverged at step" in captured.out and "stl: diverged at step" in captured.out
    assert "try a smaller --lr" in captured.out
    assert "diverged at step" in captured.err  # said as it happens, too
    assert (tmp_path / "o" / "loss_curves.png").exists()


def test_ctrl_c_prints_the_finished_estimators_and_exits_130(tmp_path, monkeypatch, capsys):
    write_module(
        tmp_path,
        "interrupted_gr",
        USER_MODEL
        + """
calls = []

def problem():
    calls.append(1)
    if len(calls) == 3:  # 1: checked by the command, 2: trace, 3: stl
        raise KeyboardInterrupt
    return dict(model=model, guide=AutoNormal(model), args=(torch.ones(3),))
""",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["--model", "interrupted_gr:problem", "--estimators", "trace,stl,dreg",
               "--out", str(tmp_path / "o"), *TINY])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 130
    assert "interrupted; finished estimators: trace" in captured.err
    assert "Traceback" not in captured.err
    table = captured.out.splitlines()
    assert any(line.startswith("trace ") for line in table)
    assert not any(line.startswith(("stl ", "dreg ")) for line in table)


def test_estimator_catalog_matches_the_classes():
    from pyro_gradroute.app.estimators import available_estimators

    assert available_estimators() == list(ESTIMATORS)


@pytest.mark.parametrize("name", ["renyi", "renyi-dreg", "enum", "enum-stl"])
def test_renyi_and_enumeration_estimators(name):
    from pyro_gradroute.app.estimators import make_elbo

    elbo = make_elbo(name, num_particles=2, alpha=0.3)
    if name.startswith("renyi"):
        assert elbo.alpha == 0.3
    if name == "enum-stl":  # the guide runs under stick_the_landing: zero gradient at the posterior
        import pyro
        import pyro.distributions as dist

        torch.set_default_dtype(torch.float64)

        def model():
            pyro.sample("z", dist.Normal(0.0, 1.0))

        def guide():
            pyro.sample("z", dist.Normal(pyro.param("m", torch.tensor(0.0)), 1.0))

        make_elbo(name, num_particles=1, max_plate_nesting=0).loss_and_grads(model, guide)
        assert pyro.param("m").unconstrained().grad.abs().max() < 1e-12


@pytest.mark.slow
def test_adaptive_estimator_prints_its_variance_reduction(tmp_path, capsys):
    flags = ["--steps", "20", "--snr-draws", "3", "--samples", "20", "--no-progress"]
    code = main(
        [
            "compare",
            "--model",
            "gaussian_means",
            "--estimators",
            "stl,adaptive",
            *flags,
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert (
        code == 0
        and "adaptive: guide-gradient variance" in out
        and "better of STL and Trace_ELBO" in out
    )
    assert (tmp_path / "control_variates.png").exists()
