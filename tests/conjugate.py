"""Conjugate models with closed-form posteriors and closed-form ELBOs, shared by the estimator tests.

Also: conjugate models whose exact posterior lies in a chosen guide *family*
(Poisson-Gamma, Binomial-Beta, Categorical-Dirichlet, Normal-Normal; :class:`Conjugate`),
for the guides' fitted-vs-exact checks (``python -m tests.conjugate`` prints the table).

Gaussian model: ``z ~ N(0, S0)`` (``D`` dims), ``x_i | z ~ N(z, s^2 I)`` for ``i`` in a data
plate. For a Gaussian guide ``q = N(m, S)``::

    ELBO(m, S) = E_q[log N(z; 0, S0)] + sum_i E_q[log N(x_i; z, s^2 I)] + H(q)

with ``E_q[log N(z; 0, S0)] = -1/2 (D log 2pi + logdet S0 + tr(S0^-1 S) + m' S0^-1 m)``,
``E_q[log N(x; z, s^2 I)] = -1/2 (D log 2pi s^2 + (|x - m|^2 + tr S) / s^2)``,
``H(q) = 1/2 logdet(2 pi e S)``. Differentiating it through the guide's parameters gives the
exact ELBO gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch
from torch.distributions import transform_to

# ---------------------------------------------------------------- Gaussian model


class GaussianModel:
    def __init__(self, D=2, n=5, prior_cov=None, obs_scale=1.0, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.D, self.n, self.s = D, n, obs_scale
        self.S0 = prior_cov if prior_cov is not None else torch.eye(D)
        self.x = torch.randn(n, D, generator=g) + 1.0

    def model(self, x=None):
        x = self.x if x is None else x
        if self.D == 1:
            z = pyro.sample("z", dist.Normal(0.0, self.S0[0, 0].sqrt()))
            with pyro.plate("data", len(x)):
                pyro.sample("x", dist.Normal(z, self.s), obs=x[:, 0])
        else:
            z = pyro.sample("z", dist.MultivariateNormal(torch.zeros(self.D), self.S0))
            with pyro.plate("data", len(x)):
                pyro.sample("x", dist.Normal(z, self.s).to_event(1), obs=x)

    def posterior(self):
        P = torch.linalg.inv(self.S0) + self.n / self.s**2 * torch.eye(self.D)
        cov = torch.linalg.inv(P)
        mean = cov @ (self.x.sum(0) / self.s**2)
        return mean, cov

    def elbo(self, m, S):
        D, s = self.D, self.s
        S0inv = torch.linalg.inv(self.S0)
        prior = -0.5 * (
            D * math.log(2 * math.pi)
            + torch.logdet(self.S0)
            + torch.trace(S0inv @ S)
            + m @ S0inv @ m
        )
        lik = -0.5 * (
            self.n * D * math.log(2 * math.pi * s**2)
            + (((self.x - m) ** 2).sum() + self.n * torch.trace(S)) / s**2
        )
        entropy = 0.5 * torch.logdet(2 * math.pi * math.e * S)
        return prior + lik + entropy


# ---------------------------------------------------------------- positive latent (log-normal)


class LogNormalModel:
    """``z ~ LogNormal(m0, s0)``, ``x_i ~ LogNormal(log z, s)``: ``log z`` is Normal a posteriori."""

    def __init__(self, n=6, m0=0.5, s0=1.0, s=0.7, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.m0, self.s0, self.s = m0, s0, s
        self.x = (torch.randn(n, generator=g) * s + 1.0).exp()

    def model(self):
        z = pyro.sample("z", dist.LogNormal(self.m0, self.s0))
        with pyro.plate("data", len(self.x)):
            pyro.sample("x", dist.LogNormal(z.log(), self.s), obs=self.x)

    def posterior_log(self):
        prec = 1 / self.s0**2 + len(self.x) / self.s**2
        mean = (self.m0 / self.s0**2 + self.x.log().sum() / self.s**2) / prec
        return mean, prec**-0.5


# ---------------------------------------------------------------- mixed discrete / continuous


class MixedModel:
    """``b ~ Bernoulli(0.3)``, ``z ~ N(0, 1)``, ``x ~ N(z + b, 1)``; guide ``q(b) q(z)``."""

    x = torch.tensor(1.7)

    def model(self):
        b = pyro.sample("b", dist.Bernoulli(0.3))
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(z + b, 1.0), obs=self.x)

    def guide(self):
        p = pyro.param("p", torch.tensor(0.6), constraint=dist.constraints.unit_interval)
        m = pyro.param("m", torch.tensor(0.2))
        s = pyro.param("s", torch.tensor(0.8), constraint=dist.constraints.positive)
        pyro.sample("b", dist.Bernoulli(p))
        pyro.sample("z", dist.Normal(m, s))

    def exact_elbo(self):
        p, m, s = pyro.param("p"), pyro.param("m"), pyro.param("s")
        qb = torch.stack([1 - p, p])
        log_pb = torch.tensor([0.7, 0.3]).log()
        kl_b = (qb * (qb.log() - log_pb)).sum()
        e_prior_z = -0.5 * (math.log(2 * math.pi) + m**2 + s**2)
        h_z = 0.5 * torch.log(2 * math.pi * math.e * s**2)
        bs = torch.tensor([0.0, 1.0])
        e_lik = (qb * (-0.5 * (math.log(2 * math.pi) + (self.x - m - bs) ** 2 + s**2))).sum()
        return e_prior_z + h_z + e_lik - kl_b


# ---------------------------------------------------------------- helpers


def set_param(name, value):
    """Set a param-store parameter to a *constrained* value in place."""
    store = pyro.get_param_store()
    unconstrained = transform_to(store._constraints[name]).inv(torch.as_tensor(value))
    with torch.no_grad():
        store._params[name].copy_(unconstrained)


def leaves():
    """``(name, unconstrained leaf)`` of every param-store parameter, in a fixed order."""
    store = pyro.get_param_store()
    return [(k, store._params[k]) for k in sorted(store.keys())]


def flat_grad():
    return torch.cat(
        [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for _, p in leaves()]
    )


def gradient_draws(elbo, model, guide, num_draws, *args):
    """``num_draws`` independent gradient estimates of the *negative* ELBO, stacked ``(num_draws, P)``."""
    out = []
    for _ in range(num_draws):
        for _, p in leaves():
            p.grad = None
        elbo.loss_and_grads(model, guide, *args)
        out.append(flat_grad())
    for _, p in leaves():
        p.grad = None
    return torch.stack(out)


def settle_at_split(elbo, at_one) -> str:
    """An adaptive estimator's fit, settled at 1 on the tensors named in ``at_one`` and at 0 on
    the others (a split from step 5), kept for the rest of the test; its next step is direct.
    Returns the moments' key."""
    cv = elbo.control_variate
    (key,) = cv.state
    st = cv.state[key]
    st["n"] = 10**6
    fit = cv.fit(key)
    b = torch.cat([torch.full((math.prod(s),), float(n in at_one)) for n, s in cv.layouts[key]])
    fit.update(b=b.to(st["buf"]), constant=None, ends=frozenset(at_one), ratio=1.0, views=None)
    st["age"] = -(10**6)
    elbo.schedule.unmeasured = 0
    return key


