r"""Forward-carried pathwise gradients of normalizing flows: one rule per transform class.

A flow samples :math:`y = T(x)`, :math:`x \sim q_0`, and scores it by
:math:`\log q(y) = \log q_0(x) - \log|\det J_T(x)|`. The pathwise part of the
score/pathwise split needs :math:`g_y = \nabla_y \log q(y)` with the parameters held
fixed. Instead of running :math:`T^{-1}`, it is carried *forward* with the sample
(Vaitl et al. 2024, "fast path gradients"), one layer :math:`x \mapsto T_i(x)` at a time:

.. math::

    g_{x_{i+1}} = J_{T_i}(x_i)^{-T}\,\big(g_{x_i} - \nabla_{x_i} \log|\det J_{T_i}(x_i)|\big),
    \qquad g_{x_0} = \nabla_{x_0} \log q_0(x_0).

Each transform class has a *rule* applying that update (:func:`register_flow_rule`;
the built-in rules are listed in :data:`RULES_TABLE`):

* diagonal (elementwise) Jacobians: closed form;
* identity plus low rank (Householder, Planar, Radial, Sylvester): Sherman-Morrison /
  Woodbury, closed form;
* coupling layers: one vector-Jacobian product (VJP) through the conditioner;
* autoregressive layers (triangular :math:`J`): the fixed-point iteration
  :math:`g \leftarrow g + \operatorname{diag}(J)^{-1}(u - J^T g)`, one VJP per iteration,
  exact after at most :math:`D` iterations, stopped on a relative tolerance
  (:func:`solve_settings`), raising :class:`FlowSolveError` if it is not reached.

Trailing transforms without parameters (``biject_to`` pushforwards, ...) need no rule:
the pathwise gradient is sent to the output of the last parametrized transform (see
:class:`FlowPath`), which also keeps saturating tails finite. A transform with no rule
makes the split fall back to the inverse-based evaluation.

The VJPs run through the graph the sample was drawn with (no re-evaluation), so the
rules cost a fraction of one backward pass through the flow; a layer whose input does
not require grad is re-evaluated once on a detached copy instead.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import numbers
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributions import TransformedDistribution
from torch.distributions import transforms as TT
from torch.distributions.utils import _sum_rightmost

__all__ = [
    "FlowLayer",
    "FlowPath",
    "FlowSolveError",
    "RULES_TABLE",
    "SolveRecord",
    "flow_grad",
    "flow_rule",
    "record_solves",
    "register_flow_rule",
    "solve_settings",
    "triangular_solve",
]


_EMPTY = torch.Size()


class FlowSolveError(ValueError):
    """The triangular fixed-point iteration of an autoregressive layer did not converge."""


# ----------------------------------------------------------------------------- settings
@dataclass
class _Settings:
    rtol: float | None = None  # None: 1e-12 (float64), 1e-6 (float32 and lower)
    max_iter: int | None = None  # None: D (exact after D iterations in exact arithmetic)


_SETTINGS = _Settings()


@contextlib.contextmanager
def solve_settings(rtol: float | None = None, max_iter: int | None = None) -> Iterator[None]:
    r"""Tolerance and iteration limit of the triangular solves (autoregressive layers).

    The iteration stops once every sample's update satisfies
    :math:`\|\delta\|_\infty \le \text{rtol}\,\|g\|_\infty`, or once the update
    stops shrinking below :math:`\sqrt{\epsilon}` (the round-off floor), or after
    :math:`D` iterations (exact in exact arithmetic: the strictly triangular part is
    nilpotent). It raises :class:`FlowSolveError` (naming the residual) if ``max_iter``
    iterations are reached first, or on a non-finite residual. ``max_iter`` must be a
    positive integer and ``rtol`` in ``[0, 1)`` (else ``ValueError``). Default ``rtol``:
    ``1e-12`` in float64, ``1e-6`` in float32.

    Example::

        >>> with solve_settings(rtol=1e-8):
        ...     pass  # TraceSTL_ELBO / TraceDReG_ELBO steps here use rtol=1e-8
    """
    if rtol is not None and (
        isinstance(rtol, bool) or not isinstance(rtol, numbers.Real) or not 0 <= rtol < 1
    ):
        raise ValueError(f"solve_settings: rtol must be a number in [0, 1), got {rtol!r}")
    if max_iter is not None and (
        isinstance(max_iter, bool) or not isinstance(max_iter, numbers.Integral) or max_iter < 1
    ):
        raise ValueError(
            f"solve_settings: max_iter must be a positive integer, got {max_iter!r} "
            "(None: the dimension D, exact in exact arithmetic)"
        )
    old = _Settings(_SETTINGS.rtol, _SETTINGS.max_iter)
    if rtol is not None:
        _SETTINGS.rtol = float(rtol)
    if max_iter is not None:
        _SETTINGS.max_iter = int(max_iter)
    try:
        yield
    finally:
        _SETTINGS.rtol, _SETTINGS.max_iter = old.rtol, old.max_iter


def _rtol(dtype: torch.dtype) -> float:
    if _SETTINGS.rtol is not None:
        return _SETTINGS.rtol
    return 1e-12 if dtype == torch.float64 else 1e-6


@dataclass(frozen=True)
class SolveRecord:
    """One triangular solve: the transform class, its dimension, the VJPs taken, the residual."""

    transform: str
    dim: int
    iterations: int
    residual: float


_RECORDS: list[list[SolveRecord]] = []


@contextlib.contextmanager
def record_solves() -> Iterator[list[SolveRecord]]:
    """Collect a :class:`SolveRecord` for every triangular solve run inside the block.

    Example::

        >>> import torch, pyro.distributions as dist, pyro.distributions.transforms as T
        >>> t = T.affine_autoregressive(3)
        >>> q = dist.TransformedDistribution(dist.Normal(torch.zeros(3), 1.0).to_event(1), [t])
        >>> with record_solves() as recs:
        ...     _ = flow_grad(q, torch.randn(3))
        >>> recs[0].transform, recs[0].dim
        ('AffineAutoregressive', 3)
    """
    recs: list[SolveRecord] = []
    _RECORDS.append(recs)
    try:
        yield recs
    finally:
        _RECORDS.remove(recs)


# ----------------------------------------------------------------------------- layers
def _fresh(t):
    """A copy of ``t`` with its own caches (parameters and sub-modules shared)."""
    if isinstance(t, TT.IndependentTransform):
        return TT.IndependentTransform(_fresh(t.base_transform), t.reinterpreted_batch_ndims)
    t2 = copy.copy(t)
    for k, v in list(vars(t2).items()):  # methods bound to t (e.g. a stable IAF's _call)
        if inspect.ismethod(v) and v.__self__ is t:
            object.__setattr__(t2, k, types.MethodType(v.__func__, t2))
    if getattr(t2, "_cache_size", 0):
        object.__setattr__(t2, "_cached_x_y", (None, None))
    return t2


def _cache_matches(t, x) -> bool:
    if isinstance(t, TT.IndependentTransform):
        return _cache_matches(t.base_transform, x)
    if not getattr(t, "_cache_size", 0):
        return True
    return getattr(t, "_cached_x_y", (None, None))[0] is x


class FlowLayer:
    """What a rule sees of one layer ``y = T(x)``.

    :ivar transform: the transform.
    :ivar x: its input (detached).
    :ivar y: its output (detached).
    :ivar event_dim: ``transform.domain.event_dim``.

    :meth:`vjp` gives vector-Jacobian products with the parameters held fixed, through
    the graph the sample was drawn with; :attr:`evaluated` is a transform whose caches
    (``_cached_log_scale``, ...) belong to ``x`` (``transform`` itself, or a copy
    re-evaluated at a detached ``x`` when the graph cannot be used).
    """

    def __init__(self, transform, x: torch.Tensor, y: torch.Tensor, _handles=None):
        self.transform = transform
        self.x = x.detach()
        self.y = y.detach()
        self.event_dim = transform.domain.event_dim
        if _handles is not None:
            self._t, self._x, self._y = _handles
        elif x.requires_grad and y.requires_grad and _cache_matches(transform, x):
            self._t, self._x, self._y = transform, x, y
        else:
            t2 = _fresh(transform)
            xd = x.detach().requires_grad_()
            with torch.enable_grad():
                yd = t2(xd)
            self._t, self._x, self._y = t2, xd, yd
        self._ladj = None

    @property
    def evaluated(self):
        """The transform whose caches hold this layer's ``x``."""
        return self._t

    def _ladj_live(self) -> torch.Tensor:
        if self._ladj is None:
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
        (r,) = torch.autograd.grad(outs, [self._x], seeds, retain_graph=True, allow_unused=True)
        return torch.zeros_like(self.x) if r is None else r.detach()

    def sub(self, transform) -> FlowLayer:
        """The same layer seen as ``transform`` (e.g. an ``IndependentTransform``'s base)."""
        return FlowLayer(
            transform, self.x, self.y, _handles=(self._t.base_transform, self._x, self._y)
        )


