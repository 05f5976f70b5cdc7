r"""Triangular Jacobians (autoregressive layers): the fixed-point solve (:func:`triangular_solve`)
and its rules."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator

import pyro.distributions.transforms as PT
import torch
from pyro.nn import AutoRegressiveNN

from ..._compat import (
    cached_log_det_jacobian,
    cached_log_scale,
    module_attr,
    naf_cache,
    spline_log_derivative,
)
from ..._validation import check_float, check_int
from .path import FlowLayer
from .rules import mlp_vjp, register_flow_rule


class FlowSolveError(ValueError):
    """The triangular fixed-point iteration of an autoregressive layer did not converge."""


@dataclasses.dataclass
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
    rtol = check_float(rtol, "rtol", "solve_settings", low=0.0, high=1.0, high_open=True,
                       allow_none=True)  # fmt: skip
    max_iter = check_int(max_iter, "max_iter", "solve_settings", minimum=1, allow_none=True)
    old = dataclasses.replace(_SETTINGS)
    if rtol is not None:
        _SETTINGS.rtol = rtol
    if max_iter is not None:
        _SETTINGS.max_iter = max_iter
    try:
        yield
    finally:
        _SETTINGS.rtol, _SETTINGS.max_iter = old.rtol, old.max_iter


@dataclasses.dataclass(frozen=True)
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
        >>> from pyro_gradroute.distributions.flows import flow_grad
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
    (g - \nabla_x \log|\det J| - J^T g_y)`, from :math:`g_y = 0`, one :meth:`FlowLayer.vjp`
    per iteration, exact after :math:`D` iterations (the strictly triangular part is
    nilpotent), stops at the tolerance of :func:`solve_settings`, or after ``depth``
    iterations when the nilpotency index is known (coupling layers: 2).

    :param log_diag: :math:`\log \operatorname{diag}(J)`, shaped like ``g`` (only the speed
        depends on it; ``slack`` extra iterations are allowed when it is approximate).
    :param F: optional ``F(g) = J^T g + grad log|det J|`` (``F(None)``: the gradient alone);
        default :meth:`FlowLayer.vjp`.
    :raises FlowSolveError: if not converged within ``max_iter`` iterations (default
        :math:`D`, plus ``slack``), or on a non-finite residual.

    Example::

        >>> import pyro.distributions.transforms as T
        >>> from pyro_gradroute._compat import cached_log_scale
        >>> t = T.affine_autoregressive(4)
        >>> x = torch.randn(4); y = t(x)
        >>> layer = FlowLayer(t, x, y)
        >>> gy = triangular_solve(layer, -x, cached_log_scale(layer.evaluated).detach())
        >>> gy.shape
        torch.Size([4])
    """
    if F is None:
        F = layer.vjp
    inv_diag = torch.exp(-log_diag)
    e = max(layer.event_dim, 1)
    n = math.prod(g.shape[g.dim() - e :])
    gy = (g - F(None)) * inv_diag
    it = 1
    if depth is not None:
        for _ in range(depth - 1):
            gy = gy + (g - F(gy)) * inv_diag
        return gy
    rtol = _SETTINGS.rtol
    if rtol is None:
        rtol = 1e-12 if g.dtype == torch.float64 else 1e-6
    floor = torch.finfo(g.dtype).eps ** 0.5
    limit = _SETTINGS.max_iter or n + slack
    tiny = torch.finfo(g.dtype).tiny
    residual, prev = float("inf"), float("inf")
    while True:
        delta = (g - F(gy)).mul_(inv_diag)
        gy = gy + delta
        it += 1
        dn, gn = delta.flatten(-e).abs().amax(-1), gy.flatten(-e).abs().amax(-1)
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


_ITERATION = "triangular fixed-point iteration, diag = "
_K_VJPS = "k VJPs, k <= D (tolerance)"


@register_flow_rule(PT.AffineAutoregressive, rule=_ITERATION + "exp(log_scale)", cost=_K_VJPS)
def _affine_autoregressive(layer, g):
    log_diag = cached_log_scale(layer.evaluated).detach()
    return triangular_solve(layer, g, log_diag, F=_made_products(layer))


def _made_products(layer):
    r"""``F(g) = J^T g + grad ladj`` of an IAF over Pyro's ``AutoRegressiveNN``, as one masked
    matmul per layer (no autograd call); None (use :meth:`FlowLayer.vjp`) for other networks."""
    t = layer.transform
    arn = module_attr(t, "arn")
    if not isinstance(arn, AutoRegressiveNN) or type(arn).forward is not AutoRegressiveNN.forward:
        return None
    if arn.output_multiplier != 2 or not arn.all_ones:
        return None
    layers = list(module_attr(arn, "layers"))
    x = layer.x
    with torch.no_grad():
        weights = [module_attr(lay, "weight") * module_attr(lay, "mask") for lay in layers]
        sk = module_attr(arn, "skip_layer")
        skip = None if sk is None else module_attr(sk, "weight") * module_attr(sk, "mask")
    biases = [module_attr(lay, "bias") for lay in layers]
    out, arn_vjp = mlp_vjp(x, weights, biases, module_attr(arn, "f"), skip)
    with torch.no_grad():
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

    def F(gy):
        with torch.no_grad():
            if gy is None:
                return arn_vjp(const)
            v = arn_vjp(torch.addcmul(const, torch.cat([gy, gy], dim=-1), coef))
            return v.addcmul_(sig, gy)

    return F


@register_flow_rule(PT.SplineAutoregressive, rule=_ITERATION + "spline derivative", cost=_K_VJPS)
def _spline_autoregressive(layer, g):
    return triangular_solve(layer, g, spline_log_derivative(layer.evaluated).detach())


@register_flow_rule(PT.SplineCoupling, rule="block-triangular: two iterations", cost="two VJPs")
def _spline_coupling(layer, g):
    t = layer.transform
    k = t.split_dim
    cache = spline_log_derivative(layer.evaluated).detach()  # [upper (x2) ..., lower (x1) ...]
    n2 = g.size(-1) - k
    if t.identity:
        log_diag = torch.cat([torch.zeros_like(g[..., :k]), cache], dim=-1)
    else:
        log_diag = torch.cat([cache[..., n2:], cache[..., :n2]], dim=-1)
    return triangular_solve(layer, g, log_diag, depth=2)


@register_flow_rule(PT.NeuralAutoregressive, rule=_ITERATION + "cached DSF terms", cost=_K_VJPS)
def _naf(layer, g):
    return triangular_solve(layer, g, naf_log_diag(layer.evaluated))


def naf_log_diag(t) -> torch.Tensor:
    """``log diag J`` of a ``NeuralAutoregressive`` layer from its last call's cached DSF terms."""
    log_df_inv_dx, A, W_pre, C, T_C = naf_cache(t)
    with torch.no_grad():
        return log_df_inv_dx + torch.logsumexp(
            torch.log(A + t.eps) + t.logsoftmax(W_pre) + t.T.log_abs_det_jacobian(C, T_C), dim=-2
        )


@register_flow_rule(PT.BlockAutoregressive, rule=_ITERATION + "cached log-diagonal", cost=_K_VJPS)
def _bnaf(layer, g):
    # Pyro's cached log-diagonal is off by ~1e-8 (an epsilon): a few more iterations
    log_diag = cached_log_det_jacobian(layer.evaluated).detach()
    return triangular_solve(layer, g, log_diag, slack=layer.x.size(-1))
