r"""The forward path of a flow sample (:class:`FlowPath`: drawn, or recovered from the
transforms' caches), and the view of one layer that a rule gets (:class:`FlowLayer`)."""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import types
import weakref

import torch
from torch.distributions import Independent, Normal, TransformedDistribution
from torch.distributions import transforms as TT

from ..._compat import set_transform_cache, sum_rightmost, transform_attrs, transform_cache, vjp
from .rules import flow_rule

_EMPTY = torch.Size()


def _fresh(t):
    """A copy of ``t`` with its own caches (parameters and sub-modules shared)."""
    if isinstance(t, TT.IndependentTransform):
        return TT.IndependentTransform(_fresh(t.base_transform), t.reinterpreted_batch_ndims)
    t2 = copy.copy(t)
    for k, v in list(vars(t2).items()):  # methods bound to t (e.g. a stable IAF's _call)
        if inspect.ismethod(v) and v.__self__ is t:
            object.__setattr__(t2, k, types.MethodType(v.__func__, t2))
    if transform_cache(t2) is not None:
        set_transform_cache(t2, None, None)
    return t2


def _cache_matches(t, x, strict: bool = False) -> bool:
    """Whether ``t``'s cache holds ``x`` (an uncached ``t`` matches, unless ``strict``)."""
    if isinstance(t, TT.IndependentTransform):
        return _cache_matches(t.base_transform, x, strict)
    cache = transform_cache(t)
    return (cache is None and not strict) or (cache is not None and cache[0] is x)


class FlowLayer:
    """What a rule sees of one layer ``y = T(x)``.

    :ivar transform: the transform.
    :ivar x: its input (detached).
    :ivar y: its output (detached).
    :ivar event_dim: ``transform.domain.event_dim``.

    :meth:`vjp` gives vector-Jacobian products with the parameters held fixed, through
    the graph the sample was drawn with; :attr:`evaluated` is a transform whose caches
    (:func:`~pyro_gradroute._compat.cached_log_scale`, ...) belong to ``x``: ``transform``
    itself, or (only when a rule asks) a copy re-evaluated at a detached ``x``.
    """

    def __init__(self, transform, x: torch.Tensor, y: torch.Tensor):
        self.transform = transform
        self.x = x.detach()
        self.y = y.detach()
        self.event_dim = transform.domain.event_dim
        self._in, self._out = x, y
        self._ladj = None
        self._x = self._y = None  # the graph's ends, once known
        if x.requires_grad and y.requires_grad and _cache_matches(transform, x):
            self._t, self._x, self._y = transform, x, y
        else:  # the caches still belong to x if the cache holds it; the graph, on demand
            self._t = transform if _cache_matches(transform, x, strict=True) else None

    def _graph(self) -> None:
        """Re-evaluate the layer at a detached ``x`` on a fresh copy (a graph to VJP through)."""
        if self._x is not None:
            return
        t2 = _fresh(self.transform)
        xd = self.x.detach().requires_grad_()
        with torch.enable_grad():
            yd = t2(xd)
        self._t, self._x, self._y = t2, xd, yd

    @property
    def evaluated(self):
        """The transform whose caches hold this layer's ``x``."""
        if self._t is None:
            self._graph()
        return self._t

    def _ladj_live(self) -> torch.Tensor:
        if self._ladj is None:
            self._graph()
            with torch.enable_grad():
                self._ladj = self._t.log_abs_det_jacobian(self._x, self._y)
        return self._ladj

    @property
    def ladj(self) -> torch.Tensor:
        """``transform.log_abs_det_jacobian(x, y)`` (detached; elementwise for elementwise transforms)."""
        return torch.as_tensor(self._ladj_live()).detach()

    def vjp(self, g: torch.Tensor | None = None, ladj: bool = True) -> torch.Tensor:
        r"""``d/dx [ladj * sum log|det J(x)| + <g, T(x)>]``, parameters held fixed.

        With ``g=None`` this is :math:`\nabla_x \log|\det J(x)|`; with ``ladj=False``
        it is :math:`J^T g`.
        """
        self._graph()
        outs, seeds = [], []
        if ladj:
            la = self._ladj_live()
            if torch.is_tensor(la) and la.requires_grad:
                outs.append(la)
                seeds.append(torch.ones_like(la))
        if g is not None and self._y.requires_grad:
            outs.append(self._y)
            seeds.append(g.expand_as(self._y))
        if not outs:
            return torch.zeros_like(self.x)
        (r,) = vjp(outs, [self._x], seeds)
        return torch.zeros_like(self.x) if r is None else r.detach()

    def sub(self, transform) -> FlowLayer:
        """The same layer seen as ``transform`` (e.g. an ``IndependentTransform``'s base)."""
        return FlowLayer(transform, self._in, self._out)


