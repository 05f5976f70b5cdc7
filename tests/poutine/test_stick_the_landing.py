"""poutine.stick_the_landing under Pyro's own ELBOs, and TraceDReG_ELBO for every Renyi alpha."""

import math
from functools import partial

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import infer as pinfer
from pyro.infer import config_enumerate

from pyro_gradroute.infer import TraceDReG_ELBO
from pyro_gradroute.poutine import block_grad, stick_the_landing


def _grads(elbo, model, guide, *args, seed=0):
    pyro.set_rng_seed(seed)
    store = pyro.get_param_store()
    for p in store.values():
        p.unconstrained().grad = None
    loss = elbo.loss_and_grads(model, guide, *args)
    return loss, {
        n: p.grad.detach().clone() for n, p in store.named_parameters() if p.grad is not None
    }


def _flat(g):
    return torch.cat([g[k].reshape(-1) for k in sorted(g)])


# ----------------------------------------------------------------------------- models
X = [0.3, 1.2, -0.4]


def normal_with_discrete(exact=True):
    """loc has a known posterior; an enumerated Bernoulli b beside it explains nothing."""
    x = torch.tensor(X)
    pm, ps = x.sum().item() / 4, 0.5

    def model():
        loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
        b = pyro.sample("b", dist.Bernoulli(0.3))
        with pyro.plate("data", 3):
            pyro.sample("x", dist.Normal(loc, 1.0), obs=x)
        pyro.sample("y", dist.Normal(b, 1.0), obs=torch.tensor(0.7))

    @config_enumerate
    def guide():
        m = pyro.param("m", torch.tensor(pm if exact else pm + 0.5))
        s = pyro.param("s", torch.tensor(ps), constraint=dist.constraints.positive)
        pyro.sample("loc", dist.Normal(m, s))
        pyro.sample(
            "b",
            dist.Bernoulli(
                pyro.param("p", torch.tensor(0.4), constraint=dist.constraints.unit_interval)
            ),
        )

    return model, guide


def normal_loc(offset=0.0):
    """loc ~ N(0, 1), three N(loc, 1) points; a Normal guide at the exact posterior (+ ``offset``)."""
    x = torch.tensor(X)
    pm, ps = x.sum().item() / 4, 0.5

    def model():
        loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 3):
            pyro.sample("x", dist.Normal(loc, 1.0), obs=x)

    def guide():
        m = pyro.param("m", torch.tensor(pm))
        s = pyro.param("s", torch.tensor(ps), constraint=dist.constraints.positive)
        pyro.sample("loc", dist.Normal(m + offset, s))

    return model, guide


def mixture():
    data = torch.tensor([-2.1, -1.8, -2.4, 1.9, 2.2, 2.5])

    def model():
        with pyro.plate("components", 2):
            locs = pyro.sample("locs", dist.Normal(0.0, 3.0))
        with pyro.plate("data", len(data)):
            k = pyro.sample(
                "k", dist.Categorical(torch.ones(2) / 2), infer={"enumerate": "parallel"}
            )
            pyro.sample("x", dist.Normal(locs[k], 0.5), obs=data)

    def guide():
        m = pyro.param("m", torch.tensor([-1.5, 1.5]))
        s = pyro.param("s", torch.tensor([0.4, 0.4]), constraint=dist.constraints.positive)
        with pyro.plate("components", 2):
            pyro.sample("locs", dist.Normal(m, s))

    return model, guide


# ----------------------------------------------------------------------------- STL under Pyro's ELBOs
def test_enum_stl_variance_vanishes_at_exact_posterior():
    torch.set_default_dtype(torch.float64)
    model, guide = normal_with_discrete()
    elbo = pinfer.TraceEnum_ELBO(max_plate_nesting=1)
    cont = lambda g: torch.stack([g["m"], g["s"]])  # noqa: E731  (p's gradient is exact under enumeration)
    stl = torch.stack(
        [cont(_grads(elbo, model, stick_the_landing(guide), seed=i)[1]) for i in range(30)]
    )
    ref = torch.stack([cont(_grads(elbo, model, guide, seed=i)[1]) for i in range(30)])
    assert (stl.var(0) <= 1e-8 * ref.var(0)).all(), (stl.var(0), ref.var(0))