# ----------------------------------------------------------------------------- registry
_RULES: dict[type, Callable[[FlowLayer, torch.Tensor], torch.Tensor]] = {}

#: ``(transform, rule, cost)`` of the built-in rules (the README's table).
RULES_TABLE: list[tuple[str, str, str]] = []


def register_flow_rule(*transform_types: type, rule: str = "", cost: str = ""):
    r"""Register ``fn(layer, g_x) -> g_y`` as the forward rule of ``transform_types`` (and subclasses).

    ``fn`` receives a :class:`FlowLayer` and :math:`g_x = \nabla_x \log q(x)` (detached,
    shaped like ``layer.x``) and returns
    :math:`g_y = J(x)^{-T}(g_x - \nabla_x \log|\det J(x)|)` shaped like ``layer.y``.
    A later registration for a class replaces an earlier one.

    Example (a user transform ``y = 2 x``)::

        >>> import torch
        >>> from torch.distributions.transforms import Transform
        >>> from torch.distributions import constraints
        >>> class Double(Transform):
        ...     domain = codomain = constraints.real
        ...     bijective = True
        ...     def _call(self, x): return 2 * x
        ...     def log_abs_det_jacobian(self, x, y): return torch.full_like(x, 0.6931471805599453)
        >>> @register_flow_rule(Double, rule="diagonal", cost="O(D)")
        ... def _double(layer, g):
        ...     return g / 2  # J = 2 I, log|det J| constant
        >>> flow_rule(Double()) is _double
        True
    """

    if not transform_types:
        raise TypeError(
            "register_flow_rule needs at least one transform class: "
            "@register_flow_rule(MyTransform, rule=..., cost=...)"
        )
    bad = [t for t in transform_types if not (isinstance(t, type) and issubclass(t, TT.Transform))]
    if bad:
        raise TypeError(
            f"register_flow_rule expects torch Transform classes, got {bad[0]!r}; pass the class "
            "itself: @register_flow_rule(MyTransform, rule=..., cost=...)"
        )

    def deco(fn):
        if not callable(fn):
            raise TypeError(f"register_flow_rule: the rule must be a function, got {fn!r}")
        for t in transform_types:
            _RULES[t] = fn
            if rule:
                RULES_TABLE.append((t.__name__, rule, cost))
        return fn

    return deco


