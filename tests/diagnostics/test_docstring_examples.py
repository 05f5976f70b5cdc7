"""The runnable examples in the docstrings of the diagnostics, models and CLI modules."""

import doctest
import importlib

import pyro
import pytest

MODULES = [
    "pyro_gradroute.diagnostics.draws",
    "pyro_gradroute.diagnostics.estimators",
    "pyro_gradroute.diagnostics.gradients",
    "pyro_gradroute.diagnostics.heldout",
    "pyro_gradroute.diagnostics.inference_data",
    "pyro_gradroute.diagnostics.psis",
    "pyro_gradroute.models.registry",
    "pyro_gradroute.models.eight_schools",
    "pyro_gradroute.models.logistic_regression",
    "pyro_gradroute.models.score_pathwise",
    "pyro_gradroute.models.swap_family",
    "pyro_gradroute.models.nested_networks",
    "pyro_gradroute.cli",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    pyro.clear_param_store()
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