@pytest.mark.slow
def test_enum_mixture_loss_identical_and_mean_gradient_equal():
    torch.set_default_dtype(torch.float64)
    model, guide = mixture()
    elbo = pinfer.TraceEnum_ELBO(max_plate_nesting=1)
    draws = 200
    a, b = [], []
    for i in range(draws):
        la, ga = _grads(elbo, model, stick_the_landing(guide), seed=i)
        lb, gb = _grads(elbo, model, guide, seed=i)
        assert la == pytest.approx(lb, rel=1e-12)
        a.append(_flat(ga))
        b.append(_flat(gb))
    d = torch.stack(a) - torch.stack(b)  # paired on the same draws: STL - Trace has mean zero
    assert (d.mean(0).abs() < 5 * d.std(0) / math.sqrt(draws)).all()


@pytest.mark.slow
def test_tracegraph_stl_with_a_discrete_site_upstream_is_unbiased():
    torch.set_default_dtype(torch.float64)

    def model():
        b = pyro.sample("b", dist.Bernoulli(0.4))
        z = pyro.sample("z", dist.Normal(2.0 * b - 1.0, 1.0))
        pyro.sample("x", dist.Normal(z, 0.5), obs=torch.tensor(0.8))

    def guide():
        p = pyro.param("p", torch.tensor(0.5), constraint=dist.constraints.unit_interval)
        b = pyro.sample("b", dist.Bernoulli(p))
        w = pyro.param("w", torch.tensor(0.3))
        pyro.sample(
            "z",
            dist.Normal(
                w + b, pyro.param("s", torch.tensor(0.8), constraint=dist.constraints.positive)
            ),
        )

    elbo = pinfer.TraceGraph_ELBO()
    draws = 300
    d = torch.stack(
        [
            _flat(_grads(elbo, model, stick_the_landing(guide), seed=i)[1])
            - _flat(_grads(elbo, model, guide, seed=i)[1])
            for i in range(draws)
        ]
    )
    assert (d.mean(0).abs() < 5 * d.std(0) / math.sqrt(draws) + 1e-12).all()


@pytest.mark.parametrize(
    "elbo_cls", [pinfer.Trace_ELBO, pinfer.TraceGraph_ELBO, pinfer.TraceEnum_ELBO]
)
def test_gradient_is_zero_at_exact_posterior(elbo_cls):
    torch.set_default_dtype(torch.float64)
    model, guide = normal_loc()

    for seed in range(3):
        _, g = _grads(elbo_cls(max_plate_nesting=1), model, stick_the_landing(guide), seed=seed)
        assert _flat(g).abs().max() < 1e-12


def test_mean_field_keeps_the_analytic_kl():
    torch.set_default_dtype(torch.float64)
    model_c, guide_c = normal_loc(offset=0.5)  # away from the posterior: the KL has a gradient

    elbo = pinfer.TraceMeanField_ELBO(max_plate_nesting=1)
    for seed in range(3):
        la, ga = _grads(elbo, model_c, stick_the_landing(guide_c), seed=seed)
        lb, gb = _grads(elbo, model_c, guide_c, seed=seed)
        assert la == lb and torch.equal(ga["m"], gb["m"])  # the KL is exact: nothing to drop


@pytest.mark.parametrize("elbo_cls", [pinfer.RenyiELBO, pinfer.ReweightedWakeSleep])
def test_importance_weighted_elbos_raise(elbo_cls):
    model, guide = mixture()
    with pytest.raises(ValueError, match="TraceDReG_ELBO"):
        elbo_cls(num_particles=2).loss(model, stick_the_landing(guide))


