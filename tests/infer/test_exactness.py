"""Regression tests for configurations where a gradient used to be silently wrong.

Each test compares against a reference independent of the code under test: Pyro's
own estimator on the same seed, a closed form, or a hand-written surrogate.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.distributions.testing.rejection_gamma import RejectionGamma
from pyro.infer import RenyiELBO
from pyro.infer import Trace_ELBO as PyroTrace
from pyro.infer.autoguide import AutoDelta, AutoNormal

from pyro_gradroute.distributions import split_log_probs
from pyro_gradroute.infer import ReweightedWakeSleepDReG, Trace_ELBO, TraceDReG_ELBO, TraceSTL_ELBO


def _grads(elbo, model, guide, *args, seed=0):
    pyro.set_rng_seed(seed)
    for p in pyro.get_param_store().values():
        p.unconstrained().grad = None
    loss = elbo.loss_and_grads(model, guide, *args)
    store = pyro.get_param_store()
    out = {
        n: store._params[n].grad.detach().clone()
        for n in store.keys()
        if store._params[n].grad is not None
    }
    return loss, out


# ----------------------------------------------------------------------------- chains
def _chain(depth, a=0.8, s=0.6, sigma=0.5, x=1.3):
    """z0 ~ N(0,1), z_t ~ N(a z_{t-1}, s^2), x ~ N(z_T, sigma^2); exact forward conditionals."""
    T = depth + 1
    # joint covariance of z_0..z_{T-1} (prior), then condition on x = z_{T-1} + noise
    A = torch.zeros(T, T, dtype=torch.float64)
    for t in range(T):
        for u in range(t + 1):
            A[t, u] = a ** (t - u) * (1.0 if u == 0 else s)
    P = A @ A.T
    h = torch.zeros(T, dtype=torch.float64)
    h[-1] = 1.0
    Sxx = h @ P @ h + sigma**2
    C = P - torch.outer(P @ h, P @ h) / Sxx
    m = P @ h * x / Sxx
    coef = [0.0] + [float(C[t, t - 1] / C[t - 1, t - 1]) for t in range(1, T)]
    icpt = [float(m[0])] + [float(m[t] - coef[t] * m[t - 1]) for t in range(1, T)]
    var = [float(C[0, 0])] + [
        float(C[t, t] - C[t, t - 1] ** 2 / C[t - 1, t - 1]) for t in range(1, T)
    ]

    def model():
        z = pyro.sample("z0", dist.Normal(0.0, 1.0))
        for t in range(1, T):
            z = pyro.sample(f"z{t}", dist.Normal(a * z, s))
        pyro.sample("x", dist.Normal(z, sigma), obs=torch.tensor(x))

    def guide():
        z = None
        for t in range(T):
            i = pyro.param(f"i{t}", torch.tensor(icpt[t]))
            c = pyro.param(f"c{t}", torch.tensor(coef[t]))
            ls = pyro.param(f"ls{t}", torch.tensor(0.5 * math.log(var[t])))
            loc = i if z is None else i + c * z
            z = pyro.sample(f"z{t}", dist.Normal(loc, ls.exp()))

    return model, guide


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
@pytest.mark.parametrize(
    "elbo",
    [TraceSTL_ELBO(), TraceDReG_ELBO(num_particles=1), TraceDReG_ELBO(num_particles=4)],
    ids=["stl", "dreg1", "dreg4"],
)
def test_conditional_chain_gradient_is_zero_at_exact_posterior(depth, elbo):
    torch.set_default_dtype(torch.float64)
    model, guide = _chain(depth)
    for seed in range(3):
        _, g = _grads(elbo, model, guide, seed=seed)
        assert g and max(v.abs().max().item() for v in g.values()) < 1e-10


def test_split_log_prob_and_pathwise_sharing_an_upstream_sample():
    """One site's log_prob and another site's pathwise part through a shared upstream sample."""
    torch.set_default_dtype(torch.float64)
    mu = torch.tensor(0.3, requires_grad=True)
    w = torch.tensor(0.7, requires_grad=True)
    z1 = dist.Normal(mu, 1.0).rsample()
    qa, qb = dist.Normal(w * z1, 1.0), dist.Normal(-w * z1, 2.0)
    za, zb = qa.rsample(), qb.rsample()
    (lpa, _, _), (_, _, pwb) = split_log_probs([(qa, za, [z1]), (qb, zb, [z1])])
    got = torch.autograd.grad(lpa + pwb, [mu, w], retain_graph=True)
    # reference: two evaluations, phi stopped by hand in b
    ref_b = dist.Normal(-w.detach() * z1, 2.0).log_prob(zb)
    ref = torch.autograd.grad(dist.Normal(w * z1, 1.0).log_prob(za) + ref_b, [mu, w])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_split_log_probs_rejects_nested_plain_upstream():
    mu = torch.tensor(0.3, requires_grad=True)
    z0 = dist.Normal(mu, 1.0).rsample()
    z1 = dist.Normal(z0, 1.0).rsample()
    q = dist.Normal(z0 + z1, 1.0)
    with pytest.raises(ValueError, match="depends on another"):
        split_log_probs([(q, q.rsample(), [z0, z1])])


# ----------------------------------------------------------------------------- DReG and scales
def _local(N=4):
    data = torch.tensor([0.5, -1.0, 2.0, 0.3])[:N]

    def model(batch=None):
        with pyro.plate("data", N, subsample_size=2, subsample=batch) as idx:
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z, 0.5), obs=data[idx])

    def guide(batch=None):
        w = pyro.param("w", torch.tensor(0.2))
        s = pyro.param("s", torch.tensor(0.7), constraint=dist.constraints.positive)
        with pyro.plate("data", N, subsample_size=2, subsample=batch) as idx:
            pyro.sample("z", dist.Normal(w * data[idx], s))

    return model, guide, data


def _iwae_reference(model, guide, K, batch):
    """Hand-written IWAE surrogate with the all-site plate's N/b outside the log-mean-exp."""
    vec = pyro.plate("particles", K, dim=-2)
    guide_tr = poutine.trace(vec(guide)).get_trace(batch)
    model_tr = poutine.trace(poutine.replay(vec(model), trace=guide_tr)).get_trace(batch)
    log_w = 0.0
    for tr, sign in ((model_tr, 1), (guide_tr, -1)):
        for site in tr.nodes.values():
            if site["type"] == "sample" and site["name"] != "data":
                log_w = log_w + sign * site["fn"].log_prob(site["value"])
    N, b = 4, len(batch)
    return -(N / b) * (torch.logsumexp(log_w, 0) - math.log(K)).sum()


