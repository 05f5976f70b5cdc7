r"""The pathwise part of a plain family's log-density: one evaluation of a detached copy.

Which distributions qualify (:func:`detached_copy` returns ``None`` otherwise): a torch or
Pyro family with Pyro's default ``score_parts`` and ``rsample``; ``Independent``,
``ExpandedDistribution`` or ``MaskedDistribution`` over one; a ``TransformedDistribution``
whose transforms hold no parameters over one (the copy shares the transforms, so their
caches give the pre-image of a cached sample without an inverse). Not ``Delta``, flows,
families with their own ``score_parts``, straight-through samples, nor a family that keeps
a parameter where a shallow copy cannot see it (checked once per type: the copy's
log-density at a detached value must require no gradient).
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
from torch.distributions.transforms import ComposeTransform, IndependentTransform

from .._compat import AccumulateGrad, set_transform_cache, transform_cache, unquantized
from ..routing import reaches_leaf_directly
from . import flows

__all__ = ["detached_copy", "param_tensors", "unchecked", "verified_params"]

_WRAPPERS = (Independent, ExpandedDistribution, MaskedDistribution)

#: distribution signature -> whether its detached copy holds every parameter
_VERIFIED: dict[tuple, bool] = {}


# What a class is (once per site and step): a dict lookup instead of isinstance against
# Pyro's classes, which are ABCs (their isinstance runs Python code).
_WRAP, _TRANSFORMED, _OWN_PARTS, _DELTA = 1, 2, 4, 8
_KIND: dict[type, int] = {}


def _kind(cls) -> int:
    k = _KIND.get(cls)
    if k is None:
        score_parts = getattr(cls, "score_parts", None)
        k = _KIND[cls] = (
            (_WRAP if issubclass(cls, _WRAPPERS) else 0)
            | (_TRANSFORMED if issubclass(cls, TransformedDistribution) else 0)
            | (_OWN_PARTS if score_parts not in (None, TorchDistributionMixin.score_parts) else 0)
            | (_DELTA if issubclass(cls, Delta) else 0)
        )
    return k


def _plain_signature(fn: Distribution) -> tuple | None:
    """The classes along ``fn`` (wrappers, transforms, base) if it is a plain family, else None."""
    sig: list = []
    while True:
        cls = type(fn)
        k = _KIND.get(cls)
        if k is None:
            k = _kind(cls)
        sig.append(cls)
        if k & _OWN_PARTS:
            return None
        if k & _TRANSFORMED and not k & _WRAP:
            if any(flows.holds_params(t, cache=False) for t in fn.transforms):
                return None
            sig.extend(type(t) for t in fn.transforms)
        elif not k & _WRAP:
            return None if k & _DELTA or not fn.has_rsample else tuple(sig)
        fn = fn.base_dist


#: class -> whether copy.copy of its instances is ``cls.__new__(cls)`` with their ``__dict__``
_DICT_COPY: dict[type, bool] = {}


def _dict_copy(cls) -> bool:
    ok = _DICT_COPY.get(cls)
    if ok is None:
        ok = _DICT_COPY[cls] = (
            getattr(cls, "__copy__", None) is None
            and cls.__reduce_ex__ is object.__reduce_ex__
            and cls.__reduce__ is object.__reduce__
            and getattr(cls, "__getstate__", None) is getattr(object, "__getstate__", None)
            and not hasattr(cls, "__setstate__")
            and not any(vars(c).get("__slots__") for c in cls.__mro__)  # none but empty ones
        )
    return ok


def _copy(fn: Distribution, params: list, keep=(), drawn=False, detach=True) -> Distribution:
    state = dict(vars(fn))
    if drawn:  # read at its own draw (detached_copy's ``value``)
        state["_validate_args"] = False
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            if v.requires_grad:
                params.append(v)
                if detach and k not in keep:
                    state[k] = v.detach()
        elif isinstance(v, Distribution):
            state[k] = _copy(v, params, keep, drawn, detach)
    cls = type(fn)
    ok = _DICT_COPY.get(cls)
    if ok or (ok is None and _dict_copy(cls)):
        new = cls.__new__(cls)
        new.__dict__ = state
    else:
        new = copy.copy(fn)
        for k, v in state.items():
            setattr(new, k, v)
    return new


def unchecked(fn: Distribution) -> Distribution:
    """``fn``; for a plain family, a shallow copy (parameters live) that reads its density
    without the support check: for ``fn``'s own draw, in its support by construction."""
    return fn if _plain_signature(fn) is None else _copy(fn, [], (), True, False)


def verified_params(fn: Distribution) -> list[torch.Tensor] | None:
    """:func:`param_tensors` of a plain family whose detached copy is known to hold all its
    parameters (its type seen before), else None."""
    return param_tensors(fn) if _VERIFIED.get(_plain_signature(fn)) else None