def flow_rule(transform) -> Callable | None:
    """The rule registered for ``transform``'s class (nearest in its MRO), or None.

    An ``IndependentTransform`` has a rule when its base transform has one.
    """
    for cls in type(transform).__mro__:
        r = _RULES.get(cls)
        if r is not None:
            if r is _independent and flow_rule(transform.base_transform) is None:
                return None
            return r
    return None


# ----------------------------------------------------------------------------- built-in rules
def _attr(m, name):
    """``m.name`` without ``PyroModule.__getattr__`` (a param-store look-up per access)."""
    if isinstance(m, torch.nn.Module):
        d = m.__dict__
        for reg in ("_parameters", "_buffers", "_modules"):
            if name in d[reg]:
                return d[reg][name]
    return getattr(m, name)


def _params(t, names):
    """The (detached) parameters of a Planar/Radial transform: its own, or its conditioned ones."""
    if isinstance(t, torch.nn.Module) and all(n in t.__dict__["_parameters"] for n in names):
        p = tuple(_attr(t, n) for n in names)
    else:
        p = t._params() if callable(t._params) else t._params
    return tuple(v.detach() if torch.is_tensor(v) else v for v in p)


def _dot(a, b):
    return (a * b).sum(-1, keepdim=True)


@register_flow_rule(TT.IndependentTransform, rule="the base transform's rule", cost="base's")
def _independent(layer, g):
    base = layer.transform.base_transform
    return flow_rule(base)(layer.sub(base), g)


@register_flow_rule(TT.AffineTransform, rule="diagonal: g / scale", cost="O(D)")
def _affine(layer, g):
    s = layer.transform.scale
    return g / (s.detach() if torch.is_tensor(s) else s)


@register_flow_rule(TT.ExpTransform, rule="diagonal: (g - 1) / y", cost="O(D)")
def _exp(layer, g):
    return (g - 1) / layer.y


def _elementwise(layer, g):
    """Increasing elementwise ``y_i = f(x_i)``: ``J = diag(exp(ladj))``, one VJP through ladj."""
    return (g - layer.vjp()) * torch.exp(-layer.ladj)


def _pyro_elementwise():
    from pyro.distributions.transforms import ELUTransform, LeakyReLUTransform
    from pyro.distributions.transforms import SoftplusTransform as PyroSoftplus
    from pyro.distributions.transforms.spline import ConditionedSpline

    return [ConditionedSpline, ELUTransform, LeakyReLUTransform, PyroSoftplus]


