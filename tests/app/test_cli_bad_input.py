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
