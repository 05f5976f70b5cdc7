r"""Gaussian means whose posterior lies in the guide family.

.. math::

    z_d \sim N(0, 1),\quad x_{id} \mid z_d \sim N(z_d, 1),\qquad d = 1..D,\ i = 1..n,

so :math:`p(z_d \mid x) = N\big(\sum_i x_{id} / (n+1),\ 1/(n+1)\big)` and AutoNormal can be
exact. There :math:`\log p(x, z) - \log q(z)` is constant in :math:`z`: the pathwise-only (STL)
gradient is exactly zero while the score part (in Trace_ELBO) keeps its noise -- the case the
one-evaluation split ``split_log_prob`` (ordinary, score and pathwise parts) was made for.

Example::

    >>> from pyro_gradroute.app.models.gaussian_means import problem, exact_posterior
    >>> p = problem()
    >>> loc, scale = exact_posterior(p.args[0])
    >>> tuple(loc.shape)
    (10,)
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.autoguide import AutoNormal

from .problem import Problem


def model(x: torch.Tensor) -> None:
    """``x`` has shape ``(n, D)``: plates ``data`` (dim -2) and ``dim`` (dim -1)."""
    with pyro.plate("dim", x.shape[-1], dim=-1):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        with pyro.plate("data", x.shape[-2], dim=-2):
            pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def exact_posterior(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and standard deviation of ``z`` per dimension."""
    n = x.shape[-2]
    return x.sum(-2) / (n + 1), x.new_full(x.shape[-1:], (n + 1) ** -0.5)


def simulate(n: int = 20, dims: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and held-out data ``(n, dims)`` around one true ``z``."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(dims, generator=g)
    return z + torch.randn(n, dims, generator=g), z + torch.randn(n, dims, generator=g)


def problem() -> Problem:
    """The bundled problem: 10 dimensions, 20 observations each, AutoNormal guide."""
    x, x_test = simulate()
    return Problem(
        model=model,
        guide=AutoNormal(model),
        args=(x,),
        heldout_args=(x_test,),
        steps=500,
        lr=0.05,
    )