JIT = [
    (pinfer.JitTrace_ELBO, pinfer.Trace_ELBO),
    (pinfer.JitTraceGraph_ELBO, pinfer.TraceGraph_ELBO),
    (pinfer.JitTraceEnum_ELBO, pinfer.TraceEnum_ELBO),
]


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("jit_cls, plain_cls", JIT, ids=[j.__name__ for j, _ in JIT])
@pytest.mark.parametrize("offset", [0.0, 0.7], ids=["exact", "off"])
def test_jit_elbos_equal_the_plain_ones(jit_cls, plain_cls, offset):
    torch.set_default_dtype(torch.float64)
    model, guide = normal_loc(offset)

    stl = stick_the_landing(guide)
    jit, plain = jit_cls(max_plate_nesting=1), plain_cls(max_plate_nesting=1)
    _grads(jit, model, stl, seed=0)  # the first call traces (and draws differently)
    for seed in range(1, 4):
        la, ga = _grads(jit, model, stl, seed=seed)
        lb, gb = _grads(plain, model, stl, seed=seed)
        assert la == pytest.approx(lb, rel=1e-12)
        torch.testing.assert_close(_flat(ga), _flat(gb), rtol=1e-10, atol=1e-12)
        if offset == 0.0:
            assert _flat(ga).abs().max() < 1e-12  # the exact posterior: zero


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_jit_conditional_site_raises_clearly():
    def model():
        a = pyro.sample("a", dist.Normal(0.0, 1.0))
        pyro.sample("b", dist.Normal(a, 1.0))

    def guide():
        a = pyro.sample("a", dist.Normal(pyro.param("m", torch.tensor(0.1)), 1.0))
        pyro.sample("b", dist.Normal(pyro.param("w", torch.tensor(0.5)) * a, 1.0))

    with pytest.raises(NotImplementedError, match="site 'b'.*JIT"):
        pinfer.JitTrace_ELBO().loss_and_grads(model, stick_the_landing(guide))


def _two_level():
    def model():
        x = pyro.sample("x", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 2):
            pyro.sample("y", dist.Normal(x, 1.0))

    return model


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("Guide", ["AutoGaussian", "AutoStructured"])
def test_jit_structured_guides_equal_the_plain_elbo(Guide):
    """``AutoGaussian`` and an ``AutoStructured`` without dependencies under the JIT ELBO: the
    same loss and gradient as the non-JIT ELBO on the same random numbers."""
    from pyro.infer import autoguide

    torch.set_default_dtype(torch.float64)
    model = _two_level()
    pyro.clear_param_store()
    kw = {"dependencies": {}} if Guide == "AutoStructured" else {}
    stl = stick_the_landing(getattr(autoguide, Guide)(model, **kw))
    jit, plain = pinfer.JitTrace_ELBO(), pinfer.Trace_ELBO()
    _grads(jit, model, stl, seed=0)  # the first call traces
    for seed in range(1, 3):
        la, ga = _grads(jit, model, stl, seed=seed)
        lb, gb = _grads(plain, model, stl, seed=seed)
        assert la == pytest.approx(lb, rel=1e-12)
        torch.testing.assert_close(_flat(ga), _flat(gb), rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_jit_structured_dependency_raises_clearly():
    """An ``AutoStructured`` dependency (a module evaluated with its parameters stopped) under
    the JIT ELBO raises naming the site and the non-JIT ELBOs, not torch's own error."""
    from pyro.infer.autoguide import AutoStructured

    model = _two_level()
    pyro.clear_param_store()
    conditionals = {"x": "normal", "y": "normal"}
    guide = AutoStructured(model, conditionals=conditionals, dependencies={"y": {"x": "linear"}})
    with pytest.raises(NotImplementedError, match="site 'y'.*'x'.*JIT.*Trace_ELBO"):
        pinfer.JitTrace_ELBO().loss_and_grads(model, stick_the_landing(guide))


def test_no_reparameterized_site_warns():
    def model():
        pyro.sample("k", dist.Poisson(3.0))

    def guide():
        pyro.sample(
            "k",
            dist.Poisson(pyro.param("r", torch.tensor(2.0), constraint=dist.constraints.positive)),
        )

    with pytest.warns(UserWarning, match="no reparameterized site"):
        pinfer.Trace_ELBO().loss(model, stick_the_landing(guide))


@pytest.mark.parametrize(
    "elbo_cls", [pinfer.Trace_ELBO, pinfer.TraceGraph_ELBO, pinfer.TraceEnum_ELBO]
)
def test_block_grad_composes(elbo_cls):
    torch.set_default_dtype(torch.float64)

    def model(detach=False):
        w = pyro.param("w", torch.tensor(0.6))
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(z * w, 1.0), obs=torch.tensor(0.9))
        pyro.sample(
            "y", dist.Normal(z * (w.detach() if detach else w), 0.5), obs=torch.tensor(-0.3)
        )

    def guide(detach=False):
        pyro.sample("z", dist.Normal(pyro.param("m", torch.tensor(0.2)), 0.8))

    elbo = elbo_cls(max_plate_nesting=0)
    for seed in range(3):
        _, routed = _grads(
            elbo, block_grad(model, sites="y", params=["w"]), stick_the_landing(guide), seed=seed
        )
        _, ref = _grads(elbo, partial(model, detach=True), stick_the_landing(guide), seed=seed)
        torch.testing.assert_close(_flat(routed), _flat(ref), rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- DReG for every alpha
def _local():
    x = torch.tensor([0.3, 1.2, -0.4, 2.0])

    def model():
        with pyro.plate("data", 4):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z, 0.5), obs=x)

    def guide(exact=False):
        # exact posterior per point: N(x / 1.25, sqrt(0.2))
        w = pyro.param("w", torch.tensor(0.8 if exact else 0.3))
        s = pyro.param(
            "s", torch.tensor(0.2**0.5 if exact else 0.9), constraint=dist.constraints.positive
        )
        with pyro.plate("data", 4):
            pyro.sample("z", dist.Normal(w * x, s))

    return model, guide


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [-0.5, 0.2, 0.5, 0.9])
def test_renyi_dreg_loss_and_mean_gradient(alpha):
    torch.set_default_dtype(torch.float64)
    model, guide = _local()
    K, draws = 5, 300
    ours = TraceDReG_ELBO(num_particles=K, alpha=alpha, max_plate_nesting=1)
    ref = pinfer.RenyiELBO(
        alpha=alpha, num_particles=K, vectorize_particles=True, max_plate_nesting=1
    )
    a, b = [], []
    for i in range(draws):
        la, ga = _grads(ours, model, guide, seed=i)
        lb, gb = _grads(ref, model, guide, seed=i)
        assert la == pytest.approx(lb, rel=1e-12)
        a.append(_flat(ga))
        b.append(_flat(gb))
    a, b = torch.stack(a), torch.stack(b)
    se = ((a.var(0) + b.var(0)) / draws).sqrt()
    assert ((a.mean(0) - b.mean(0)).abs() < 5 * se).all(), (a.mean(0), b.mean(0), se)
    assert (a.var(0) < b.var(0)).all()  # doubly-reparameterized: lower variance here