def log_prob_along(fn: TransformedDistribution, steps: list, x0: torch.Tensor) -> tuple:
    """``(fn.log_prob(y), base log_prob)`` along ``steps``, ``(transform, input, output)`` per
    transform of ``fn``, as torch computes it: walking from the output, each transform changes
    the event dims by ``domain.event_dim - codomain.event_dim`` (``CorrCholeskyTransform``,
    ``ReshapeTransform``) and its Jacobian term is summed over those left of its domain's."""
    event_dim = len(fn.event_shape)
    lp: torch.Tensor | float = 0.0
    for t, x, y in reversed(steps):
        event_dim += t.domain.event_dim - t.codomain.event_dim
        lp = lp - sum_rightmost(t.log_abs_det_jacobian(x, y), event_dim - t.domain.event_dim)
    base_lp = fn.base_dist.log_prob(x0)
    return lp + sum_rightmost(base_lp, event_dim - len(fn.base_dist.event_shape)), base_lp


def normal_base_grad(base, x: torch.Tensor) -> torch.Tensor | None:
    r""":math:`\nabla_x \log q_0(x) = (\mu - x) / \sigma^2` of a ``Normal`` base (also under
    ``Independent``), parameters held fixed, rounded as autograd rounds it; None for any
    other base (a subclass that changes ``log_prob`` included)."""
    while type(base).log_prob is Independent.log_prob:
        base = base.base_dist
    if type(base).log_prob is not Normal.log_prob:
        return None
    with torch.no_grad():
        scale = base.scale
        return (base.loc - x) * (scale * scale).reciprocal()


def _flatten(transforms) -> list:
    """The transforms with every ``ComposeTransform`` expanded into its parts."""
    out = []
    for t in transforms:
        out.extend(_flatten(t.parts) if isinstance(t, TT.ComposeTransform) else [t])
    return out


class FlowPath:
    r"""The forward path of one ``TransformedDistribution`` sample: ``x_0 -> x_1 -> ... -> x_n = y``.

    ``xs`` are the tensors the sample was drawn with (``ComposeTransform`` flattened into
    its parts). ``target`` is :math:`x_k`, the output of the last transform that holds
    parameters (or depends on upstream tensors): the pathwise gradient is sent there, as
    :math:`\nabla_{x_k} \log q(T_{>k}(x_k))`, the trailing parameter-free transforms
    entering through one VJP of their ``log|det J|``.
    """

    def __init__(self, fn: TransformedDistribution, xs: list[torch.Tensor], k: int):
        self.fn = fn
        self.leaves = _flatten(fn.transforms)
        self.xs = xs
        self.k = k
        ends = list(itertools.accumulate((len(_flatten([t])) for t in fn.transforms), initial=0))
        self.spans = list(zip(ends[:-1], ends[1:]))  # each transform's (input, output) in xs
        self._base_lp = None

    @property
    def target(self) -> torch.Tensor:
        return self.xs[self.k]

    @property
    def value(self) -> torch.Tensor:
        return self.xs[-1]

    def log_prob(self) -> torch.Tensor:
        """``fn.log_prob(y)`` from the path (the same operations as with the transforms' caches)."""
        steps = [(t, self.xs[a], self.xs[b]) for t, (a, b) in zip(self.fn.transforms, self.spans)]
        lp, self._base_lp = log_prob_along(self.fn, steps, self.xs[0])
        return lp

    def base_grad(self) -> torch.Tensor:
        r""":math:`\nabla_{x_0} \log q_0(x_0)`, parameters held fixed (closed form for a
        ``Normal`` base, :func:`normal_base_grad`; through autograd for any other)."""
        x0 = self.xs[0]
        g = normal_base_grad(self.fn.base_dist, x0.detach())
        if g is not None:
            return g
        if x0.requires_grad and self._base_lp is not None and self._base_lp.requires_grad:
            lp, x = self._base_lp, x0
        else:
            x = x0.detach().requires_grad_()
            with torch.enable_grad():
                lp = self.fn.base_dist.log_prob(x)
        (g,) = vjp([lp], [x], [torch.ones_like(lp)])
        return g.detach()

    def target_grad(self) -> torch.Tensor:
        r""":math:`\nabla_{x_k} \log q(T_{>k}(x_k))`, parameters held fixed (forward-carried)."""
        g = self.base_grad()
        for i, t in enumerate(self.leaves[: self.k]):
            rule = flow_rule(t)
            if rule is None:
                raise NotImplementedError(f"no forward pathwise rule for {type(t).__name__}")
            g = rule(FlowLayer(t, self.xs[i], self.xs[i + 1]), g)
        if self.k == len(self.leaves):
            return g
        xk = self.target
        if xk.requires_grad:
            x, xs, tail = xk, self.xs[self.k :], self.leaves[self.k :]
        else:  # re-run the parameter-free tail from a detached copy
            x = xk.detach().requires_grad_()
            xs, tail = [x], [_fresh(t) for t in self.leaves[self.k :]]
            with torch.enable_grad():
                for t in tail:
                    xs.append(t(xs[-1]))
        with torch.enable_grad():
            s = sum(t.log_abs_det_jacobian(a, b).sum() for t, a, b in zip(tail, xs[:-1], xs[1:]))
        if torch.is_tensor(s) and s.requires_grad:
            (d,) = vjp([s], [x], [torch.ones_like(s)])
            if d is not None:
                g = g - d.detach()
        return g