def exact_gradient(neg_elbo_fn):
    """Gradient of a closed-form negative ELBO with respect to the param-store leaves."""
    ps = [p for _, p in leaves()]
    gs = torch.autograd.grad(neg_elbo_fn(), ps, allow_unused=True)
    return torch.cat(
        [torch.zeros(p.numel()) if g is None else g.reshape(-1) for g, p in zip(gs, ps)]
    )


# ---------------------------------------------------------------- a conditional (structured) guide


class HierarchicalModel:
    """``z1 ~ N(0,1)``, ``z2 ~ N(z1, 1)``, ``x ~ N(z2, 0.5)``; guide ``q(z1) q(z2 | z1)``, linear-Gaussian."""

    x = torch.tensor(1.3)
    sx = 0.5

    def model(self):
        z1 = pyro.sample("z1", dist.Normal(0.0, 1.0))
        z2 = pyro.sample("z2", dist.Normal(z1, 1.0))
        pyro.sample("x", dist.Normal(z2, self.sx), obs=self.x)

    def guide(self):
        a = pyro.param("a", torch.tensor(0.4))
        s1 = pyro.param("s1", torch.tensor(0.9), constraint=dist.constraints.positive)
        b = pyro.param("b", torch.tensor(-0.2))
        c = pyro.param("c", torch.tensor(0.5))
        s2 = pyro.param("s2", torch.tensor(0.7), constraint=dist.constraints.positive)
        z1 = pyro.sample("z1", dist.Normal(a, s1))
        pyro.sample("z2", dist.Normal(b + c * z1, s2))

    def exact_elbo(self):
        a, s1, b, c, s2 = (pyro.param(k) for k in ("a", "s1", "b", "c", "s2"))
        m1, m2 = a, b + c * a
        v11, v12, v22 = s1**2, c * s1**2, c**2 * s1**2 + s2**2
        log2pi = math.log(2 * math.pi)
        e1 = -0.5 * (log2pi + m1**2 + v11)
        e2 = -0.5 * (log2pi + (m2 - m1) ** 2 + v11 + v22 - 2 * v12)
        e3 = -0.5 * (log2pi + 2 * math.log(self.sx) + ((self.x - m2) ** 2 + v22) / self.sx**2)
        h = 0.5 * torch.log(2 * math.pi * math.e * s1**2) + 0.5 * torch.log(
            2 * math.pi * math.e * s2**2
        )
        return e1 + e2 + e3 + h


# ---------------------------------------------------------------- posteriors in a guide family


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


if __name__ == "__main__":  # the fitted-vs-exact table: python -m tests.conjugate
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