def param_tensors(fn: Distribution) -> list[torch.Tensor]:
    """The tensors that require grad among ``fn``'s attributes, and its inner distributions'."""
    out = []
    for v in vars(fn).values():
        if isinstance(v, torch.Tensor):
            if v.requires_grad:
                out.append(v)
        elif isinstance(v, Distribution):
            out.extend(param_tensors(v))
    return out


def detached_copy(
    fn: Distribution, value: torch.Tensor | None = None, params: list | None = None, keep=()
) -> Distribution | None:
    r"""A copy of ``fn`` whose parameters are stopped, or ``None`` if ``fn`` does not qualify.

    ``detached_copy(fn).log_prob(z)`` is :math:`\log q(z; \bot(\phi))`: the ordinary
    value, gradient to :math:`z` only. ``value``: a draw of ``fn``, where the copy's
    ``log_prob`` is read (so it skips the support check: a draw is in the support by
    construction), and where, the first time ``fn``'s type is seen, the copy is checked to
    hold all of its parameters.
    ``params``: a list to which the parameters it read are appended (those of
    :func:`param_tensors`), where it qualifies. ``keep``: attribute names (``"loc"``,
    ``"scale"``) left live: :math:`\log q(z; \theta_K, \bot(\theta_{\bar K}))` keeps the
    score part at those parameters only.

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
    sig = _plain_signature(fn)
    if sig is None:
        return None
    new = _copy(fn, [] if params is None else params, keep, value is not None)
    verdict = _VERIFIED.get(sig)
    if verdict is None and value is not None and torch.is_grad_enabled():
        if unquantized(value) is not None:  # straight-through: its density is at the relaxed
            _VERIFIED[sig] = False  # sample (the split node's rule)
            return None
        v = value.detach()
        caches = _transform_caches(fn)  # evaluating at v replaces them: the sample's are kept
        try:
            has_params = fn.log_prob(v).requires_grad
            if has_params:  # does the copy hold them all?
                full = _copy(fn, [], ()) if keep else new
                verdict = _VERIFIED[sig] = not full.log_prob(v).requires_grad
        except Exception:  # cannot be checked at a detached value: another rule decides
            return None
        finally:
            for t, cache in caches:
                set_transform_cache(t, *cache)
    return None if verdict is False else new


def _transform_caches(fn: Distribution) -> list:
    """``(transform, (x, y))`` of every cached transform along ``fn`` (the parts of composed ones too)."""
    todo: list = []
    while isinstance(fn, Distribution):
        if isinstance(fn, TransformedDistribution):
            todo.extend(fn.transforms)
        fn = getattr(fn, "base_dist", None)
    out = []
    while todo:
        t = todo.pop()
        cache = transform_cache(t)
        if cache is not None:
            out.append((t, cache))
        if isinstance(t, ComposeTransform):
            todo.extend(t.parts)
        elif isinstance(t, IndependentTransform):
            todo.append(t.base_transform)
    return out


def delta_base(fn: Distribution):
    """The :class:`~pyro.distributions.Delta` inside ``fn`` (unwrapping ``Independent``, ``expand``, ``mask``), or None."""
    while True:
        k = _KIND.get(type(fn))
        if k is None:
            k = _kind(type(fn))
        if not k & _WRAP:
            return fn if k & _DELTA else None
        fn = fn.base_dist


def density_reads_parameters(delta: Delta, nodes: dict) -> bool:
    """Whether the ``log_density`` of the Delta ``delta`` (from :func:`delta_base`) reads a
    parameter directly, not only through the earlier samples whose autograd nodes are the
    keys of ``nodes`` (as AutoStructured's and AutoGaussian's Deltas do)."""
    ld = delta.log_density
    if not (torch.is_tensor(ld) and ld.requires_grad):
        return False
    walk = short_walk([ld.grad_fn], nodes) if ld.grad_fn is not None else None
    if walk is not None and not walk[1]:
        return False  # a few operations on earlier samples
    return reaches_leaf_directly(ld, stop_nodes=nodes)


def short_walk(roots: list, stops: dict, limit: int = 32) -> tuple[set, bool] | None:
    """``(stops reached, reaches a leaf)``: the graph below the autograd nodes ``roots``, each
    path ending at a node in ``stops`` (node -> index; the indices of those reached are
    returned); None past ``limit`` nodes (the graph walkers of :mod:`~pyro_gradroute.routing`
    then decide). Decides a guide's plain sites without them."""
    stack, hits, leaf, get = list(roots), set(), False, stops.get
    while stack:  # (every step, a few nodes a site: a leaf's node is known by its class)
        limit -= 1
        if limit < 0:
            return None
        nexts = stack.pop().next_functions
        leaf = leaf or not nexts
        for f, _ in nexts:
            if type(f) is AccumulateGrad:
                leaf = True
            elif (i := get(f)) is not None:
                hits.add(i)
            elif f is not None:
                stack.append(f)
    return hits, leaf