@pytest.mark.slow
def test_dreg_minibatch_all_site_plate_is_unbiased_for_the_full_data_bound():
    torch.set_default_dtype(torch.float64)
    model, guide, _ = _local()
    batch = torch.tensor([0, 2])
    K, draws = 4, 500
    elbo = TraceDReG_ELBO(num_particles=K, max_plate_nesting=1)
    elbo.loss(model, guide, batch)  # initialise params
    params = [pyro.param("w").unconstrained(), pyro.param("s").unconstrained()]
    dreg, ref = [], []
    for i in range(draws):
        pyro.set_rng_seed(i)
        for p in params:
            p.grad = None
        loss = elbo.loss_and_grads(model, guide, batch)
        dreg.append(torch.stack([p.grad for p in params]))
        pyro.set_rng_seed(i)
        surrogate = _iwae_reference(model, guide, K, batch)
        assert loss == pytest.approx(surrogate.item(), rel=1e-10)
        ref.append(torch.stack(torch.autograd.grad(surrogate, params)))
    dreg, ref = torch.stack(dreg), torch.stack(ref)
    se = (dreg.var(0) / draws + ref.var(0) / draws).sqrt()
    assert ((dreg.mean(0) - ref.mean(0)).abs() < 5 * se).all(), (dreg.mean(0), ref.mean(0), se)


