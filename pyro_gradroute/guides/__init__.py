"""Param-store guides whose family you swap in one line.

* :class:`ParametrizedDistribution` -- a family whose arguments are constrained
  parameters in Pyro's param store, re-read at every call.
* :class:`AutoMeanField` -- an AutoGuide with one independent factor of a chosen
  family (Gamma, Beta, Dirichlet, LogNormal, Normal, ...) per latent site.
* :func:`moment_init`, :func:`register_moment_init` -- moment-matching initial values.
"""

from .init import has_moment_init, moment_init, register_moment_init, support_spread
from .mean_field import AutoMeanField, FamilySpec
from .parametrized import ParametrizedDistribution, as_pyro_family
from .support import match_support, support_key

__all__ = [
    "AutoMeanField",
    "FamilySpec",
    "ParametrizedDistribution",
    "as_pyro_family",
    "has_moment_init",
    "match_support",
    "moment_init",
    "register_moment_init",
    "support_key",
    "support_spread",
]