#: modules seen holding parameters (checked on every step; a module keeps its parameters)
_WITH_PARAMS: weakref.WeakSet = weakref.WeakSet()


def _holds_params(obj, seen: set, cache: bool) -> bool:
    """Whether ``obj`` holds, or computes from, a tensor that requires grad."""
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if torch.is_tensor(obj):
        return obj.requires_grad
    if isinstance(obj, torch.nn.Module):
        if obj in _WITH_PARAMS:
            return True
        if next(obj.parameters(), None) is not None:
            _WITH_PARAMS.add(obj)
            return True
    if isinstance(obj, functools.partial):
        parts = [obj.func, *obj.args, *obj.keywords.values()]
    elif inspect.ismethod(obj):
        parts = [obj.__self__]
    elif isinstance(obj, (list, tuple)):
        parts = obj
    elif isinstance(obj, dict):
        parts = obj.values()
    elif isinstance(obj, torch.nn.Module):  # its attributes and sub-modules (no parameters)
        attrs = vars(obj) if cache or not isinstance(obj, TT.Transform) else transform_attrs(obj)
        skip = ("_parameters", "_buffers", "_modules")
        parts = [v for k, v in attrs.items() if k not in skip]
        parts += list(obj.children())
    elif isinstance(obj, TT.Transform):
        parts = (vars(obj) if cache else transform_attrs(obj)).values()
    else:
        return False
    return any(_holds_params(v, seen, cache) for v in parts)


def holds_params(t, cache: bool = False) -> bool:
    """Whether a transform holds parameters, or tensors computed from them (conditioned flows);
    its cache of its last call counts only with ``cache=True``."""
    return _holds_params(t, set(), cache)


def _split_index(leaves) -> int:
    """One past the last leaf that holds parameters (0: none does)."""
    return max((i + 1 for i, t in enumerate(leaves) if holds_params(t)), default=0)


def supported(fn: TransformedDistribution) -> bool:
    """Whether every transform up to the last parametrized one has a rule (and one has parameters)."""
    leaves = _flatten(fn.transforms)
    k = _split_index(leaves)
    return k > 0 and all(flow_rule(t) is not None for t in leaves[:k])


def forward_path(fn: TransformedDistribution, sample_shape=_EMPTY) -> FlowPath:
    """``fn.rsample(sample_shape)``, recording the path (the same operations, the same graph: a
    layer whose input has no graph is re-evaluated at it only where a rule asks for a VJP)."""
    xs = [fn.base_dist.rsample(sample_shape)]
    for t in _flatten(fn.transforms):
        xs.append(t(xs[-1]))
    _set_compose_caches(fn.transforms, xs, 0)
    return FlowPath(fn, xs, _split_index(_flatten(fn.transforms)))


