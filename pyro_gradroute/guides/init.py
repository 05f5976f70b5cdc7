r"""Moment-matching initialisation: family arguments with a given mean and standard deviation.

For a family and a target mean :math:`m` and standard deviation :math:`s`
(elementwise tensors), :func:`moment_init` returns constrained argument values
with (approximately) that mean and sd:

===============  ==============================================================================
family           arguments
===============  ==============================================================================
Normal           :math:`\mu = m,\ \sigma = s`
Laplace          :math:`\mu = m,\ b = s/\sqrt 2`
StudentT         :math:`\nu = 10,\ \mu = m,\ \sigma = s\sqrt{(\nu-2)/\nu}`
LogNormal        :math:`\sigma^2 = \log(1 + s^2/m^2),\ \mu = \log m - \sigma^2/2`
Gamma            :math:`\alpha = m^2/s^2,\ \beta = m/s^2`
InverseGamma     :math:`\alpha = 2 + m^2/s^2,\ \beta = m(\alpha - 1)`
Weibull          :math:`k` solves :math:`\Gamma(1+2/k)/\Gamma(1+1/k)^2 - 1 = s^2/m^2`,
                 :math:`\lambda = m/\Gamma(1+1/k)`
Beta             :math:`\nu = m(1-m)/s^2 - 1,\ \alpha = m\nu,\ \beta = (1-m)\nu`
Dirichlet        :math:`\alpha_0 = \overline{m_i(1-m_i)/s_i^2} - 1,\ \alpha = m\,\alpha_0`
MVN              :math:`\mu = m,\ L = \operatorname{diag}(s)` (MultivariateNormal ``scale_tril``)
===============  ==============================================================================

(Beta and Dirichlet need :math:`s^2 < m(1-m)`; larger ``s`` is clipped.)
Register more families with :func:`register_moment_init`; :func:`support_spread` gives the sd.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributions import constraints

from .support import base_constraint, support_key

__all__ = ["register_moment_init", "moment_init", "has_moment_init", "support_spread"]

MomentInit = Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]
_REGISTRY: dict[type, MomentInit] = {}

#: degrees of freedom a StudentT factor starts from (learned afterwards).
STUDENT_T_DF = 10.0
_TINY = 1e-6


def register_moment_init(family: type) -> Callable[[MomentInit], MomentInit]:
    """Decorator registering ``fn(mean, sd) -> {arg: value}`` for ``family`` and its subclasses.

    Example::

        >>> import math, torch, pyro.distributions as dist
        >>> class MyGumbel(dist.Gumbel):
        ...     pass
        >>> @register_moment_init(MyGumbel)
        ... def _gumbel(m, s):
        ...     beta = s * 6**0.5 / math.pi
        ...     return {"loc": m - 0.5772156649 * beta, "scale": beta}
        >>> q = MyGumbel(**moment_init(MyGumbel, torch.tensor(1.0), torch.tensor(0.5)))
        >>> round(q.mean.item(), 4), round(q.stddev.item(), 4)
        (1.0, 0.5)
    """

    def decorator(fn: MomentInit) -> MomentInit:
        _REGISTRY[family] = fn
        return fn

    return decorator


def _lookup(family: type) -> MomentInit | None:
    for cls in getattr(family, "__mro__", ()):
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    return None


def has_moment_init(family: type) -> bool:
    """Whether :func:`moment_init` knows ``family`` (or one of its base classes)."""
    return _lookup(family) is not None


def moment_init(family: type, mean: torch.Tensor, sd: torch.Tensor) -> dict[str, torch.Tensor]:
    """Constrained argument values of ``family`` with mean ``mean`` and sd ``sd`` (elementwise).

    Example::

        >>> import torch, pyro.distributions as dist
        >>> p = moment_init(dist.Gamma, torch.tensor(2.0), torch.tensor(0.5))
        >>> q = dist.Gamma(**p)
        >>> round(float(q.mean), 4), round(float(q.stddev), 4)
        (2.0, 0.5)

    :raises NotImplementedError: for a family without a registered rule.
    """
    fn = _lookup(family)
    if fn is None:
        raise NotImplementedError(f"no moment-matching rule for {family.__name__}")
    sd = torch.as_tensor(sd, dtype=mean.dtype).expand_as(mean)
    return {k: v.detach().clone() for k, v in fn(mean.detach(), sd.detach()).items()}


@register_moment_init(torch.distributions.Normal)
def _normal(m, s):
    return {"loc": m, "scale": s.clamp_min(_TINY)}


@register_moment_init(torch.distributions.MultivariateNormal)
def _multivariate_normal(m, s):
    return {"loc": m, "scale_tril": torch.diag_embed(s.clamp_min(_TINY))}


@register_moment_init(torch.distributions.Laplace)
def _laplace(m, s):
    return {"loc": m, "scale": (s / math.sqrt(2)).clamp_min(_TINY)}


@register_moment_init(torch.distributions.StudentT)
def _student_t(m, s):
    df = torch.full_like(m, STUDENT_T_DF)
    return {
        "df": df,
        "loc": m,
        "scale": (s * math.sqrt((STUDENT_T_DF - 2) / STUDENT_T_DF)).clamp_min(_TINY),
    }


def _positive(m, s):
    return m.clamp_min(_TINY), s.clamp_min(_TINY)


@register_moment_init(torch.distributions.LogNormal)
def _log_normal(m, s):
    m, s = _positive(m, s)
    var = torch.log1p((s / m) ** 2)
    return {"loc": m.log() - var / 2, "scale": var.sqrt()}


@register_moment_init(torch.distributions.Gamma)
def _gamma(m, s):
    m, s = _positive(m, s)
    return {"concentration": (m / s) ** 2, "rate": m / s**2}


@register_moment_init(torch.distributions.InverseGamma)
def _inverse_gamma(m, s):
    m, s = _positive(m, s)
    alpha = 2 + (m / s) ** 2
    return {"concentration": alpha, "rate": m * (alpha - 1)}


@register_moment_init(torch.distributions.Weibull)
def _weibull(m, s):
    m, s = _positive(m, s)
    cv2 = ((s / m) ** 2).double()
    lo = torch.full_like(cv2, math.log(0.05))  # bisection on log k; cv^2(k) decreases in k
    hi = torch.full_like(cv2, math.log(1e5))
    for _ in range(80):
        mid = (lo + hi) / 2
        k = mid.exp()
        f = torch.expm1(torch.lgamma(1 + 2 / k) - 2 * torch.lgamma(1 + 1 / k)) - cv2
        lo, hi = torch.where(f > 0, mid, lo), torch.where(f > 0, hi, mid)
    k = ((lo + hi) / 2).exp()
    scale = m.double() / torch.exp(torch.lgamma(1 + 1 / k))
    return {"scale": scale.to(m.dtype), "concentration": k.to(m.dtype)}


def _interior(m, s):
    m = m.clamp(_TINY, 1 - _TINY)
    var = torch.minimum(s**2, 0.9 * m * (1 - m)).clamp_min(_TINY**2)
    return m, var


@register_moment_init(torch.distributions.Beta)
def _beta(m, s):
    m, var = _interior(m, s)
    nu = m * (1 - m) / var - 1
    return {"concentration1": m * nu, "concentration0": (1 - m) * nu}


@register_moment_init(torch.distributions.Dirichlet)
def _dirichlet(m, s):
    m, var = _interior(m, s)
    m = m / m.sum(-1, keepdim=True)
    alpha0 = (m * (1 - m) / var).mean(-1, keepdim=True) - 1
    return {"concentration": m * alpha0.clamp_min(_TINY)}


def support_spread(
    support: constraints.Constraint, value: torch.Tensor, init_scale: float
) -> torch.Tensor:
    r"""Constrained-space sd matching an unconstrained sd ``init_scale`` at ``value`` (delta method).

    ``real``: :math:`s`; lower bound :math:`l`: :math:`s\,(x - l)`; upper bound
    :math:`u`: :math:`s\,(u - x)`; interval :math:`(l, u)`:
    :math:`s\,(x-l)(u-x)/(u-l)`; simplex: :math:`s\,x(1-x)`. Other supports: :math:`s`.

    Example::

        >>> import torch
        >>> from torch.distributions import constraints
        >>> support_spread(constraints.positive, torch.tensor(4.0), 0.1)
        tensor(0.4000)
    """
    key = support_key(support)
    base = base_constraint(support)
    if key[0] == "lower":
        return init_scale * (value - base.lower_bound).abs()
    if key[0] == "upper":
        return init_scale * (base.upper_bound - value).abs()
    if key[0] == "interval":
        lo, hi = base.lower_bound, base.upper_bound
        return init_scale * (value - lo) * (hi - value) / (hi - lo)
    if isinstance(base, type(constraints.simplex)):
        return init_scale * value * (1 - value)
    return torch.full_like(value, init_scale)
