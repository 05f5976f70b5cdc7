"""TraceSTL_ELBO: unbiased, zero variance at the exact posterior, a drop-in for Trace_ELBO."""

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from pyro.infer import autoguide as ag
from pyro.nn import PyroModule
from torch.distributions import constraints

from pyro_gradroute.infer import Trace_ELBO, TraceDReG_ELBO, TraceSTL_ELBO
from tests.conjugate import (
    GaussianModel,
    HierarchicalModel,
    LogNormalModel,
    MixedModel,
    exact_gradient,
    gradient_draws,
    set_param,
)

# ------------------------------------------------------------------ guides for the Gaussian model


def custom_guide_factory(gm):
    def guide(x=None):
        loc = pyro.param("q_loc", torch.full((gm.D,), 0.3))
        scale = pyro.param("q_scale", torch.full((gm.D,), 0.6), constraint=constraints.positive)
        if gm.D == 1:
            pyro.sample("z", dist.Normal(loc[0], scale[0]))
        else:
            pyro.sample("z", dist.Normal(loc, scale).to_event(1))

    def moments():
        return pyro.param("q_loc"), torch.diag(pyro.param("q_scale") ** 2)

    return guide, moments


class AmortizedGuide(PyroModule):
    """A PyroModule encoder from the data summary to q(z)'s loc and scale."""

    def __init__(self, D):
        super().__init__()
        self.net = PyroModule[torch.nn.Linear](D, 2 * D)
        self.D = D

    def params(self, x):
        h = self.net(x.mean(0))
        return h[: self.D], torch.nn.functional.softplus(h[self.D :]) + 0.1

    def forward(self, x=None):
        loc, scale = self.params(x)
        pyro.sample("z", dist.Normal(loc, scale).to_event(1))


def make_guide(kind, gm):
    """Return ``(guide, neg_exact_elbo_fn or None)`` for the Gaussian model ``gm``."""
    if kind == "custom":
        guide, moments = custom_guide_factory(gm)
        return guide, lambda: -gm.elbo(*moments())
    if kind == "amortized":
        guide = AmortizedGuide(gm.D)

        def neg():
            loc, scale = guide.params(gm.x)
            return -gm.elbo(loc, torch.diag(scale**2))

        return guide, neg
    if kind == "AutoNormal":
        guide = ag.AutoNormal(gm.model)
        return guide, lambda: -gm.elbo(guide.locs.z, torch.diag(guide.scales.z**2))
    if kind in ("AutoDiagonalNormal", "AutoMultivariateNormal", "AutoLowRankMultivariateNormal"):
        guide = getattr(ag, kind)(gm.model)

        def neg():
            post = guide.get_posterior()
            cov = (
                torch.diag(post.base_dist.scale**2)
                if kind == "AutoDiagonalNormal"
                else post.covariance_matrix
            )
            loc = post.base_dist.loc if kind == "AutoDiagonalNormal" else post.loc
            return -gm.elbo(loc, cov)

        return guide, neg
    if kind == "AutoDelta":
        guide = ag.AutoDelta(gm.model)

        def neg():
            z = guide.z
            return -(
                dist.MultivariateNormal(torch.zeros(gm.D), gm.S0).log_prob(z)
                + dist.Normal(z, gm.s).log_prob(gm.x).sum()
            )

        return guide, neg
    if kind == "AutoIAFNormal":
        return ag.AutoIAFNormal(gm.model, hidden_dim=[6]), None
    raise ValueError(kind)


GUIDE_KINDS = [
    "custom",
    "amortized",
    "AutoNormal",
    "AutoDiagonalNormal",
    "AutoMultivariateNormal",
    "AutoLowRankMultivariateNormal",
    "AutoDelta",
    "AutoIAFNormal",
]


def _batched_gradient_stats(elbo, model, guide, args, batches):
    g = gradient_draws(elbo, model, guide, batches, *args)
    return g.mean(0), g.std(0) / batches**0.5


