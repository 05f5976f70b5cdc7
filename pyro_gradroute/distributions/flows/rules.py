r"""The rule registry (:func:`register_flow_rule`), and the closed-form rules: elementwise,
orthogonal, low-rank, coupling (:data:`RULES_TABLE` lists the built-in ones)."""

from __future__ import annotations

from collections.abc import Callable

import pyro.distributions.transforms as PT
import torch
import torch.nn.functional as F
from pyro.distributions.transforms.householder import ConditionedHouseholder
from pyro.distributions.transforms.planar import ConditionedPlanar
from pyro.distributions.transforms.radial import ConditionedRadial
from pyro.distributions.transforms.spline import ConditionedSpline
from pyro.nn import DenseNN
from torch.distributions import transforms as TT

from ..._compat import (
    cached_log_scale,
    conditioned_params,
    default_dense_forward,
    module_attr,
    transform_call,
)

_RULES: dict[type, Callable] = {}

#: ``(transform, rule, cost)`` of the built-in rules (the README's table).
RULES_TABLE: list[tuple[str, str, str]] = []


def register_flow_rule(*transform_types: type, rule: str = "", cost: str = ""):
    r"""Register ``fn(layer, g_x) -> g_y`` as the forward rule of ``transform_types`` (and subclasses).

    ``fn`` receives a :class:`~pyro_gradroute.distributions.flows.FlowLayer` and
    :math:`g_x = \nabla_x \log q(x)` (detached, shaped like ``layer.x``) and returns
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


def _params(t, names):
    """The (detached) parameters of a Planar/Radial transform: its own, or its conditioned ones."""
    if isinstance(t, torch.nn.Module):
        p = tuple(module_attr(t, n) for n in names)
    else:
        p = conditioned_params(t)
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


@register_flow_rule(
    TT.ExpTransform,
    TT.SigmoidTransform,
    TT.TanhTransform,
    TT.SoftplusTransform,
    ConditionedSpline,
    PT.ELUTransform,
    PT.LeakyReLUTransform,
    PT.SoftplusTransform,
    rule="diagonal: (g - grad ladj) * exp(-ladj)",
    cost="O(D), one VJP through ladj",
)
def _elementwise(layer, g):
    """Increasing elementwise ``y_i = f(x_i)``: ``J = diag(exp(ladj))``, one VJP through ladj."""
    return (g - layer.vjp()) * torch.exp(-layer.ladj)


@register_flow_rule(PT.Permute, rule="permutation: g[perm]", cost="O(D)")
def _permute(layer, g):
    t = layer.transform
    return g.index_select(t.dim, t.permutation)


@register_flow_rule(TT.ReshapeTransform, rule="reshape g", cost="O(D)")
def _reshape(layer, g):
    return transform_call(layer.transform, g)


@register_flow_rule(PT.LowerCholeskyAffine, rule="triangular solve L^T g_y = g", cost="O(D^2)")
def _lca(layer, g):
    L = layer.transform.scale_tril.detach()
    return torch.linalg.solve_triangular(L.mT, g.unsqueeze(-1), upper=True).squeeze(-1)


@register_flow_rule(ConditionedHouseholder, rule="orthogonal: g_y = H g", cost="O(KD)")
def _householder(layer, g):
    with torch.no_grad():
        return transform_call(layer.transform, g, ConditionedHouseholder)


@register_flow_rule(ConditionedPlanar, rule="Sherman-Morrison, closed form", cost="O(D)")
def _planar(layer, g):
    # y = x + u_hat tanh(w.x + b):  J = I + u_hat psi^T, psi = tanh'(a) w, det J = 1 + psi.u_hat
    t = layer.transform
    with torch.no_grad():
        bias, u, w = _params(t, ("bias", "u", "w"))
        act = torch.tanh(_dot(w, layer.x) + bias)
        dact = 1 - act * act
        uh = t.u_hat(u, w)
        wu = _dot(w, uh)
        den = 1 + dact * wu
        # g - grad log|det J| = g + (2 act dact wu / den) w;  then Sherman-Morrison
        r = torch.addcmul(g, 2 * act * dact * wu / den, w)
        return r - (dact * _dot(uh, r) / den) * w


@register_flow_rule(ConditionedRadial, rule="Sherman-Morrison, closed form", cost="O(D)")
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


@register_flow_rule(PT.Sylvester, rule="Woodbury: one batched DxD solve", cost="O(D^3)")
def _sylvester(layer, g):
    # Pyro's row-vector form y = x + tanh(x B + b) A, A = Q R, B = S Q^T, Q = H_1 ... H_K:
    # dy/dx = I + B diag(tanh') A; Pyro's log|det J| = sum log1p(tanh' diag(R) diag(S) + 1e-8)
    names = ("u_unnormed", "R_dense", "R_diag", "S_dense", "S_diag", "triangular_mask", "b")
    u, R, rd, S, sd, mask, b = (module_attr(layer.transform, n).detach() for n in names)
    with torch.no_grad():
        rd, sd = torch.tanh(rd), torch.tanh(sd)
        A = torch.diagonal_scatter(R * mask, rd)  # R, then Q R
        B = torch.diagonal_scatter(S * mask, sd)  # S, then S Q^T
        u = u / torch.linalg.norm(u, ord=2, dim=-1, keepdim=True)
        for k in range(u.size(-2) - 1, -1, -1):  # H v = v - 2 u (u.v): O(D^2) each
            A = torch.addr(A, u[k], u[k] @ A, alpha=-2.0)
            B = torch.addr(B, B @ u[k], u[k], alpha=-2.0)
        th = torch.tanh(layer.x @ B + b)
        dact = 1 - th * th
        rs = rd * sd
        # g - grad log|det J| = g + B (2 th dact rs / (1 + dact rs + 1e-8))
        r = g + (2 * th * dact * rs / (1 + dact * rs + 1e-8)) @ B.mT
        # M g_y = r, M = I + B diag(tanh') A: g_y = r - B u with (I + diag(tanh') A B) u =
        # diag(tanh') A r; A B once per layer, then O(D^2) per sample to form the system.
        # Kt = (I + diag(tanh') A B)^T, so that Kt.mT is laid out as LAPACK takes it
        Kt = (A @ B).mT.contiguous() * dact.unsqueeze(-2)
        Kt.diagonal(dim1=-2, dim2=-1).add_(1)
        u = torch.linalg.solve(Kt.mT, (dact * (r @ A.mT)).unsqueeze(-1)).squeeze(-1)
        return r - u @ B.mT


def mlp_vjp(x: torch.Tensor, weights: list, biases: list, f, skip=None, out: bool = True):
    r"""``(out, vjp)`` of the network ``out = W_n f(\dots f(W_1 x + b_1) \dots) + b_n`` (``+ S x``).

    ``vjp(s)`` is :math:`\partial \langle s, \text{out} \rangle / \partial x` with the
    parameters held fixed, as plain matmuls over the activations' derivatives kept by one
    forward run. ``out=False``: the last layer is not run (``out`` is None).

    Example::

        >>> import torch
        >>> lin1, lin2 = torch.nn.Linear(3, 5), torch.nn.Linear(5, 2)
        >>> x, s = torch.randn(4, 3), torch.randn(4, 2)
        >>> out, vjp = mlp_vjp(x, [lin1.weight, lin2.weight], [lin1.bias, lin2.bias], torch.nn.ReLU())
        >>> xx = x.clone().requires_grad_()
        >>> (ref,) = torch.autograd.grad((lin2(torch.relu(lin1(xx))) * s).sum(), xx)
        >>> torch.allclose(vjp(s), ref)
        True
    """
    relu = isinstance(f, torch.nn.ReLU)
    last = len(weights) - 1
    with torch.no_grad():
        h, dacts = x, []
        for i, (b, w) in enumerate(zip(biases[:-1], weights[:-1])):
            a = F.linear(h, w, b)
            if relu:
                dacts.append((a > 0).to(a.dtype))
                if out or i + 1 < last:
                    h = torch.relu(a)
            else:
                with torch.enable_grad():
                    aa = a.detach().requires_grad_()
                    ha = f(aa)
                    (d,) = torch.autograd.grad(ha, aa, torch.ones_like(ha))
                dacts.append(d)
                h = ha.detach()
        if out:
            out = F.linear(h, weights[-1], biases[-1])
            if skip is not None:
                out = out + F.linear(x, skip)

    def vjp(s: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            v = s @ weights[-1]
            for w, d in zip(reversed(weights[:-1]), reversed(dacts)):
                v = (v * d) @ w
            return v if skip is None else v + s @ skip

    return (out if out is not False else None), vjp


def _dense_net(t, k: int, n: int):
    """``(weights, biases, f)`` of an ``AffineCoupling``'s Pyro ``DenseNN`` (mean and log-scale
    from ``x[..., :k]``, ``n`` each), or None for any other conditioner."""
    net = module_attr(t, "nn")
    if (
        not isinstance(net, DenseNN)
        or type(net).forward is not DenseNN.forward
        or not default_dense_forward(net)
        or t.dim != -1
        or list(net.param_dims) != [n, n]
    ):
        return None
    layers = list(module_attr(net, "layers"))
    weights = [module_attr(lay, "weight") for lay in layers]
    return weights, [module_attr(lay, "bias") for lay in layers], module_attr(net, "f")


@register_flow_rule(
    PT.AffineCoupling,
    rule="coupling: closed form + one VJP",
    cost="one VJP (plain matmuls over Pyro's DenseNN)",
)
def _affine_coupling(layer, g):
    # y1 = x1, y2 = exp(s(x1)) x2 + m(x1): g_y2 = g_x2 exp(-s), g_y1 = g_x1 - d/dx1[ladj + <g_y2, y2>]
    t = layer.transform
    d, k = t.dim, t.split_dim
    n = g.size(d) - k
    log_scale = cached_log_scale(layer.evaluated).detach()
    g2 = g.narrow(d, k, n) / torch.exp(log_scale)
    net = _dense_net(t, k, n)
    if net is None:  # through the graph
        v = layer.vjp(torch.cat([torch.zeros_like(g.narrow(d, 0, k)), g2], dim=d)).narrow(d, 0, k)
    else:  # Pyro's DenseNN: plain matmuls (the clamp of the log-scale passes gradients)
        x = layer.x
        _, vjp = mlp_vjp(x.narrow(-1, 0, k), *net, out=False)
        # seeds of (mean, log-scale): g_y2, and 1 + g_y2 exp(s) x2 = 1 + g_x2 x2
        v = vjp(torch.cat([g2, (g.narrow(d, k, n) * x.narrow(-1, k, n)).add_(1)], dim=-1))
    return torch.cat([g.narrow(d, 0, k) - v, g2], dim=d)
