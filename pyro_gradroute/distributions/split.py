r"""One-evaluation score/pathwise split of a log-density: evaluated once at a detached copy of the
sample (the score part), with the ordinary and pathwise parts outputs of one node
(:class:`_Pathwise`). ``docs/split.md`` tells the mechanism, its exactness and the families.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import NamedTuple

import torch
from pyro.distributions import Independent as PyroIndependent
from pyro.distributions.score_parts import ScoreParts
from pyro.distributions.torch_distribution import TorchDistributionMixin
from pyro.distributions.util import scale_and_mask
from pyro.ops.provenance import (
    ProvenanceTensor,
    detach_provenance,
    get_provenance,
    track_provenance,
)
from torch.distributions import Distribution, Independent, TransformedDistribution
from torch.distributions.transforms import ComposeTransform, IndependentTransform

from .._compat import set_unquantized, transform_cache, unquantized, vjp
from ..routing import reached
from . import flows
from .detached import unchecked
from .flows.path import evaluate, log_prob_along

__all__ = ["SplitLogProb", "SplitNotSupported", "split_log_prob", "split_log_probs"]


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
        return SplitLogProb(*(scale_and_mask(t, scale, mask) for t in self))


class SplitNotSupported(NotImplementedError):
    """The distribution's log-density cannot be evaluated at a fixed (detached) sample."""


# ----------------------------------------------------------------------------- the node
class _Item(NamedTuple):
    target: torch.Tensor  # what the product with v is sent to (the value, or its pre-image)
    v: torch.Tensor  # the detached leaf at which the density was evaluated
    lp: torch.Tensor  # the evaluated tensor (graph to params, upstream, v)
    ups: tuple[int, ...]  # indices into the node's upstream list
    g: torch.Tensor | None  # flows: d lp / d target carried forward (v is None, no VJP)
    slot: int  # the target's index in the node's targets


class _Pathwise(torch.autograd.Function):
    """Outputs ``full_i, pathwise_i`` equal to ``lp_i``; a seed of either goes to ``target_i``
    times ``d lp_i / d v_i``; ``full_i``'s also into ``lp_i``'s graph, ``pathwise_i``'s also to
    the upstream tensors (times the partials ``d lp_i / d u``), never into ``lp_i``'s graph."""

    @staticmethod
    def forward(ctx, meta, *tensors):  # type: ignore[override]
        ctx.meta = meta
        ctx.set_materialize_grads(False)
        lps = tensors[len(meta[1]) : len(meta[1]) + len(meta[0])]
        return tuple(t for lp in lps for t in (lp.detach(), lp.detach()))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "split_log_prob's log_prob and pathwise parts are first-order only: they are "
                "not differentiable twice (create_graph=True). Their score part, and "
                "fn.log_prob(value) itself, support higher derivatives; the package's "
                "Trace_ELBO (which does not split) does too."
            )
        items, ups, shared, cut = ctx.meta
        g_full, g_path = grads[0::2], grads[1::2]
        g_targets: list = [None] * len(shared)
        g_ups: list = [None] * len(ups)
        # one product when no item that reads upstream samples has a full seed (STL): the
        # seeds to its value and to the samples it reads are then the same
        merged = all(g_full[i] is None for i, it in enumerate(items) if it.ups)
        v_outs, v_seeds, vs, slots, v_ids = [], [], [], [], set()  # one input per distinct v
        u_outs, u_seeds, wanted = [], [], {}
        for i, it in enumerate(items):
            in_v = False
            if it.g is not None:  # a flow: the full seed is lp's own graph; no VJP
                if g_path[i] is not None:
                    g = _times(g_path[i], it.g, it.target)
                    g_targets[it.slot] = _add(g_targets[it.slot], g)
            else:
                s = _add(g_full[i], g_path[i])
                if s is not None and it.v.requires_grad:
                    in_v = True
                    v_outs.append(it.lp)
                    v_seeds.append(s)
                    if id(it.v) not in v_ids:
                        v_ids.add(id(it.v))
                        vs.append(it.v)
                        slots.append(it.slot)
            if it.ups and g_path[i] is not None:
                wanted.update(dict.fromkeys(it.ups))
                if not (merged and in_v):
                    u_outs.append(it.lp)
                    u_seeds.append(g_path[i])
                if it.g is not None:  # d/du log q(y | u) at y fixed: minus the sample's path
                    u_outs.append(it.target)
                    u_seeds.append(-_times(g_path[i], it.g, it.target))
        u_in = list(wanted)
        calls = (
            [(v_outs + u_outs, v_seeds + u_seeds, vs, slots, u_in)]
            if merged
            else [(v_outs, v_seeds, vs, slots, []), (u_outs, u_seeds, [], [], u_in)]
        )
        for outs, seeds, v_in, v_slots, u_in in calls:
            if not outs or not (v_in or u_in):
                continue
            with _cut_at(ups if u_in else (), cut):
                gs = vjp(outs, [*v_in, *(ups[k] for k in u_in)], seeds)
            for k, g in zip(v_slots, gs):
                g_targets[k] = _add(g_targets[k], g)
            for k, g in zip(u_in, gs[len(v_in) :]):
                g_ups[k] = g
        for j, k in enumerate(shared):  # a target that is an upstream tensor: one input
            if k is not None:
                g_ups[k] = _add(g_ups[k], g_targets[j])
        return (None, *g_ups, *g_full, *(g for g, k in zip(g_targets, shared) if k is None))


