"""pyro-gradroute compare: bad flags exit 2 naming the flag, before the model is loaded."""

import pytest

from pyro_gradroute.app import cli
from pyro_gradroute.app.cli import main


def test_negative_seed_exits_2_naming_the_flag_before_loading(capsys, tmp_path, monkeypatch):
    loaded = []
    import pyro_gradroute.app.models.problem as problem

    monkeypatch.setattr(problem, "load_problem", lambda name: loaded.append(name))
    assert (
        main(["compare", "--model", "gaussian_means", "--out", str(tmp_path / "o"), "--seed", "-1"])
        == 2
    )
    err = capsys.readouterr().err
    assert "argument --seed: must be at least 0, got -1" in err
    assert not loaded and "loading" not in err


def test_model_file_name_suggests_the_module_name(capsys, tmp_path):
    assert main(["compare", "--model", "my_model.py:problem", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "without '.py': --model my_model:problem" in err


@pytest.mark.parametrize(
    "flag,default", [("--seed", "0"), ("--snr-draws", "20"), ("--samples", "1000")]
)
def test_help_shows_the_defaults(flag, default):
    helps = {
        a.option_strings[0]: a.help
        for a in cli._parser().compare_parser._actions
        if a.option_strings
    }
    assert f"(default {default})" in helps[flag]


def test_unknown_command_lists_the_commands(capsys):
    assert main(["comapre", "--model", "gaussian_means"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'comapre'; the commands are: compare, list" in err


@pytest.mark.parametrize("estimators", ["trace,stl", None])
def test_alpha_without_a_renyi_estimator_is_refused(estimators, capsys, tmp_path):
    flags = ["--estimators", estimators] if estimators else []  # None: the default list
    out = tmp_path / "never"
    assert main(["compare", "--alpha", "0.3", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert "argument --alpha: only the renyi and renyi-dreg estimators use it" in err
    assert not out.exists() and "loading" not in err


def test_alpha_with_a_renyi_estimator_reaches_it(monkeypatch, capsys, tmp_path):
    import pyro_gradroute.app.compare as compare

    seen = {}

    def fake_iter_compare(build, names, **kwargs):
        seen.update(names=names, alpha=kwargs["alpha"])
        return iter(())

    monkeypatch.setattr(compare, "iter_compare", fake_iter_compare)
    monkeypatch.setattr(compare, "suggest", lambda rows: "")
    monkeypatch.setattr("pyro_gradroute.app.plots.write_plots", lambda *a, **k: [])
    main(["compare", "--model", "gaussian_means", "--estimators", "trace,renyi", "--alpha",
          "0.3", "--out", str(tmp_path / "o")])  # fmt: skip
    assert seen == {"names": ["trace", "renyi"], "alpha": 0.3}


def test_compare_help_names_models_estimators_out_default_and_divergence(capsys):
    from pyro_gradroute.app.catalog import ESTIMATORS, MODEL_DESCRIPTIONS

    with pytest.raises(SystemExit):
        cli._parser().parse_args(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in [*MODEL_DESCRIPTIONS, *ESTIMATORS]:
        assert f" {name} " in text, name
    assert "(default gradroute-compare, in the current folder)" in text
    assert "diverged at step N when step N's loss is not finite" in text


@pytest.mark.skipif(not cli.sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_out_in_proc_gives_the_right_reason(capsys):
    assert main(["compare", "--out", "/proc/gradroute-never"]) == 2
    err = capsys.readouterr().err
    assert "cannot create a folder in '/proc'" in err
    assert "takes no new files or folders" in err and "No such file" not in err