register_flow_rule(
    TT.SigmoidTransform,
    TT.TanhTransform,
    TT.SoftplusTransform,
    *_pyro_elementwise(),
    rule="diagonal: (g - grad ladj) * exp(-ladj)",
    cost="O(D), one VJP through ladj",
)(_elementwise)


def _permute_types():
    from pyro.distributions.transforms import Permute

    return Permute


@register_flow_rule(_permute_types(), rule="permutation: g[perm]", cost="O(D)")
def _permute(layer, g):
    t = layer.transform
    return g.index_select(t.dim, t.permutation)


@register_flow_rule(TT.ReshapeTransform, rule="reshape g", cost="O(D)")
def _reshape(layer, g):
    return layer.transform._call(g)


def _lower_cholesky_affine():
    from pyro.distributions.transforms import LowerCholeskyAffine

    return LowerCholeskyAffine


@register_flow_rule(_lower_cholesky_affine(), rule="triangular solve L^T g_y = g", cost="O(D^2)")
def _lca(layer, g):
    L = layer.transform.scale_tril.detach()
    return torch.linalg.solve_triangular(L.mT, g.unsqueeze(-1), upper=True).squeeze(-1)


def _householder_types():
    from pyro.distributions.transforms.householder import ConditionedHouseholder

    return ConditionedHouseholder


@register_flow_rule(_householder_types(), rule="orthogonal: g_y = H g", cost="O(KD)")
def _householder(layer, g):
    from pyro.distributions.transforms.householder import ConditionedHouseholder

    with torch.no_grad():
        return ConditionedHouseholder._call(layer.transform, g)


def _planar_types():
    from pyro.distributions.transforms.planar import ConditionedPlanar

    return ConditionedPlanar


@register_flow_rule(_planar_types(), rule="Sherman-Morrison, closed form", cost="O(D)")
def _planar(layer, g):
    # y = x + u_hat tanh(w.x + b):  J = I + u_hat psi^T, psi = tanh'(a) w
    t = layer.transform
    with torch.no_grad():
        bias, u, w = _params(t, ("bias", "u", "w"))
        x = layer.x
        act = torch.tanh(_dot(w, x) + bias)
        dact = 1 - act * act
        uh = t.u_hat(u, w)
        wu = _dot(w, uh)
        den = 1 + dact * wu  # det J
        r = g - (-2 * act * dact * wu / den) * w  # g - grad log|det J|
        psi = dact * w
        return r - psi * _dot(uh, r) / den


def _radial_types():
    from pyro.distributions.transforms.radial import ConditionedRadial

    return ConditionedRadial


@register_flow_rule(_radial_types(), rule="Sherman-Morrison, closed form", cost="O(D)")
def _radial(layer, g):
    # y = x + beta h(r) z, z = x - x0: J = a I + c z z^T (symmetric), a = 1 + beta h,
    # c = beta h'(r) / r
    t = layer.transform
    r_ = g - layer.vjp()
    with torch.no_grad():
        x0, alpha_prime, beta_prime = _params(t, ("x0", "alpha_prime", "beta_prime"))
        alpha = F.softplus(alpha_prime)
        beta = -alpha + F.softplus(beta_prime)
        z = layer.x - x0
        r = z.norm(dim=-1, keepdim=True)
        h = 1 / (alpha + r)
        a = 1 + beta * h
        c = -beta * h * h / r
        return (r_ - c * z * _dot(z, r_) / (a + c * r * r)) / a


def _sylvester_types():
    from pyro.distributions.transforms import Sylvester

    return Sylvester


@register_flow_rule(_sylvester_types(), rule="Woodbury: one batched DxD solve", cost="O(D^3)")
def _sylvester(layer, g):
    # Pyro's (row-vector) form y = x + tanh(x B + b) A, A = Q R, B = S Q^T:
    # J^T g = g + B (tanh'(pre) * (A g))
    t = layer.transform
    r_ = g - layer.vjp()
    with torch.no_grad():
        x = layer.x
        u = _attr(t, "u_unnormed")
        u = u / torch.linalg.norm(u, ord=2, dim=-1, keepdim=True)
        eye = torch.eye(x.size(-1), dtype=x.dtype, device=x.device)
        Q = eye - 2.0 * torch.outer(u[0], u[0])
        for k in range(1, u.size(-2)):
            Q = Q @ (eye - 2.0 * torch.outer(u[k], u[k]))
        mask = _attr(t, "triangular_mask")
        R = _attr(t, "R_dense") * mask + torch.diag(torch.tanh(_attr(t, "R_diag")))
        S = _attr(t, "S_dense") * mask + torch.diag(torch.tanh(_attr(t, "S_diag")))
        A = Q @ R
        B = S @ Q.t()
        dact = 1 - torch.tanh(x @ B + _attr(t, "b")).pow(2)
        M = (B * dact.unsqueeze(-2)) @ A
        M = M + torch.eye(M.size(-1), dtype=M.dtype, device=M.device)
        return torch.linalg.solve(M, r_.unsqueeze(-1)).squeeze(-1)