@pytest.mark.parametrize("kind", GUIDE_KINDS)
def test_stl_gradient_is_unbiased(kind):
    gm = GaussianModel(D=2, prior_cov=torch.tensor([[1.0, 0.6], [0.6, 1.5]]))
    guide, neg_exact = make_guide(kind, gm)
    guide(gm.x)  # create the parameters
    args = (gm.x,)
    stl = TraceSTL_ELBO(num_particles=64, vectorize_particles=True)
    mean, se = _batched_gradient_stats(stl, gm.model, guide, args, 40)
    if neg_exact is not None:
        exact, exact_se = exact_gradient(neg_exact), torch.zeros_like(mean)
    else:  # no closed form for a flow: brute-force Trace_ELBO average
        ref = PyroTrace_ELBO(num_particles=256, vectorize_particles=True)
        exact, exact_se = _batched_gradient_stats(ref, gm.model, guide, args, 40)
    tol = 4 * (se**2 + exact_se**2).sqrt() + 1e-4 * (1 + exact.abs())
    assert exact.abs().max() > 0.05  # away from the optimum
    assert ((mean - exact).abs() <= tol).all(), (mean, exact, tol)


def _fit_exact(kind, gm):
    mean, cov = gm.posterior()
    guide, _ = make_guide(kind, gm)
    guide(gm.x)
    if kind == "custom":
        set_param("q_loc", mean)
        set_param("q_scale", cov.diagonal().sqrt())
    elif kind == "AutoNormal":
        set_param("AutoNormal.locs.z", mean.reshape(-1)[0] if gm.D == 1 else mean)
        set_param(
            "AutoNormal.scales.z",
            cov.diagonal().sqrt().reshape(-1)[0] if gm.D == 1 else cov.diagonal().sqrt(),
        )
    elif kind == "AutoMultivariateNormal":
        L = torch.linalg.cholesky(cov)
        set_param("AutoMultivariateNormal.loc", mean)
        set_param("AutoMultivariateNormal.scale", L.diagonal())
        set_param("AutoMultivariateNormal.scale_tril", L / L.diagonal()[:, None])
    return guide


@pytest.mark.parametrize(
    "kind,D,prior_cov",
    [
        ("custom", 1, None),
        ("AutoNormal", 1, None),
        ("AutoMultivariateNormal", 2, torch.tensor([[1.0, 0.8], [0.8, 2.0]])),
    ],
)
def test_stl_variance_vanishes_at_exact_posterior(kind, D, prior_cov):
    gm = GaussianModel(D=D, n=8, prior_cov=prior_cov)
    guide = _fit_exact(kind, gm)
    stl = gradient_draws(TraceSTL_ELBO(), gm.model, guide, 30, gm.x)
    trace = gradient_draws(PyroTrace_ELBO(), gm.model, guide, 30, gm.x)
    var_stl, var_trace = stl.var(0).sum(), trace.var(0).sum()
    assert var_trace > 1e-2
    assert var_stl <= 1e-8 * var_trace, (var_stl, var_trace)


def test_stl_variance_vanishes_for_positive_latent_through_autonormal_transform():
    lm = LogNormalModel()
    guide = ag.AutoNormal(lm.model)
    guide()
    mean, sd = lm.posterior_log()
    set_param("AutoNormal.locs.z", mean)
    set_param("AutoNormal.scales.z", sd)
    stl = gradient_draws(TraceSTL_ELBO(), lm.model, guide, 30)
    trace = gradient_draws(PyroTrace_ELBO(), lm.model, guide, 30)
    assert trace.var(0).sum() > 1e-2
    assert stl.var(0).sum() <= 1e-8 * trace.var(0).sum()


@pytest.mark.parametrize(
    "Model",
    [MixedModel, HierarchicalModel],
    ids=["mixed_guide_score_function_for_discrete_site", "conditional_guide_q_z2_given_z1"],
)
def test_stl_is_unbiased_against_closed_form(Model):
    """Mixed guide: the Bernoulli site keeps Trace_ELBO's score-function term.
    Conditional guide q(z2 | z1): the pathwise part keeps the path through z1 (only phi is stopped)."""
    m = Model()
    m.guide()
    elbo = TraceSTL_ELBO(num_particles=200, vectorize_particles=True)
    mean, se = _batched_gradient_stats(elbo, m.model, m.guide, (), 40)
    exact = exact_gradient(lambda: -m.exact_elbo())
    assert exact.abs().max() > 0.05  # away from the optimum
    assert ((mean - exact).abs() <= 4 * se + 1e-4).all(), (mean, exact, se)


