"""Run the README's recipe snippets (the ```python blocks of its recipes section) as written."""

import pytest

from tests.readme import python_snippets

RECIPES = python_snippets("recipes")


def test_three_recipes():
    assert len(RECIPES) == 3


@pytest.mark.parametrize("index", range(len(RECIPES)))
def test_recipe_runs(index):
    code = compile(RECIPES[index], f"README.md recipe {index + 1}", "exec")
    exec(code, {"__name__": f"readme_recipe_{index + 1}"})


def test_user_model_example_of_the_diagnostics_section(tmp_path, monkeypatch):
    (snippet,) = python_snippets("diagnostics", prefix="# my_model.py\n")
    (tmp_path / "my_model.py").write_text(snippet)
    monkeypatch.syspath_prepend(str(tmp_path))
    from pyro_gradroute.app.models import load_problem

    problem = load_problem("my_model:problem")
    assert problem.heldout_args is not None and len(problem.args[0]) == 50


def test_user_model_is_found_in_the_current_folder_like_the_console_script(tmp_path, monkeypatch):
    """The console script's sys.path lacks the current folder; load_problem adds it."""
    import os
    import sys

    (snippet,) = python_snippets("diagnostics", prefix="# my_model.py\n")
    (tmp_path / "my_model_cwd.py").write_text(snippet)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    from pyro_gradroute.app.models import load_problem

    assert load_problem("my_model_cwd:problem").args is not None