@contextlib.contextmanager
def _cut_at(ups, cut: bool):
    """While the upstream product is taken, drop the gradient arriving at each upstream
    sample's autograd node (a backward pre-hook), so each gets its partial derivative."""
    nodes = {u.grad_fn for u in ups if u.grad_fn is not None} if cut else ()
    handles = [n.register_prehook(lambda grads: (None,) * len(grads)) for n in nodes]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _times(h: torch.Tensor, g: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``h * g`` with ``h`` (batch-shaped) broadcast over the event dims, summed to ``target``'s shape."""
    pad = g.dim() - h.dim()
    out = h.reshape(h.shape + (1,) * pad) * g if pad > 0 else h * g
    if out.shape != target.shape:
        out = out.sum_to_size(target.shape)
    return out


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _check_independent(ups: list[torch.Tensor]) -> None:
    """Raise if one of ``ups`` lies on another's graph (the product would count a path twice)."""
    for j, u in enumerate(ups):
        others = [w for i, w in enumerate(ups) if i != j]
        below = [others[i] for i in reached(u, others)]
        if below:
            raise ValueError(
                "split_log_probs: an upstream tensor depends on another one (shape "
                f"{tuple(u.shape)} is computed from shape {tuple(below[0].shape)}): the product "
                "would count that path twice. Pass samples not computed from each other, or use "
                "the package's ELBOs or poutine.stick_the_landing (exact at any depth)."
            )


# ----------------------------------------------------------------------------- evaluation
def _default_score_parts(fn) -> bool:
    """Whether ``fn``'s parts are Pyro's default ones (a plain ``torch.distributions`` object has none)."""
    return getattr(type(fn), "score_parts", None) in (None, TorchDistributionMixin.score_parts)


def _parts(fn: Distribution, lp: torch.Tensor) -> ScoreParts:
    """Pyro's default score parts of ``fn`` with log-density ``lp``."""
    return ScoreParts(lp, 0, lp) if fn.has_rsample else ScoreParts(lp, lp, 0)


def _score_parts(fn: Distribution, value: torch.Tensor) -> ScoreParts:
    """``fn.score_parts(value)``, or Pyro's default parts for a plain ``torch.distributions`` object."""
    method = getattr(fn, "score_parts", None)
    return _parts(fn, fn.log_prob(value)) if method is None else method(value)


def flatten_transformed(fn: Distribution) -> Distribution:
    """``TD(TD(base, [t1]), [t2])`` as the equal ``TD(base, [t1, t2])`` (any depth, through
    ``Independent`` as ``IndependentTransform``); else ``fn``."""
    if not isinstance(fn, TransformedDistribution) or not _default_score_parts(fn):
        return fn
    base, n = fn.base_dist, 0
    if type(base) in (Independent, PyroIndependent):
        base, n = base.base_dist, base.reinterpreted_batch_ndims
    if not isinstance(base, TransformedDistribution) or not _default_score_parts(base):
        return fn
    inner = flatten_transformed(base)
    ts = [IndependentTransform(t, n) for t in inner.transforms] if n else list(inner.transforms)
    flat = type(fn)(inner.base_dist, ts + list(fn.transforms), validate_args=False)
    if flat.batch_shape != fn.batch_shape or flat.event_shape != fn.event_shape:
        return fn
    return flat


def preimage_rsample(fn: Distribution, sample_shape=()):
    """``fn.rsample(sample_shape)`` and, for a ``TransformedDistribution``, its pre-image.

    Returns ``(value, pre)``: ``pre`` is the base sample of a parameter-free
    ``TransformedDistribution`` with cached transforms, the
    :class:`~pyro_gradroute.distributions.flows.FlowPath` of a flow whose transforms have
    forward rules, else ``None``. The same operations as ``TransformedDistribution.rsample``.
    """
    sample_shape = torch.Size(sample_shape)
    fn = flatten_transformed(fn)
    if _flow_candidate(fn):
        path = flows.forward_path(fn, sample_shape)
        return path.value, path
    if _transformed(fn) and all(not flows.holds_params(t) and _cached(t) for t in fn.transforms):
        x = fn.base_dist.rsample(sample_shape)
        y = x
        for t in fn.transforms:
            y = t(y)
        return y, x
    return fn.rsample(sample_shape), None


def _cached(t) -> bool:
    """Whether ``t`` (every part of it) caches its last pre-image (else ``log_prob`` runs the
    inverse, and the split does too, so that loss values stay those of ``Trace_ELBO``)."""
    if isinstance(t, ComposeTransform):
        return all(_cached(p) for p in t.parts)
    if isinstance(t, IndependentTransform):
        return _cached(t.base_transform)
    return transform_cache(t) is not None


def _transformed_log_prob(fn: TransformedDistribution, x: torch.Tensor) -> torch.Tensor:
    """``fn.log_prob(T(x))`` computed forward from the pre-image ``x`` (no inverse), with
    torch's event-dim bookkeeping (:func:`~.flows.path.log_prob_along`)."""
    steps, y = [], x
    for t in fn.transforms:
        t = t.with_cache(0)
        steps.append((t, y, t(y)))
        y = steps[-1][2]
    return log_prob_along(fn, steps, x)[0]


def _leaf(t: torch.Tensor, grad_mode: bool) -> torch.Tensor:
    return t.detach().requires_grad_(t.requires_grad and grad_mode)


def _evaluate(fn: Distribution, value: torch.Tensor, preimage, grad_mode: bool, drawn=False):
    """``(target, v, ScoreParts at v, flow)``: one evaluation of ``fn``'s score parts at a detached
    copy; ``flow``: ``(g, score)`` of a flow evaluated along its path (``v`` is then None)."""
    fn = flatten_transformed(fn)
    if preimage is None and _flow_candidate(fn):
        preimage = flows.cached_path(fn, value)
    if isinstance(preimage, flows.FlowPath):
        lp, g, score = evaluate(preimage, grad_mode)
        return preimage.target, None, _parts(fn, lp), (g, score)
    if preimage is not None:
        v = _leaf(preimage, grad_mode)
        return preimage, v, _parts(fn, _transformed_log_prob(fn, v)), None
    unq = unquantized(value)
    if unq is not None:  # straight-through: the density is at the relaxed sample
        v = value.detach()
        set_unquantized(v, _leaf(unq, grad_mode))
        return unq, unquantized(v), _score_parts(fn, v), None
    v = _leaf(value, grad_mode)
    try:  # (``drawn``: ``value`` is ``fn``'s own draw)
        return value, v, _score_parts(unchecked(fn) if drawn else fn, v), None
    except AssertionError:
        if _default_score_parts(fn):
            raise
        # score_parts that read the sampler's state for the tensor it returned (RSVI)
        return value, v, _sampled_score_parts(fn, v, value), None


def _sampled_score_parts(fn: Distribution, v: torch.Tensor, raw: torch.Tensor) -> ScoreParts:
    """``fn.score_parts`` of a family that accepts only the tensor its sampler returned: taken
    at ``raw``, with their ``log_prob`` (which must be ``fn.log_prob`` there) at ``v``."""
    name = type(fn).__name__
    try:
        at_raw = fn.score_parts(raw)
    except AssertionError as e:
        raise SplitNotSupported(
            f"{name}.score_parts accepts neither a fixed copy of the sample nor the sample "
            "itself, so its parts cannot be split"
        ) from e
    lp = fn.log_prob(v)
    for part in (at_raw.log_prob, at_raw.entropy_term):
        if torch.is_tensor(part) and not (part.shape == lp.shape and torch.equal(part, lp)):
            raise SplitNotSupported(
                f"{name}.score_parts accepts only the tensor its sampler returned and its "
                "log_prob (or entropy_term) is not the family's log_prob there, so it cannot "
                "be evaluated at a fixed copy of the sample"
            )
    at_v = [lp if torch.is_tensor(p) else p for p in (at_raw.log_prob, at_raw.entropy_term)]
    return ScoreParts(at_v[0], at_raw.score_function, at_v[1])


def _flow_candidate(fn) -> bool:
    """A flow (parametrized transforms, each up to the last with a rule) drawn by ``rsample``."""
    return (
        _transformed(fn)
        and fn.has_rsample
        and any(flows.holds_params(t) for t in fn.transforms)
        and flows.supported(fn)
    )


def _transformed(fn) -> bool:
    """A ``TransformedDistribution`` with Pyro's default score parts, over a base with them."""
    td = isinstance(fn, TransformedDistribution)
    return td and _default_score_parts(fn) and _default_score_parts(fn.base_dist)


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

    Works for any :class:`torch.distributions.Distribution` (flows included); ``value``
    may broadcast against ``fn.batch_shape``.

    ``upstream``: tensors that ``fn``'s parameters may have been computed from, typically
    the samples of earlier sites of a conditional guide ``q(z_2 | z_1)``. Then
    ``pathwise = log q(z_2 | z_1; stop(phi))`` sends gradients to ``z_2`` *and* to ``z_1``,
    while ``score`` stays ``log q(stop(z_2) | z_1; phi)`` (fn's whole graph), so the two no
    longer add up to ``log_prob``'s gradient. Candidates that ``fn``'s graph does not
    reach are ignored; candidates that depend on each other raise ``ValueError``.

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
    :raises TypeError: if ``fn`` is not a distribution, ``value`` not a tensor, or
        ``upstream`` not a sequence of tensors.
    """
    return split_log_probs([(fn, value, upstream)])[0]


def split_log_probs(
    items: Sequence[tuple[Distribution, torch.Tensor, Sequence[torch.Tensor]]],
) -> list[SplitLogProb]:
    """:func:`split_log_prob` for several ``(fn, value, upstream)`` at once.

    Same results; the backward of all parts is batched into (at most) two
    vector-Jacobian products, which is what the ELBOs use for a whole guide trace.
    """
    for _, _, upstream in items:
        _check_upstream(upstream)
    out = split_score_parts([(fn, value, upstream, None) for fn, value, upstream in items])
    return [SplitLogProb(p.log_prob, s, q.log_prob) for p, q, s in out]


def _check_upstream(upstream) -> None:
    if torch.is_tensor(upstream) or not isinstance(upstream, Sequence):
        raise TypeError(
            "split_log_prob: upstream must be a sequence of tensors (the earlier samples the "
            f"distribution's parameters were computed from), got {type(upstream).__name__}"
        )
    for j, u in enumerate(upstream):
        if not torch.is_tensor(u):
            raise TypeError(
                f"split_log_prob: upstream[{j}] is a {type(u).__name__}, not a tensor; pass the "
                "sample tensors the distribution's parameters were computed from"
            )


def split_score_parts(items, on_error=None, cut: bool = False, names=None):
    """The split of each item's ``score_parts``: a list of ``(full, pathwise, score)``.

    ``items``: ``(fn, value, upstream, preimage)``; ``full`` / ``pathwise``: ``ScoreParts``
    with the full / pathwise gradient; ``score``: the evaluated ``log_prob``. ``on_error(i,
    exc)``: ``None`` (re-raise) or a triple for item ``i``. ``cut``: values are draws (read
    without the support check), upstream tensors the samples each reads, possibly computed
    from each other (the product stops the gradient below each). ``names``: the site names.
    """
    grad_mode = torch.is_grad_enabled()
    results: list = [None] * len(items)
    pending: list = []  # (item index, parts, part name -> first name holding it, score)
    node_items: list[_Item] = []
    targets: list[torch.Tensor] = []
    ups_list: list[torch.Tensor] = []
    ups_index: dict[int, int] = {}  # id(upstream tensor) -> its index in ups_list
    for i, (fn, value, upstream, preimage) in enumerate(items):
        if not isinstance(fn, Distribution):
            raise TypeError(
                f"split_log_prob expects a torch.distributions.Distribution, got {type(fn).__name__}"
            )
        if not torch.is_tensor(value):
            raise TypeError(f"split_log_prob expects a tensor value, got {type(value).__name__}")
        try:
            target, v, parts, flow = _evaluate(fn, value, preimage, grad_mode, cut)
        except (NotImplementedError, KeyError) as e:
            err = SplitNotSupported(
                f"{type(fn).__name__}.log_prob cannot be evaluated at a fixed sample "
                f"({type(e).__name__}: {e}): a transform without a forward rule "
                "(flows.register_flow_rule) is run backwards, and one without an inverse "
                "cannot be split. Register a rule for it, or use an estimator that does not "
                "split this site (Trace_ELBO)."
            )
            results[i] = on_error(i, err) if on_error is not None else None
            if results[i] is None:
                raise err from e
            continue
        except ValueError as e:
            if names is None:
                raise
            raise ValueError(f"Error while computing log_prob at site '{names[i]}':\n{e}") from e
        g_flow, score = (None, parts.log_prob) if flow is None else flow
        distinct: dict[str, str] = {}  # part name -> the first name holding the same tensor
        if grad_mode:
            for name, t in zip(_NAMES, parts):
                if torch.is_tensor(t) and t.requires_grad:
                    distinct[name] = next((n for n in distinct if getattr(parts, n) is t), name)
        if not distinct:  # nothing to differentiate: the evaluation is the split
            results[i] = (parts, ScoreParts(*map(_stop, parts)), score)
            continue
        ups_here: list[int] = []
        if upstream:
            if cut:
                hit = range(len(upstream))
            else:
                hit = set(reached(parts.log_prob, list(upstream)))
                if g_flow is not None:  # the sample's own path to upstream tensors
                    hit.update(reached(target, list(upstream)))
            for j in sorted(hit):
                k = ups_index.setdefault(id(upstream[j]), len(ups_list))
                if k == len(ups_list):
                    ups_list.append(upstream[j])
                ups_here.append(k)
        value_path = target.requires_grad if g_flow is not None else v.requires_grad
        if not (value_path or ups_here):
            results[i] = (parts, ScoreParts(*map(_stop, parts)), score)
            continue
        targets.append(target)
        for name, first in distinct.items():
            if first == name:
                lp = getattr(parts, name)
                node_items.append(_Item(target, v, lp, tuple(ups_here), g_flow, len(targets) - 1))
        pending.append((i, parts, distinct, score))
    if not node_items:
        return results
    cut = cut and len(ups_list) > 1
    if len(ups_list) > 1 and not cut:
        _check_independent(ups_list)
    # TraceGraph_ELBO's provenance tracking: stripped for the node, put back on its outputs
    tracked = any(
        isinstance(t, ProvenanceTensor)
        for t in (*ups_list, *targets, *(x for it in node_items for x in (it.v, it.lp)))
    )
    if tracked:
        provenance = [get_provenance(it.lp) for it in node_items]
        strip = detach_provenance
        node_items = [
            it._replace(target=strip(it.target), v=strip(it.v), lp=strip(it.lp))
            for it in node_items
        ]
        ups_list = [strip(u) for u in ups_list]
        targets = [strip(t) for t in targets]
    up_index = {id(u): k for k, u in enumerate(ups_list)}
    shared = [up_index.get(id(t)) for t in targets]  # (a chain's samples are both)
    meta = (node_items, ups_list, shared, cut)
    own = (t for t, k in zip(targets, shared) if k is None)
    outs = _Pathwise.apply(meta, *ups_list, *(it.lp for it in node_items), *own)
    if tracked:
        outs = [track_provenance(t, provenance[n // 2]) for n, t in enumerate(outs)]
    n = 0
    for i, parts, distinct, score in pending:
        split_of = {}
        for name, first in distinct.items():
            if first == name:
                split_of[name] = outs[2 * n], outs[2 * n + 1]
                n += 1
        full, path = [], []
        for name, t in zip(_NAMES, parts):
            f, p = split_of[distinct[name]] if name in distinct else (t, _stop(t))
            full.append(f)
            path.append(p)
        results[i] = (ScoreParts(*full), ScoreParts(*path), score)
    return results


_NAMES = ("log_prob", "score_function", "entropy_term")


def _stop(t):
    return t.detach() if torch.is_tensor(t) else t