# ------------------------------------------------------------------ drop-in behaviour


class SubsampledModel(PyroModule):
    def __init__(self, N=20):
        super().__init__()
        self.N = N
        self.data = torch.randn(N, 2)

    def model(self):
        z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with poutine.scale(scale=0.5):
            with pyro.plate("data", self.N, subsample_size=5) as idx:
                mask = torch.arange(5) != 2
                with poutine.mask(mask=mask):
                    pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=self.data[idx])


@pytest.mark.parametrize("vectorize", [False, True])
@pytest.mark.parametrize("Elbo", [Trace_ELBO, TraceSTL_ELBO])
def test_loss_identical_to_pyro_trace_elbo(Elbo, vectorize):
    sm = SubsampledModel()
    guide = ag.AutoNormal(sm.model)
    guide()
    kw = dict(num_particles=3, vectorize_particles=vectorize, max_plate_nesting=1)
    for seed in range(3):
        pyro.set_rng_seed(seed)
        ref = PyroTrace_ELBO(**kw).loss(sm.model, guide)
        pyro.set_rng_seed(seed)
        ours = Elbo(**kw).loss(sm.model, guide)
        pyro.set_rng_seed(seed)
        ours_lg = Elbo(**kw).loss_and_grads(sm.model, guide)
        assert ours == pytest.approx(ref, rel=1e-6)
        assert ours_lg == pytest.approx(ref, rel=1e-6)


def test_routing_aware_trace_elbo_gradients_equal_pyros():
    sm = SubsampledModel()
    guide = ag.AutoMultivariateNormal(sm.model)
    guide()
    grads = []
    for Elbo in (PyroTrace_ELBO, Trace_ELBO):
        pyro.set_rng_seed(3)
        grads.append(gradient_draws(Elbo(num_particles=2), sm.model, guide, 1))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_stl_equals_naive_two_pass_for_amortized_guide_with_subsampling():
    """One pass of TraceSTL_ELBO == log p(x, z) - log q(z; stop(phi)) computed by hand."""
    sm = SubsampledModel()
    enc = PyroModule[torch.nn.Linear](2, 4)

    def guide():
        h = enc(sm.data.mean(0))
        pyro.sample("z", dist.Normal(h[:2], h[2:].exp()).to_event(1))

    guide()
    params = list(enc.parameters())
    pyro.set_rng_seed(7)
    TraceSTL_ELBO().loss_and_grads(sm.model, guide)
    ours = [p.grad.clone() for p in params]

    pyro.set_rng_seed(7)
    gtr = poutine.trace(guide).get_trace()
    mtr = poutine.trace(poutine.replay(sm.model, trace=gtr)).get_trace()
    mtr.compute_log_prob()
    fn = gtr.nodes["z"]["fn"].base_dist
    z = gtr.nodes["z"]["value"]
    log_q_stopped = dist.Normal(fn.loc.detach(), fn.scale.detach()).to_event(1).log_prob(z)
    ref = torch.autograd.grad(-(mtr.log_prob_sum() - log_q_stopped), params)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_stl_opt_out_restores_ordinary_gradient():
    gm = GaussianModel(D=1)

    def guide(x=None, stl=False):
        loc = pyro.param("q_loc", torch.tensor(0.3))
        scale = pyro.param("q_scale", torch.tensor(0.6), constraint=constraints.positive)
        pyro.sample("z", dist.Normal(loc, scale), infer={"stl": stl})

    guide()
    grads = []
    for Elbo in (PyroTrace_ELBO, TraceSTL_ELBO):
        pyro.set_rng_seed(1)
        grads.append(gradient_draws(Elbo(), gm.model, guide, 3, gm.x))
    torch.testing.assert_close(grads[0], grads[1])
    pyro.set_rng_seed(1)
    with_stl = gradient_draws(TraceSTL_ELBO(), gm.model, lambda x: guide(x, stl=True), 3, gm.x)
    assert not torch.allclose(with_stl, grads[0])


