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
  one network pass per dimension. Transforms without an inverse (Planar, Radial,
  Sylvester, BlockNeuralAutoregressive) cannot be split: :class:`SplitNotSupported`
  (a ``NotImplementedError``) says so. ``TraceSTL_ELBO`` then falls back to the
  ordinary gradient for that site, with a warning; ``TraceDReG_ELBO`` raises.
  Numerical inverses (splines) make the three parts equal to ``log_prob`` at the
  cached sample only up to the inverse's round-off (~1e-6 relative in float32).
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

__all__ = ["SplitLogProb", "SplitNotSupported", "split_log_prob", "split_log_probs", "is_delta"]


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
    """For ``m`` split sites at once: outputs ``log_prob_j, pathwise_j`` equal to ``lp_j``.

    Each ``lp_j`` is the one evaluated log-density of site ``j``, at the detached leaf
    ``v_j``; the ``lp_j`` are inputs too, so that the outer backward never frees their
    graphs before this node has used them. Backward takes the vector-Jacobian
    products through those graphs lazily, in one ``autograd.grad`` call for all sites
    (each such call is a re-entrant engine run, so batching them matters):

    * ``log_prob_j``'s gradient ``g`` goes to ``value_j`` (as ``g * d lp_j / dv_j``)
      and on to ``lp_j`` (whose graph reaches the parameters);
    * ``pathwise_j``'s gradient ``h`` goes to ``value_j`` and to site ``j``'s upstream
      tensors only (as ``h * d lp_j / d(v_j, upstream_j)``), nothing to ``lp_j``.
    """

    @staticmethod
    def forward(ctx, meta, *tensors):  # type: ignore[override]
        # meta: (lps, vs, ups_per_site, unique_ups) with their graphs (forward sees detached inputs)
        ctx.meta = meta
        ctx.set_materialize_grads(False)
        m = len(meta[0])
        outs = []
        for lp in tensors[m : 2 * m]:
            d = lp.detach()
            outs += [d.clone(), d.clone()]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        lps, vs, ups_per_site, unique_ups = ctx.meta
        m = len(lps)
        create = torch.is_grad_enabled()
        g_vs: list = [None] * m
        g_ups: dict[int, torch.Tensor] = {}
        outputs, seeds, inputs, slots = [], [], [], []  # one re-entrant call for (nearly) all
        for j in range(m):
            g_full, g_path = grads[2 * j], grads[2 * j + 1]
            seed = g_path
            if g_full is not None and not (g_path is not None and ups_per_site[j]):
                seed = g_full if seed is None else seed + g_full
            elif g_full is not None and vs[j].requires_grad:
                # log_prob's seed must not reach the upstream tensors: its own product
                (g,) = torch.autograd.grad(
                    lps[j], [vs[j]], g_full, retain_graph=True, create_graph=create, allow_unused=True
                )
                g_vs[j] = g
            if seed is None:
                continue
            outputs.append(lps[j])
            seeds.append(seed)
            if vs[j].requires_grad:
                inputs.append(vs[j])
                slots.append(("v", j))
            if g_path is not None:
                for k in ups_per_site[j]:
                    if ("u", k) not in slots:
                        inputs.append(unique_ups[k])
                        slots.append(("u", k))
        if inputs:
            out = torch.autograd.grad(
                outputs, inputs, seeds, retain_graph=True, create_graph=create, allow_unused=True
            )
            for (kind, j), g in zip(slots, out):
                if kind == "v":
                    g_vs[j] = g if g_vs[j] is None or g is None else g_vs[j] + g
                else:
                    g_ups[j] = g
        g_lps = [grads[2 * j] for j in range(m)]
        return (None, *g_vs, *g_lps, *(g_ups.get(k) for k in range(len(unique_ups))))


class SplitNotSupported(NotImplementedError):
    """The distribution's log-density cannot be evaluated at a fixed (detached) sample."""


def _reached(tensor: torch.Tensor, candidates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The ``candidates`` whose autograd node lies on ``tensor``'s graph (searched up to them)."""
    root = tensor.grad_fn
    if root is None:
        return []
    targets = {}
    for i, c in enumerate(candidates):
        node = c.grad_fn
        if node is not None:
            targets[node] = i
    if not targets:
        return []
    hit = []
    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        i = targets.get(node)
        if i is not None:
            hit.append(i)
            continue
        for f, _ in node.next_functions:
            if f is not None and f not in seen:
                seen.add(f)
                stack.append(f)
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
    return split_log_probs([(fn, value, upstream)])[0]


def split_log_probs(
    items: Sequence[tuple[Distribution, torch.Tensor, Sequence[torch.Tensor]]],
) -> list[SplitLogProb]:
    """:func:`split_log_prob` for several ``(fn, value, upstream)`` at once.

    Same results; the backward of all pathwise parts is batched into one
    vector-Jacobian product (one re-entrant autograd call instead of one per item),
    which is what the ELBOs use for a whole guide trace.
    """
    results: list = [None] * len(items)
    joint = []  # (index, value, score, v, reached upstream)
    grad_mode = torch.is_grad_enabled()
    for i, (fn, value, upstream) in enumerate(items):
        if not isinstance(fn, Distribution):
            raise TypeError(
                f"split_log_prob expects a torch.distributions.Distribution, got {type(fn).__name__}"
            )
        if not torch.is_tensor(value):
            raise TypeError(f"split_log_prob expects a tensor value, got {type(value).__name__}")
        needs_path = value.requires_grad and grad_mode
        v = value.detach()
        if needs_path:
            v.requires_grad_(True)
        try:
            score = fn.log_prob(v)
        except ValueError as e:
            e.split_index = i  # type: ignore[attr-defined]  # lets callers name the site
            raise
        except (NotImplementedError, KeyError) as e:
            err = SplitNotSupported(
                f"{type(fn).__name__}.log_prob cannot be evaluated at a fixed sample "
                f"({type(e).__name__}: {e}). The score/pathwise split needs log q(z; phi) at "
                "a sample held fixed, which for a TransformedDistribution means running its "
                "transforms' inverse (the transform cache only knows the sample it produced); "
                "transforms without an inverse (Planar, Radial, Sylvester, "
                "BlockNeuralAutoregressive, ...) cannot be split. Use invertible transforms "
                "(affine_autoregressive, spline, spline_autoregressive, ...) or an estimator "
                "that does not split this site (Trace_ELBO)."
            )
            err.split_index = i  # type: ignore[attr-defined]
            raise err from e
        if not grad_mode or not score.requires_grad:  # e.g. a Delta of constant log-density
            results[i] = SplitLogProb(score, score, score)
            continue
        up = _reached(score, list(upstream)) if upstream else []
        if not needs_path and not up:
            results[i] = SplitLogProb(score, score, score.detach())
            continue
        joint.append((i, value, score, v, up))
    if joint:
        unique_ups: list[torch.Tensor] = []
        ups_per_site = []
        for *_, up in joint:
            idx = []
            for u in up:
                k = next((n for n, w in enumerate(unique_ups) if w is u), None)
                if k is None:
                    k = len(unique_ups)
                    unique_ups.append(u)
                idx.append(k)
            ups_per_site.append(idx)
        lps = [j[2] for j in joint]
        meta = (lps, [j[3] for j in joint], ups_per_site, unique_ups)
        outs = _Pathwise.apply(meta, *(j[1] for j in joint), *lps, *unique_ups)
        for n, (i, _, score, _, _) in enumerate(joint):
            results[i] = SplitLogProb(outs[2 * n], score, outs[2 * n + 1])
    return results


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
