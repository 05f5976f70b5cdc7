"""Conjugate models whose exact posterior lies in a chosen guide family, with closed forms.

Each :class:`Conjugate` holds a model ``model(data)``, its data, the factor family
whose member is the exact posterior of the latent site ``site``, and that posterior.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
    return Conjugate(
        "Normal-Normal", model, x, "mu", dist.Normal, dist.Normal(mean, precision**-0.5)
    )


ALL = [poisson_gamma, binomial_beta, categorical_dirichlet, normal_normal]


#: estimator name -> (steps, optimizer args, num_particles). STL's gradient vanishes at the
#: exact posterior, so a constant step size converges; Trace_ELBO's needs a decaying one.
FIT_SETTINGS = {
    "Trace_ELBO": (600, {"lr": 0.1, "lrd": 0.002 ** (1 / 600)}, 16),
    "TraceSTL_ELBO": (400, {"lr": 0.05}, 4),
}


def fit(case: Conjugate, estimator: str):
    """Fit ``AutoMeanField(family=case.family)``; return the fitted factor of ``case.site``."""
    import pyro.infer
    from pyro.infer.autoguide import init_to_median

    from pyro_gradroute.guides import AutoMeanField
    from pyro_gradroute.infer import TraceSTL_ELBO

    elbo_class = {"Trace_ELBO": pyro.infer.Trace_ELBO, "TraceSTL_ELBO": TraceSTL_ELBO}[estimator]
    steps, optim_args, particles = FIT_SETTINGS[estimator]
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoMeanField(
        case.model, family=case.family, init_loc_fn=init_to_median, init_scale=0.3
    )
    elbo = elbo_class(num_particles=particles, vectorize_particles=True, max_plate_nesting=1)
    svi = pyro.infer.SVI(case.model, guide, pyro.optim.ClippedAdam(optim_args), elbo)
    for _ in range(steps):
        svi.step(case.data)
    return guide, guide.get_posterior(case.data)[case.site]


def relative_errors(q: dist.Distribution, exact: dist.Distribution) -> tuple[float, float]:
    """Largest relative error of the mean and of the standard deviation."""
    rel_mean = ((q.mean - exact.mean) / exact.mean).abs().max().item()
    rel_sd = ((q.stddev - exact.stddev) / exact.stddev).abs().max().item()
    return rel_mean, rel_sd


def _fmt(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in t.detach().reshape(-1).tolist()) + "]"


if __name__ == "__main__":  # the fitted-vs-exact table: python -m tests.guides.conjugate
    torch.set_num_threads(1)
    print(
        "| model | estimator | fitted mean | exact mean | fitted sd | exact sd | rel. err mean / sd |"
    )
    print("|---|---|---|---|---|---|---|")
    for make in ALL:
        case = make()
        for estimator in FIT_SETTINGS:
            _, q = fit(case, estimator)
            e = case.posterior
            rm, rs = relative_errors(q, e)
            print(
                f"| {case.name} | {estimator} | {_fmt(q.mean)} | {_fmt(e.mean)} | {_fmt(q.stddev)} "
                f"| {_fmt(e.stddev)} | {rm:.2%} / {rs:.2%} |"
            )
