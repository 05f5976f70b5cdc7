"""Every function the diagnostics docstring names with :func: is exported there."""

import re

import pyro_gradroute.diagnostics as diagnostics


def test_named_functions_are_exported():
    named = set(re.findall(r":func:`~?([\w.]+)`", diagnostics.__doc__))
    assert named
    for name in named:
        assert name in diagnostics.__all__ and callable(getattr(diagnostics, name)), name


def test_the_comparison_it_points_to_exists():
    from pyro_gradroute.app.compare import compare_estimators

    assert "pyro_gradroute.app.compare.compare_estimators" in diagnostics.__doc__
    assert callable(compare_estimators)
