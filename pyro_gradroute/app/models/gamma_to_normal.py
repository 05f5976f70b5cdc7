r"""Fit a Gamma factor to a Normal(5, 5) target, with the unchanged SVI loop.

.. math::

    p(x) = N(x; 5, 5^2),\qquad q(x) = \text{Gamma}(x; \alpha, \beta),\quad
    \alpha = e^{u_\alpha},\ \beta = e^{u_\beta},

fitted by minimizing :math:`\mathrm{KL}(q \,\|\, p)`. The positive arguments live in Pyro's param
store unconstrained and are mapped through ``exp`` at every read
(:class:`~pyro_gradroute.guides.ParametrizedDistribution`), so the graph reaches
:math:`u` at every step; swapping ``dist.Gamma`` for ``dist.Normal`` or ``dist.LogNormal`` is
the ``family`` argument of :func:`problem`. The Gamma cannot cover the target's negative half,
which the PSIS k-hat reports.

Example::

    >>> import pyro, pyro.distributions as dist
    >>> from pyro_gradroute.app.models.gamma_to_normal import problem
    >>> p = problem(dist.LogNormal)
    >>> type(p.guide.q()).__name__
    'LogNormal'
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist

from .problem import Problem

INIT = {
    dist.Gamma: {"concentration": 2.0, "rate": 0.5},
    dist.LogNormal: {"loc": 1.0, "scale": 0.5},
    dist.Normal: {"loc": 1.0, "scale": 1.0},
}


def model() -> None:
    """The target as a model without data: ``x ~ Normal(5, 5)``."""
    pyro.sample("x", dist.Normal(5.0, 5.0))


class FamilyGuide:
    """Guide ``x ~ family(...)`` whose arguments are constrained param-store parameters."""

    def __init__(self, family: type = dist.Gamma) -> None:
        from ...guides import ParametrizedDistribution

        if family not in INIT:
            raise ValueError(
                f"gamma_to_normal: no initial values for {family.__name__}; "
                f"choose one of {[f.__name__ for f in INIT]}"
            )
        self.q = ParametrizedDistribution("q", family, **INIT[family])

    def __call__(self) -> None:
        pyro.sample("x", self.q())


def problem(family: type = dist.Gamma) -> Problem:
    """The bundled problem (``family=Gamma``), 400 steps at lr 0.05."""
    return Problem(
        model=model,
        guide=FamilyGuide(family),
        steps=400,
        lr=0.05,
    )
