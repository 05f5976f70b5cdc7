"""Gradient estimators by name, imported lazily (an estimator that is not installed is an error
naming what is).

======== ==================================================== ===============================
name     class                                                objective
======== ==================================================== ===============================
trace    ``pyro_gradroute.infer.Trace_ELBO``                  ELBO, full reparameterized grad
stl      ``pyro_gradroute.infer.TraceSTL_ELBO``               ELBO, pathwise guide gradient
iwae     ``pyro.infer.RenyiELBO(alpha=0)``                    IWAE bound (K particles)
dreg     ``pyro_gradroute.infer.TraceDReG_ELBO``              IWAE bound, doubly reparameterized
renyi    ``pyro.infer.RenyiELBO(alpha)``                      Renyi bound of order ``alpha``
renyi-   ``pyro_gradroute.infer.TraceDReG_ELBO(alpha)``       Renyi bound, doubly reparameterized
dreg
enum     ``pyro.infer.TraceEnum_ELBO``                        ELBO, enumerated discrete sites
enum-stl ``TraceEnum_ELBO`` with ``stick_the_landing(guide)`` the same, sticking the landing
======== ==================================================== ===============================

Example::

    >>> from pyro_gradroute.app.estimators import make_elbo
    >>> type(make_elbo("stl", num_particles=4)).__name__
    'TraceSTL_ELBO'
"""

from __future__ import annotations

import importlib
from typing import Any

from .catalog import ESTIMATORS

__all__ = ["ESTIMATORS", "available_estimators", "make_elbo"]


def _load(name: str) -> type | None:
    module, cls, _, _ = ESTIMATORS[name]
    return getattr(importlib.import_module(module), cls, None)


def available_estimators() -> list[str]:
    """Names whose class is importable in this install, in table order."""
    return [name for name in ESTIMATORS if _load(name) is not None]


def make_elbo(
    name: str,
    num_particles: int = 8,
    max_plate_nesting: int | None = None,
    vectorize_particles: bool = True,
    alpha: float = 0.5,
) -> Any:
    """A fresh ELBO for estimator ``name`` with ``num_particles`` (vectorized) particles.

    ``max_plate_nesting`` is passed on when given (Pyro guesses it otherwise); ``alpha`` is
    the order of the Renyi estimators (``renyi``, ``renyi-dreg``).

    :raises ValueError: for an unknown name or one whose class is not installed, listing the
        available names.
    """
    if name not in ESTIMATORS:
        raise ValueError(
            f"Unknown estimator {name!r}; available: {', '.join(available_estimators())}"
        )
    cls = _load(name)
    if cls is None:
        module, clsname, _, _ = ESTIMATORS[name]
        raise ValueError(
            f"Estimator {name!r} needs {module}.{clsname}, which this install does not have; "
            f"available: {', '.join(available_estimators())}"
        )
    kwargs = dict(ESTIMATORS[name][2])
    if kwargs.get("alpha", 0.0) is None:
        kwargs["alpha"] = alpha
    stl = kwargs.pop("stick_the_landing", False)
    if max_plate_nesting is not None:
        kwargs["max_plate_nesting"] = max_plate_nesting
    elbo = cls(num_particles=num_particles, vectorize_particles=vectorize_particles, **kwargs)
    return _stick_the_landing(elbo) if stl else elbo


def _stick_the_landing(elbo):
    """``elbo`` (a Pyro ELBO) whose guide is always run under ``poutine.stick_the_landing``.

    A wrapper, not a subclass: the estimator that runs the guide stays the plain ELBO (the
    handler's allow-list sees it), and each guide keeps one handler, which learns on its
    first run what the guide needs.
    """
    from pyro.infer.elbo import ELBO

    from pyro_gradroute.poutine import stick_the_landing

    class StickTheLandingELBO(ELBO):
        def __init__(self, inner):
            self.elbo = inner
            self._guides: dict = {}

        def __getattr__(self, name):
            if name in ("elbo", "_guides"):
                raise AttributeError(name)
            return getattr(self.elbo, name)

        def _get_trace(self, model, guide, args, kwargs):
            return self.elbo._get_trace(model, self._wrap(guide), args, kwargs)

        def _wrap(self, guide):
            key = id(guide)
            if key not in self._guides or self._guides[key][0] is not guide:
                self._guides[key] = (guide, stick_the_landing(guide))
            return self._guides[key][1]

        def loss(self, model, guide, *args, **kwargs):
            return self.elbo.loss(model, self._wrap(guide), *args, **kwargs)

        def loss_and_grads(self, model, guide, *args, **kwargs):
            return self.elbo.loss_and_grads(model, self._wrap(guide), *args, **kwargs)

        def differentiable_loss(self, model, guide, *args, **kwargs):
            return self.elbo.differentiable_loss(model, self._wrap(guide), *args, **kwargs)

    wrapped = StickTheLandingELBO(elbo)
    type(wrapped).__name__ = type(elbo).__name__ + "WithStickTheLanding"
    return wrapped
