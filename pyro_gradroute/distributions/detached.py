r"""The pathwise part of a plain family's log-density: one evaluation of a detached copy.

For a reparameterized sample :math:`z = g(\epsilon; \phi)` of a family whose parameters
are tensors it holds as attributes, the pathwise part of the log-density is

.. math::

    \log q(z; \bot(\phi)) = \texttt{detached\_copy(fn).log\_prob}(z),

one evaluation at the live sample of a shallow copy of ``fn`` whose tensor attributes
are detached. Its value is the ordinary :math:`\log q(z;\phi)`, its gradient reaches
the parameters only through :math:`z`, and its backward is a subset of the ordinary
one. Sticking the landing then costs what ``Trace_ELBO`` costs.

Which distributions qualify (:func:`detached_copy` returns ``None`` otherwise):

* a torch or Pyro family with Pyro's default ``score_parts`` (or none, as plain
  ``torch.distributions`` objects) and ``rsample``;
* ``Independent``, ``ExpandedDistribution`` or ``MaskedDistribution`` over one;
* a ``TransformedDistribution`` whose transforms hold no parameters (``biject_to``
  pushforwards, ``SigmoidTransform``, ...) over one. The copy shares the transforms,
  so their caches give the pre-image of a cached sample without an inverse (a
  saturating sigmoid keeps its value, exactly as Pyro's ``log_prob`` does).

Not ``Delta`` (no random draw), flows (parametrized transforms), distributions with
their own ``score_parts`` (``Rejector``), and straight-through samples: those take the
general split (:mod:`~pyro_gradroute.distributions.split`).

A family that keeps a parameter where a shallow copy cannot see it (a closure, a
module) must not silently lose its score part: the first time a distribution type is
seen with parameters that require grad, :func:`detached_copy` checks that the copy's
log-density at a detached value requires no gradient at all, and refuses the type
(``None``: the general split) if it does.
"""

from __future__ import annotations

import copy

import torch
from pyro.distributions import Delta
from pyro.distributions.torch_distribution import (
    ExpandedDistribution,
    MaskedDistribution,
    TorchDistributionMixin,
)
from torch.distributions import Distribution, Independent, TransformedDistribution

from . import flows

__all__ = ["detached_copy", "param_tensors"]

_WRAPPERS = (Independent, ExpandedDistribution, MaskedDistribution)

#: distribution signature -> whether its detached copy holds every parameter
_VERIFIED: dict[tuple, bool] = {}


def _signature(fn: Distribution) -> tuple:
    sig: list = []
    while True:
        sig.append(type(fn))
        if isinstance(fn, TransformedDistribution):
            sig.extend(type(t) for t in fn.transforms)
        if isinstance(fn, (*_WRAPPERS, TransformedDistribution)):
            fn = fn.base_dist
            continue
        return tuple(sig)


def _plain(fn: Distribution) -> bool:
    while True:
        score_parts = getattr(type(fn), "score_parts", None)
        if score_parts is not None and score_parts is not TorchDistributionMixin.score_parts:
            return False
        if isinstance(fn, _WRAPPERS):
            fn = fn.base_dist
        elif isinstance(fn, TransformedDistribution):
            if any(flows.holds_params(t) for t in fn.transforms):
                return False
            fn = fn.base_dist
        else:
            return not isinstance(fn, Delta) and bool(fn.has_rsample)


def _copy(fn: Distribution) -> Distribution:
    new = copy.copy(fn)
    for k, v in vars(new).items():
        if torch.is_tensor(v):
            if v.requires_grad:
                setattr(new, k, v.detach())
        elif isinstance(v, Distribution):
            setattr(new, k, _copy(v))
    return new


def param_tensors(fn: Distribution) -> list[torch.Tensor]:
    """The tensors that require grad among ``fn``'s attributes, and its inner distributions'."""
    out = []
    for v in vars(fn).values():
        if torch.is_tensor(v):
            if v.requires_grad:
                out.append(v)
        elif isinstance(v, Distribution):
            out.extend(param_tensors(v))
    return out


def detached_copy(fn: Distribution, value: torch.Tensor | None = None) -> Distribution | None:
    r"""A copy of ``fn`` whose parameters are stopped, or ``None`` if ``fn`` does not qualify.

    ``detached_copy(fn).log_prob(z)`` is :math:`\log q(z; \bot(\phi))`: the ordinary
    value, gradient to :math:`z` only. ``value`` (a sample of ``fn``) is used the first
    time ``fn``'s type is seen, to check that the copy holds all of its parameters.

    Example::

        >>> import torch, pyro.distributions as dist
        >>> loc = torch.tensor(0.5, requires_grad=True)
        >>> q = dist.Normal(loc, 1.0)
        >>> z = q.rsample()
        >>> lp = detached_copy(q, z).log_prob(z)
        >>> (g,) = torch.autograd.grad(lp, loc)  # d/dloc log q(z; stop(loc)) = -(z - loc)
        >>> torch.allclose(g, -(z - loc).detach())
        True
    """
    if not isinstance(fn, Distribution):
        raise TypeError(
            f"detached_copy expects a torch.distributions.Distribution, got {type(fn).__name__}"
        )
    if not _plain(fn):
        return None
    new = _copy(fn)
    sig = _signature(fn)
    verdict = _VERIFIED.get(sig)
    if verdict is None and value is not None and torch.is_grad_enabled():
        v = value.detach()
        try:
            has_params = fn.log_prob(v).requires_grad
            if has_params:  # does the copy hold them all?
                verdict = _VERIFIED[sig] = not new.log_prob(v).requires_grad
        except Exception:  # cannot be checked at a detached value: the general split decides
            return None
    return None if verdict is False else new
