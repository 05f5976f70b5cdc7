"""One-pass score/pathwise split of a log-density.

For a reparameterized sample ``z = g(eps; phi)`` of ``q(.; phi)`` the total
derivative of ``log q(z; phi)`` splits into two parts::

    d/dphi log q(g(eps; phi); phi) =  d/dphi log q(z; phi)|_z          (score part)
                                    + grad_z log q(z; phi) . dz/dphi    (pathwise part)

The score part has expectation zero under ``q``; dropping it gives the
*sticking-the-landing* estimator (Roeder et al. 2017), weighting the pathwise
part gives DReG (Tucker et al. 2019).

:func:`split_log_prob` evaluates ``fn.log_prob`` exactly **once**, at a detached
copy ``v`` of ``value``, and builds all three tensors from that one graph:

* ``score = log fn(stop(value))``: the evaluated graph itself (gradients reach
  ``fn``'s parameters only);
* ``pathwise = log fn(value; stop(phi))``: a node whose backward is the
  vector-Jacobian product ``grad_out * d log fn(v) / dv`` taken lazily through the
  same graph and sent to ``value`` (gradients reach ``value`` only);
* ``log_prob``: the ordinary log-density, a node whose backward sends the upstream
  gradient both ways (``score + pathwise - stop(pathwise)`` in one op).

All three have the same value and share one graph (so, as with any shared graph,
pass ``retain_graph=True`` to all but the last of several separate backward calls
through them). Their first derivatives equal those of the naive
two-evaluation computation; second derivatives of ``pathwise`` treat
``d log fn / dv`` as a constant (the cross term ``d^2 log fn / dv dphi`` is
not carried), which is what every first-order estimator needs.

Families that need care (all handled, one evaluation each):

* :class:`~torch.distributions.TransformedDistribution` (normalizing flows,
  AutoNormal's ``biject_to`` pushforward): the evaluation at the detached copy
  misses the transform cache on purpose, so ``log_prob`` runs the transforms'
  inverse. This is what makes the score part correct (the cached inverse would
  silently drop ``d T^{-1}(z; phi) / dphi``). For autoregressive flows such as
  :class:`~pyro.distributions.transforms.AffineAutoregressive` the inverse costs
  one network pass per dimension.
* :class:`~pyro.distributions.Delta` (and ``Delta`` wrapped in ``Independent``,
  ``expand`` or ``mask``): its "parameters" are functions of the sample itself
  (an AutoContinuous guide's ``Delta`` carries the Jacobian term as
  ``log_density``). :func:`is_delta` lets estimators keep such sites'
  full gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.distributions import Distribution, Independent

__all__ = ["SplitLogProb", "split_log_prob", "is_delta"]


class SplitLogProb(NamedTuple):
    """The three parts of a log-density, equal in value.

    :ivar log_prob: ``log fn(value)``, gradients to ``value`` and to the parameters.
    :ivar score: ``log fn(stop(value))``, gradients to the parameters only.
    :ivar pathwise: ``log fn(value; stop(params))``, gradients to ``value`` only.
    """

    log_prob: torch.Tensor
    score: torch.Tensor
    pathwise: torch.Tensor

    def scale_and_mask(self, scale=1.0, mask=None) -> SplitLogProb:
        """Apply Pyro's ``scale_and_mask`` to all three parts."""
        from pyro.distributions.util import scale_and_mask

        return SplitLogProb(*(scale_and_mask(t, scale, mask) for t in self))


class _Pathwise(torch.autograd.Function):
    """Identity in value; backward is the vector-Jacobian product of ``lp`` taken lazily.

    ``lp`` (the one evaluated log-density, at the detached leaf ``v``) is passed as
    an input so that the outer backward never frees its graph before this node has
    used it. With ``through_score`` the node is the full ``log_prob``: it sends
    ``grad_out * d lp / dv`` to ``value`` and ``grad_out`` on to ``lp`` (whose graph
    reaches the parameters). Otherwise it is the ``pathwise`` part: it sends the
    VJP to ``value`` and to the ``upstream`` tensors only, nothing to ``lp``.
    """

    @staticmethod
    def forward(ctx, through_score, graph, value, lp, *upstream):  # type: ignore[override]
        ctx.lp, ctx.v, ctx.up = graph  # the tensors with their graph (forward sees detached inputs)
        ctx.through_score = through_score
        return lp.detach().clone()

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        with_v = ctx.v.requires_grad
        up = [] if ctx.through_score else list(ctx.up)
        grads = torch.autograd.grad(
            ctx.lp,
            ([ctx.v] if with_v else []) + up,
            grad_out,
            retain_graph=True,
            create_graph=torch.is_grad_enabled(),
            allow_unused=True,
        )
        g_v = grads[0] if with_v else None
        if with_v and g_v is None:
            g_v = torch.zeros_like(ctx.v)
        g_up = tuple(grads[1:] if with_v else grads)
        if ctx.through_score:
            return (None, None, g_v, grad_out) + (None,) * len(ctx.up)
        return (None, None, g_v, None) + g_up


