"""TraceSTL_ELBO's default path on many families: equal to a hand-written same-draw STL surrogate.

The surrogate draws ``z`` with the same seed from a fresh distribution with the same parameters
and differentiates ``log p(x, z) - log q(z; stop(phi))``, written without the package.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_gradroute.infer import TraceSTL_ELBO


def _t(v):
    return torch.tensor(v, dtype=torch.float64)


FAMILIES = {
    "Normal": (lambda a, b: dist.Normal(a, b), (0.3, 0.8)),
    "LogNormal": (lambda a, b: dist.LogNormal(a, b), (0.3, 0.5)),
    "Gamma": (lambda a, b: dist.Gamma(a, b), (2.0, 1.5)),
    "Beta": (lambda a, b: dist.Beta(a, b), (2.0, 3.0)),
    "StudentT": (lambda a, b: dist.StudentT(4.0, a, b), (0.3, 0.8)),
    "Weibull": (lambda a, b: dist.Weibull(a, b), (1.5, 2.0)),
    "Kumaraswamy": (lambda a, b: dist.Kumaraswamy(a, b), (2.0, 3.0)),  # the general split
    "Laplace": (lambda a, b: dist.Laplace(a, b), (0.3, 0.8)),
    "Gumbel": (lambda a, b: dist.Gumbel(a, b), (0.3, 0.8)),
    "HalfNormal": (lambda a, b: dist.HalfNormal(a * 0 + b), (0.3, 0.8)),
    "InverseGamma": (lambda a, b: dist.InverseGamma(a, b), (3.0, 2.0)),
    "Dirichlet": (lambda a, b: dist.Dirichlet(torch.stack([a, b, a + b])), (2.0, 3.0)),
    "MultivariateNormal": (
        lambda a, b: dist.MultivariateNormal(
            torch.stack([a, b]), scale_tril=torch.eye(2, dtype=torch.float64) * b
        ),
        (0.3, 0.8),
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_default_path_equals_hand_written_stl(family):
    make, init = FAMILIES[family]
    prior = make(_t(1.0), _t(1.2))
    x = _t(0.7)

    def guide():
        a = pyro.param("a", _t(init[0]), constraint=dist.constraints.positive)
        b = pyro.param("b", _t(init[1]), constraint=dist.constraints.positive)
        pyro.sample("z", make(a, b))

    def model():
        z = pyro.sample("z", prior)
        pyro.sample("x", dist.Normal(z.sum(), 1.0), obs=x)

    pyro.clear_param_store()
    guide()
    store = pyro.get_param_store()
    leaves = [store.get_param(n).unconstrained() for n in ("a", "b")]
    for seed in range(3):
        for p in leaves:
            p.grad = None
        pyro.set_rng_seed(seed)
        TraceSTL_ELBO().loss_and_grads(model, guide)
        ours = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in leaves]
        for p in leaves:
            p.grad = None
        pyro.set_rng_seed(seed)
        a, b = store["a"], store["b"]
        z = make(a, b).rsample()
        lp = prior.log_prob(z).sum() + dist.Normal(z.sum(), 1.0).log_prob(x)
        (-(lp - make(a.detach(), b.detach()).log_prob(z).sum())).backward()
        ref = [torch.zeros_like(p) if p.grad is None else p.grad for p in leaves]
        for g, r in zip(ours, ref):
            torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10)
