"""Conjugate models whose exact posterior lies in a chosen guide family, with closed forms.

Each :class:`Conjugate` holds a model ``model(data)``, its data, the factor family
whose member is the exact posterior of the latent site ``site``, and that posterior.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pyro
import pyro.distributions as dist
import torch


@dataclass
class Conjugate:
    name: str
    model: Callable
    data: torch.Tensor
    site: str
    family: type
    posterior: dist.Distribution


def poisson_gamma() -> Conjugate:
    a0, b0 = 2.0, 1.0
    x = torch.tensor([3.0, 5.0, 4.0, 6.0])

    def model(x):
        rate = pyro.sample("rate", dist.Gamma(a0, b0))
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Poisson(rate), obs=x)

    post = dist.Gamma(a0 + x.sum(), b0 + len(x))
    return Conjugate("Poisson-Gamma", model, x, "rate", dist.Gamma, post)


def binomial_beta() -> Conjugate:
    a0, b0, n = 2.0, 3.0, 20.0
    k = torch.tensor([7.0, 9.0, 6.0])

    def model(k):
        p = pyro.sample("p", dist.Beta(a0, b0))
        with pyro.plate("data", len(k)):
            pyro.sample("k", dist.Binomial(n, p), obs=k)

    post = dist.Beta(a0 + k.sum(), b0 + n * len(k) - k.sum())
    return Conjugate("Binomial-Beta", model, k, "p", dist.Beta, post)


def categorical_dirichlet() -> Conjugate:
    alpha = torch.tensor([1.0, 2.0, 1.5])
    x = torch.tensor([0, 1, 1, 2, 1, 0, 1, 2, 1, 1, 0, 2])

    def model(x):
        theta = pyro.sample("theta", dist.Dirichlet(alpha))
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Categorical(theta), obs=x)

    counts = torch.bincount(x, minlength=3).to(alpha.dtype)
    return Conjugate(
        "Categorical-Dirichlet", model, x, "theta", dist.Dirichlet, dist.Dirichlet(alpha + counts)
    )


def normal_normal() -> Conjugate:
    m0, s0, sigma = 0.0, 2.0, 1.5
    x = torch.tensor([1.2, 0.4, 2.1, 1.7, 0.9, 1.4])

    def model(x):
        mu = pyro.sample("mu", dist.Normal(m0, s0))
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Normal(mu, sigma), obs=x)

    precision = 1 / s0**2 + len(x) / sigma**2
    mean = (m0 / s0**2 + x.sum() / sigma**2) / precision
    return Conjugate("Normal-Normal", model, x, "mu", dist.Normal, dist.Normal(mean, precision**-0.5))


ALL = [poisson_gamma, binomial_beta, categorical_dirichlet, normal_normal]
