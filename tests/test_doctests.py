"""Every runnable example in the package's docstrings runs as written and shows what it says.

Walks all modules of ``pyro_gradroute``; a module whose docstrings hold examples must pass
them all. Modules with no example are listed so that a lost example is noticed.
"""

import doctest
import importlib
import pkgutil

import pyro
import pytest

import pyro_gradroute

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(pyro_gradroute.__path__, "pyro_gradroute.")
    if not m.name.endswith("__main__")
)

# package __init__s and internal helpers carry no runnable example; every other module must
NO_EXAMPLES = {
    "pyro_gradroute.diagnostics",
    "pyro_gradroute.diagnostics._arviz",
    "pyro_gradroute.distributed",
    "pyro_gradroute.distributions",
    "pyro_gradroute.distributions.structured",  # internal: the pathwise parts of two Pyro guides
    "pyro_gradroute.guides",
    "pyro_gradroute.infer",
    "pyro_gradroute.infer.elbo",
    "pyro_gradroute.poutine.pathwise",  # internal: the rule per guide site
    "pyro_gradroute.app",
    "pyro_gradroute.app.plots",
    "pyro_gradroute.poutine",
}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    pyro.clear_param_store()
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    assert (result.attempted == 0) == (name in NO_EXAMPLES), "an example was lost or added"
