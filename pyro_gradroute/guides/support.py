"""Comparing supports: does a family live on a site's support (:func:`support_key`: up to a set
of measure zero), or on the reals?"""

from __future__ import annotations

from typing import Literal

import torch
from torch.distributions import constraints
from torch.distributions.constraints import Constraint

__all__ = ["base_constraint", "support_key", "match_support", "family_support"]


def base_constraint(c: Constraint) -> Constraint:
    """The base constraint of a possibly ``independent`` constraint."""
    while isinstance(c, constraints.independent):
        c = c.base_constraint
    return c


def _bound(b) -> object:
    if torch.is_tensor(b):
        if b.numel() == 1:
            return float(b)
        return (tuple(b.shape), tuple(b.detach().flatten().tolist()))
    return float(b)


def support_key(c: Constraint) -> tuple:
    """A hashable key of the base constraint; equal keys mean the same support up to measure zero.

    Example::

        >>> from torch.distributions import constraints
        >>> support_key(constraints.positive) == support_key(constraints.nonnegative)
        True
        >>> support_key(constraints.unit_interval)
        ('interval', 0.0, 1.0)
    """
    c = base_constraint(c)
    if isinstance(c, (constraints.greater_than, constraints.greater_than_eq)):
        return ("lower", _bound(c.lower_bound))
    if isinstance(c, constraints.less_than):
        return ("upper", _bound(c.upper_bound))
    if isinstance(c, (constraints.interval, constraints.half_open_interval)):
        return ("interval", _bound(c.lower_bound), _bound(c.upper_bound))
    if type(c) is type(constraints.real):
        return ("real",)
    attrs = {k: v for k, v in vars(c).items() if not k.startswith("_")}
    return (type(c).__qualname__, repr(sorted(attrs.items())))


def family_support(family: type) -> Constraint:
    """The support declared by a distribution class (not an instance).

    :raises TypeError: if the family's support depends on its parameters
        (e.g. ``Uniform``), which a mean-field guide cannot check in advance.
    """
    support = getattr(family, "support", None)
    if not isinstance(support, Constraint) or constraints.is_dependent(support):
        raise TypeError(
            f"{family.__name__} has a parameter-dependent support ({support!r}), so it cannot be "
            "matched to a site's support in advance. Choose a family with a fixed support "
            "(e.g. Beta for (0, 1), Gamma/LogNormal for (0, inf), Normal pushed through a bijection)."
        )
    return support


def match_support(
    site_support: Constraint, family: type, site: str = "?"
) -> Literal["direct", "pushforward"]:
    """How a factor of class ``family`` covers a site with ``site_support``.

    * ``"direct"``: the family's support equals the site's (Gamma for a positive
      site, Beta for a unit-interval site, Dirichlet for a simplex site);
    * ``"pushforward"``: the family lives on the reals and is pushed through
      ``biject_to(site_support)`` (what AutoNormal does with a Normal).

    :raises ValueError: otherwise, naming both supports.
    """
    fam = family_support(family)
    if support_key(site_support) == support_key(fam):
        return "direct"
    if support_key(fam) == ("real",):  # real or independent(real, n)
        return "pushforward"
    raise ValueError(
        f"support mismatch at site '{site}': its support is {site_support!r} but {family.__name__} lives on "
        f"{fam!r}. Use a family with the site's support, or one on the reals (Normal, StudentT, "
        "Laplace, ...) which is pushed through biject_to(site support)."
    )
