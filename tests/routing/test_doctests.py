"""The docstring examples of the routing engine and the block_grad handler run as written."""

import doctest

import pytest

import pyro_gradroute.poutine.block_grad_messenger
import pyro_gradroute.poutine.collect
import pyro_gradroute.poutine.gated_distribution
import pyro_gradroute.poutine.resolve
import pyro_gradroute.routing

MODULES = [
    pyro_gradroute.routing,
    pyro_gradroute.poutine.block_grad_messenger,
    pyro_gradroute.poutine.collect,
    pyro_gradroute.poutine.gated_distribution,
    pyro_gradroute.poutine.resolve,
]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
