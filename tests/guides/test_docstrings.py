"""The runnable examples in the guides' docstrings run and give what they show."""

import doctest

import pytest

from pyro_gradroute.guides import init, mean_field, parametrized, support


@pytest.mark.parametrize(
    "module", [init, mean_field, parametrized, support], ids=lambda m: m.__name__
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
