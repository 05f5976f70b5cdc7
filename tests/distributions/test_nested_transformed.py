"""A nested ``TransformedDistribution`` ``TD(TD(base, [t1]), [t2])`` splits as ``TD(base, [t1, t2])``.

Reference: a hand-written surrogate on the same draw, with the pathwise gradient
``g_z = J^{-T} (grad log q0(x0) - grad log|det J(x0)|)`` from an explicit Jacobian of the
whole map ``x0 -> z`` (no rule of the package, no inverse):

* STL: ``-(log p(x, z) - <stop(g_z), z>)``;
* DReG (alpha = 0): ``-sum_k stop(w_k)^2 (log p(x, z_k) - <stop(g_k), z_k>)``, ``w`` the
  self-normalized importance weights.
"""

import math

import pyro
import pyro.distributions as dist
import pyro.distributions.transforms as T
import pytest
import torch
from pyro.infer import RenyiELBO
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from torch.distributions import transforms as tT

from pyro_gradroute.distributions import split_log_prob
from pyro_gradroute.distributions.split import flatten_transformed
from pyro_gradroute.infer import TraceDReG_ELBO, TraceSTL_ELBO
from pyro_gradroute.poutine import stick_the_landing

D = 2
SEED = 7


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _data():
    return torch.tensor([[0.3, -0.2], [0.1, 0.5], [0.4, 0.0]])


def _prior():
    return dist.Gamma(torch.full((D,), 2.0), 1.0).to_event(1)


def model():
    x = _data()
    z = pyro.sample("z", _prior())
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.Normal(z.log(), 1.0).to_event(1), obs=x)


def _base(p):
    return dist.Normal(p["loc"], p["log_scale"].exp()).to_event(1)


def _inner_planar(p, m):
    # an inner flow without an inverse, a cached parameter-free outer transform
    inner = dist.TransformedDistribution(_base(p), [m["flow"]])
    return dist.TransformedDistribution(inner, [tT.ExpTransform(cache_size=1)])


def _learnable_base_cached_exp(p, m):
    # a learnable base through an inner cached ExpTransform, a parametrized outer transform
    inner = dist.TransformedDistribution(_base(p), [tT.ExpTransform(cache_size=1)])
    return dist.TransformedDistribution(inner, [tT.AffineTransform(p["a"], p["b"].exp())])


def _inner_cached_power(p, m):
    inner = dist.TransformedDistribution(
        _base(p), [tT.ExpTransform(), tT.PowerTransform(torch.tensor(1.5), cache_size=1)]
    )
    return dist.TransformedDistribution(inner, [tT.AffineTransform(p["a"], p["b"].exp())])


def _reinterpreted_inner(p, m):
    # the outer flow reads vectors: the outer TD wraps the elementwise inner one in Independent
    inner = dist.TransformedDistribution(
        dist.Normal(p["loc"], p["log_scale"].exp()), [tT.AffineTransform(0.1, 1.2, cache_size=1)]
    )
    return dist.TransformedDistribution(inner, [m["flow"], tT.ExpTransform(cache_size=1)])


CASES = {
    "inner_planar": _inner_planar,
    "learnable_base_cached_exp": _learnable_base_cached_exp,
    "inner_cached_power": _inner_cached_power,
    "reinterpreted_inner": _reinterpreted_inner,
}


def _setup(name):
    pyro.clear_param_store()
    torch.manual_seed(0)
    flow = T.planar(D)
    for w in flow.parameters():
        w.data.normal_(0, 0.5)
    mods = {"flow": flow}
    make = CASES[name]

    def params():
        return {
            "loc": pyro.param("loc", torch.tensor([0.1, -0.2])),
            "log_scale": pyro.param("log_scale", torch.tensor([-0.5, -0.3])),
            "a": pyro.param("a", torch.tensor([0.2, 0.1])),
            "b": pyro.param("b", torch.tensor([0.1, -0.1])),
        }

    def guide():
        pyro.module("flow", flow)
        pyro.sample("z", make(params(), mods))

    guide()
    return guide, lambda p: make(p, mods), params, flow


def _leaves(fn):
    ts = []
    while isinstance(fn, torch.distributions.TransformedDistribution):
        ts = list(fn.transforms) + ts
        fn = fn.base_dist
    while isinstance(fn, torch.distributions.Independent):
        fn = fn.base_dist
    return fn, ts


def _map(ts):
    def F(x):
        for t in ts:
            x = t._call(x) if isinstance(t, torch.nn.Module) else t.with_cache(0)(x)
        return x

    return F


