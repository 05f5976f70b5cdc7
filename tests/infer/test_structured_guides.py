"""AutoStructured and AutoGaussian (dense) under sticking the landing and DReG.

References, independent of the package:

* a hand-written STL surrogate on the same draw: the guide run by Pyro alone, its joint
  density written as the multivariate normal it is (mean and Cholesky factor from the
  guide's parameters, in closed form), evaluated with those parameters detached at the live
  sample: ``-(log p(x, z) - log N(u(z); stop(mu), stop(L)) + log|du/dz|)``;
* Pyro's own ``Trace_ELBO`` on the same seeds (paired differences within 5 SE);
* the exact posterior (the guides hold it): the gradient is zero to round-off.
"""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from pyro.infer.autoguide import AutoGaussian, AutoStructured

from pyro_gradroute.infer import TraceDReG_ELBO, TraceSTL_ELBO
from pyro_gradroute.poutine import stick_the_landing
from tests import conjugate
from tests.conformance.cases import chain_conditionals, gaussian_chain_posterior

A, SX = 0.8, 0.7
X = torch.tensor([0.9, -0.4], dtype=torch.float64)


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    pyro.clear_param_store()
    pyro.enable_validation(True)
    yield
    pyro.clear_param_store()
    torch.set_default_dtype(old)


def chain_model():
    """``z0 ~ N(0,1)``, ``z1 ~ N(A z0, 1)``, ``x_t ~ N(z_t, SX)``: a Gaussian posterior."""
    z0 = pyro.sample("z0", dist.Normal(0.0, 1.0))
    z1 = pyro.sample("z1", dist.Normal(A * z0, 1.0))
    pyro.sample("x0", dist.Normal(z0, SX), obs=X[0])
    pyro.sample("x1", dist.Normal(z1, SX), obs=X[1])


def _p(name):
    return pyro.param(name)


def _structured_chain(cond="normal", dep="linear"):
    guide = AutoStructured(
        chain_model, conditionals={"z0": cond, "z1": "normal"}, dependencies={"z1": {"z0": dep}}
    )
    guide()
    with torch.no_grad():  # away from the posterior, with a non-zero dependency
        guide.deps.z1.z0.weight.fill_(0.4) if dep == "linear" else None
    return guide


def _chain_q(guide):
    """``(mu, L)`` of the chain guide's joint normal over ``(z0, z1)`` (closed form, no package)."""
    m0, m1 = _p("AutoStructured.locs.z0")[0], _p("AutoStructured.locs.z1")[0]
    s0, s1 = _p("AutoStructured.scales.z0")[0], _p("AutoStructured.scales.z1")[0]
    w = guide.deps.z1.z0.weight[0, 0]
    zero = torch.zeros(())
    L = torch.stack([torch.stack([s0, zero]), torch.stack([w * s0, s1])])
    return torch.stack([m0, m1]), L


def _exact_chain():
    mean, cov = gaussian_chain_posterior(2, torch.tensor(A), SX, X)
    (m0, _, s0), (_, c1, s1) = chain_conditionals(mean, cov)
    p = "AutoStructured"
    for name, v in {
        f"{p}.locs.z0": m0,
        f"{p}.scales.z0": s0,
        f"{p}.locs.z1": mean[1],
        f"{p}.scales.z1": s1,
        f"{p}.deps.z1.z0$$$weight": c1,
    }.items():
        store = pyro.get_param_store()
        conjugate.set_param(name, torch.as_tensor(v).reshape(store[name].shape))


def _grads(guide, run, *args):
    for p in guide.parameters():
        p.grad = None
    loss = run(*args)
    out = {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in guide.named_parameters()
    }
    for p in guide.parameters():
        p.grad = None
    return loss, out


def _hand_stl(model, guide, q_of, to_u, seed):
    """The reference STL gradient on the draw of ``seed``: Pyro runs the guide, the surrogate is written out."""
    pyro.set_rng_seed(seed)

    def run():
        tr = poutine.trace(guide).get_trace()
        mt = poutine.trace(poutine.replay(model, trace=tr)).get_trace()
        names = [
            n
            for n, s in tr.nodes.items()
            if s["type"] == "sample" and not s["infer"].get("is_auxiliary")
        ]
        z = torch.cat([tr.nodes[n]["value"].reshape(-1) for n in names])
        u, log_jac = to_u(z)
        mu, L = q_of(guide)
        log_q = dist.MultivariateNormal(mu.detach(), scale_tril=L.detach()).log_prob(u) + log_jac
        surrogate = mt.log_prob_sum() - log_q
        (-surrogate).backward()
        return -surrogate.item()

    return _grads(guide, run)