def test_stl_true_on_non_reparameterized_site_is_an_error():
    def model():
        pyro.sample("k", dist.Poisson(3.0))

    def guide():
        rate = pyro.param("rate", torch.tensor(2.0), constraint=constraints.positive)
        pyro.sample("k", dist.Poisson(rate), infer={"stl": True})

    with pytest.raises(ValueError, match="'k'.*no rsample"):
        TraceSTL_ELBO().loss_and_grads(model, guide)


def test_nan_log_density_is_a_clear_error():
    def model():
        pyro.sample("z", dist.Normal(0.0, 1.0))

    def guide():
        loc = pyro.param("loc", torch.tensor(float("nan")))
        pyro.sample("z", dist.Normal(loc, 1.0, validate_args=False))

    with pytest.raises(ValueError, match="NaN log-density at guide site 'z'"):
        TraceSTL_ELBO().loss_and_grads(model, guide)


@pytest.mark.parametrize(
    "elbo",
    [
        TraceSTL_ELBO(),
        Trace_ELBO(),
        TraceDReG_ELBO(num_particles=2),
        TraceDReG_ELBO(num_particles=2, vectorize_particles=False),
    ],
    ids=["stl", "trace", "dreg", "dreg-loop"],
)
@pytest.mark.parametrize("where", ["guide", "model"])
def test_a_nan_log_density_is_named_from_the_elbo(elbo, where):
    """A NaN log-density that no support check catches is named from the NaN ELBO (a guide
    site first), by every estimator."""

    def model():
        scale = float("nan") if where == "model" else 1.0
        z = pyro.sample("z", dist.Normal(0.0, 1.0, validate_args=False))
        pyro.sample("x", dist.Normal(z, scale, validate_args=False), obs=torch.tensor(0.5))

    def guide():
        loc = pyro.param("loc", torch.tensor(0.0))
        scale = -1.0 if where == "guide" else 1.0  # (a NaN density at a finite sample)
        pyro.sample("z", dist.Normal(loc, scale, validate_args=False))

    site = "guide site 'z'" if where == "guide" else "model site 'x'"
    with pytest.raises(ValueError, match=f"NaN log-density at {site}"):
        elbo.loss_and_grads(model, guide)


def test_model_and_guide_run_once_per_particle(monkeypatch):
    gm = GaussianModel(D=2)
    calls = {"model": 0, "guide": 0, "log_prob": 0}
    guide_fn, _ = custom_guide_factory(gm)

    def model(x):
        calls["model"] += 1
        gm.model(x)

    def guide(x):
        calls["guide"] += 1
        guide_fn(x)

    original = dist.Independent.log_prob

    def counting(self, value):
        if isinstance(self.base_dist, dist.Normal):
            calls["log_prob"] += 1
        return original(self, value)

    guide(gm.x)
    calls.update(model=0, guide=0)
    monkeypatch.setattr(dist.Independent, "log_prob", counting)
    TraceSTL_ELBO(num_particles=3).loss_and_grads(model, guide, gm.x)
    # 3 particles: one guide pass, one model pass and one guide-site log_prob each
    # (the model's likelihood site is also an Independent Normal: one evaluation each)
    assert calls["guide"] == 3 and calls["model"] == 3
    assert calls["log_prob"] == 3 * 2


@pytest.mark.slow
def test_svi_and_elbo_module():
    gm = GaussianModel(D=2)
    guide = ag.AutoNormal(gm.model)
    svi = SVI(gm.model, guide, pyro.optim.Adam({"lr": 0.05}), TraceSTL_ELBO())
    losses = [svi.step(gm.x) for _ in range(300)]
    assert losses[-1] < losses[0]
    mean, _ = gm.posterior()
    torch.testing.assert_close(guide.locs.z.detach(), mean, atol=0.05, rtol=0)

    # ELBOModule: elbo(model, guide) is an nn.Module returning the differentiable loss
    elbo_module = TraceSTL_ELBO()(gm.model, guide)
    loss = elbo_module(gm.x)
    loss.backward()
    assert guide.locs.z.grad is not None or any(
        p.grad is not None for p in elbo_module.parameters()
    )


