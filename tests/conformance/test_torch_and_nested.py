"""Conformance cells: plain torch distributions, nested transformed distributions, handler misuse.

* ``split_log_prob`` of a plain ``torch.distributions`` object (the plain-PyTorch user's question)
  equals the naive two-pass computation written by hand, in value and gradient, per family;
* a nested ``TransformedDistribution`` ``TD(TD(base, [t1]), [t2])`` gives the same as the flat
  ``TD(base, [t1, t2])`` (Pyro's meaning);
* ``with stick_the_landing(): Trace_ELBO().loss_and_grads(model, guide)`` equals
  ``Trace_ELBO().loss_and_grads(model, stick_the_landing(guide))`` on every registry case (or
  both raise where STL refuses), and ``stick_the_landing(model)`` raises naming a site.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.distributions as td
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from torch.distributions import constraints
from torch.distributions import transforms as T

from pyro_gradroute.poutine import stick_the_landing

from . import checks as K
from .cases import CASES

ESTIMATORS = ("Trace", "STL", "Adaptive", "DReG1", "DReGK")
X = torch.tensor([0.4, 1.3, -0.2, 0.9], dtype=torch.float64)


def _torch_families():
    """name -> (builder from parameter tensors, the parameter tensors): plain torch objects."""
    f64 = torch.float64
    loc = torch.tensor([0.2, -0.1], dtype=f64)
    tril = torch.tensor([[0.7, 0.0], [0.2, 0.5]], dtype=f64)
    conc = torch.tensor([3.0, 1.5], dtype=f64)
    return {
        "normal": (lambda m, s: td.Normal(m, s), (loc, tril.diagonal())),
        "independent": (lambda m, s: td.Independent(td.Normal(m, s), 1), (loc, tril.diagonal())),
        "mvn": (lambda m, L: td.MultivariateNormal(m, scale_tril=L), (loc, tril)),
        "lowrank_mvn": (
            lambda m, W, d: td.LowRankMultivariateNormal(m, W, d),
            (loc, tril[:, :1].clone(), conc.clone()),
        ),
        "gamma": (lambda c, r: td.Gamma(c, r), (conc, conc.flip(0))),
        "beta": (lambda a, b: td.Beta(a, b), (conc, conc.flip(0))),
        "dirichlet": (lambda c: td.Dirichlet(c), (conc,)),
        "transformed": (
            lambda m, s: td.TransformedDistribution(td.Normal(m, s), [T.ExpTransform()]),
            (loc, tril.diagonal()),
        ),
    }


@pytest.mark.parametrize("family", sorted(_torch_families()))
def test_split_log_prob_of_a_torch_distribution_equals_the_naive_two_pass(family):
    """The three parts of a plain torch distribution, against two evaluations written by hand."""
    from pyro_gradroute.distributions import split_log_prob

    build, params = _torch_families()[family]
    for seed in range(3):
        torch.manual_seed(seed)
        ps = [p.clone().requires_grad_() for p in params]
        fn = build(*ps)
        z = fn.rsample()
        lp, score, path = split_log_prob(fn, z)
        # naive: the density with the sample stopped, and rebuilt from detached parameters
        ref_score = build(*ps).log_prob(z.detach())
        ref_path = build(*(p.detach() for p in ps)).log_prob(z)
        ref_lp = build(*ps).log_prob(z)
        for ours, ref in ((lp, ref_lp), (score, ref_score), (path, ref_path)):
            torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
            g = torch.autograd.grad(ours.sum(), ps, retain_graph=True, allow_unused=True)
            gr = torch.autograd.grad(ref.sum(), ps, retain_graph=True, allow_unused=True)
            for a, b in zip(g, gr):
                a = torch.zeros_like(ps[0]) if a is None else a
                b = torch.zeros_like(ps[0]) if b is None else b
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _grads(elbo, model, guide, seed, unused_as_zeros=False):
    """Loss and parameter gradients on one seed (``unused_as_zeros``: zeros for the parameters
    no gradient reached, such as an unused module)."""
    pyro.set_rng_seed(seed)
    store = pyro.get_param_store()
    for p in store.values():
        p.unconstrained().grad = None
    loss = elbo.loss_and_grads(model, guide)
    leaves = {k: v.unconstrained() for k, v in store.items()}
    return loss, {
        k: torch.zeros_like(p) if p.grad is None and unused_as_zeros else p.grad.clone()
        for k, p in leaves.items()
    }


def _elbo(est):
    return {
        "Trace": lambda: K.Trace_ELBO(),
        "STL": lambda: K.TraceSTL_ELBO(),
        "Adaptive": lambda: K.TraceAdaptiveSTL_ELBO(),
        "DReG1": lambda: K.TraceDReG_ELBO(num_particles=1),
        "DReGK": lambda: K.TraceDReG_ELBO(num_particles=3, vectorize_particles=True),
    }[est]()


NESTED = {
    # name: (nested, flat) given (loc, scale, a): base Normal(loc, scale) on R
    "affine_in_exp": (
        lambda loc, s, a: dist.TransformedDistribution(
            dist.TransformedDistribution(dist.Normal(loc, s), [T.AffineTransform(0.3, a)]),
            [T.ExpTransform()],
        ),
        lambda loc, s, a: dist.TransformedDistribution(
            dist.Normal(loc, s), [T.AffineTransform(0.3, a), T.ExpTransform()]
        ),
    ),
    "cached_power_in_affine": (
        lambda loc, s, a: dist.TransformedDistribution(
            dist.TransformedDistribution(
                dist.Normal(loc, s),
                [T.ExpTransform(cache_size=1), T.PowerTransform(a, cache_size=1)],
            ),
            [T.AffineTransform(0.1, 2.0)],
        ),
        lambda loc, s, a: dist.TransformedDistribution(
            dist.Normal(loc, s),
            [
                T.ExpTransform(cache_size=1),
                T.PowerTransform(a, cache_size=1),
                T.AffineTransform(0.1, 2.0),
            ],
        ),
    ),
}


def _nested_model():
    w = pyro.sample("w", dist.LogNormal(torch.tensor(0.0, dtype=torch.float64), 1.0))
    with pyro.plate("d", len(X)):
        pyro.sample("x", dist.Normal(w, 1.0), obs=X.abs())


def _nested_guide(make):
    def guide():
        f64 = torch.float64
        loc = pyro.param("n_loc", torch.tensor(0.1, dtype=f64))
        s = pyro.param("n_s", torch.tensor(0.4, dtype=f64), constraint=constraints.positive)
        a = pyro.param("n_a", torch.tensor(1.2, dtype=f64), constraint=constraints.positive)
        pyro.sample("w", make(loc, s, a))

    return guide


@pytest.mark.parametrize("est", ESTIMATORS)
@pytest.mark.parametrize("case", sorted(NESTED))
def test_nested_transformed_equals_flat(case, est):
    nested, flat = NESTED[case]
    pyro.clear_param_store()
    _nested_guide(flat)()
    for seed in range(3):
        ln, gn = _grads(_elbo(est), _nested_model, _nested_guide(nested), seed)
        lf, gf = _grads(_elbo(est), _nested_model, _nested_guide(flat), seed)
        assert ln == pytest.approx(lf, rel=1e-10, abs=1e-10)
        for k in gf:
            torch.testing.assert_close(gn[k], gf[k], rtol=1e-9, atol=1e-10)


def _flow():
    torch.manual_seed(0)
    flow = dist.transforms.planar(2).to(torch.float64)
    for w in flow.parameters():
        w.data.normal_(0, 0.5)
    return flow


def _base(loc, s):
    return dist.Normal(loc, s).to_event(1)


# the two that crashed ("not used in the graph"): an inner flow, and a learnable base through
# an inner cached ExpTransform under a parametrized outer transform
NESTED_2D = {
    "planar_in_exp": (
        lambda loc, s, a, f: dist.TransformedDistribution(
            dist.TransformedDistribution(_base(loc, s), [f]), [T.ExpTransform(cache_size=1)]
        ),
        lambda loc, s, a, f: dist.TransformedDistribution(
            _base(loc, s), [f, T.ExpTransform(cache_size=1)]
        ),
    ),
    "base_through_cached_exp": (
        lambda loc, s, a, f: dist.TransformedDistribution(
            dist.TransformedDistribution(_base(loc, s), [T.ExpTransform(cache_size=1)]),
            [T.AffineTransform(0.1, a)],
        ),
        lambda loc, s, a, f: dist.TransformedDistribution(
            _base(loc, s), [T.ExpTransform(cache_size=1), T.AffineTransform(0.1, a)]
        ),
    ),
}


def _nested_model_2d():
    w = pyro.sample("w", dist.LogNormal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1))
    with pyro.plate("d", len(X)):
        pyro.sample("x", dist.Normal(w.sum(-1), 1.0), obs=X.abs())


def _nested_guide_2d(make, flow):
    def guide():
        f64 = torch.float64
        pyro.module("flow", flow)
        loc = pyro.param("n2_loc", torch.tensor([0.1, -0.2], dtype=f64))
        s = pyro.param("n2_s", torch.tensor([0.4, 0.3], dtype=f64), constraint=constraints.positive)
        a = pyro.param("n2_a", torch.tensor([1.2, 0.8], dtype=f64), constraint=constraints.positive)
        pyro.sample("w", make(loc, s, a, flow))

    return guide


@pytest.mark.parametrize("est", ESTIMATORS)
@pytest.mark.parametrize("case", sorted(NESTED_2D))
def test_nested_flow_and_cached_transform_equal_flat(case, est):
    """Pyro's meaning: the nested distribution is the flat one (the flat one is checked against an
    explicit Jacobian in tests/distributions/test_nested_transformed.py)."""
    nested, flat = NESTED_2D[case]
    pyro.clear_param_store()
    flow = _flow()
    _nested_guide_2d(flat, flow)()
    for seed in range(3):
        ln, gn = _grads(_elbo(est), _nested_model_2d, _nested_guide_2d(nested, flow), seed, True)
        lf, gf = _grads(_elbo(est), _nested_model_2d, _nested_guide_2d(flat, flow), seed, True)
        assert ln == pytest.approx(lf, rel=1e-10, abs=1e-10)
        reached = {k for k, g in gf.items() if g.abs().max() > 0}
        assert {"n2_loc", "n2_s"} <= reached  # the base's parameters get a gradient
        planar = case == "planar_in_exp"  # its flow's parameters, or the outer affine's
        assert any(k.startswith("flow") for k in reached) == planar
        assert ("n2_a" in reached) == (not planar)
        for k in gf:
            torch.testing.assert_close(gn[k], gf[k], rtol=1e-9, atol=1e-10)


HANDLER_CASES = [c for c in CASES if not c.messenger]


@pytest.mark.parametrize("case", HANDLER_CASES, ids=[c.name for c in HANDLER_CASES])
def test_handler_as_context_manager_equals_wrapped_guide(case):
    spec = case.raise_for("STL", routed=False)
    with K.cell(case) as c:
        elbo = PyroTrace_ELBO(max_plate_nesting=case.max_plate_nesting)
        wrapped = stick_the_landing(c.guide)
        for seed in range(2):

            def around(seed=seed):
                pyro.set_rng_seed(seed)
                with stick_the_landing():
                    return elbo.loss_and_grads(c.model, c.guide, *c.args)

            def inside(seed=seed):
                pyro.set_rng_seed(seed)
                return elbo.loss_and_grads(c.model, wrapped, *c.args)

            if spec is not None and not spec.optional:
                for fn in (around, inside):
                    with pytest.raises(spec.exc, match=spec.match):
                        K.grad_of(c, fn)
                return
            la, ga = K.grad_of(c, around)
            li, gi = K.grad_of(c, inside)
            assert la == pytest.approx(li, rel=1e-9, abs=1e-9)
            torch.testing.assert_close(ga, gi, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("case", HANDLER_CASES, ids=[c.name for c in HANDLER_CASES])
def test_handler_around_the_model_raises(case):
    with K.cell(case) as c:
        tr = pyro.poutine.trace(c.guide).get_trace(*c.args)
        latent = [
            n
            for n, s in tr.nodes.items()
            if s["type"] == "sample" and not s["is_observed"] and s["fn"].has_rsample
        ]
        model_latent = pyro.poutine.trace(c.model).get_trace(*c.args).nodes
        elbo = PyroTrace_ELBO(max_plate_nesting=case.max_plate_nesting)
        if not any(n in model_latent and not model_latent[n]["is_observed"] for n in latent):
            # no reparameterized latent to take pathwise: the handler changes nothing there
            def wrapped(seed=0):
                pyro.set_rng_seed(seed)
                return elbo.loss_and_grads(stick_the_landing(c.model), c.guide, *c.args)

            def plain(seed=0):
                pyro.set_rng_seed(seed)
                return elbo.loss_and_grads(c.model, c.guide, *c.args)

            la, ga = K.grad_of(c, wrapped)
            lb, gb = K.grad_of(c, plain)
            assert la == pytest.approx(lb, rel=1e-12)
            torch.testing.assert_close(ga, gb)
            return
        with pytest.raises(ValueError, match="wraps the model instead of the guide"):
            elbo.loss_and_grads(stick_the_landing(c.model), c.guide, *c.args)