def _identity(z):
    return z, 0.0


def _close(got, ref):
    for n in ref:
        torch.testing.assert_close(
            got[n], ref[n], rtol=1e-9, atol=1e-9, msg=lambda m, n=n: f"{n}: {m}"
        )


def _warm(elbo, model, guide):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        elbo.loss_and_grads(model, guide)


# ----------------------------------------------------------------------------- same-draw references
@pytest.mark.parametrize("dep", ["linear", "module"])
def test_autostructured_stl_equals_hand_written_surrogate(dep):
    if dep == "module":  # a non-linear dependency: a shear, no inverse needed
        net = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False), torch.nn.Tanh())
        guide = AutoStructured(
            chain_model,
            conditionals={"z0": "normal", "z1": "normal"},
            dependencies={"z1": {"z0": net}},
        )
        guide()
        with torch.no_grad():
            net[0].weight.fill_(0.6)
    else:
        guide = _structured_chain()
    elbo = TraceSTL_ELBO()
    _warm(elbo, chain_model, guide)
    for seed in range(3):
        pyro.set_rng_seed(seed)
        loss, got = _grads(guide, elbo.loss_and_grads, chain_model, guide)
        if dep == "linear":
            ref_loss, ref = _hand_stl(chain_model, guide, _chain_q, _identity, seed)
        else:
            ref_loss, ref = _hand_stl_shear(guide, net, seed)
        assert math.isclose(loss, ref_loss, rel_tol=1e-12)
        _close(got, ref)
        assert any(g.abs().sum() > 0 for g in got.values())


def _hand_stl_shear(guide, net, seed):
    """Non-linear dependency: log q = log N(e0) + log N(e1) - log s0 - log s1, e from z (params stopped)."""
    pyro.set_rng_seed(seed)

    def run():
        tr = poutine.trace(guide).get_trace()
        mt = poutine.trace(poutine.replay(chain_model, trace=tr)).get_trace()
        z0, z1 = tr.nodes["z0"]["value"].reshape(1), tr.nodes["z1"]["value"].reshape(1)
        m0, m1 = (_p(f"AutoStructured.locs.{n}").detach() for n in ("z0", "z1"))
        s0, s1 = (_p(f"AutoStructured.scales.{n}").detach() for n in ("z0", "z1"))
        w = net[0].weight.detach()
        a0 = z0 - m0
        e0 = a0 / s0
        e1 = (z1 - m1 - torch.tanh(w[0, 0] * a0)) / s1
        std = dist.Normal(0.0, 1.0)
        log_q = (std.log_prob(e0) + std.log_prob(e1) - s0.log() - s1.log()).sum()
        surrogate = mt.log_prob_sum() - log_q
        (-surrogate).backward()
        return -surrogate.item()

    return _grads(guide, run)