def _reference(q, params, K=None):
    """(loss, surrogate) of STL (K None) or DReG alpha=0 (K particles) on the draw of seed SEED."""
    torch.manual_seed(SEED)
    base, ts = _leaves(q(params))
    x0 = base.rsample([K] if K else [])
    F = _map(ts)
    z = F(x0)
    base_d, _ = _leaves(q({k: v.detach() for k, v in params.items()}))
    gs, lqs = [], []
    for xb in x0.detach().reshape(-1, D):
        xx = xb.clone().requires_grad_()
        J = torch.autograd.functional.jacobian(F, xx, create_graph=True)
        ladj = torch.linalg.slogdet(J)[1]
        g_ladj = torch.autograd.grad(ladj, xx)[0]
        x2 = xb.clone().requires_grad_()
        lq0 = base_d.log_prob(x2).sum()
        g0 = torch.autograd.grad(lq0, x2)[0]
        gs.append(torch.linalg.solve(J.detach().T, g0 - g_ladj))
        lqs.append((lq0 - ladj).detach())
    g = torch.stack(gs)
    zz = z.reshape(-1, D)
    x = _data()
    lp = torch.stack(
        [
            _prior().log_prob(zi) + dist.Normal(zi.log(), 1.0).to_event(1).log_prob(x).sum()
            for zi in zz
        ]
    )
    logw = (lp - torch.stack(lqs)).detach()
    path = lp - (g * zz).sum(-1)
    if K is None:
        return -logw.sum().item(), -path.sum()
    w = torch.softmax(logw, 0)
    return -(torch.logsumexp(logw, 0) - math.log(K)).item(), -(w**2 * path).sum()


def _run(est):
    if est == "TraceSTL_ELBO":
        return lambda g: TraceSTL_ELBO(max_plate_nesting=1).loss_and_grads(model, g)
    if est == "stick_the_landing":
        return lambda g: PyroTrace_ELBO(max_plate_nesting=1).loss_and_grads(
            model, stick_the_landing(g)
        )
    return lambda g: TraceDReG_ELBO(num_particles=3, max_plate_nesting=1).loss_and_grads(model, g)


@pytest.mark.parametrize("est", ["TraceSTL_ELBO", "stick_the_landing", "TraceDReG_ELBO"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_nested_equals_hand_written_reference_on_the_same_draw(name, est, float64):
    guide, q, params, _ = _setup(name)
    K = 3 if est == "TraceDReG_ELBO" else None
    ref_loss, surrogate = _reference(q, params(), K)
    leaves = dict(pyro.get_param_store().named_parameters())
    expected = torch.autograd.grad(surrogate, list(leaves.values()), allow_unused=True)
    # the loss is Pyro's on the same draw, and the hand-written one
    pyro.set_rng_seed(SEED)
    pyro_elbo = (
        RenyiELBO(alpha=0, num_particles=3, vectorize_particles=True, max_plate_nesting=1)
        if K
        else PyroTrace_ELBO(max_plate_nesting=1)
    )
    pyro_loss = pyro_elbo.loss(model, guide)
    assert pyro_loss == pytest.approx(ref_loss, rel=1e-10)
    for w in leaves.values():
        w.grad = None
    pyro.set_rng_seed(SEED)
    loss = _run(est)(guide)
    assert loss == pytest.approx(ref_loss, rel=1e-10)
    for (k, w), e in zip(leaves.items(), expected):
        got = torch.zeros_like(w) if w.grad is None else w.grad
        want = torch.zeros_like(w) if e is None else e
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=k)


def test_flatten_is_the_same_distribution(float64):
    _, q, params, flow = _setup("reinterpreted_inner")
    nested = q(params())
    flat = flatten_transformed(nested)
    assert not isinstance(flat.base_dist, torch.distributions.TransformedDistribution)
    assert len(flat.transforms) == 3
    assert flat.batch_shape == nested.batch_shape and flat.event_shape == nested.event_shape
    torch.manual_seed(1)
    a = nested.rsample([4])
    torch.manual_seed(1)
    b = flat.rsample([4])
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # an invertible nesting: the same log-density (through the inverse) at a fresh point
    inner = dist.TransformedDistribution(dist.Normal(0.2, 1.3), [tT.ExpTransform()])
    nested = dist.TransformedDistribution(inner, [tT.AffineTransform(1.0, 2.0)])
    flat = flatten_transformed(nested)
    y = torch.tensor([1.5, 3.0])
    torch.testing.assert_close(flat.log_prob(y), nested.log_prob(y))


def test_split_log_prob_of_a_nested_flow(float64):
    """One split of TD(TD(base, [planar]), [exp]) at its own sample: pathwise = -(surrogate's q part)."""
    _, q, params, _ = _setup("inner_planar")
    p = params()
    torch.manual_seed(SEED)
    fn = q(p)
    z = fn.rsample()
    lp, score, path = split_log_prob(fn, z)
    torch.testing.assert_close(lp, fn.log_prob(z))
    # pathwise gradient = <g_z, dz/dphi>: the reference surrogate without the model's part
    _, ts = _leaves(fn)
    _, surrogate = _reference(q, p)
    leaves = [*p.values(), *ts[0].parameters()]
    torch.manual_seed(SEED)
    base, _ = _leaves(q(p))
    zz = _map(ts)(base.rsample())
    lp_model = (
        _prior().log_prob(zz) + dist.Normal(zz.log(), 1.0).to_event(1).log_prob(_data()).sum()
    )
    want = torch.autograd.grad(surrogate + lp_model, leaves, allow_unused=True)  # <g_z, z>
    got = torch.autograd.grad(path, leaves, allow_unused=True)
    for a, b in zip(got, want):
        if b is None:
            assert a is None or torch.all(a == 0)
        else:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