def _coupling_types():
    from pyro.distributions.transforms import AffineCoupling

    return AffineCoupling


@register_flow_rule(_coupling_types(), rule="coupling: closed form + one VJP", cost="one VJP")
def _affine_coupling(layer, g):
    # y1 = x1, y2 = exp(s(x1)) x2 + m(x1): g_y2 = g_x2 exp(-s), g_y1 = g_x1 - d/dx1[ladj + <g_y2, y2>]
    t = layer.transform
    d, k = t.dim, t.split_dim
    log_scale = layer.evaluated._cached_log_scale.detach()
    g1, g2 = g.split([k, g.size(d) - k], dim=d)
    gy2 = g2 * torch.exp(-log_scale)
    v = layer.vjp(torch.cat([torch.zeros_like(g1), gy2], dim=d))
    return torch.cat([g1 - v.narrow(d, 0, k), gy2], dim=d)


def triangular_solve(
    layer: FlowLayer,
    g: torch.Tensor,
    log_diag: torch.Tensor,
    depth: int | None = None,
    slack: int = 0,
    F: Callable[[torch.Tensor | None], torch.Tensor] | None = None,
) -> torch.Tensor:
    r"""Solve :math:`J^T g_y = g - \nabla_x \log|\det J|` for a triangular :math:`J` (any variable order).

    The fixed-point iteration :math:`g_y \leftarrow g_y + \operatorname{diag}(J)^{-1}
    (g - \nabla_x \log|\det J| - J^T g_y)`, from :math:`g_y = 0`, takes one
    :meth:`FlowLayer.vjp` per iteration and is exact after :math:`D` iterations (the
    strictly triangular part is nilpotent). It stops when the update is below the
    relative tolerance of :func:`solve_settings`, or after exactly ``depth``
    iterations when the nilpotency index is known (coupling layers: 2).

    :param log_diag: :math:`\log \operatorname{diag}(J)`, shaped like ``g``. Only the speed
        depends on it (the fixed point does not); ``slack`` extra iterations are allowed
        when it is approximate.
    :param F: optional ``F(g) = J^T g + grad log|det J|`` (``F(None)``: the gradient alone);
        default :meth:`FlowLayer.vjp`.
    :raises FlowSolveError: if not converged within ``max_iter`` iterations (default
        :math:`D`, plus ``slack``), or on a non-finite residual.

    Example::

        >>> import torch, pyro.distributions as dist, pyro.distributions.transforms as T
        >>> t = T.affine_autoregressive(4)
        >>> x = torch.randn(4); y = t(x)
        >>> layer = FlowLayer(t, x, y)
        >>> gy = triangular_solve(layer, -x, layer.evaluated._cached_log_scale.detach())
        >>> gy.shape
        torch.Size([4])
    """
    if F is None:
        F = layer.vjp
    inv_diag = torch.exp(-log_diag)
    e = max(layer.event_dim, 1)
    n = 1
    for s in g.shape[g.dim() - e :]:
        n *= s
    gy = (g - F(None)) * inv_diag
    it = 1
    if depth is not None:
        for _ in range(depth - 1):
            gy = gy + (g - F(gy)) * inv_diag
        return gy
    rtol = _rtol(g.dtype)
    floor = torch.finfo(g.dtype).eps ** 0.5
    limit = _SETTINGS.max_iter or n + slack
    tiny = torch.finfo(g.dtype).tiny
    residual, prev = float("inf"), float("inf")
    while True:
        delta = (g - F(gy)).mul_(inv_diag)
        gy = gy + delta
        it += 1
        if e > 1:
            dn = delta.reshape(delta.shape[: delta.dim() - e] + (-1,)).abs().amax(-1)
            gn = gy.reshape(gy.shape[: gy.dim() - e] + (-1,)).abs().amax(-1)
        else:
            dn, gn = delta.abs().amax(-1), gy.abs().amax(-1)
        residual = (dn / gn.clamp_min(tiny)).max().item()  # per sample, the worst
        if residual <= rtol:
            break
        if residual <= floor and residual > 0.5 * prev:  # stalled at the round-off floor
            break
        if residual != residual or it >= limit:
            if residual == residual and slack == 0 and it >= n and not _SETTINGS.max_iter:
                break  # exact after D iterations (nilpotent): the rest is round-off
            raise FlowSolveError(
                f"the triangular solve of the forward-carried pathwise gradient through "
                f"{type(layer.transform).__name__} (D={n}) did not converge in {it} "
                f"iterations: relative residual {residual:.3g} > rtol {rtol:.3g}. Loosen it "
                "with pyro_gradroute.distributions.flows.solve_settings(rtol=...) (or "
                "max_iter=...), or use an estimator that does not split this site "
                "(Trace_ELBO)."
            )
        prev = residual
    for recs in _RECORDS:
        recs.append(SolveRecord(type(layer.transform).__name__, n, it, residual))
    return gy