def test_autostructured_mvn_positive_support_equals_hand_written_surrogate():
    m = conjugate.LogNormalModel(n=4)

    def model():  # two positive latents, one mvn block each: exp transform and a scale_tril
        z = pyro.sample("z", dist.LogNormal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", len(m.x)):
            pyro.sample("x", dist.LogNormal(z.log().sum(), m.s), obs=m.x)

    guide = AutoStructured(model, conditionals="mvn")
    guide()
    with torch.no_grad():
        guide.scale_trils.z_unconstrained.add_(torch.tensor([[0.0, 0.0], [0.5, 0.2]]))

    def q_of(g):
        scale, tril = _p("AutoStructured.scales.z"), _p("AutoStructured.scale_trils.z")
        return _p("AutoStructured.locs.z"), scale[:, None] * tril

    def to_u(z):
        u = z.log()
        return u, -u.sum()

    elbo = TraceSTL_ELBO()
    _warm(elbo, model, guide)
    for seed in range(3):
        pyro.set_rng_seed(seed)
        loss, got = _grads(guide, elbo.loss_and_grads, model, guide)
        ref_loss, ref = _hand_stl(model, guide, q_of, to_u, seed)
        assert math.isclose(loss, ref_loss, rel_tol=1e-12)
        _close(got, ref)


def _gaussian_q(guide):
    mvn = guide._dense_get_mvn()  # Pyro's own joint Gaussian of the auxiliary draw
    loc, scale = _p("AutoGaussianDense.locs.z"), _p("AutoGaussianDense.scales.z")
    return loc + scale * mvn.loc, scale[:, None] * mvn.scale_tril


def test_autogaussian_stl_and_handler_equal_hand_written_surrogate():
    m = conjugate.GaussianModel(D=2, n=3)
    guide = AutoGaussian(m.model)
    guide()
    with torch.no_grad():
        for p in guide.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    elbo = TraceSTL_ELBO()
    pyro_elbo, handled = PyroTrace_ELBO(), stick_the_landing(guide)
    _warm(elbo, m.model, guide)
    _warm(pyro_elbo, m.model, handled)
    for seed in range(3):
        ref_loss, ref = _hand_stl(m.model, guide, _gaussian_q, _identity, seed)
        for est, g in ((elbo, guide), (pyro_elbo, handled)):
            pyro.set_rng_seed(seed)
            loss, got = _grads(guide, est.loss_and_grads, m.model, g)
            assert math.isclose(loss, ref_loss, rel_tol=1e-12)
            _close(got, ref)


def test_dreg_one_particle_equals_stl():
    for guide in (_structured_chain(), _structured_chain("mvn")):
        stl, dreg = TraceSTL_ELBO(), TraceDReG_ELBO(num_particles=1)
        _warm(stl, chain_model, guide)
        for seed in range(2):
            pyro.set_rng_seed(seed)
            ls, gs = _grads(guide, stl.loss_and_grads, chain_model, guide)
            pyro.set_rng_seed(seed)
            ld, gd = _grads(guide, dreg.loss_and_grads, chain_model, guide)
            assert math.isclose(ls, ld, rel_tol=1e-12)
            _close(gd, gs)
        pyro.clear_param_store()


# ----------------------------------------------------------------------------- exact posterior
def test_zero_at_the_exact_posterior():
    guide = _structured_chain()
    _exact_chain()
    m = conjugate.GaussianModel(D=2, n=3)
    gauss = AutoGaussian(m.model)
    gauss()
    mean, cov = m.posterior()
    P = torch.linalg.inv(cov)
    Lp = torch.linalg.cholesky(P)
    for name, v in {
        "locs.z": torch.zeros(2),
        "scales.z": torch.ones(2),
        "prec_sqrts.z": Lp,
        "white_vecs.z": Lp.T @ mean,
        "prec_sqrts.x": torch.zeros(2, 2),
        "white_vecs.x": torch.zeros(2),
    }.items():
        conjugate.set_param("AutoGaussianDense." + name, v)
    cases = [(chain_model, guide), (m.model, gauss)]
    for model, g in cases:
        for est in (
            TraceSTL_ELBO(),
            TraceSTL_ELBO(num_particles=4, vectorize_particles=True, max_plate_nesting=1),
            TraceDReG_ELBO(num_particles=1),
            TraceDReG_ELBO(num_particles=4),
        ):
            _warm(est, model, g)
            for seed in range(2):
                pyro.set_rng_seed(seed)
                _, got = _grads(g, est.loss_and_grads, model, g)
                worst = max(v.abs().max().item() for v in got.values())
                assert worst < 1e-9, (type(g).__name__, type(est).__name__, got)
        # Pyro's Trace_ELBO is not zero there (its score part): the check is informative
        pyro.set_rng_seed(0)
        _, ref = _grads(g, PyroTrace_ELBO().loss_and_grads, model, g)
        assert max(v.abs().max().item() for v in ref.values()) > 1e-3


# ----------------------------------------------------------------------------- unbiased
@pytest.mark.slow
def test_mean_gradient_equals_trace_elbo():
    guide = _structured_chain("mvn")
    elbo = TraceSTL_ELBO()
    _warm(elbo, chain_model, guide)
    diffs = []
    for seed in range(200):
        pyro.set_rng_seed(seed)
        _, g = _grads(guide, elbo.loss_and_grads, chain_model, guide)
        pyro.set_rng_seed(seed)
        _, r = _grads(guide, PyroTrace_ELBO().loss_and_grads, chain_model, guide)
        diffs.append(torch.cat([(g[n] - r[n]).reshape(-1) for n in sorted(g)]))
    D = torch.stack(diffs)
    mean, se = D.mean(0), D.std(0) / math.sqrt(len(D))
    assert (mean.abs() <= 5 * se + 1e-12).all(), (mean, se)
    assert (se > 0).any()


# ----------------------------------------------------------------------------- refusals
def test_callable_dependency_that_is_not_a_module_is_a_clear_error():
    guide = AutoStructured(
        chain_model,
        conditionals={"z0": "normal", "z1": "normal"},
        dependencies={"z1": {"z0": lambda a: 0.3 * a}},
    )
    guide()
    with pytest.raises(ValueError, match="'z1'.*not\\s+a torch.nn.Module"):
        TraceSTL_ELBO().loss_and_grads(chain_model, guide)


def test_delta_conditional_dreg_many_particles_is_a_clear_error():
    guide = AutoStructured(
        chain_model,
        conditionals={"z0": "normal", "z1": "delta"},
        dependencies={"z1": {"z0": "linear"}},
    )
    guide()
    TraceSTL_ELBO().loss_and_grads(chain_model, guide)  # STL: exact (a point has no density)
    with pytest.raises(ValueError, match="'z1'.*'delta'"):
        TraceDReG_ELBO(num_particles=3).loss_and_grads(chain_model, guide)


def _aux_chain(params_only=False):
    def model():
        z0 = pyro.sample("z0", dist.Normal(0.0, 1.0))
        z2 = pyro.sample("z2", dist.Normal(z0, 1.0))
        pyro.sample("x", dist.Normal(z2, 0.5), obs=torch.tensor(0.3))

    def guide():
        m0 = pyro.param("m0", torch.tensor(0.1))
        c = pyro.param("c", torch.tensor(0.2))
        d = pyro.param("d", torch.tensor(0.5))
        z0 = pyro.sample("z0", dist.Normal(m0, 1.0))
        w = pyro.sample(
            "w", dist.Delta(c if params_only else c + d * z0), infer={"is_auxiliary": True}
        )
        pyro.sample("z2", dist.Normal(w, 0.7))

    return model, guide


@pytest.mark.parametrize("params_only", [False, True])
def test_auxiliary_delta_read_by_a_conditional_site_is_a_clear_error(params_only):
    model, guide = _aux_chain(params_only)
    match = "'z2' reads the auxiliary Delta site 'w'"
    with pytest.raises(ValueError, match=match):
        TraceSTL_ELBO().loss_and_grads(model, guide)
    with pytest.raises(ValueError, match="'z2'|'w'"):
        TraceDReG_ELBO(num_particles=2).loss_and_grads(model, guide)


def test_autogaussian_plated_latent_with_vectorized_particles():
    """A latent inside a plate and vectorized particles: the blocks of the auxiliary draw have
    different sample shapes; the recomputation (checked against the trace) matches them, and the
    loss equals Pyro's Trace_ELBO on the same seed."""

    def model():
        a = pyro.sample("a", dist.Normal(0.0, 1.0))
        with pyro.plate("p", 3):
            b = pyro.sample("b", dist.Normal(a, 1.0))
            pyro.sample("x", dist.Normal(b, 1.0), obs=torch.tensor([0.3, -0.2, 1.1]))

    guide = AutoGaussian(model)
    kw = dict(num_particles=10, vectorize_particles=True, max_plate_nesting=1)
    PyroTrace_ELBO(**kw).loss(model, guide)  # builds the guide
    for seed in range(2):
        pyro.set_rng_seed(seed)
        ref = PyroTrace_ELBO(**kw).loss(model, guide)
        pyro.set_rng_seed(seed)
        ours = TraceSTL_ELBO(**kw).loss_and_grads(model, guide)
        assert ours == pytest.approx(ref, rel=1e-9)