@pytest.mark.slow
def test_dreg_with_tensor_poutine_scale_is_unbiased_against_renyi():
    torch.set_default_dtype(torch.float64)
    data = torch.tensor([0.5, -1.0, 2.0])
    scale = torch.tensor([0.5, 2.0, 3.0])

    def model():
        with pyro.plate("data", 3), poutine.scale(scale=scale):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z, 0.5), obs=data)

    def guide():
        g = pyro.sample("g", dist.Normal(pyro.param("m", torch.tensor(0.1)), 1.0))  # one global
        w = pyro.param("w", torch.tensor(0.2))
        with pyro.plate("data", 3), poutine.scale(scale=scale):
            pyro.sample("z", dist.Normal(w * data, 0.8))
        return g

    def model_g():
        pyro.sample("g", dist.Normal(0.0, 1.0))
        model()

    K, draws = 3, 500
    dreg = TraceDReG_ELBO(num_particles=K, max_plate_nesting=1)
    ren = RenyiELBO(alpha=0, num_particles=K, vectorize_particles=True, max_plate_nesting=1)
    ren.loss(model_g, guide)
    params = [pyro.param("m").unconstrained(), pyro.param("w").unconstrained()]
    a, b = [], []
    for i in range(draws):
        for elbo, out in ((dreg, a), (ren, b)):
            pyro.set_rng_seed(i)
            for p in params:
                p.grad = None
            elbo.loss_and_grads(model_g, guide)
            out.append(torch.stack([p.grad for p in params]))
    pyro.set_rng_seed(5)
    assert dreg.loss(model_g, guide) == pytest.approx(
        (pyro.set_rng_seed(5), ren.loss(model_g, guide))[1], rel=1e-10
    )
    a, b = torch.stack(a), torch.stack(b)
    se = (a.var(0) / draws + b.var(0) / draws).sqrt()
    assert ((a.mean(0) - b.mean(0)).abs() < 5 * se).all(), (a.mean(0), b.mean(0), se)


@pytest.mark.parametrize("K", [1, 4, 16])
def test_dreg_autodelta_gradient_is_the_map_gradient(K):
    torch.set_default_dtype(torch.float64)
    data = torch.tensor([0.5, -1.0, 2.0])

    def model():
        loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 3):
            pyro.sample("x", dist.Normal(loc, 0.5), obs=data)

    guide = AutoDelta(model)
    _, ref = _grads(PyroTrace(), model, guide)
    _, got = _grads(TraceDReG_ELBO(num_particles=K), model, guide)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- errors
def test_delta_with_parameter_density_is_a_clear_error_for_stl_and_dreg():
    # AutoStructured / AutoGaussian are supported (tests/infer/test_structured_guides.py);
    # any other Delta whose log_density depends on parameters directly still raises
    def model():
        a = pyro.sample("a", dist.Normal(0.0, 1.0))
        pyro.sample("b", dist.Normal(a, 1.0), obs=torch.tensor(0.5))

    def guide():
        m = pyro.param("m", torch.tensor(0.1))
        s = pyro.param("s", torch.tensor(0.5), constraint=dist.constraints.positive)
        e = pyro.sample("e", dist.Normal(0.0, 1.0), infer={"is_auxiliary": True})
        pyro.sample("a", dist.Delta(m + s * e, log_density=-s.log()))

    for elbo in (TraceSTL_ELBO(), TraceDReG_ELBO(num_particles=1), TraceDReG_ELBO(num_particles=4)):
        with pytest.raises(ValueError, match="'a'.*log_density depends on the guide's parameters"):
            elbo.loss_and_grads(model, guide)