def _autoregressive_types():
    from pyro.distributions.transforms import AffineAutoregressive

    return AffineAutoregressive


@register_flow_rule(
    _autoregressive_types(),
    rule="triangular fixed-point iteration, diag = exp(log_scale)",
    cost="k VJPs, k <= D (tolerance)",
)
def _affine_autoregressive(layer, g):
    return triangular_solve(
        layer, g, layer.evaluated._cached_log_scale.detach(), F=_made_products(layer)
    )


def _made_products(layer):
    r"""``F(g) = J^T g + grad ladj`` of an IAF over Pyro's ``AutoRegressiveNN`` with plain matmuls.

    The network is re-run once on the detached input (keeping its pre-activations);
    each product is then one masked matmul per layer, with no autograd call. None
    (use :meth:`FlowLayer.vjp`) for other networks.
    """
    from pyro.nn import AutoRegressiveNN

    t = layer.transform
    arn = _attr(t, "arn")
    if not isinstance(arn, AutoRegressiveNN) or type(arn).forward is not AutoRegressiveNN.forward:
        return None
    if arn.output_multiplier != 2 or not arn.all_ones:
        return None
    f = _attr(arn, "f")
    relu = isinstance(f, torch.nn.ReLU)
    layers = list(_attr(arn, "layers"))
    x = layer.x
    with torch.no_grad():
        weights = [_attr(lay, "weight") * _attr(lay, "mask") for lay in layers]
        biases = [_attr(lay, "bias") for lay in layers]
        sk = _attr(arn, "skip_layer")
        skip = None if sk is None else _attr(sk, "weight") * _attr(sk, "mask")
        h, dacts = x, []
        for b, w in zip(biases[:-1], weights[:-1]):
            a = torch.nn.functional.linear(h, w, b)
            if relu:
                dacts.append((a > 0).to(a.dtype))
                h = f(a)
            else:
                with torch.enable_grad():
                    aa = a.detach().requires_grad_()
                    ha = f(aa)
                    (d,) = torch.autograd.grad(ha, aa, torch.ones_like(ha))
                dacts.append(d)
                h = ha.detach()
        out = torch.nn.functional.linear(h, weights[-1], biases[-1])
        if skip is not None:
            out = out + torch.nn.functional.linear(x, skip)
        mean, raw = out.reshape(out.shape[:-1] + (2, x.size(-1))).unbind(-2)
        if t.stable:
            sig = torch.sigmoid(raw + t.sigmoid_bias)
            c_mean, c_lin, c_ladj = 1 - sig, sig * (1 - sig) * (x - mean), 1 - sig
        else:
            sig = torch.exp(raw.clamp(t.log_scale_min_clip, t.log_scale_max_clip))
            c_mean, c_lin, c_ladj = torch.ones_like(x), sig * x, torch.ones_like(x)
        # seeds of the network's outputs (mean, raw log-scale): g * coef + const
        coef = torch.cat([c_mean, c_lin], dim=-1)
        const = torch.cat([torch.zeros_like(x), c_ladj], dim=-1)

    def arn_vjp(s_out):
        v = s_out @ weights[-1]
        for w, d in zip(reversed(weights[:-1]), reversed(dacts)):
            v = (v * d) @ w
        if skip is not None:
            v = v + s_out @ skip
        return v

    def F(gy):
        with torch.no_grad():
            if gy is None:
                return arn_vjp(const)
            v = arn_vjp(torch.addcmul(const, torch.cat([gy, gy], dim=-1), coef))
            return v.addcmul_(sig, gy)

    return F


def _spline_ar_types():
    from pyro.distributions.transforms import SplineAutoregressive

    return SplineAutoregressive


@register_flow_rule(
    _spline_ar_types(),
    rule="triangular fixed-point iteration, diag = spline derivative",
    cost="k VJPs, k <= D (tolerance)",
)
def _spline_autoregressive(layer, g):
    return triangular_solve(layer, g, layer.evaluated._cache_log_detJ.detach())