def _reached(tensor: torch.Tensor, candidates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The ``candidates`` whose autograd node lies on ``tensor``'s graph (searched up to them)."""
    targets = {c.grad_fn: i for i, c in enumerate(candidates) if c.grad_fn is not None}
    if not targets or tensor.grad_fn is None:
        return []
    hit: set[int] = set()
    seen = set()
    stack = [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in targets:
            hit.add(targets[node])
            continue
        stack.extend(f for f, _ in node.next_functions if f is not None and f not in seen)
    return [candidates[i] for i in sorted(hit)]


def split_log_prob(
    fn: Distribution, value: torch.Tensor, upstream: Sequence[torch.Tensor] = ()
) -> SplitLogProb:
    r"""Split ``fn.log_prob(value)`` into ordinary, score and pathwise parts, evaluating it once.

    .. math::

        \text{log\_prob} &= \log q(z;\phi) \\
        \text{score} &= \log q(\bot(z);\phi) \\
        \text{pathwise} &= \log q(z;\bot(\phi))

    where :math:`\bot` is stop-gradient. All three have equal values; the
    gradients of ``score`` and ``pathwise`` add up to that of ``log_prob``.

    Works for any :class:`torch.distributions.Distribution` (plain families,
    ``Independent``/``.to_event``, ``expand``, ``mask``, ``MultivariateNormal``,
    ``LowRankMultivariateNormal``, ``TransformedDistribution`` including flows
    whose transforms hold ``nn.Module`` parameters). ``value`` may broadcast
    against ``fn.batch_shape``.

    ``upstream``: tensors that ``fn``'s parameters may have been computed from and
    whose path the pathwise part must keep, typically the samples of earlier sites
    of a conditional guide ``q(z_2 | z_1)``. Then
    ``pathwise = log q(z_2 | z_1; stop(phi))`` sends gradients to ``z_2`` *and* to
    ``z_1`` (only the direct dependence on ``phi`` is stopped), while ``score`` stays
    ``log q(stop(z_2) | z_1; phi)`` (fn's whole graph, as Pyro's score-function terms
    use it); the upstream path then appears in both, so with ``upstream`` the two no
    longer add up to ``log_prob``'s gradient. Candidates that ``fn``'s graph does not
    reach are ignored.

    Example::

        >>> import torch, pyro.distributions as dist
        >>> from pyro_gradroute.distributions import split_log_prob
        >>> mu = torch.tensor(0.5, requires_grad=True)
        >>> q = dist.Normal(mu, 1.0)
        >>> z = q.rsample()
        >>> lp, score, pathwise = split_log_prob(q, z)
        >>> torch.allclose(lp, score) and torch.allclose(lp, pathwise)
        True
        >>> # pathwise gradient: grad_z log q(z) * dz/dmu = -(z - mu) * 1 = -eps
        >>> (g,) = torch.autograd.grad(pathwise, mu)
        >>> torch.allclose(g, -(z - mu).detach())
        True

    :param fn: the distribution.
    :param value: the point at which to evaluate, typically ``fn.rsample()``.
    :param upstream: optional tensors whose path into ``fn``'s parameters is kept
        in ``pathwise``.
    :raises TypeError: if ``fn`` is not a distribution or ``value`` not a tensor.
    """
    if not isinstance(fn, Distribution):
        raise TypeError(
            f"split_log_prob expects a torch.distributions.Distribution, got {type(fn).__name__}"
        )
    if not torch.is_tensor(value):
        raise TypeError(f"split_log_prob expects a tensor value, got {type(value).__name__}")
    needs_path = value.requires_grad and torch.is_grad_enabled()
    v = value.detach()
    if needs_path:
        v.requires_grad_(True)
    score = fn.log_prob(v)
    if not torch.is_grad_enabled():
        return SplitLogProb(score, score, score)
    up = _reached(score, list(upstream)) if upstream else []
    if not score.requires_grad:  # e.g. a Delta whose log-density is a constant
        return SplitLogProb(score, score, score)
    if not needs_path and not up:
        return SplitLogProb(score, score, score.detach())
    graph = (score, v, up)
    pathwise = _Pathwise.apply(False, graph, value, score, *up)
    log_prob = _Pathwise.apply(True, graph, value, score, *up) if needs_path else score
    return SplitLogProb(log_prob, score, pathwise)


def is_delta(fn: Distribution) -> bool:
    """Whether ``fn`` is a :class:`~pyro.distributions.Delta`, possibly wrapped.

    Unwraps ``Independent``, ``ExpandedDistribution`` and ``MaskedDistribution``.
    A Delta's ``v`` and ``log_density`` are functions of the sample, not free
    parameters, so estimators that stop parameter gradients must keep them.
    """
    from pyro.distributions import Delta
    from pyro.distributions.torch_distribution import (
        ExpandedDistribution,
        MaskedDistribution,
    )

    while isinstance(fn, (Independent, ExpandedDistribution, MaskedDistribution)):
        fn = fn.base_dist
    return isinstance(fn, Delta)