def test_dreg_non_reparameterized_auxiliary_site_is_a_clear_error():
    def model():
        pyro.sample("z", dist.Normal(0.0, 1.0))

    def guide():
        p = pyro.param("p", torch.tensor(0.3), constraint=dist.constraints.unit_interval)
        b = pyro.sample("b", dist.Bernoulli(p), infer={"is_auxiliary": True})
        pyro.sample("z", dist.Normal(b, 1.0))

    with pytest.raises(ValueError, match="Guide site 'b'.*not reparameterized"):
        TraceDReG_ELBO(num_particles=2).loss_and_grads(model, guide)


# ----------------------------------------------------------------------------- Pyro's semantics
def _rejector_setup():
    def model():
        pyro.sample("r", dist.Gamma(3.0, 2.0))

    def guide():
        a = pyro.param("a", torch.tensor(2.0), constraint=dist.constraints.positive)
        pyro.sample("r", RejectionGamma(a, torch.tensor(1.5)))

    return model, guide


def test_rejector_keeps_its_own_score_parts():
    torch.set_default_dtype(torch.float64)
    model, guide = _rejector_setup()
    for seed in range(3):
        _, ref = _grads(PyroTrace(), model, guide, seed=seed)
        _, got = _grads(Trace_ELBO(), model, guide, seed=seed)
        torch.testing.assert_close(got["a"], ref["a"], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="'r'.*own score-function term"):
        TraceDReG_ELBO(num_particles=2).loss_and_grads(model, guide)


@pytest.mark.slow
def test_rejector_stl_is_unbiased():
    torch.set_default_dtype(torch.float64)
    model, guide = _rejector_setup()
    draws = 600
    diff = []
    for i in range(draws):
        _, ref = _grads(PyroTrace(), model, guide, seed=i)
        _, got = _grads(TraceSTL_ELBO(), model, guide, seed=i)
        diff.append(got["a"] - ref["a"])
    diff = torch.stack(diff)
    assert diff.mean().abs() < 5 * diff.std() / math.sqrt(draws)


@pytest.mark.parametrize("elbo", [Trace_ELBO(), TraceSTL_ELBO()], ids=["trace", "stl"])
def test_masked_non_reparameterized_site_keeps_pyros_score_function(elbo):
    torch.set_default_dtype(torch.float64)

    def model():
        with pyro.plate("p", 2):
            pyro.sample("k", dist.Poisson(torch.tensor([2.0, 3.0])))

    def guide():
        rate = pyro.param("rate", torch.tensor([1.0, 1.0]), constraint=dist.constraints.positive)
        with pyro.plate("p", 2):
            pyro.sample("k", dist.Poisson(rate).mask(torch.tensor([True, False])))

    for seed in range(5):
        _, ref = _grads(PyroTrace(), model, guide, seed=seed)
        _, got = _grads(elbo, model, guide, seed=seed)
        torch.testing.assert_close(got["rate"], ref["rate"], rtol=1e-12, atol=1e-12)


def test_saturating_sigmoid_keeps_loss_and_pathwise_gradient():
    def model():
        pyro.sample("u", dist.Beta(2.0, 2.0))

    def guide():
        loc = pyro.param("loc", torch.tensor(20.0))
        base = dist.Normal(loc, 0.1)
        pyro.sample(
            "u",
            dist.TransformedDistribution(base, [dist.transforms.SigmoidTransform(cache_size=1)]),
        )

    for seed in range(3):
        pyro.set_rng_seed(seed)
        ref = PyroTrace().loss(model, guide)
        loss, g = _grads(TraceSTL_ELBO(), model, guide, seed=seed)
        assert loss == pytest.approx(ref, rel=1e-6)
        # pathwise: d/dloc [log Beta(sigmoid(x)) - log q(sigmoid(x))] with x = loc + 0.1 eps;
        # log q(sigmoid(x)) with phi stopped = log N(x) + log|dx/du|; the N term is flat in loc
        x = torch.tensor(20.0, requires_grad=True)
        f = dist.Beta(2.0, 2.0).log_prob(torch.sigmoid(x).clamp(max=1 - 1e-7))
        assert g["loc"].abs() > 0.5  # the model's pull through the tail does not vanish
        assert torch.isfinite(g["loc"]) and f is not None