def _planar_flow_setup():
    gm = GaussianModel(D=2)
    guide = ag.AutoNormalizingFlow(
        gm.model,
        lambda dim: pyro.distributions.transforms.iterated(
            2, pyro.distributions.transforms.planar, dim
        ),
    )
    guide(gm.x)
    return gm, guide


def test_flow_without_inverse_sticks_the_landing_without_a_warning():
    """Planar has no inverse; its pathwise part is carried forward: no fallback."""
    import warnings

    gm, guide = _planar_flow_setup()
    pyro.set_rng_seed(4)
    ref = gradient_draws(PyroTrace_ELBO(), gm.model, guide, 2, gm.x)
    pyro.set_rng_seed(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = gradient_draws(TraceSTL_ELBO(), gm.model, guide, 2, gm.x)
    # same draws, a different (pathwise-only) gradient: the score part is gone
    assert not torch.allclose(ours, ref, rtol=1e-3, atol=1e-4)


class _NoRuleNoInverse(torch.distributions.transforms.Transform):
    """``y = s (x + x^3)``: parametrized, no forward pathwise rule and no inverse."""

    domain = constraints.real_vector
    codomain = constraints.real_vector
    bijective = True

    def __init__(self, s):
        super().__init__(cache_size=1)
        self.s = s

    def _call(self, x):
        return self.s * (x + x**3)

    def log_abs_det_jacobian(self, x, y):
        return (self.s.log() + torch.log1p(3 * x**2)).sum(-1)


def test_flow_without_rule_or_inverse_falls_back_to_ordinary_gradient_with_a_warning():
    gm = GaussianModel(D=2)

    def guide(x=None):
        s = pyro.param("nr_s", torch.tensor(0.5), constraint=constraints.positive)
        loc = pyro.param("nr_loc", torch.zeros(2))
        base = dist.Normal(loc, 1.0).to_event(1)
        pyro.sample("z", dist.TransformedDistribution(base, [_NoRuleNoInverse(s)]))

    guide(gm.x)
    pyro.set_rng_seed(4)
    ref = gradient_draws(PyroTrace_ELBO(), gm.model, guide, 2, gm.x)
    pyro.set_rng_seed(4)
    with pytest.warns(UserWarning, match="'z' cannot be split.*ordinary Trace_ELBO gradient"):
        ours = gradient_draws(TraceSTL_ELBO(), gm.model, guide, 2, gm.x)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_stl_location_noise_is_larger_along_the_slow_direction_of_a_correlated_posterior():
    """A mean-field guide at its optimum (variances ``D``, ``1/D = diag H``) on a Gaussian with
    precision ``H``: STL's gradient covariance at the location exceeds ``Trace_ELBO``'s by
    ``D^-1 - 2H`` (closed form), smaller in total, larger along ``H``'s low-curvature direction."""
    cov = torch.tensor([[1.0, 0.95], [0.95, 1.0]])
    H = torch.linalg.inv(cov)
    scale = H.diagonal().rsqrt()

    def model():
        pyro.sample("z", dist.MultivariateNormal(torch.zeros(2), cov))

    def guide():
        loc = pyro.param("loc", torch.tensor([0.2, -0.1]))
        pyro.sample("z", dist.Normal(loc, scale).to_event(1))

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    n = 2000
    g_trace = gradient_draws(PyroTrace_ELBO(), model, guide, n)
    g_stl = gradient_draws(TraceSTL_ELBO(), model, guide, n)
    diff = torch.cov(g_stl.T) - torch.cov(g_trace.T)
    expected = torch.diag(H.diagonal()) - 2 * H
    lam, vecs = torch.linalg.eigh(H)  # ascending: the slow direction first
    for u in vecs.T:
        want = float(u @ expected @ u)
        # the sampling SE of u^T Cov u is about sqrt(2 / n) u^T Cov u for each estimator
        se = (2 / n) ** 0.5 * float(u @ (torch.cov(g_stl.T) + torch.cov(g_trace.T)) @ u)
        assert abs(float(u @ diff @ u) - want) < 5 * se
    slow, fast = vecs[:, 0], vecs[:, 1]
    assert float(slow @ diff @ slow) > 0 > float(fast @ diff @ fast)
    assert float(diff.trace()) < 0  # lower summed per-element variance
