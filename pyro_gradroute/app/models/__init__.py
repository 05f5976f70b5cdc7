"""Bundled problems for ``pyro-gradroute compare``, by name.

:data:`MODELS` maps each name to its problem function: a zero-argument function returning a
:class:`Problem` (model, fresh guide, data, defaults). A user's own problem is such a function,
named on the command line as ``module:function``.

Example::

    >>> from pyro_gradroute.app.models import MODELS, load_problem
    >>> MODELS["gaussian_means"].__module__
    'pyro_gradroute.app.models.gaussian_means'
    >>> load_problem("gaussian_means").args[0].shape
    torch.Size([20, 10])
"""

from collections.abc import Callable

from . import (
    digits_vae,
    eight_schools,
    gamma_to_normal,
    gaussian_means,
    logistic_regression,
    nested_aux_loss,
)
from .problem import Problem, as_problem, load_problem

#: bundled problem name -> problem function (descriptions: ``app.catalog.MODEL_DESCRIPTIONS``)
MODELS: dict[str, Callable[[], Problem]] = {
    "logistic_regression": logistic_regression.problem,
    "eight_schools": eight_schools.problem,
    "digits_vae": digits_vae.problem,
    "gaussian_means": gaussian_means.problem,
    "gamma_to_normal": gamma_to_normal.problem,
    "nested_aux_loss": nested_aux_loss.problem,
}

__all__ = ["MODELS", "Problem", "as_problem", "load_problem"]