@pytest.mark.parametrize("alpha", [-0.5, 0.2, 0.5, 0.9])
def test_renyi_dreg_zero_at_exact_posterior(alpha):
    torch.set_default_dtype(torch.float64)
    model, guide = _local()
    for seed in range(3):
        _, g = _grads(
            TraceDReG_ELBO(num_particles=6, alpha=alpha, max_plate_nesting=1),
            model,
            partial(guide, exact=True),
            seed=seed,
        )
        assert _flat(g).abs().max() < 1e-10


def test_alpha_one_is_an_error():
    with pytest.raises(ValueError, match="TraceSTL_ELBO"):
        TraceDReG_ELBO(alpha=1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"alpha": float("nan")}, "alpha must be a finite"),
        ({"num_particles": 0}, "num_particles must be an integer >= 1"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TraceDReG_ELBO(**kwargs)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_jit_with_autonormal_on_a_constrained_site_equals_the_plain_elbo():
    from pyro.infer.autoguide import AutoNormal

    torch.set_default_dtype(torch.float64)
    y = torch.tensor([1.0, 3.0, 0.0, 2.0])

    def model():
        rate = pyro.sample("rate", dist.Gamma(2.0, 1.0))
        with pyro.plate("obs", 4):
            pyro.sample("y", dist.Poisson(rate), obs=y)

    guide = stick_the_landing(AutoNormal(model))
    jit, plain = pinfer.JitTrace_ELBO(), pinfer.Trace_ELBO()
    _grads(jit, model, guide, seed=0)
    for seed in range(1, 3):
        la, ga = _grads(jit, model, guide, seed=seed)
        lb, gb = _grads(plain, model, guide, seed=seed)
        assert la == pytest.approx(lb, rel=1e-12)
        torch.testing.assert_close(_flat(ga), _flat(gb), rtol=1e-10, atol=1e-12)
