"""Small models for the diagnostics tests, with closed-form posteriors where needed."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch


def normal_normal_plates(x: torch.Tensor) -> None:
    """``mu ~ N(0, 1)``, ``w ~ N(0, 1)^3`` (event), ``t_g ~ N(0, 1)`` in plate ``group`` (2),
    ``x_ig ~ N(mu + t_g + sum(w), 1)`` in plates ``data`` x ``group``."""
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    with pyro.plate("group", x.shape[-1], dim=-1):
        t = pyro.sample("t", dist.Normal(0.0, 1.0))
        pyro.deterministic("m", mu + t)
        with pyro.plate("data", x.shape[-2], dim=-2):
            pyro.sample("x", dist.Normal(mu + t + w.sum(-1), 1.0), obs=x)


def gaussian(x: torch.Tensor) -> None:
    """``z ~ N(0, 1)``, ``x_i ~ N(z, 1)``: posterior ``N(sum x / (n+1), 1/(n+1))``."""
    z = pyro.sample("z", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def gaussian_posterior(x: torch.Tensor) -> tuple[float, float]:
    n = len(x)
    return float(x.sum() / (n + 1)), (n + 1) ** -0.5


def fixed_normal_guide(loc: float, scale: float):
    """A guide ``z ~ N(loc, scale)`` without parameters."""

    def guide(x):
        pyro.sample("z", dist.Normal(loc, scale))

    return guide
