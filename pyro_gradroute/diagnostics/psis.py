r"""Pareto-smoothed importance sampling diagnostic :math:`\hat k` of a fitted guide.

Yao, Vehtari, Simpson & Gelman (2018), "Yes, but did it work?": fit a generalized Pareto
distribution to the largest importance ratios :math:`r_s = p(x, z_s) / q(z_s)`,
:math:`z_s \sim q`. Its shape :math:`\hat k` estimates how many moments the ratios have
(:math:`1/k`): below 0.5 the guide is good, 0.5-0.7 usable (importance sampling still
converges, slowly), above 0.7 unreliable (the guide misses mass the posterior has).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .._validation import check_float, check_int
from ._arviz import psislw_khat
from .draws import importance_draws

GOOD, USABLE = 0.5, 0.7


class PSISResult(float):
    """A float (the k-hat) with ``.khat``, ``.reading`` and ``.num_samples``.

    ``reading`` is ``"good"`` (k < 0.5), ``"usable"`` (0.5 <= k <= 0.7) or ``"unreliable"``
    (k > 0.7 or NaN). ``khat == -inf`` means all log-ratios were equal: the guide is the
    posterior up to normalization, and its reading is ``"good"``.
    """

    num_samples: int

    def __new__(cls, khat: float, num_samples: int = 0) -> PSISResult:
        obj = super().__new__(cls, khat)
        obj.num_samples = num_samples
        return obj

    @property
    def khat(self) -> float:
        return float(self)

    @property
    def reading(self) -> str:
        k = float(self)
        if math.isnan(k) or k > USABLE:
            return "unreliable"
        return "good" if k < GOOD else "usable"

    def __repr__(self) -> str:
        return f"PSISResult(khat={float(self):.3f}, reading={self.reading!r})"

    __str__ = __repr__


def _pyro_khat(lw: np.ndarray) -> float:
    """Pyro's tail fit (as in :func:`pyro.infer.importance.psis_diagnostic`)."""
    from pyro.ops.stats import fit_generalized_pareto

    lw = torch.as_tensor(lw, dtype=torch.float64)
    n = lw.numel()
    m = max(5, min(int(0.2 * n), int(3 * math.sqrt(n))))
    top, _ = lw.topk(m + 1)
    tail = (top[:-1] - top[-1]).exp() - 1.0
    k, _ = fit_generalized_pareto(tail)
    return float(k)


def pareto_khat(log_ratios, rtol: float = 1e-6) -> PSISResult:
    r"""PSIS :math:`\hat k` of given importance log-ratios :math:`\log p(x,z_s) - \log q(z_s)`.

    Uses ArviZ's PSIS (``az.psislw`` on ArviZ 0.23, ``.azstats.psislw`` on 1.x); Pyro's
    generalized-Pareto fit (the 5 largest ratios at least) for fewer than 25 draws on ArviZ 1.x,
    whose PSIS needs a tail of 5 draws out of a fifth of them.
    Log-ratios that are all equal, up to ``rtol * (1 + max |log r|)`` (float rounding), give
    ``-inf`` ("good"): PSIS itself would report ``inf`` for that perfect case.

    Example::

        >>> import torch
        >>> from pyro_gradroute.diagnostics import pareto_khat
        >>> pareto_khat(torch.zeros(100)).reading
        'good'
        >>> k = pareto_khat(torch.randn(2000, generator=torch.Generator().manual_seed(0)) * 3)
        >>> k.reading  # log-normal ratios with sigma = 3 have very heavy tails
        'unreliable'
    """
    rtol = check_float(rtol, "rtol", "pareto_khat", low=0.0)
    lw = np.asarray(torch.as_tensor(log_ratios).detach().cpu().double()).reshape(-1)
    if np.isnan(lw).any():
        raise ValueError(
            f"{int(np.isnan(lw).sum())} of {lw.size} importance log-ratios are NaN: the model "
            "or guide log-density is NaN at some guide draws; check their parameters."
        )
    if np.isposinf(lw).any():  # the guide draws where the model has infinite density
        return PSISResult(math.inf, lw.size)
    lw = lw[np.isfinite(lw)]  # -inf ratios have zero weight and carry no tail
    if lw.size < 2:
        raise ValueError(f"pareto_khat needs at least 2 finite log-ratios, got {lw.size}")
    if np.ptp(lw) <= rtol * (1.0 + np.abs(lw).max()):
        return PSISResult(-math.inf, lw.size)
    khat = psislw_khat(lw)
    return PSISResult(_pyro_khat(lw) if khat is None else khat, lw.size)


def psis_khat(
    model,
    guide,
    *args,
    num_samples: int = 1000,
    max_plate_nesting: int | None = None,
    vectorize: bool | None = None,
    progress: bool = True,
    **kwargs,
) -> PSISResult:
    r"""Pareto :math:`\hat k` of ``guide`` as an importance proposal for ``model``'s posterior.

    Draws :math:`z_s \sim q`, :math:`s = 1..S`, computes :math:`\log p(x, z_s) - \log q(z_s)`
    with :func:`~pyro_gradroute.diagnostics.draws.importance_draws` (``vectorize`` and
    ``progress`` as there; subsampled plates at full size, enumerated sites summed out) and
    fits the tail with :func:`pareto_khat`.

    :returns: a float-like :class:`PSISResult` with ``.khat`` and ``.reading``.

    Example::

        >>> import pyro, pyro.distributions as dist
        >>> from pyro_gradroute.diagnostics import psis_khat
        >>> model = lambda: pyro.sample("z", dist.Normal(0.0, 1.0))
        >>> exact = lambda: pyro.sample("z", dist.Normal(0.0, 1.0))
        >>> psis_khat(model, exact).reading
        'good'
        >>> pyro.set_rng_seed(0)
        >>> off = lambda: pyro.sample("z", dist.Normal(2.0, 0.2))  # shifted and 5x too narrow
        >>> psis_khat(model, off, num_samples=4000).reading
        'unreliable'
    """
    check_int(num_samples, "num_samples", "psis_khat", minimum=2)
    check_int(max_plate_nesting, "max_plate_nesting", "psis_khat", minimum=0, allow_none=True)
    draws = importance_draws(
        model, guide, *args, num_samples=num_samples, max_plate_nesting=max_plate_nesting,
        vectorize=vectorize, progress=progress, **kwargs,
    )  # fmt: skip
    return pareto_khat(draws.log_ratios)