def _set_compose_caches(transforms, xs, i) -> int:
    for t in transforms:
        n = len(_flatten([t]))
        if isinstance(t, TT.ComposeTransform):
            _set_compose_caches(t.parts, xs, i)
            if transform_cache(t) is not None:
                set_transform_cache(t, xs[i], xs[i + n])
        i += n
    return i


def cached_path(fn: TransformedDistribution, value: torch.Tensor) -> FlowPath | None:
    """The path of ``value`` recovered from the transforms' caches (``fn.rsample()``'s output), or None."""
    leaves = _flatten(fn.transforms)
    xs = [value]
    for t in reversed(leaves):
        c = t.base_transform if isinstance(t, TT.IndependentTransform) else t
        cx, cy = transform_cache(c) or (None, None)
        if cy is not xs[-1] or cx is None:
            return None
        xs.append(cx)
    return FlowPath(fn, xs[::-1], _split_index(leaves))


def caches_hold(path: FlowPath) -> bool:
    """Whether the transforms' caches still hold ``path`` (what :func:`cached_path` recovers:
    no later call of a shared transform has replaced it)."""
    for t, x, y in zip(path.leaves, path.xs, path.xs[1:]):
        cache = transform_cache(t.base_transform if isinstance(t, TT.IndependentTransform) else t)
        if cache is None or cache[0] is not x or cache[1] is not y:
            return False
    return True


def flow_grad(fn: TransformedDistribution, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(y, g_y)``: the sample :math:`y = T(x)` and :math:`\nabla_y \log q(y)`, carried forward.

    .. math::

        g_y = J_{T_n}^{-T}(g_{x_{n-1}} - \nabla \log|\det J_{T_n}|) \circ \dots,
        \qquad g_{x_0} = \nabla_{x_0} \log q_0(x_0),

    parameters held fixed, no inverse. Every transform needs a rule.

    Example::

        >>> import torch, pyro.distributions as dist, pyro.distributions.transforms as T
        >>> q = dist.TransformedDistribution(
        ...     dist.Normal(torch.zeros(2), 1.0).to_event(1), [T.planar(2), T.radial(2)])
        >>> x = torch.randn(2)
        >>> y, g = flow_grad(q, x)  # no inverse: Planar and Radial have none
        >>> g.shape
        torch.Size([2])
    """
    xs = [x]
    with torch.enable_grad():
        if not x.requires_grad:
            xs = [x.detach().requires_grad_()]
        for t in _flatten(fn.transforms):
            xs.append(t(xs[-1]))
    return xs[-1].detach(), FlowPath(fn, xs, len(xs) - 1).target_grad()


def _target_product(path: FlowPath, g: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """``<g, x_k>`` summed over the target's event dims (shaped like ``lp``)."""
    s = g * path.target
    pad = s.dim() - lp.dim()
    if pad > 0:
        s = s.reshape(s.shape[: s.dim() - pad] + (-1,)).sum(-1)
    return s


def evaluate(path: FlowPath, grad_mode: bool):
    """``(log_prob, g, score)`` of a path: the value, the forward-carried gradient at the target
    (None without grad mode) and the score part ``log q(stop(y); phi)``."""
    lp = path.log_prob()
    if not grad_mode:
        return lp, None, lp
    g = path.target_grad()
    s = _target_product(path, g, lp)
    return lp, g, lp - s + s.detach()


def pathwise_log_prob(path: FlowPath) -> torch.Tensor:
    r"""The pathwise part :math:`\log q(y; \bot(\phi))` of a flow sample, with no custom node.

    .. math::

        \bot(\log q(y)) + \langle \bot(g), x_k \rangle - \bot(\langle g, x_k \rangle),
        \qquad g = \nabla_{x_k} \log q(T_{>k}(x_k))\ \text{(forward-carried)}:

    the ordinary value, and a gradient that reaches the parameters only through the sample
    (the output :math:`x_k` of the last parametrized transform); the log-density's own graph
    is not built.
    """
    with torch.no_grad():
        lp = path.log_prob()
    if not (path.target.requires_grad and torch.is_grad_enabled()):
        return lp
    s = _target_product(path, path.target_grad(), lp)
    return lp + (s - s.detach())
