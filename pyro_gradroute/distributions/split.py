r"""One-pass score/pathwise split of a log-density.

For a reparameterized sample ``z = g(eps; phi)`` of ``q(.; phi)`` the total
derivative of ``log q(z; phi)`` splits into two parts::

    d/dphi log q(g(eps; phi); phi) =  d/dphi log q(z; phi)|_z          (score part)
                                    + grad_z log q(z; phi) . dz/dphi    (pathwise part)

The score part has expectation zero under ``q``; dropping it gives the
*sticking-the-landing* estimator (Roeder et al. 2017), weighting the pathwise
part gives DReG (Tucker et al. 2019).

:func:`split_log_prob` evaluates the log-density exactly **once**, at a detached
copy ``v`` of the sample, and builds all three tensors from that one graph:

* ``score = log fn(stop(value))``: the evaluated graph itself (gradients reach
  ``fn``'s parameters, and the upstream tensors they were computed from);
* ``pathwise = log fn(value; stop(phi))``: a node whose backward is the
  vector-Jacobian product ``grad_out * d log fn(v) / dv`` taken lazily through the
  same graph and sent to ``value`` (and, for a conditional ``q(z_2 | z_1)``, the
  product ``grad_out * d log fn / d z_1`` sent to the upstream sample ``z_1``);
* ``log_prob``: the ordinary log-density: the product with ``v`` goes to ``value``,
  and the upstream gradient goes into the evaluated graph itself.

**Exactness.** First derivatives equal those of the naive two-evaluation
computation. Each backward makes at most two batched vector-Jacobian products: all
seeds with respect to the detached values (independent leaves, so nothing can be
counted twice), and the pathwise seeds with respect to the upstream samples. For the
second product the upstream samples must be *cut points*: when one upstream sample
depends on another (``z_0 -> z_1 -> z_2``), a product with respect to both would
count the path through ``z_1`` twice. The estimators and the handler stop the gradient
below each upstream sample while that product is taken (a backward pre-hook on each one's
autograd node, registered for that product only: ``split_score_parts(..., cut=True)``),
which makes the product exact at any depth. Where no
item has a seed for its full part (STL) the two products are one.
:func:`split_log_probs` called directly with plain upstream tensors raises if they
depend on each other.

**Higher derivatives.** ``score`` is an ordinary graph (exact at any order).
``log_prob`` and ``pathwise`` are first-order only: differentiating them with
``create_graph=True`` raises :class:`NotImplementedError` (their backward evaluates
``d log fn / d v`` at a detached ``v``, whose second derivative with respect to the
sample does not exist in the graph). Use ``fn.log_prob(value)`` directly for
second derivatives.

Families that need care (all handled, one evaluation each):

* :class:`~torch.distributions.TransformedDistribution` whose transforms hold no
  parameters (``biject_to`` pushforwards, ``SigmoidTransform`` ...), drawn through
  :func:`preimage_rsample`: the split is taken at the cached *pre-image* ``x``
  (``log q(T(x)) = log q_base(x) - log|det J_T(x)|``, with the transforms run
  forward), so no inverse runs and a saturating transform (a sigmoid deep in its
  float32 tail) keeps both its loss value and its pathwise gradient.
* ``TransformedDistribution`` with parametrized transforms (normalizing flows, and
  conditioned transforms whose parameters come from upstream samples), drawn through
  :func:`preimage_rsample` or with the path in the transforms' caches: the value is
  computed forward along the recorded path (exactly the ordinary value, no inverse),
  ``full`` is that graph itself, and the pathwise product ``h * g`` with the gradient
  ``g = d log q / d x_k`` *carried forward* by one rule per transform
  (:mod:`~pyro_gradroute.distributions.flows`) is sent to the output ``x_k`` of the
  last parametrized transform, no VJP through an inverse; the upstream partials are
  one product through ``lp - <g, x_k>``. Flows with a transform that has no rule are
  evaluated at the detached sample, which runs the inverse; without an inverse
  :class:`SplitNotSupported` (a ``NotImplementedError``) says so.
* Straight-through relaxed families (``RelaxedOneHotCategoricalStraightThrough``,
  ``RelaxedBernoulliStraightThrough``): the density is evaluated at the relaxed
  sample the quantized value carries (``value._unquantize``), and the pathwise
  product goes to that relaxed sample.
* Distributions with their own ``score_parts`` (``Rejector``, ``RejectionGamma``,
  ``MaskedDistribution`` with a tensor mask): the split is taken of what their
  ``score_parts`` returns, so Pyro's meaning of each part is kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import NamedTuple

import torch
from pyro.distributions.score_parts import ScoreParts
from pyro.distributions.torch_distribution import (
    TorchDistributionMixin,
)
from pyro.ops.provenance import detach_provenance, get_provenance, track_provenance
from torch.distributions import Distribution, Independent, TransformedDistribution

from .._compat import set_unquantized, sum_rightmost, transform_cache, unquantized
from ..routing import reached
from . import flows

__all__ = [
    "SplitLogProb",
    "SplitNotSupported",
    "split_log_prob",
    "split_log_probs",
]


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


class SplitNotSupported(NotImplementedError):
    """The distribution's log-density cannot be evaluated at a fixed (detached) sample."""