def _spline_coupling_types():
    from pyro.distributions.transforms import SplineCoupling

    return SplineCoupling


@register_flow_rule(
    _spline_coupling_types(), rule="block-triangular: two iterations", cost="two VJPs"
)
def _spline_coupling(layer, g):
    t = layer.transform
    k = t.split_dim
    cache = layer.evaluated._cache_log_detJ.detach()  # [upper (x2) ..., lower (x1) ...]
    n2 = g.size(-1) - k
    if t.identity:
        log_diag = torch.cat([torch.zeros_like(g[..., :k]), cache], dim=-1)
    else:
        log_diag = torch.cat([cache[..., n2:], cache[..., :n2]], dim=-1)
    return triangular_solve(layer, g, log_diag, depth=2)


def _naf_types():
    from pyro.distributions.transforms import NeuralAutoregressive

    return NeuralAutoregressive


@register_flow_rule(
    _naf_types(),
    rule="triangular fixed-point iteration, diag from the cached DSF terms",
    cost="k VJPs, k <= D (tolerance)",
)
def _naf(layer, g):
    t = layer.evaluated
    with torch.no_grad():
        log_diag = t._cached_log_df_inv_dx + torch.logsumexp(
            torch.log(t._cached_A + t.eps)
            + t.logsoftmax(t._cached_W_pre)
            + t.T.log_abs_det_jacobian(t._cached_C, t._cached_T_C),
            dim=-2,
        )
    return triangular_solve(layer, g, log_diag)


def _bnaf_types():
    from pyro.distributions.transforms import BlockAutoregressive

    return BlockAutoregressive


@register_flow_rule(
    _bnaf_types(),
    rule="triangular fixed-point iteration, diag = cached log-diagonal",
    cost="k VJPs, k <= D (tolerance)",
)
def _bnaf(layer, g):
    # Pyro's cached log-diagonal is off by ~1e-8 (an epsilon): a few more iterations
    return triangular_solve(
        layer, g, layer.evaluated._cached_logDetJ.detach(), slack=layer.x.size(-1)
    )


# ----------------------------------------------------------------------------- paths
def _flatten(transforms) -> list:
    out = []
    for t in transforms:
        if isinstance(t, TT.ComposeTransform):
            out.extend(_flatten(t.parts))
        else:
            out.append(t)
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
        spans, i = [], 0
        for t in fn.transforms:
            n = len(_flatten([t]))
            spans.append((i, i + n))
            i += n
        self.spans = spans
        self._base_lp = None

    @property
    def target(self) -> torch.Tensor:
        return self.xs[self.k]

    @property
    def value(self) -> torch.Tensor:
        return self.xs[-1]

    def log_prob(self) -> torch.Tensor:
        """``fn.log_prob(y)`` from the path (the same operations as with the transforms' caches)."""
        fn = self.fn
        event_dim = len(fn.event_shape)
        lp: torch.Tensor | float = 0.0
        for t, (a, b) in zip(reversed(fn.transforms), reversed(self.spans)):
            event_dim += t.domain.event_dim - t.codomain.event_dim
            ladj = t.log_abs_det_jacobian(self.xs[a], self.xs[b])
            lp = lp - _sum_rightmost(ladj, event_dim - t.domain.event_dim)
        self._base_lp = fn.base_dist.log_prob(self.xs[0])
        return lp + _sum_rightmost(self._base_lp, event_dim - len(fn.base_dist.event_shape))

    def base_grad(self) -> torch.Tensor:
        r""":math:`\nabla_{x_0} \log q_0(x_0)` with the parameters held fixed."""
        x0 = self.xs[0]
        if x0.requires_grad and self._base_lp is not None and self._base_lp.requires_grad:
            lp, x = self._base_lp, x0
        else:
            x = x0.detach().requires_grad_()
            with torch.enable_grad():
                lp = self.fn.base_dist.log_prob(x)
        (g,) = torch.autograd.grad(lp, [x], torch.ones_like(lp), retain_graph=True)
        return g.detach()

    def carry(self, g: torch.Tensor, stop: int) -> torch.Tensor:
        """Apply the rules of leaves ``0 .. stop-1`` to ``g`` (the gradient at ``x_0``)."""
        for i in range(stop):
            t = self.leaves[i]
            rule = flow_rule(t)
            if rule is None:
                raise NotImplementedError(f"no forward pathwise rule for {type(t).__name__}")
            g = rule(FlowLayer(t, self.xs[i], self.xs[i + 1]), g)
        return g

    def target_grad(self) -> torch.Tensor:
        r""":math:`\nabla_{x_k} \log q(T_{>k}(x_k))`, parameters held fixed (forward-carried)."""
        g = self.carry(self.base_grad(), self.k)
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
            (d,) = torch.autograd.grad(s, [x], retain_graph=True, allow_unused=True)
            if d is not None:
                g = g - d.detach()
        return g