def test_create_graph_through_split_parts_raises():
    mu = torch.tensor(0.5, requires_grad=True)
    q = dist.Normal(mu, 1.0)
    z = q.rsample()
    (lp, _, pw) = split_log_probs([(q, z, ())])[0]
    for t in (lp, pw):
        with pytest.raises(NotImplementedError, match="first-order only"):
            torch.autograd.grad(t, mu, create_graph=True)


def test_differentiable_loss_particle_override_is_honoured():
    def model():
        pyro.sample("z", dist.Normal(0.0, 1.0))

    class Tempered(Trace_ELBO):
        def _differentiable_loss_particle(self, model_trace, guide_trace):
            loss, surrogate = super()._differentiable_loss_particle(model_trace, guide_trace)
            lq = guide_trace.nodes["z"]["log_prob_sum"]
            return loss - 10 * lq, surrogate - 10 * lq

    guide = AutoNormal(model)
    guide()  # initialise (draws from the RNG)
    pyro.set_rng_seed(0)
    plain = Trace_ELBO().loss(model, guide)
    pyro.set_rng_seed(0)
    tempered = Tempered().loss(model, guide)
    pyro.set_rng_seed(0)
    tr = poutine.trace(guide).get_trace()
    lq = tr.log_prob_sum(lambda name, site: name == "z").item()
    assert tempered == pytest.approx(plain - 10 * lq, rel=1e-5)


def test_no_param_site_means_no_backward():
    x = torch.tensor(1.0, requires_grad=True)

    def model():
        pyro.sample("z", dist.Normal(x, 1.0))

    def guide():
        pyro.sample("z", dist.Normal(x * 2, 1.0))

    for elbo in (
        Trace_ELBO(),
        TraceSTL_ELBO(),
        TraceDReG_ELBO(num_particles=2),
        ReweightedWakeSleepDReG(num_particles=2),
    ):
        elbo.loss_and_grads(model, guide)
        assert x.grad is None


def test_straight_through_relaxed_site_matches_trace_elbo():
    def model():
        pyro.sample(
            "c",
            dist.RelaxedOneHotCategoricalStraightThrough(
                torch.tensor(1.0), probs=torch.ones(3) / 3
            ),
        )

    def guide():
        p = pyro.param("p", torch.tensor([0.2, 0.3, 0.5]), constraint=dist.constraints.simplex)
        pyro.sample("c", dist.RelaxedOneHotCategoricalStraightThrough(torch.tensor(1.0), probs=p))

    for seed in range(3):
        pyro.set_rng_seed(seed)
        ref = Trace_ELBO().loss(model, guide)
        loss, g = _grads(TraceSTL_ELBO(), model, guide, seed=seed)
        assert loss == pytest.approx(ref, rel=1e-5)
        assert all(torch.isfinite(v).all() for v in g.values())


def test_observed_site_blocked_from_encoder_through_score_function_term():
    """x's cost reaches the encoder e only through z's REINFORCE term: the route removes it."""
    from pyro_gradroute.poutine import block_grad

    def model(with_x=True):
        w = pyro.param("w", torch.tensor(0.7))
        z = pyro.sample("z", dist.Bernoulli(0.4))
        if with_x:
            pyro.sample("x", dist.Normal(z * w, 1.0), obs=torch.tensor(0.9))

    def guide(with_x=True):
        pyro.sample("z", dist.Bernoulli(logits=pyro.param("e", torch.tensor(0.2))))

    for seed in range(4):
        _, plain = _grads(Trace_ELBO(), model, guide, seed=seed)
        _, routed = _grads(
            Trace_ELBO(), block_grad(model, sites="x", params=["e"]), guide, seed=seed
        )
        _, ref = _grads(Trace_ELBO(), model, guide, False, seed=seed)  # x's cost removed
        torch.testing.assert_close(routed["e"], ref["e"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(routed["w"], plain["w"], rtol=1e-6, atol=1e-7)