# ----------------------------------------------------------------------------- the node
class _Item(NamedTuple):
    target: torch.Tensor  # what the product with v is sent to (the value, or its pre-image)
    v: torch.Tensor  # the detached leaf at which the density was evaluated
    lp: torch.Tensor  # the evaluated tensor (graph to params, upstream, v)
    ups: tuple[int, ...]  # indices into the node's upstream list
    g: torch.Tensor | None = None  # flows: d lp / d target carried forward (v is None, no VJP)


class _Pathwise(torch.autograd.Function):
    """For ``m`` evaluated tensors at once: outputs ``full_i, pathwise_i`` equal to ``lp_i``.

    Inputs are the targets, the evaluated tensors ``lp_i`` (so that the outer backward
    keeps and orders their graphs) and the upstream tensors. Backward:

    * ``full_i``'s seed ``g`` goes to ``target_i`` as ``g * d lp_i / d v_i`` and into
      ``lp_i``'s own graph (parameters and upstream samples, as the ordinary
      gradient does);
    * ``pathwise_i``'s seed ``h`` goes to ``target_i`` as ``h * d lp_i / d v_i`` and to
      the upstream tensors as ``h * d lp_i / d u`` (partials: cut below each), never
      into ``lp_i``'s graph.
    """

    @staticmethod
    def forward(ctx, meta, *tensors):  # type: ignore[override]
        ctx.meta = meta
        ctx.set_materialize_grads(False)
        m, n_ups = len(meta[0]), len(meta[1])
        outs = []
        for lp in tensors[n_ups : n_ups + m]:
            d = lp.detach()
            outs += [d.clone(), d.clone()]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "split_log_prob's log_prob and pathwise parts are first-order only: they are "
                "not differentiable twice (create_graph=True). Their score part, and "
                "fn.log_prob(value) itself, support higher derivatives; the package's "
                "Trace_ELBO (which does not split) does too."
            )
        items, ups, targets, target_index, cut = ctx.meta
        g_full = grads[0::2]
        g_path = grads[1::2]
        g_targets: list = [None] * len(targets)
        g_ups: list = [None] * len(ups)
        # one product when no item that reads upstream samples has a full seed (STL): the
        # seeds to its value and to the samples it reads are then the same
        merged = all(g_full[i] is None for i, it in enumerate(items) if it.ups)
        v_outs, v_seeds, vs, slots = [], [], [], []  # one input per distinct v
        u_outs, u_seeds, wanted = [], [], {}
        for i, it in enumerate(items):
            in_v = False
            if it.g is not None:  # a flow: the full seed is lp's own graph; no VJP
                if g_path[i] is not None:
                    k = target_index[i]
                    g_targets[k] = _add(g_targets[k], _times(g_path[i], it.g, it.target))
            else:
                s = _add(g_full[i], g_path[i])
                if s is not None and it.v.requires_grad:
                    in_v = True
                    v_outs.append(it.lp)
                    v_seeds.append(s)
                    if not any(w is it.v for w in vs):
                        vs.append(it.v)
                        slots.append(target_index[i])
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
                gs = torch.autograd.grad(
                    outs,
                    [*v_in, *(ups[k] for k in u_in)],
                    seeds,
                    retain_graph=True,
                    allow_unused=True,
                )
            for k, g in zip(v_slots, gs):
                g_targets[k] = _add(g_targets[k], g)
            for k, g in zip(u_in, gs[len(v_in) :]):
                g_ups[k] = g
        return (None, *g_ups, *g_full, *g_targets)