def _holds_params(obj, seen: set) -> bool:
    """Whether ``obj`` holds, or computes from, a tensor that requires grad."""
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if torch.is_tensor(obj):
        return obj.requires_grad
    if isinstance(obj, torch.nn.Module):
        if any(True for _ in obj.parameters()):
            return True
        return any(
            _holds_params(v, seen)
            for k, v in vars(obj).items()
            if k not in ("_parameters", "_buffers", "_modules")
        ) or any(_holds_params(m, seen) for m in obj._modules.values())
    if isinstance(obj, TT.Transform):
        return any(_holds_params(v, seen) for v in vars(obj).values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_params(v, seen) for v in obj)
    if isinstance(obj, dict):
        return any(_holds_params(v, seen) for v in obj.values())
    import functools

    if isinstance(obj, functools.partial):
        return (
            _holds_params(obj.func, seen)
            or any(_holds_params(a, seen) for a in obj.args)
            or any(_holds_params(a, seen) for a in obj.keywords.values())
        )
    if inspect.ismethod(obj):
        return _holds_params(obj.__self__, seen)
    return False


def holds_params(t) -> bool:
    """Whether a transform holds parameters, or tensors computed from them (conditioned flows)."""
    return _holds_params(t, set())


def _split_index(leaves) -> int:
    k = 0
    for i, t in enumerate(leaves):
        if holds_params(t):
            k = i + 1
    return k


def supported(fn: TransformedDistribution) -> bool:
    """Whether every transform up to the last parametrized one has a rule (and one has parameters)."""
    leaves = _flatten(fn.transforms)
    k = _split_index(leaves)
    return k > 0 and all(flow_rule(t) is not None for t in leaves[:k])


class _Anchor(torch.autograd.Function):
    """Identity whose output requires grad: a graph to VJP through from a sample with no parameters."""

    @staticmethod
    def forward(ctx, x, dummy):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return None, None


def forward_path(fn: TransformedDistribution, sample_shape=_EMPTY) -> FlowPath:
    """``fn.rsample(sample_shape)``, recording the path (the same operations).

    A base sample that does not require grad is passed through an identity node whose
    output does, so that the first layer's VJPs can run through the sampling graph.
    """
    x = fn.base_dist.rsample(sample_shape)
    if not x.requires_grad and torch.is_grad_enabled():
        x = _Anchor.apply(x, x.new_zeros(()).requires_grad_())
    xs = [x]
    for t in _flatten(fn.transforms):
        xs.append(t(xs[-1]))
    _set_compose_caches(fn.transforms, xs, 0)
    return FlowPath(fn, xs, _split_index(_flatten(fn.transforms)))


def _set_compose_caches(transforms, xs, i) -> int:
    for t in transforms:
        n = len(_flatten([t]))
        if isinstance(t, TT.ComposeTransform):
            _set_compose_caches(t.parts, xs, i)
            if getattr(t, "_cache_size", 0) == 1:
                t._cached_x_y = (xs[i], xs[i + n])
        i += n
    return i


def cached_path(fn: TransformedDistribution, value: torch.Tensor) -> FlowPath | None:
    """The path of ``value`` recovered from the transforms' caches (``fn.rsample()``'s output), or None."""
    leaves = _flatten(fn.transforms)
    xs = [value]
    for t in reversed(leaves):
        c = t.base_transform if isinstance(t, TT.IndependentTransform) else t
        if not getattr(c, "_cache_size", 0):
            return None
        cx, cy = getattr(c, "_cached_x_y", (None, None))
        if cy is not xs[-1] or cx is None:
            return None
        xs.append(cx)
    return FlowPath(fn, xs[::-1], _split_index(leaves))


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
    path = FlowPath(fn, xs, len(xs) - 1)
    return xs[-1].detach(), path.carry(path.base_grad(), len(path.leaves))


def evaluate(path: FlowPath, grad_mode: bool):
    """``(log_prob, g, score)`` of a path: the value, the forward-carried gradient at the target
    (None without grad mode) and the score part ``log q(stop(y); phi)``."""
    lp = path.log_prob()
    if not grad_mode:
        return lp, None, lp
    g = path.target_grad()
    target = path.target
    pad = target.dim() - lp.dim()
    s = g * target
    if pad > 0:
        s = s.reshape(s.shape[: s.dim() - pad] + (-1,)).sum(-1)
    score = lp - s + s.detach()
    return lp, g, score
