"""ParametrizedDistribution: param-store arguments, re-read at every call; the seed's loop."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch.distributions import constraints

from pyro_gradroute.guides import ParametrizedDistribution

TARGET = dist.Normal(5.0, 5.0)


def seed_loop(q, steps=300, lr=0.05, num_samples=128):
    """The seed's loop, verbatim for every family: Monte Carlo KL(q || target) with rsample."""
    opt = torch.optim.Adam(q.parameters(), lr=lr)
    for _ in range(steps):
        d = q()
        z = d.rsample((num_samples,))
        kl = (d.log_prob(z) - TARGET.log_prob(z)).mean()
        opt.zero_grad()
        kl.backward()
        opt.step()


def exact_kl(d):
    """KL(d || Normal(5, 5)) in closed form from d's entropy, mean and variance."""
    expected_sq = d.variance + (d.mean - 5.0) ** 2
    cross = math.log(5.0 * math.sqrt(2 * math.pi)) + expected_sq / 50.0
    return cross - d.entropy()


def best_kl(family, init):
    """The family's smallest KL to the target, by L-BFGS on the closed-form KL."""
    q = ParametrizedDistribution("best", family, **init)
    opt = torch.optim.LBFGS(list(q.parameters()), max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = exact_kl(q())
        loss.backward()
        return loss

    opt.step(closure)
    return exact_kl(q()).item()


SEED_FAMILIES = [
    (dist.Normal, {"loc": 0.0, "scale": 1.0}),
    (dist.LogNormal, {"loc": 0.0, "scale": 1.0}),
    (dist.Gamma, {"concentration": 2.0, "rate": 1.0}),
]


@pytest.mark.parametrize("family,init", SEED_FAMILIES, ids=lambda x: getattr(x, "__name__", ""))
def test_seed_loop_runs_unchanged_and_reaches_the_family_optimum(family, init):
    q = ParametrizedDistribution("q", family, **init)
    before = exact_kl(q()).item()
    seed_loop(q)
    after = exact_kl(q()).item()
    best = best_kl(family, init)
    assert after < before
    assert after - best < 0.02, (family.__name__, before, after, best)
    if family is dist.Normal:
        assert q.params()["loc"].item() == pytest.approx(5.0, rel=0.05)
        assert q.params()["scale"].item() == pytest.approx(5.0, rel=0.05)


def test_std_computed_once_breaks_but_param_store_rebuilds_the_graph():
    log_std = torch.zeros((), requires_grad=True)
    std = torch.exp(log_std)  # computed once, outside the loop
    for step in range(2):
        z = dist.Normal(0.0, std).rsample((4,))
        if step == 0:
            z.sum().backward()
        else:
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                z.sum().backward()
    q = ParametrizedDistribution("q", dist.Normal, loc=0.0, scale=1.0)
    scales = []
    for _ in range(2):
        d = q()
        d.rsample((4,)).pow(2).sum().backward()  # no error: a fresh graph each call
        scales.append(d.scale)
        with torch.no_grad():
            for p in q.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    assert scales[0].item() != scales[1].item()


def test_names_constraints_and_values_reread_each_call():
    q = ParametrizedDistribution("q", dist.Gamma, concentration=2.0, rate=3.0)
    d = q()
    store = pyro.get_param_store()
    assert sorted(store.keys()) == ["q.concentration", "q.rate"]
    assert store._constraints["q.rate"] is constraints.positive
    assert torch.allclose(store["q.rate"].unconstrained(), torch.tensor(3.0).log())
    with torch.no_grad():
        store["q.rate"].unconstrained().fill_(0.0)
    assert q().rate.item() == 1.0 and d.rate.item() == 3.0
    assert isinstance(q(), torch.distributions.Gamma)


def test_fixed_defaults_event_dim_and_torch_classes():
    q = ParametrizedDistribution("t", dist.StudentT, fixed={"df": 4.0}, loc=torch.zeros(3))
    assert list(pyro.get_param_store().keys()) == []  # registered at the first call
    d = q()
    assert sorted(pyro.get_param_store().keys()) == ["t.loc", "t.scale"]  # scale: its default 1.
    assert bool((d.df == 4.0).all()) and bool((d.scale == 1.0).all())
    q = ParametrizedDistribution(
        "n", torch.distributions.Normal, event_dim=1, loc=torch.zeros(3), scale=torch.ones(3)
    )
    d = q()
    assert d.event_shape == (3,) and hasattr(d, "to_event")


def test_alternative_parametrizations_learn_what_is_given():
    q = ParametrizedDistribution("b", dist.Bernoulli, logits=torch.zeros(2))
    assert torch.equal(q().probs, torch.full((2,), 0.5))
    assert list(pyro.get_param_store().keys()) == ["b.logits"]
    q = ParametrizedDistribution("c", dist.Categorical, probs=torch.tensor([0.2, 0.8]))
    assert pyro.get_param_store()._constraints.get("c.probs") is None  # lazily registered
    q()
    assert pyro.get_param_store()._constraints["c.probs"] is constraints.simplex
    q = ParametrizedDistribution(
        "m", dist.MultivariateNormal, loc=torch.zeros(2), scale_tril=torch.eye(2)
    )
    assert q().scale_tril.shape == (2, 2)
    assert pyro.get_param_store()._constraints["m.scale_tril"] is constraints.lower_cholesky
    q = ParametrizedDistribution("k", dist.Binomial, total_count=10, probs=0.3)
    assert float(q().total_count) == 10 and "k.total_count" not in pyro.get_param_store()


def test_constraints_hold_after_many_steps_at_large_lr():
    qs = [
        ParametrizedDistribution("g", dist.Gamma, concentration=1.0, rate=1.0),
        ParametrizedDistribution("be", dist.Beta, concentration1=1.0, concentration0=1.0),
        ParametrizedDistribution("d", dist.Dirichlet, concentration=torch.ones(3)),
        ParametrizedDistribution("n", dist.Normal, loc=0.0, scale=1.0),
    ]
    params = [p for q in qs for p in q.parameters()]
    opt = torch.optim.Adam(params, lr=1.0)
    for _ in range(100):
        loss = sum((q().rsample((8,)) - 3.0).pow(2).sum() for q in qs)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for q in qs:
        for arg, value in q.params().items():
            assert q.constraints[arg].check(value).all(), (q, arg, value)


@pytest.mark.parametrize(
    "family,kwargs,match",
    [
        (dist.Normal, {"loc": 0.0}, "argument 'scale' needs a value"),
        (dist.Normal, {"loc": 0.0, "scale": -1.0}, "violates its constraint"),
        (dist.Normal, {"loc": 0.0, "sd": 1.0}, r"unknown init argument\(s\) \['sd'\]"),
        (dist.Uniform, {"low": 0.0, "high": 1.0}, "arg_constraints depend on its parameters"),
        (dist.Bernoulli, {"probs": 0.5, "logits": 0.0}, "alternative parametrizations"),
        (dist.Bernoulli, {}, r"pass exactly one of \['probs', 'logits'\]"),
        (dist.Normal, {"loc": 0.0, "scale": 1.0, "fixed": {"scale": 2.0}}, "both as learned"),
        ("Normal", {"loc": 0.0, "scale": 1.0}, "expected a distribution class"),
    ],
)
def test_clear_errors(family, kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        ParametrizedDistribution("q", family, **kwargs)


def test_dependent_arg_constraint_can_only_be_fixed():
    class Shifted(dist.Normal):
        arg_constraints = {"loc": constraints.dependent, "scale": constraints.positive}

    with pytest.raises(ValueError, match="'loc' has a parameter-dependent constraint.*fixed="):
        ParametrizedDistribution("q", Shifted, loc=0.0, scale=1.0)
    assert ParametrizedDistribution("q", Shifted, fixed={"loc": 0.0}, scale=1.0)().loc == 0.0