@contextlib.contextmanager
def _cut_at(ups, cut: bool):
    r"""While the upstream product is taken, stop the gradient below the upstream samples.

    The product then gives each sample :math:`u` its partial derivative (the other samples
    held fixed): a backward pre-hook on each sample's autograd node drops the gradient
    arriving there (after the product has captured it), for this product only. (A sample
    without a node is a leaf: it is computed from no other.)
    """
    if not ups or not cut:
        yield
        return
    nodes = {u.grad_fn for u in ups if u.grad_fn is not None}
    handles = [n.register_prehook(_drop) for n in nodes]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _drop(grads):
    return (None,) * len(grads)


def _times(h: torch.Tensor, g: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``h * g`` with ``h`` (batch-shaped) broadcast over the event dims, summed to ``target``'s shape."""
    pad = g.dim() - h.dim()
    out = h.reshape(h.shape + (1,) * pad) * g if pad > 0 else h * g
    if out.shape != target.shape:
        out = out.sum_to_size(target.shape)
    return out


def _strip_provenance(item):
    return item._replace(
        target=detach_provenance(item.target),
        v=detach_provenance(item.v),
        lp=detach_provenance(item.lp),
    )


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _check_independent(ups: list[torch.Tensor]) -> None:
    """Raise if one of ``ups`` lies on another's graph (the product would count a path twice)."""
    for j, u in enumerate(ups):
        others = [w for i, w in enumerate(ups) if i != j]
        below = [others[i] for i in reached(u, others)]
        if below:
            raise ValueError(
                "split_log_probs: an upstream tensor depends on another one (shape "
                f"{tuple(u.shape)} is computed from shape {tuple(below[0].shape)}), so the "
                "pathwise product with respect to both would count the path through the "
                "later one twice. Pass only the samples the distribution reads directly and "
                "that are not computed from each other, or use the package's ELBOs or "
                "pyro_gradroute.poutine.stick_the_landing, which stop the gradient below each "
                "sample while that product is taken."
            )


# ----------------------------------------------------------------------------- evaluation
def _param_free(t) -> bool:
    """Whether a transform holds no parameters, nor tensors computed from them.

    Conditioned transforms (``ConditionalAffineAutoregressive.condition(z)``, ...) hold
    their context inside a ``functools.partial`` and count as parametrized.
    """
    return not flows.holds_params(t, cache=False)


def _default_score_parts(fn) -> bool:
    """Whether ``fn``'s parts are Pyro's default ones (a plain ``torch.distributions`` object has none)."""
    return getattr(type(fn), "score_parts", None) in (None, TorchDistributionMixin.score_parts)


def _score_parts(fn: Distribution, value: torch.Tensor) -> ScoreParts:
    """``fn.score_parts(value)``, or Pyro's default parts for a plain ``torch.distributions`` object."""
    method = getattr(fn, "score_parts", None)
    if method is not None:
        return method(value)
    lp = fn.log_prob(value)
    return ScoreParts(lp, 0, lp) if fn.has_rsample else ScoreParts(lp, lp, 0)


def flatten_transformed(fn: Distribution) -> Distribution:
    """``TD(TD(base, [t1]), [t2])`` as the equal ``TD(base, [t1, t2])`` (any depth); else ``fn``.

    A nested ``TransformedDistribution`` samples and scores exactly as the flat one (the
    same operations, the same random numbers). Flat, the split sees the whole path from
    the base sample, so an inner flow gets its forward rules and an inner cached
    transform is not inverted through its cache. An inner one that the outer one
    reinterprets (``Independent``) is flattened with ``IndependentTransform``; one that
    is expanded, or with its own ``score_parts``, is kept as it is.
    """
    if not isinstance(fn, TransformedDistribution) or not _default_score_parts(fn):
        return fn
    from torch.distributions.transforms import IndependentTransform

    base, n = fn.base_dist, 0
    if isinstance(base, Independent) and type(base) in (Independent, _pyro_independent()):
        base, n = base.base_dist, base.reinterpreted_batch_ndims
    if not isinstance(base, TransformedDistribution) or not _default_score_parts(base):
        return fn
    inner = flatten_transformed(base)
    if not isinstance(inner, TransformedDistribution):
        return fn
    ts = list(inner.transforms)
    if n:
        ts = [IndependentTransform(t, n) for t in ts]
    flat = type(fn)(inner.base_dist, ts + list(fn.transforms), validate_args=False)
    if flat.batch_shape != fn.batch_shape or flat.event_shape != fn.event_shape:
        return fn
    return flat


def _pyro_independent():
    from pyro.distributions import Independent

    return Independent


def preimage_rsample(fn: Distribution, sample_shape=()):
    """``fn.rsample(sample_shape)`` and, for a ``TransformedDistribution``, its pre-image.

    Returns ``(value, pre)``: for a parameter-free ``TransformedDistribution`` ``pre``
    is the base sample; for a flow whose transforms have forward pathwise rules
    (:mod:`~pyro_gradroute.distributions.flows`) it is the
    :class:`~pyro_gradroute.distributions.flows.FlowPath` of the sample (base sample and
    intermediate values); otherwise ``None``. The same operations as
    ``TransformedDistribution.rsample``.
    """
    sample_shape = torch.Size(sample_shape)
    fn = flatten_transformed(fn)
    if (
        isinstance(fn, TransformedDistribution)
        and _default_score_parts(fn)
        and _default_score_parts(fn.base_dist)
    ):
        if all(_param_free(t) and _cached(t) for t in fn.transforms):
            x = fn.base_dist.rsample(sample_shape)
            y = x
            for t in fn.transforms:
                y = t(y)
            return y, x
        if fn.has_rsample and flows.supported(fn):
            path = flows.forward_path(fn, sample_shape)
            return path.value, path
    return fn.rsample(sample_shape), None


def _cached(t) -> bool:
    """Whether ``t`` (every part of it) caches its last pre-image, as Pyro's log_prob then uses it.

    For an uncached transform the ordinary ``log_prob`` runs the inverse; the split then
    does the same, so that loss values stay identical to ``Trace_ELBO``'s.
    """
    from torch.distributions.transforms import ComposeTransform, IndependentTransform

    if isinstance(t, ComposeTransform):
        return all(_cached(p) for p in t.parts)
    if isinstance(t, IndependentTransform):
        return _cached(t.base_transform)
    return transform_cache(t) is not None


def _transformed_log_prob(fn: TransformedDistribution, x: torch.Tensor) -> torch.Tensor:
    """``fn.log_prob(T(x))`` computed forward from the pre-image ``x`` (no inverse).

    The event dimensions follow torch's ``TransformedDistribution.log_prob``: walking the
    transforms from the output, each changes them by ``domain.event_dim -
    codomain.event_dim`` (``CorrCholeskyTransform`` maps a vector to a matrix,
    ``ReshapeTransform`` changes the event's rank), and each Jacobian term is summed over
    the event dimensions left of its own domain's.
    """
    event_dim = len(fn.event_shape)
    sums = []
    for t in reversed(fn.transforms):
        event_dim += t.domain.event_dim - t.codomain.event_dim
        sums.append(event_dim - t.domain.event_dim)
    log_prob = 0.0
    y = x
    for t, n in zip(fn.transforms, reversed(sums)):
        t = t.with_cache(0)
        y_next = t(y)
        log_prob = log_prob - sum_rightmost(t.log_abs_det_jacobian(y, y_next), n)
        y = y_next
    base_lp = fn.base_dist.log_prob(x)
    return log_prob + sum_rightmost(base_lp, event_dim - len(fn.base_dist.event_shape))


def _evaluate(fn: Distribution, value: torch.Tensor, preimage, grad_mode: bool, raw=None):
    """``(target, v, ScoreParts at v, flow)``: one evaluation of ``fn``'s score parts at a detached copy.

    ``flow`` is ``None``, or for a flow evaluated forward along its path ``(g, score)``:
    the forward-carried gradient at the target and the score part (``v`` is then None).
    """
    fn = flatten_transformed(fn)
    if preimage is None and _flow_candidate(fn):
        preimage = flows.cached_path(fn, value)
    if isinstance(preimage, flows.FlowPath):
        lp, g, score = flows.evaluate(preimage, grad_mode)
        parts = ScoreParts(lp, 0, lp) if fn.has_rsample else ScoreParts(lp, lp, 0)
        return preimage.target, None, parts, (g, score)
    unq = unquantized(value)
    if preimage is not None:
        target = preimage
        v = preimage.detach().requires_grad_(preimage.requires_grad and grad_mode)
        lp = _transformed_log_prob(fn, v)
        parts = ScoreParts(lp, 0, lp) if fn.has_rsample else ScoreParts(lp, lp, 0)
        return target, v, parts, None
    if unq is not None:
        target = unq
        v = value.detach()
        set_unquantized(v, unq.detach().requires_grad_(unq.requires_grad and grad_mode))
        return target, unquantized(v), _score_parts(fn, v), None
    v = value.detach().requires_grad_(value.requires_grad and grad_mode)
    if _default_score_parts(fn):
        return value, v, _score_parts(fn, v), None
    try:
        parts = fn.score_parts(v)
    except AssertionError:
        # a family whose score_parts read its sampler's state for the exact tensor it
        # returned (RSVI's ShapeAugmentedGamma): take them there
        parts = _sampled_score_parts(fn, v, value if raw is None else raw)
    return value, v, parts, None


def _sampled_score_parts(fn: Distribution, v: torch.Tensor, raw: torch.Tensor) -> ScoreParts:
    """``fn.score_parts`` of a family that accepts only the tensor its sampler returned.

    They are taken at ``raw``; their ``log_prob`` (and ``entropy_term``), which must be
    ``fn.log_prob`` there, are re-evaluated at the detached ``v``; the score-function
    term (the sampler's own, e.g. a rejection correction) is kept as it is.
    """
    name = type(fn).__name__
    try:
        at_raw = fn.score_parts(raw)
    except AssertionError as e:
        raise SplitNotSupported(
            f"{name}.score_parts accepts neither a fixed copy of the sample nor the sample "
            "itself, so its parts cannot be split"
        ) from e
    lp = fn.log_prob(v)
    out = []
    for part in (at_raw.log_prob, at_raw.entropy_term):
        if torch.is_tensor(part):
            if part.shape != lp.shape or not torch.equal(part.detach(), lp.detach()):
                raise SplitNotSupported(
                    f"{name}.score_parts accepts only the tensor its sampler returned and its "
                    "log_prob (or entropy_term) is not the family's log_prob there, so it cannot "
                    "be evaluated at a fixed copy of the sample"
                )
            out.append(lp)
        else:
            out.append(part)
    return ScoreParts(out[0], at_raw.score_function, out[1])


def _flow_candidate(fn) -> bool:
    """A flow (parametrized transforms) whose transforms' caches may hold a sample's path."""
    return (
        isinstance(fn, TransformedDistribution)
        and fn.has_rsample
        and _default_score_parts(fn)
        and _default_score_parts(fn.base_dist)
        and not all(_param_free(t) for t in fn.transforms)
        and flows.supported(fn)
    )


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

    ``items``: ``(fn, value, upstream, preimage)``. ``full`` and ``pathwise`` are
    :class:`~pyro.distributions.score_parts.ScoreParts` (``log_prob``,
    ``score_function``, ``entropy_term``) whose tensors carry the full, respectively
    the pathwise, gradient; ``score`` is the evaluated ``log_prob`` itself.
    ``on_error(i, exc)`` may return ``None`` to re-raise, or a
    ``(full, pathwise, score)`` triple to use for item ``i`` instead.
    ``cut``: each item's upstream tensors are the samples its parameters read (found by
    the caller, so not searched for again), which may be computed from each other (a
    chain :math:`z_0 \to z_1 \to z_2`, a dense DAG): the upstream product stops the
    gradient below each of them (a backward pre-hook on its autograd node, for that product
    only). ``names``: the items' site names, which an error in evaluating one names.
    """
    grad_mode = torch.is_grad_enabled()
    results: list = [None] * len(items)
    node_items: list[_Item] = []
    owners: list[tuple[int, str]] = []  # (item index, part name) per node item
    targets: list[torch.Tensor] = []
    target_index: list[int] = []
    ups_list: list[torch.Tensor] = []
    ups_index: dict[int, int] = {}  # id(upstream tensor) -> its index in ups_list
    for i, (fn, value, upstream, preimage, *sampled) in enumerate(items):
        if not isinstance(fn, Distribution):
            raise TypeError(
                f"split_log_prob expects a torch.distributions.Distribution, got {type(fn).__name__}"
            )
        if not torch.is_tensor(value):
            raise TypeError(f"split_log_prob expects a tensor value, got {type(value).__name__}")
        try:
            raw = sampled[0] if sampled else value
            target, v, parts, flow = _evaluate(fn, value, preimage, grad_mode, raw)
        except (NotImplementedError, KeyError) as e:
            err = SplitNotSupported(
                f"{type(fn).__name__}.log_prob cannot be evaluated at a fixed sample "
                f"({type(e).__name__}: {e}). The score/pathwise split needs log q(z; phi) at "
                "a sample held fixed, which for a TransformedDistribution with parametrized "
                "transforms means running their inverse; transforms without an inverse "
                "(Planar, Radial, Sylvester, BlockNeuralAutoregressive, ...) cannot be split. "
                "Use invertible transforms (affine_autoregressive, spline, "
                "spline_autoregressive, ...) or an estimator that does not split this site "
                "(Trace_ELBO)."
            )
            alt = on_error(i, err) if on_error is not None else None
            if alt is None:
                raise err from e
            results[i] = alt
            continue
        except ValueError as e:
            if names is None:
                raise
            raise ValueError(f"Error while computing log_prob at site '{names[i]}':\n{e}") from e
        lp = parts.log_prob
        g_flow, score = (None, lp) if flow is None else flow
        distinct: dict[str, str] = {}  # part name -> the first name holding the same tensor
        for name in ("log_prob", "score_function", "entropy_term"):
            t = getattr(parts, name)
            if torch.is_tensor(t) and t.requires_grad and grad_mode:
                alias = [n for n in distinct if getattr(parts, n) is t]
                distinct[name] = alias[0] if alias else name
        if not distinct:
            results[i] = (parts, _stop_all(parts), score)
            continue
        ups_here: list[int] = []
        if upstream:
            if cut:
                hit = range(len(upstream))
            else:
                hit = set(reached(lp, list(upstream)))
                if g_flow is not None:  # the sample's own path to upstream tensors
                    hit.update(reached(target, list(upstream)))
            for j in sorted(hit):
                u = upstream[j]
                k = ups_index.get(id(u))
                if k is None:
                    k = ups_index[id(u)] = len(ups_list)
                    ups_list.append(u)
                ups_here.append(k)
        value_path = target.requires_grad if g_flow is not None else v.requires_grad
        if not value_path and not ups_here:  # no value path: the evaluation is the split
            results[i] = (parts, _stop_all(parts), score)
            continue
        targets.append(target)
        tk = len(targets) - 1
        for name, first in distinct.items():
            if first != name:
                continue
            node_items.append(_Item(target, v, getattr(parts, name), tuple(ups_here), g_flow))
            owners.append((i, name))
            target_index.append(tk)
        results[i] = (parts, distinct, score)
    if node_items:
        cut = cut and len(ups_list) > 1
        if len(ups_list) > 1 and not cut:
            _check_independent(ups_list)
        meta = (node_items, ups_list, targets, target_index, cut)
        provenance = [get_provenance(it.lp) for it in node_items]  # TraceGraph_ELBO's tracking
        if any(provenance) or any(get_provenance(t) for t in (*ups_list, *targets)):
            node_items = [_strip_provenance(it) for it in node_items]
            ups_list = [detach_provenance(u) for u in ups_list]
            targets = [detach_provenance(t) for t in targets]
            meta = (node_items, ups_list, targets, target_index, cut)
        lps = [it.lp for it in node_items]
        outs = _Pathwise.apply(meta, *ups_list, *lps, *targets)
        split_of: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for n, key in enumerate(owners):
            full, path = outs[2 * n], outs[2 * n + 1]
            if provenance[n]:
                full, path = (
                    track_provenance(full, provenance[n]),
                    track_provenance(path, provenance[n]),
                )
            split_of[key] = (full, path)
        for i, r in enumerate(results):
            if r is None or len(r) != 3 or not isinstance(r[1], dict):
                continue
            parts, distinct, score = r
            full, path = [], []
            for name in ("log_prob", "score_function", "entropy_term"):
                t = getattr(parts, name)
                if name in distinct:
                    f, p = split_of[(i, distinct[name])]
                    full.append(f)
                    path.append(p)
                else:
                    full.append(t)
                    path.append(t.detach() if torch.is_tensor(t) else t)
            results[i] = (ScoreParts(*full), ScoreParts(*path), score)
    return results


def _stop_all(parts: ScoreParts) -> ScoreParts:
    return ScoreParts(*(t.detach() if torch.is_tensor(t) else t for t in parts))
