"""TraceAdaptiveSTL_ELBO / TraceAdaptiveDReG_ELBO: exact endpoints, unbiased, the weight policy, resumable."""

from __future__ import annotations

import copy
import io
import math
import pickle

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, RenyiELBO
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from pyro.infer import autoguide as ag
from pyro.nn import PyroModule
from torch.distributions import constraints

from pyro_gradroute.infer import (
    ScheduleConfig,
    Trace_ELBO,
    TraceAdaptiveDReG_ELBO,
    TraceAdaptiveSTL_ELBO,
    TraceDReG_ELBO,
    TraceSTL_ELBO,
)
from pyro_gradroute.infer.control_variate import ControlVariate
from pyro_gradroute.infer.schedule import Gate, Schedule
from pyro_gradroute.poutine import block_grad
from tests.conjugate import GaussianModel, gradient_draws, leaves, settle_at_split

# ------------------------------------------------------------------ helpers


def grads_on_seed(elbo, model, guide, seed, *args):
    for _, p in leaves():
        p.grad = None
    pyro.set_rng_seed(seed)
    elbo.loss_and_grads(model, guide, *args)
    out = {k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for k, p in leaves()}
    for _, p in leaves():
        p.grad = None
    return out


def force_weights(elbo, b: float, model, guide, *args):
    """Freeze every weight at ``b`` (and run two steps that create the moments)."""
    elbo.control_variate.fixed_weight = b
    for _ in range(2):
        grads_on_seed(elbo, model, guide, 123, *args)


def assert_same(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=atol, msg=k)


def conditional_model(x):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        pyro.sample("x", dist.Normal(z, 0.5), obs=x)


def conditional_guide(x):
    m = pyro.param("m", torch.tensor(0.3))
    s = pyro.param("s", torch.tensor(0.7), constraint=constraints.positive)
    a = pyro.param("a", torch.tensor(0.5))
    mu = pyro.sample("mu", dist.Normal(m, s))
    with pyro.plate("data", len(x)):
        pyro.sample("z", dist.Normal(a * x + mu, 0.6))  # q(z | mu): a conditional link


X = torch.tensor([0.4, -1.2, 2.0, 0.7, 1.1, -0.3])


# ------------------------------------------------------------------ endpoints: b = 0 is STL, b = 1 Trace_ELBO


@pytest.mark.parametrize(
    "kw",
    [{}, {"num_particles": 3}, {"num_particles": 3, "vectorize_particles": True}],
    ids=["1", "3-seq", "3-vec"],
)
@pytest.mark.parametrize("b", [0.0, 1.0])
def test_endpoints_stl(kw, b):
    kw = dict(kw, max_plate_nesting=1)
    conditional_guide(X)
    ref = (Trace_ELBO if b else TraceSTL_ELBO)(**kw)
    elbo = TraceAdaptiveSTL_ELBO(warmup=0, **kw)
    force_weights(elbo, b, conditional_model, conditional_guide, X)
    ours = grads_on_seed(elbo, conditional_model, conditional_guide, 5, X)
    assert_same(ours, grads_on_seed(ref, conditional_model, conditional_guide, 5, X))
    assert sorted(elbo.control_variate_weights()) == ["a", "m", "s"]


def _subsampled_model(x):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x), subsample_size=3) as idx:
        pyro.sample("x", dist.Normal(mu, 1.0), obs=x[idx])


def _two_site_model(x):
    pyro.sample("u", dist.Normal(0.0, 1.0))
    _subsampled_model(x)


def _two_site_guide(x):
    pyro.sample("u", dist.Normal(pyro.param("u_loc", torch.tensor(0.2)), 0.9), infer={"stl": False})
    loc = pyro.param("loc", torch.tensor(0.1))
    pyro.sample(
        "mu", dist.Normal(loc, pyro.param("sc", torch.tensor(0.5), constraint=constraints.positive))
    )


@pytest.mark.parametrize("b", [0.0, 1.0])
def test_endpoints_subsampling_and_sites_without_score_part(b):
    """Subsampled plate; a site marked stl=False (no score part: Trace_ELBO's treatment at any b)."""
    _two_site_guide(X)
    ref = (Trace_ELBO if b else TraceSTL_ELBO)(max_plate_nesting=1)
    elbo = TraceAdaptiveSTL_ELBO(warmup=0, max_plate_nesting=1)
    force_weights(elbo, b, _two_site_model, _two_site_guide, X)
    # measured in one pass: the weights are per guide site parameter (not u, which has no
    # score part)
    assert sorted(elbo.control_variate_weights()) == ["mu.loc", "mu.scale"]
    assert_same(
        grads_on_seed(elbo, _two_site_model, _two_site_guide, 7, X),
        grads_on_seed(ref, _two_site_model, _two_site_guide, 7, X),
    )


@pytest.mark.parametrize("b", [0.0, 1.0])
def test_endpoints_with_block_grad_route(b):
    """A guide site blocked from a parameter sends it neither its pathwise nor its score part.

    (``z - mu`` does not depend on ``m`` or ``s``, so blocking ``z`` from them changes
    nothing; the route that matters here is ``z`` kept from ``a``.)
    """
    routed_guide = block_grad(conditional_guide, sites=["z"], params=["m", "a"])
    conditional_guide(X)
    ref = (Trace_ELBO if b else TraceSTL_ELBO)(max_plate_nesting=1)
    elbo = TraceAdaptiveSTL_ELBO(warmup=0, max_plate_nesting=1)
    force_weights(elbo, b, conditional_model, routed_guide, X)
    ours = grads_on_seed(elbo, conditional_model, routed_guide, 3, X)
    assert_same(ours, grads_on_seed(ref, conditional_model, routed_guide, 3, X))
    if b == 0:  # the route changes STL's gradient (at b = 1 this route happens to be a no-op)
        unrouted = grads_on_seed(elbo, conditional_model, conditional_guide, 3, X)
        assert not torch.allclose(ours["a"], unrouted["a"])


def _IWAE(num_particles, max_plate_nesting):
    """Pyro's IWAE bound (``RenyiELBO(alpha=0)``), which draws what ``TraceDReG_ELBO`` draws."""
    return RenyiELBO(
        alpha=0,
        num_particles=num_particles,
        max_plate_nesting=max_plate_nesting,
        vectorize_particles=True,
    )


@pytest.mark.parametrize("K", [1, 4])
@pytest.mark.parametrize("b", [0.0, 1.0])
def test_endpoints_dreg(K, b):
    """b = 0: TraceDReG_ELBO; b = 1: the IWAE gradient, on the same draws (conditional guide)."""
    conditional_guide(X)
    ref = (_IWAE if b else TraceDReG_ELBO)(num_particles=K, max_plate_nesting=1)
    elbo = TraceAdaptiveDReG_ELBO(num_particles=K, max_plate_nesting=1, warmup=0)
    force_weights(elbo, b, conditional_model, conditional_guide, X)
    assert_same(
        grads_on_seed(elbo, conditional_model, conditional_guide, 11, X),
        grads_on_seed(ref, conditional_model, conditional_guide, 11, X),
    )


@pytest.mark.slow
def test_dreg_control_variate_has_mean_zero():
    """E[IWAE - DReG] = 0 for the guide: the adaptive mix is unbiased for any b."""
    conditional_guide(X)
    iw = gradient_draws(
        _IWAE(num_particles=4, max_plate_nesting=1), conditional_model, conditional_guide, 400, X
    )
    dr = gradient_draws(
        TraceDReG_ELBO(num_particles=4, max_plate_nesting=1),
        conditional_model,
        conditional_guide,
        400,
        X,
    )
    se = (iw.var(0) / len(iw) + dr.var(0) / len(dr)).sqrt()
    assert ((iw.mean(0) - dr.mean(0)).abs() <= 5 * se).all()


def test_dreg_block_grad_is_a_clear_error():
    routed = block_grad(conditional_guide, sites=["z"], params=["m"])
    with pytest.raises(NotImplementedError, match="block_grad"):
        TraceAdaptiveDReG_ELBO(num_particles=2, max_plate_nesting=1).loss_and_grads(
            conditional_model, routed, X
        )


# ------------------------------------------------------------------ unbiased for several guides


class Encoder(PyroModule):
    """An amortized encoder: each data point's q(z_i | x_i) from a linear layer."""

    def __init__(self):
        super().__init__()
        self.net = PyroModule[torch.nn.Linear](1, 2)

    def forward(self, x):
        h = self.net(x.unsqueeze(-1))
        with pyro.plate("data", len(x)):
            pyro.sample("z", dist.Normal(h[..., 0], torch.nn.functional.softplus(h[..., 1]) + 0.1))


def local_model(x):
    with pyro.plate("data", len(x)):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(z, 0.5), obs=x)


def _case(kind):
    gm = GaussianModel(D=3, n=4, seed=2)
    if kind == "AutoNormal":
        return gm.model, ag.AutoNormal(gm.model, init_scale=0.3), ()
    if kind == "AutoMultivariateNormal":
        return gm.model, ag.AutoMultivariateNormal(gm.model, init_scale=0.3), ()
    if kind == "conditional":
        return conditional_model, conditional_guide, (X,)
    return local_model, Encoder(), (X,)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["AutoNormal", "AutoMultivariateNormal", "conditional", "encoder"])
def test_mean_gradient_equals_trace_elbo(kind):
    model, guide, args = _case(kind)
    elbo = TraceAdaptiveSTL_ELBO(max_plate_nesting=1, decay=0.95)
    elbo.loss(model, guide, *args)  # create the params
    with torch.no_grad():  # move away from the initialisation, deterministically
        for i, (_, p) in enumerate(leaves()):
            p.add_(0.3 * torch.cos(torch.arange(p.numel(), dtype=p.dtype) + i).reshape(p.shape))
    gradient_draws(elbo, model, guide, 60, *args)  # warm-up: b is learned
    b = torch.cat([w.reshape(-1) for w in elbo.control_variate_weights().values()])
    assert (b != 0).any()
    ours = gradient_draws(elbo, model, guide, 200, *args)
    ref = gradient_draws(Trace_ELBO(max_plate_nesting=1), model, guide, 200, *args)
    se = (ours.var(0) / len(ours) + ref.var(0) / len(ref)).sqrt()
    assert ((ours.mean(0) - ref.mean(0)).abs() <= 5 * se + 1e-6).all()


# ------------------------------------------------------------------ frozen weights: unbiased, paired


@pytest.mark.slow
@pytest.mark.parametrize("frozen", ["-0.7", "0.4", "2.5", "per-element"])
def test_frozen_weights_mean_gradient_equals_pyro_trace_elbo_paired(frozen):
    """g(b) - g(1) = (b - 1) g_cv on the same draw: mean zero for any b fixed before the draw.

    g(1) is Pyro's own Trace_ELBO on the same seed (a reference independent of the package).
    """
    model, guide, args = _case("conditional")
    elbo = TraceAdaptiveSTL_ELBO(max_plate_nesting=1)
    elbo.loss(model, guide, *args)
    if frozen == "per-element":
        g = torch.Generator().manual_seed(3)
        fixed = {k: 3 * torch.randn(p.shape, generator=g) - 1 for k, p in leaves()}
        cv = elbo.control_variate
        cv.weights = lambda names, likes: [fixed[n].to(t) for n, t in zip(names, likes)]
        # frozen, not at an endpoint: every step measures
        elbo.schedule.endpoint = lambda cv: None
    else:
        elbo.control_variate.fixed_weight = float(frozen)
    ref = PyroTrace_ELBO(max_plate_nesting=1)
    diffs = []
    for seed in range(150):
        ours = grads_on_seed(elbo, model, guide, seed, *args)
        theirs = grads_on_seed(ref, model, guide, seed, *args)
        diffs.append(torch.cat([(ours[k] - theirs[k]).reshape(-1) for k in sorted(ours)]))
    d = torch.stack(diffs)
    assert (d.abs().amax(0) > 1e-3).all()  # the weights do change every draw's gradient
    se = d.std(0) / math.sqrt(len(d))
    assert (d.mean(0).abs() <= 5 * se).all(), (d.mean(0), se)


# ------------------------------------------------------------------ the weight policy


@pytest.mark.parametrize("kind", ["AutoNormal", "conditional", "encoder"])
def test_first_step_is_pyro_trace_elbo(kind):
    """The policy starts at b = 1: the first step equals Pyro's Trace_ELBO on the same seed."""
    model, guide, args = _case(kind)
    elbo = TraceAdaptiveSTL_ELBO(max_plate_nesting=1)
    elbo.loss(model, guide, *args)
    ours = grads_on_seed(elbo, model, guide, 4, *args)
    assert all((b == 1).all() for b in elbo.control_variate_weights().values())
    assert_same(ours, grads_on_seed(PyroTrace_ELBO(max_plate_nesting=1), model, guide, 4, *args))


def test_dreg_starts_at_iwae():
    conditional_guide(X)
    elbo = TraceAdaptiveDReG_ELBO(num_particles=4, max_plate_nesting=1)
    ref = _IWAE(num_particles=4, max_plate_nesting=1)
    assert_same(
        grads_on_seed(elbo, conditional_model, conditional_guide, 6, X),
        grads_on_seed(ref, conditional_model, conditional_guide, 6, X),
    )


def _feed(cv, steps, b_star, noise, gen, shape=(400,), name="p", mean=2.0):
    """Synthetic parts: g_cv ~ N(0, 1), g_path = mean - b* g_cv + noise * N(0, 1)."""
    parts = []
    for _ in range(steps):
        c = torch.randn(shape, generator=gen, dtype=torch.float64)
        p = mean - b_star * c + noise * torch.randn(shape, generator=gen, dtype=torch.float64)
        parts.append((p, c))
        cv.update([name], [p], [c])
    return parts


def test_policy_estimate_matches_naive_two_pass_weighted_least_squares():
    """b_hat is minus the slope of the weighted least-squares fit of g_path on g_cv (with an
    intercept), weights decay^(age), recomputed in two passes from the stored parts."""
    beta = 0.8
    cv = ControlVariate(decay=beta, warmup=0)
    parts = _feed(cv, 12, 0.3, 1.0, torch.Generator().manual_seed(0), shape=(5,))
    P = torch.stack([p for p, _ in parts])
    C = torch.stack([c for _, c in parts])
    w = beta ** torch.arange(len(parts) - 1, -1, -1, dtype=torch.float64)[:, None]
    pm, cm = (w * P).sum(0) / w.sum(0), (w * C).sum(0) / w.sum(0)
    slope = (w * (P - pm) * (C - cm)).sum(0) / (w * (C - cm) ** 2).sum(0)
    diag = cv.fit("p")
    torch.testing.assert_close(diag["b_hat"], -slope, rtol=1e-9, atol=0)
    assert diag["n_eff"] == pytest.approx((w.sum() ** 2 / (w**2).sum()).item())


def test_policy_standard_error_matches_the_spread_of_the_estimate():
    """400 independent elements: the delta-method SE of b_hat against b_hat's spread across them."""
    cv = ControlVariate(decay=0.95, warmup=0)
    _feed(cv, 200, 0.3, 1.0, torch.Generator().manual_seed(1))
    diag = cv.fit("p")
    spread = diag["b_hat"].std().item()
    assert 0.8 < diag["se"].mean().item() / spread < 1.25
    assert abs(diag["b_hat"].mean().item() - 0.3) < 4 * spread / 20


@pytest.mark.parametrize(
    "b_star, noise, expect",
    [
        (0.0, 0.0, "stl"),  # STL's gradient exact: b = 0
        (1.0, 0.0, "trace"),  # Trace_ELBO's gradient exact: b = 1
        (0.3, 0.1, "fit"),  # a clear optimum inside: the fitted b
        (0.3, 30.0, "trace"),  # the score part is noise beside g_path's own: no evidence, stay
    ],
)
def test_policy_choice(b_star, noise, expect):
    cv = ControlVariate()
    gen = torch.Generator().manual_seed(2)
    _feed(cv, 100, b_star, noise, gen)
    b = cv.weights(["p"], [torch.zeros(400, dtype=torch.float64)])[0]
    if expect == "stl":
        assert b.abs().max() < 1e-9
    elif expect == "trace":
        # (g_path - m) carries the centre's own noise: b is near, not exactly, 1
        assert (b - 1).abs().max() < 0.02 if noise == 0 else (b == 1).float().mean() > 0.9
    else:
        assert (b - b_star).abs().mean() < 0.05 and (b - 1).abs().min() > 0


def test_policy_warmup_holds_trace():
    cv = ControlVariate(warmup=5)
    like = torch.zeros(400, dtype=torch.float64)
    assert (cv.weights(["p"], [like])[0] == 1).all()  # no state yet
    _feed(cv, 5, 0.0, 0.0, torch.Generator().manual_seed(3))
    assert (cv.weights(["p"], [like])[0] == 1).all()  # 5 steps: still warming up
    _feed(cv, 1, 0.0, 0.0, torch.Generator().manual_seed(4))
    assert cv.weights(["p"], [like])[0].abs().max() < 1e-9


_RESET_CASES = {
    # estimator, and the fresh estimator's first step on the same draws (Pyro's own ELBO)
    "stl": (lambda: TraceAdaptiveSTL_ELBO(), lambda: PyroTrace_ELBO()),
    "dreg": (
        lambda: TraceAdaptiveDReG_ELBO(num_particles=3, max_plate_nesting=1),
        lambda: RenyiELBO(alpha=0, num_particles=3, vectorize_particles=True, max_plate_nesting=1),
    ),
}


@pytest.mark.parametrize("kind", sorted(_RESET_CASES))
def test_parameter_whose_shape_changes_resets_its_state(kind):
    """One estimator for two problems with the same parameter names: a reset, not a size error."""
    make, reference = _RESET_CASES[kind]
    elbo = make()
    for D in (2, 3):
        pyro.clear_param_store()
        gm = GaussianModel(D=D, n=4, seed=D)
        guide = ag.AutoNormal(gm.model, init_scale=0.3)
        for seed in range(8):
            grads_on_seed(elbo, gm.model, guide, seed, *())
        assert {b.shape for b in elbo.control_variate_weights().values()} == {(D,)}
    # a new problem's first step starts again at Trace_ELBO (STL) / IWAE (DReG)
    pyro.clear_param_store()
    gm = GaussianModel(D=4, n=4, seed=4)
    guide = ag.AutoNormal(gm.model, init_scale=0.3)
    guide()
    assert_same(
        grads_on_seed(elbo, gm.model, guide, 9), grads_on_seed(reference(), gm.model, guide, 9)
    )


# ------------------------------------------------------------------ at the exact posterior


def _fit_of(cv, name):
    """The fit of one parameter (a slice of its joint state's)."""
    key = next(k for k, layout in cv.layouts.items() if name in dict(layout))
    return {k: cv.split(key, v)[name] for k, v in cv.fit(key).items() if k in ("b", "endpoint")}


def _exact_posterior_problem(D=2):
    """A conjugate model and a mean-field guide at its exact posterior."""
    gm = GaussianModel(D=D, n=5, prior_cov=torch.eye(D), seed=1)
    mean, cov = gm.posterior()

    def guide():
        loc = pyro.param("loc", mean.clone())
        scale = pyro.param("scale", cov.diagonal().sqrt(), constraint=constraints.positive)
        pyro.sample("z", dist.Normal(loc, scale).to_event(1))

    return gm, guide


def test_policy_picks_stl_at_exact_posterior():
    """There STL's gradient is zero on every draw: the default policy moves from Trace to STL."""
    gm, guide = _exact_posterior_problem()
    elbo = TraceAdaptiveSTL_ELBO()
    first = gradient_draws(elbo, gm.model, guide, 1)
    assert first.abs().max() > 1e-2  # the first step is Trace_ELBO's: not zero there
    gradient_draws(elbo, gm.model, guide, 20)
    for name, b in elbo.control_variate_weights().items():
        assert b.abs().max() < 1e-3, name  # STL (the pathwise part is ~0 on every draw)
        assert (_fit_of(elbo.control_variate, name)["endpoint"] == 0).all()
    g = gradient_draws(elbo, gm.model, guide, 20)
    assert g.abs().max() < 1e-4


class SharedParams:
    """z ~ N(theta, 1), x ~ N(z, 1); the guide is the exact posterior built from the model's theta.

    As in Pyro's Gaussian-HMM conjugate test: log p(x, z) - log q(z) = log p(x; theta) for
    every z, so Trace_ELBO's gradient has zero variance while STL's does not.
    """

    x = torch.tensor(1.3)

    def model(self):
        theta = pyro.param("theta", torch.tensor(0.4))
        z = pyro.sample("z", dist.Normal(theta, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=self.x)

    def guide(self):
        theta = pyro.param("theta", torch.tensor(0.4))
        pyro.sample("z", dist.Normal((theta + self.x) / 2, math.sqrt(0.5)))


@pytest.mark.slow
def test_shared_parameters_b_goes_to_one():
    c = SharedParams()
    elbo = TraceAdaptiveSTL_ELBO(decay=0.98)
    gradient_draws(elbo, c.model, c.guide, 300)
    (b,) = elbo.control_variate_weights().values()
    assert abs(b.item() - 1.0) < 0.05
    ours = gradient_draws(elbo, c.model, c.guide, 300)
    trace = gradient_draws(Trace_ELBO(), c.model, c.guide, 300)
    stl = gradient_draws(TraceSTL_ELBO(), c.model, c.guide, 300)
    assert trace.var(0).item() < 1e-10  # Trace_ELBO: exactly the deterministic gradient
    assert ours.var(0).item() <= 1e-3 * stl.var(0).item()
    torch.testing.assert_close(ours.mean(0), trace.mean(0), atol=0.02, rtol=0)


# ------------------------------------------------------------------ variance on the D=10 Gaussian


@pytest.mark.slow
@pytest.mark.parametrize("t", [0.3, 1.0, 3.0])
def test_variance_below_half_of_the_better_estimator(t):
    D, n = 10, 20
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, D, generator=g) + 1

    def model():
        z = pyro.sample("z", dist.Normal(torch.zeros(D), 1.0).to_event(1))
        with pyro.plate("data", n):
            pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=x)

    post_sd = (1.0 / (1 + n)) ** 0.5
    post_mean = x.sum(0) / (1 + n)

    def guide():
        loc = pyro.param("loc", post_mean + t * post_sd)
        scale = pyro.param(
            "scale", torch.full((D,), post_sd * math.exp(t / 2)), constraint=constraints.positive
        )
        pyro.sample("z", dist.Normal(loc, scale).to_event(1))

    v_trace = gradient_draws(Trace_ELBO(), model, guide, 200).var(0).sum()
    v_stl = gradient_draws(TraceSTL_ELBO(), model, guide, 200).var(0).sum()
    mix = TraceAdaptiveSTL_ELBO(mix_gain=None)  # the mix on every step
    gradient_draws(mix, model, guide, 300)  # 300 warm-up calls at fixed parameters
    assert gradient_draws(mix, model, guide, 200).var(0).sum() <= 0.5 * min(v_trace, v_stl)
    # the default takes the better endpoint directly where the mix would not pay for its
    # cost (mix_gain): its variance is then the better endpoint's (200 draws: ~10% noise)
    default = TraceAdaptiveSTL_ELBO()
    gradient_draws(default, model, guide, 300)
    assert gradient_draws(default, model, guide, 200).var(0).sum() <= 1.3 * min(v_trace, v_stl)


# ------------------------------------------------------------------ state


def test_state_dict_round_trip_gives_identical_gradients():
    model, guide, args = _case("AutoNormal")
    elbo = TraceAdaptiveSTL_ELBO(decay=0.9, warmup=2, clip=5.0)
    svi = SVI(model, guide, pyro.optim.SGD({"lr": 0.01}), elbo)
    for _ in range(15):
        svi.step(*args)
    buf = io.BytesIO()
    torch.save(elbo.state_dict(), buf)
    buf.seek(0)
    resumed = TraceAdaptiveSTL_ELBO()
    resumed.load_state_dict(torch.load(buf, weights_only=False))
    assert resumed.decay == 0.9 and resumed.clip == 5.0
    for k, b in elbo.control_variate_weights().items():
        torch.testing.assert_close(resumed.control_variate_weights()[k], b, rtol=0, atol=0)
    for seed in (1, 2):  # two steps: the moments updated alike too
        a = grads_on_seed(elbo, model, guide, seed, *args)
        r = grads_on_seed(resumed, model, guide, seed, *args)
        assert_same(a, r, atol=0)
    resumed.reset()  # a reset estimator starts again at Trace_ELBO (b = 1)
    assert resumed.control_variate_weights() == {}
    assert_same(
        grads_on_seed(resumed, model, guide, 4, *args),
        grads_on_seed(PyroTrace_ELBO(), model, guide, 4, *args),
    )


def test_grad_accumulates_onto_existing_grad():
    conditional_guide(X)
    elbo = TraceAdaptiveSTL_ELBO(warmup=0, max_plate_nesting=1)
    force_weights(elbo, 0.5, conditional_model, conditional_guide, X)
    state = elbo.state_dict()
    g = grads_on_seed(elbo, conditional_model, conditional_guide, 8, X)
    elbo.load_state_dict(state)
    for _, p in leaves():
        p.grad = torch.ones_like(p)
    pyro.set_rng_seed(8)
    elbo.loss_and_grads(conditional_model, conditional_guide, X)
    for k, p in leaves():
        torch.testing.assert_close(p.grad, g[k] + 1, rtol=1e-5, atol=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="decay"):
        TraceAdaptiveSTL_ELBO(decay=1.0)
    with pytest.raises(ValueError, match="clip"):
        TraceAdaptiveSTL_ELBO(clip=0.0)
    with pytest.raises(ValueError, match="warmup"):
        TraceAdaptiveSTL_ELBO(warmup=-1)
    with pytest.raises(ValueError, match="confidence"):
        TraceAdaptiveDReG_ELBO(confidence=math.inf)
    with pytest.raises(ValueError, match="fixed_weight"):
        TraceAdaptiveSTL_ELBO(fixed_weight=math.nan)
    with pytest.raises(ValueError, match="older version"):
        TraceAdaptiveSTL_ELBO().load_state_dict({"decay": 0.9, "clip": None, "moments": {}})
    with pytest.raises(ValueError, match="mix_gain"):
        TraceAdaptiveSTL_ELBO(mix_gain=0.5)
    old = TraceAdaptiveSTL_ELBO().state_dict()  # moments without the spp buffer: refused
    old["moments"] = {"p": {"sp": torch.zeros(2), "sc": torch.zeros(2), "n": 3}}
    with pytest.raises(ValueError, match="spp"):
        TraceAdaptiveSTL_ELBO().load_state_dict(old)


# ------------------------------------------------------------------ distributed


def _distributed_worker(rank, world_size):
    from pyro_gradroute.distributed import DistributedOptimizer, broadcast_param_store

    pyro.clear_param_store()
    pyro.set_rng_seed(10 + rank)  # different draws on every rank
    model, guide, args = _case("AutoNormal")
    elbo = TraceAdaptiveSTL_ELBO(decay=0.9, warmup=2)
    elbo.loss(model, guide, *args)
    broadcast_param_store(src=0)
    svi = SVI(model, guide, DistributedOptimizer(pyro.optim.Adam({"lr": 0.01})), elbo)
    for _ in range(8):
        svi.step(*args)
    params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    cv = elbo.control_variate
    fits = {key: cv.fit(key)["b_mix"] for key in cv.state}  # the fit before step 5
    return {"b": elbo.control_variate_weights(), "fits": fits, "params": params}


@pytest.mark.slow
def test_distributed_weights_identical_on_every_rank(tmp_path):
    from tests.distributed.launch import run_ranks

    r0, r1 = run_ranks(_distributed_worker, out_dir=tmp_path, world_size=2, timeout_s=120)
    assert r0["b"].keys() == r1["b"].keys() and r0["b"]
    for k in r0["b"]:
        torch.testing.assert_close(r0["b"][k], r1["b"][k], rtol=0, atol=0)
    assert r0["fits"].keys() == r1["fits"].keys() and r0["fits"]
    for k in r0["fits"]:  # the fitted weights, identical and not all zero
        torch.testing.assert_close(r0["fits"][k], r1["fits"][k], rtol=0, atol=0)
        assert (r0["fits"][k] != 0).any()
    for k in r0["params"]:
        torch.testing.assert_close(r0["params"][k], r1["params"][k], rtol=0, atol=0)


def _measuring_schedule_only() -> TraceAdaptiveSTL_ELBO:
    """The estimator with its gate held open (the bound unknown): the measurement schedule alone."""
    elbo = TraceAdaptiveSTL_ELBO()
    elbo.schedule.gate.bound = lambda: math.inf
    return elbo


def _measured(elbo, step) -> bool:
    """Whether ``step()`` measured: the moments moved (or a new state replaced the old one)."""
    before = {k: st["n"] for k, st in elbo.control_variate.state.items()}
    step()
    return {k: st["n"] for k, st in elbo.control_variate.state.items()} != before


def _settling_problem():
    """A conjugate model and a mean-field guide near (not at) its posterior."""
    gm = GaussianModel(D=2, n=5, prior_cov=torch.eye(2), seed=1)
    mean, cov = gm.posterior()

    def guide():
        loc = pyro.param("loc", mean.clone() + 0.3)
        scale = pyro.param("scale", cov.diagonal().sqrt(), constraint=constraints.positive)
        pyro.sample("z", dist.Normal(loc, scale).to_event(1))

    return gm, guide


def _measured_steps(config, steps=30):
    """The steps (from the first settled one) that measure: after ``measure_every - 1`` direct
    steps, then waits doubling up to ``measure_max``."""
    out, wait, at = [], config.measure_every, -1
    while at + wait < steps:
        at += wait
        out.append(at)
        wait = min(2 * wait, config.measure_max)
    return out


_MEASURED_STEPS = _measured_steps(ScheduleConfig())


def test_settled_at_an_endpoint_measures_ever_less_often():
    """Every weight exactly 0: the direct steps are TraceSTL_ELBO's gradient on the same seed,
    and the measured ones come after 3, then 7, then 15 direct steps."""
    gm, guide = _settling_problem()
    elbo = _measuring_schedule_only()
    gradient_draws(elbo, gm.model, guide, 40)  # past warm-up and the fresh phase
    _fit_at_endpoint(elbo, 0.0)
    st = next(iter(elbo.control_variate.state.values()))
    elbo.schedule.last_end = None  # the schedule starts at this first settled step
    n0, measured = st["n"], []
    for seed in range(30):
        before = st["n"]
        ours = grads_on_seed(elbo, gm.model, guide, seed)
        if st["n"] != before:
            measured.append(seed)
        ref = grads_on_seed(TraceSTL_ELBO(), gm.model, guide, seed)
        for k in ref:
            torch.testing.assert_close(ours[k], ref[k])
    assert measured == _MEASURED_STEPS and st["n"] == n0 + 3  # only they update the moments


# ------------------------------------------------------------------ direct steps: when the mix does not pay


def _second_moments(parts, beta, b, mean_only=False):
    """Two-pass ||mean||^2 + sum_e Var(g_path + b g_cv) from the stored parts (weights beta^age);
    ``mean_only``: ||mean||^2."""
    P = torch.stack([p for p, _ in parts])
    C = torch.stack([c for _, c in parts])
    w = beta ** torch.arange(len(parts) - 1, -1, -1, dtype=torch.float64)[:, None]
    w = w / w.sum()
    mean2 = float((w * P).sum(0).square().sum())
    if mean_only:
        return mean2

    def var(bb):
        g = P + bb * C
        m = (w * g).sum(0)
        return float((w * (g - m) ** 2).sum())

    return mean2 + var(b), mean2 + var(torch.zeros_like(b)), mean2 + var(torch.ones_like(b))


@pytest.mark.parametrize(
    "tensors, expect",
    [
        ([(0.5, 0.05, 0.0)], [None]),  # the mix removes almost all of both endpoints' noise
        ([(0.5, 0.05, 5.0)], [1.0]),  # the same noise beside a large mean gradient: buys little
        ([(0.05, 3.0, 0.0)], [0.0]),  # near STL and noisy: the mix gains < 2x, take STL
        ([(0.05, 0.5, 0.0)], [0.0]),
        ([(0.9, 3.0, 0.0)], [1.0]),  # near Trace_ELBO: take Trace_ELBO
        ([(0.05, 0.5, 0.0), (0.05, 0.5, 5.0)], [0.0, 1.0]),  # per tensor: a large mean keeps 1
        ([(0.05, 0.5, 0.0), (0.5, 0.05, 0.0)], [0.0, None]),
    ],
)
def test_endpoints_per_tensor_match_two_pass_second_moments(tensors, expect):
    """Step 5 of the fit, against second moments recomputed per tensor from the stored parts:
    a tensor takes Trace_ELBO's gradient where no weights can gain more than ``mix_gain`` over
    it (its second moment within that of its squared mean gradient), else the better endpoint
    where the fit gains less than ``mix_gain`` over it, else the fit; direct steps only where
    every tensor takes one endpoint."""
    beta, gain = 0.9, 2.0
    cv = ControlVariate(decay=beta, gain=gain)
    gen = torch.Generator().manual_seed(3)
    names = [f"t{i}" for i in range(len(tensors))]
    stored = []
    for _ in range(60):
        ps, cs = [], []
        for b_star, noise, mean in tensors:
            c = torch.randn(50, generator=gen, dtype=torch.float64)
            ps.append(
                mean - b_star * c + noise * torch.randn(50, generator=gen, dtype=torch.float64)
            )
            cs.append(c)
        stored.append((torch.cat(ps), torch.cat(cs)))
        cv.update(names, ps, cs)
    likes = [torch.zeros(50, dtype=torch.float64)] * len(names)
    key = cv.key(names, likes)
    fit = cv.fit(key)
    b = cv.weights(names, likes)
    for i, want in enumerate(expect):
        sl = slice(50 * i, 50 * (i + 1))
        parts = [(p[sl], c[sl]) for p, c in stored]
        s_mix, s0, s1 = _second_moments(parts, beta, fit["b_mix"][sl])
        mean2 = _second_moments(parts, beta, fit["b_mix"][sl], mean_only=True)
        best, s_end = (0.0, s0) if s0 <= s1 else (1.0, s1)
        ref = 1.0 if s1 <= gain * mean2 else best if s_end <= gain * s_mix else None
        assert ref == want  # the case is what its label says
        if want is None:
            torch.testing.assert_close(b[i], fit["b_mix"][sl])
        else:
            assert bool((b[i] == want).all())
    schedule = Schedule(gain, beta, ScheduleConfig())
    schedule.key = key
    constant = expect[0] if len(set(expect)) == 1 else None
    assert schedule.endpoint(cv) == constant
    plain = ControlVariate(decay=beta)  # without ``gain``, no step 5: the fitted mix
    for p, c in stored:
        plain.update(["all"], [p], [c])
    torch.testing.assert_close(plain.fit("all")["b"], fit["b_mix"])


def _directional_draw(gen, u):
    """Parts of two tensors: ``a`` whose score part cancels the pathwise noise along ``u`` and
    is pure noise across it; ``b`` near STL with isotropic noise."""
    n = len(u)
    xi = torch.randn((), generator=gen, dtype=torch.float64)
    eta = torch.randn(n, generator=gen, dtype=torch.float64)
    eta = eta - (eta @ u) * u  # across u only
    p_a, c_a = 0.3 + 5**0.5 * xi * u, -(5**0.5) * xi * u + eta
    c_b = torch.randn(n, generator=gen, dtype=torch.float64)
    p_b = 0.05 + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)
    return (p_a, c_a), (p_b, c_b)


def test_a_tensor_whose_stl_noise_lies_along_its_mean_gradient_keeps_trace_elbo():
    """Step 5's direction test. Tensor ``a``: along its mean gradient ``u`` the score part
    cancels the pathwise noise (Trace_ELBO exact there), across ``u`` it is pure noise (STL
    exact there); the per-element sums favour STL (more directions across), yet the slope of
    <p, u> on <c, u>, recomputed from the stored parts, is near 1: ``a`` keeps Trace_ELBO's
    gradient.
    Tensor ``b``, isotropic noise with STL better in every direction, takes STL."""
    beta, gain, n = 0.9, 2.0, 10
    cv = ControlVariate(decay=beta, gain=gain)
    gen = torch.Generator().manual_seed(5)
    u = torch.ones(n, dtype=torch.float64) / n**0.5
    stored = []
    for _ in range(80):
        (p_a, c_a), (p_b, c_b) = _directional_draw(gen, u)
        stored.append(((p_a, c_a), (p_b, c_b)))
        cv.update(["a", "b"], [p_a, p_b], [c_a, c_b])
    likes = [torch.zeros(n, dtype=torch.float64)] * 2
    fit = cv.fit(cv.key(["a", "b"], likes))
    b_a, b_b = cv.weights(["a", "b"], likes)
    parts_a = [pa for pa, _ in stored]
    s_mix, s0, s1 = _second_moments(parts_a, beta, fit["b_mix"][:n])
    assert s0 < s1 and s0 <= gain * s_mix  # the per-element sums alone would take STL
    # the slope along the mean gradient, two-pass: u from the steps before each draw
    w = beta ** torch.arange(len(stored) - 2, -1, -1, dtype=torch.float64)
    a_p, a_c = [], []
    for k in range(1, len(stored)):
        mean = sum(p + c for p, c in parts_a[:k])
        v = mean / mean.norm()
        a_p.append(parts_a[k][0] @ v)
        a_c.append(parts_a[k][1] @ v)
    a_p, a_c = torch.stack(a_p), torch.stack(a_c)
    w = w / w.sum()
    cov = (w * a_p * a_c).sum() - (w * a_p).sum() * (w * a_c).sum()
    var = (w * a_c * a_c).sum() - (w * a_c).sum() ** 2
    assert float(-cov / var) > 0.9  # (1 but for the sampled mean's direction)
    assert bool((b_a == 1).all()) and bool((b_b == 0).all())
    assert fit["ends"] == frozenset({"a"})


@pytest.mark.parametrize("how", ["state_dict", "pickle", "deepcopy"])
def test_the_directional_moments_survive_a_round_trip(how):
    """The moments along each tensor's mean gradient are saved and restored with the others:
    a copy taken after the direction test has moved tensor ``a`` to 1 fits the same weights on
    the same later draws as the original."""
    gen = torch.Generator().manual_seed(5)
    u = torch.ones(10, dtype=torch.float64) / 10**0.5
    cv = ControlVariate(decay=0.9, gain=2.0)
    for _ in range(80):
        (p_a, c_a), (p_b, c_b) = _directional_draw(gen, u)
        cv.update(["a", "b"], [p_a, p_b], [c_a, c_b])
    if how == "state_dict":
        copy_ = ControlVariate(gain=2.0)
        copy_.load_state_dict(cv.state_dict())
    else:
        copy_ = pickle.loads(pickle.dumps(cv)) if how == "pickle" else copy.deepcopy(cv)
    likes = [torch.zeros(10, dtype=torch.float64)] * 2
    for _ in range(12):
        (p_a, c_a), (p_b, c_b) = _directional_draw(gen, u)
        for c in (cv, copy_):
            c.update(["a", "b"], [p_a, p_b], [c_a, c_b])
        key = cv.key(["a", "b"], likes)
        torch.testing.assert_close(cv.fit(key)["b"], copy_.fit(key)["b"], rtol=0, atol=0)
    assert bool((cv.fit(key)["b"][:10] == 1).all())  # the direction test holds ``a`` at 1


def test_direct_steps_equal_pyro_trace_elbo_and_the_others_measure():
    """A fit settled at Trace_ELBO's endpoint: the direct steps are Pyro's Trace_ELBO gradient
    on the same seed, and so are the measured ones (after 3, 7, 15 direct steps), which also
    update the moments."""
    gm, guide = _settling_problem()
    elbo = _measuring_schedule_only()
    gradient_draws(elbo, gm.model, guide, 40)  # past warm-up and the fresh phase
    _fit_at_endpoint(elbo, 1.0)
    (st,) = elbo.control_variate.state.values()
    n0, measured = st["n"], []
    for seed in range(30):
        before = st["n"]
        ours = grads_on_seed(elbo, gm.model, guide, seed)
        if st["n"] != before:
            measured.append(seed)
        ref = grads_on_seed(PyroTrace_ELBO(), gm.model, guide, seed)
        for k in ref:
            torch.testing.assert_close(ours[k], ref[k])
    assert measured == _MEASURED_STEPS and st["n"] == n0 + 3


def _fit_at_endpoint(elbo, end):
    """A fit at endpoint ``end`` everywhere, kept for the whole test."""
    cv = elbo.control_variate
    (key,) = cv.state
    fit = cv.fit(key)
    fit.update(b=torch.full_like(fit["b"], end), constant=end, views=None)
    cv.state[key]["age"] = -100


def test_enumerated_model_site_is_a_clear_error():
    """A model site marked for enumeration would be sampled from its prior: refused, naming it."""
    from pyro.infer import config_enumerate

    @config_enumerate
    def model(data):
        w = pyro.sample("w", dist.Dirichlet(torch.ones(2)))
        locs = torch.tensor([-2.0, 2.0])
        with pyro.plate("data", len(data)):
            k = pyro.sample("k", dist.Categorical(w))
            pyro.sample("x", dist.Normal(locs[k], 1.0), obs=data)

    def guide(data):
        c = pyro.param("c", torch.ones(2), constraint=constraints.positive)
        pyro.sample("w", dist.Dirichlet(c))

    with pytest.raises(ValueError, match=r"'k' is marked for enumeration.*TraceEnum_ELBO"):
        TraceAdaptiveSTL_ELBO(max_plate_nesting=1).loss_and_grads(model, guide, torch.randn(5))


# ------------------------------------------------------------------ the gate: no measuring while no weights could pay


def test_gate_bound_matches_two_pass_second_moments():
    """B = E||g_t||^2 / E<g_t, g_(t-1)> from the running sums, against a two-pass computation
    with the same weights; B estimates S(e) / ||E g||^2."""
    beta = 0.9
    gate = Gate(beta)
    gen = torch.Generator().manual_seed(0)
    mean = torch.linspace(-1.0, 2.0, 30, dtype=torch.float64)
    gs = [mean + 0.7 * torch.randn(30, generator=gen, dtype=torch.float64) for _ in range(400)]
    for i, g in enumerate(gs):
        gate.update(g)
        if i == 0:
            assert gate.bound() == math.inf
            continue
        w = beta ** torch.arange(i - 1, -1, -1, dtype=torch.float64)
        if float(w.sum() ** 2 / (w**2).sum()) < ScheduleConfig().min_samples:
            assert gate.bound() == math.inf  # too few products: the gate stays open
            continue
        G = torch.stack(gs[: i + 1])
        sq = (w * (G[1:] ** 2).sum(1)).sum()
        cross = (w * (G[1:] * G[:-1]).sum(1)).sum()
        assert gate.bound() == pytest.approx(float(sq / cross), rel=1e-9)
    # what it estimates: S(e) / ||E g||^2 = 1 + 30 * 0.49 / ||mean||^2 (within its noise)
    truth = 1 + 30 * 0.49 / float(mean.square().sum())
    sq_all = torch.stack(gs).square().sum(1).mean()
    cross_all = (torch.stack(gs[1:]) * torch.stack(gs[:-1])).sum(1).mean()
    assert float(sq_all / cross_all) == pytest.approx(truth, rel=0.05)
    gate.update(torch.zeros(3, dtype=torch.float64))  # another parameter set: starts again
    assert gate.bound() == math.inf and gate.w1 == 0.0


def _far_guide(mean, cov, shift):
    def guide():
        loc = pyro.param("loc", mean.clone() + shift)
        scale = pyro.param("scale", 0.1 * cov.diagonal().sqrt(), constraint=constraints.positive)
        pyro.sample("z", dist.Normal(loc, scale).to_event(1))

    return guide


def test_gate_far_from_the_posterior_takes_pyro_trace_elbo_without_measuring():
    """Far from the posterior, from a narrow scale (the mean gradient dominates): after the
    first measured steps every step is Pyro's Trace_ELBO gradient on the same seed, and no
    step measures (the moments do not move)."""
    gm = GaussianModel(D=2, n=5, prior_cov=torch.eye(2), seed=1)
    mean, cov = gm.posterior()
    guide = _far_guide(mean, cov, 5.0)
    elbo = TraceAdaptiveSTL_ELBO()
    gradient_draws(elbo, gm.model, guide, 8)
    (st,) = elbo.control_variate.state.values()
    n0 = st["n"]
    assert n0 < 8 and elbo.schedule.gate.bound() <= 1.25  # measured only until the bound was known
    for seed in range(10):
        ours = grads_on_seed(elbo, gm.model, guide, seed)
        ref = grads_on_seed(PyroTrace_ELBO(), gm.model, guide, seed)
        for k in ref:
            torch.testing.assert_close(ours[k], ref[k], rtol=0, atol=0)
    assert st["n"] == n0


def test_gate_opens_where_the_mix_pays():
    """At the exact posterior the Trace_ELBO gradient is all noise: the gate stays open, every
    step measures until the policy settles, and the weights reach STL."""
    gm, guide = _exact_posterior_problem()
    elbo = TraceAdaptiveSTL_ELBO()
    first = (
        elbo.control_variate.warmup + elbo.schedule.config.fresh
    )  # measured steps until the policy settles
    gradient_draws(elbo, gm.model, guide, 1)  # the first step measures
    (st,) = elbo.control_variate.state.values()
    steps = 1
    while st["n"] < first:  # the gate's first samples come from direct Trace_ELBO steps
        gradient_draws(elbo, gm.model, guide, 1)
        steps += 1
        # the first step's moments are the general path's: the next measured step, in one
        # pass, keeps its moments per guide site (the state is replaced once)
        (st,) = elbo.control_variate.state.values()
    assert steps <= first + 5 and elbo.schedule.gate.bound() > elbo.schedule.mix_gain
    gradient_draws(elbo, gm.model, guide, 10)
    for b in elbo.control_variate_weights().values():
        assert b.abs().max() < 1e-3


def test_gate_state_is_saved_and_reset():
    """The gate's moments travel with state_dict (a resumed run takes the same steps) and
    reset() forgets them."""
    gm = GaussianModel(D=2, n=5, prior_cov=torch.eye(2), seed=1)
    mean, cov = gm.posterior()
    guide = _far_guide(mean, cov, 5.0)
    elbo = TraceAdaptiveSTL_ELBO()
    gradient_draws(elbo, gm.model, guide, 8)
    resumed = TraceAdaptiveSTL_ELBO()
    resumed.load_state_dict(elbo.state_dict())
    assert resumed.schedule.gate.bound() == elbo.schedule.gate.bound() <= 1.25
    assert_same(
        grads_on_seed(resumed, gm.model, guide, 3), grads_on_seed(elbo, gm.model, guide, 3), atol=0
    )
    resumed.reset()
    assert resumed.schedule.gate.bound() == math.inf


@pytest.mark.parametrize("end", [0.0, 1.0])
def test_gate_direct_steps_keep_block_grad_routes(end):
    """A step the gate takes directly honours block_grad: the model's likelihood kept from the
    guide parameter ``a`` (a route that changes both endpoints' gradients) gives the routed
    Trace_ELBO's / STL's gradient on the same seed (at b = 1 Pyro's own step, through the gates)."""
    routed_model = block_grad(conditional_model, sites=["x"], params=["a"])
    conditional_guide(X)
    ref = (Trace_ELBO if end else TraceSTL_ELBO)(max_plate_nesting=1)
    elbo = TraceAdaptiveSTL_ELBO(max_plate_nesting=1)
    grads_on_seed(elbo, routed_model, conditional_guide, 100, X)  # the first step measures
    elbo.schedule.gate.reset(end)
    elbo.schedule.gate.bound = lambda: 1.0  # quiet: the next steps are direct
    (st,) = elbo.control_variate.state.values()
    n0 = st["n"]
    ours = grads_on_seed(elbo, routed_model, conditional_guide, 3, X)
    assert st["n"] == n0
    assert_same(ours, grads_on_seed(ref, routed_model, conditional_guide, 3, X))
    unrouted = grads_on_seed(ref, conditional_model, conditional_guide, 3, X)
    assert not torch.allclose(ours["a"], unrouted["a"])  # the route matters here


def test_measured_switch_never_mixes_and_moves_to_stl():
    """mix_gain=inf: every step is one whole estimator's gradient on the same seed (Pyro's
    Trace_ELBO first; at the exact posterior, where STL's gradient is zero, STL)."""
    gm, guide = _exact_posterior_problem()
    elbo = TraceAdaptiveSTL_ELBO(mix_gain=math.inf)
    ends = []
    for seed in range(40):
        ours = grads_on_seed(elbo, gm.model, guide, seed)
        trace = grads_on_seed(PyroTrace_ELBO(), gm.model, guide, seed)
        stl = grads_on_seed(TraceSTL_ELBO(), gm.model, guide, seed)
        same = [
            all(torch.allclose(ours[k], ref[k], atol=1e-6) for k in ref) for ref in (trace, stl)
        ]
        assert any(same), f"step {seed} mixes"
        ends.append(1.0 if same[0] else 0.0)
    assert ends[0] == 1.0 and ends[-10:] == [0.0] * 10
    for b in elbo.control_variate_weights().values():
        assert bool((b == 0).all())


def test_mix_gain_bad_values():
    with pytest.raises(ValueError, match="mix_gain"):
        TraceAdaptiveSTL_ELBO(mix_gain=math.nan)
    with pytest.raises(ValueError, match="mix_gain"):
        TraceAdaptiveSTL_ELBO(mix_gain=0.9)


@pytest.mark.parametrize("gain, quiet", [(3.0, True), (2.0, False), (math.inf, False)])
def test_gate_threshold_is_mix_gain(gain, quiet):
    """With a bound of 2.5, the gate takes the step directly for mix_gain 3 (no weights could gain
    more than it), and measures for mix_gain 2 and for the switch (mix_gain=inf: threshold 2)."""
    gm, guide = _exact_posterior_problem()
    elbo = TraceAdaptiveSTL_ELBO(mix_gain=gain)
    grads_on_seed(elbo, gm.model, guide, 0)  # the first step measures (it names the parameters)
    elbo.schedule.gate.known, elbo.schedule.gate.bound = (lambda: True), (lambda: 2.5)
    assert (not _measured(elbo, lambda: grads_on_seed(elbo, gm.model, guide, 1))) == quiet


# ------------------------------------------------------------------ measured steps in one backward
def _mean_field_guide(x):
    loc = pyro.param("q_loc", torch.tensor([0.3, -0.2]))
    sc = pyro.param("q_sc", torch.tensor([0.7, 1.3]), constraint=constraints.positive)
    mu = pyro.sample("mu", dist.Normal(loc, sc).to_event(1))
    return mu


def _mean_field_model(x):
    mu = pyro.sample("mu", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.Normal(mu.sum(-1), 0.5), obs=x)


def _one_pass_after_first(elbo, model, guide, *args):
    grads_on_seed(elbo, model, guide, 11, *args)  # the first step: the general path, which
    return elbo.schedule.one_pass  # finds whether the guide allows one pass


@pytest.mark.parametrize("auto", [False, True], ids=["hand-written", "AutoNormal"])
def test_one_pass_step_equals_the_elementwise_mix_of_pyro_trace_and_stl(auto):
    """Per-element weights on the one-pass path: the gradient is, element by element,
    (1 - b) STL + b Trace_ELBO on the same seed (the guide's loc and scale are elementwise in
    its parameters, so a weight at the Normal's loc/scale is the weight of that parameter
    element), and the moments move."""
    from pyro.infer.autoguide import AutoNormal

    guide = AutoNormal(_mean_field_model) if auto else _mean_field_guide
    guide(X)
    names = ("AutoNormal.locs.mu", "AutoNormal.scales.mu") if auto else ("q_loc", "q_sc")
    elbo = TraceAdaptiveSTL_ELBO(mix_gain=None)
    assert _one_pass_after_first(elbo, _mean_field_model, guide, X) is True
    grads_on_seed(elbo, _mean_field_model, guide, 12, X)  # the one-pass state
    (key,) = elbo.control_variate.state
    site = "mu_unconstrained" if auto else "mu"  # AutoNormal's draw, before its Delta
    cv = elbo.control_variate
    assert [n for n, _ in cv.layouts[key]] == [f"{site}.loc", f"{site}.scale"]
    b = torch.tensor([-0.5, 0.25, 2.0, 0.8])  # mu.loc (2), mu.scale (2)
    st = cv.state[key]
    st["n"], st["qw"] = 10**6, 1.0
    cv.fit(key).update(b=b, views=None, constant=None)
    st["age"] = -(10**6)
    n0 = st["n"]
    ours = grads_on_seed(elbo, _mean_field_model, guide, 13, X)
    assert st["n"] == n0 + 1
    trace = grads_on_seed(PyroTrace_ELBO(), _mean_field_model, guide, 13, X)
    stl = grads_on_seed(TraceSTL_ELBO(), _mean_field_model, guide, 13, X)
    for name, w in zip(names, (b[:2], b[2:])):
        torch.testing.assert_close(ours[name], (1 - w) * stl[name] + w * trace[name])
    assert not torch.allclose(trace[names[1]], stl[names[1]])  # the weights matter here


@pytest.mark.parametrize("b", [0.0, 1.0, -0.5])
def test_one_pass_parts_equal_the_two_pass_parts(b):
    """The one-pass step's parts (read at the Normal's parameters) are the two-pass ones on the
    same seed: with b frozen, the moments are those of STL's gradient and of Trace_ELBO's
    minus STL's."""
    _mean_field_guide(X)
    elbo = TraceAdaptiveSTL_ELBO(fixed_weight=b)
    assert _one_pass_after_first(elbo, _mean_field_model, _mean_field_guide, X) is True
    elbo.control_variate.state.clear()
    ours = grads_on_seed(elbo, _mean_field_model, _mean_field_guide, 21, X)
    (st,) = elbo.control_variate.state.values()
    trace = grads_on_seed(PyroTrace_ELBO(), _mean_field_model, _mean_field_guide, 21, X)
    stl = grads_on_seed(TraceSTL_ELBO(), _mean_field_model, _mean_field_guide, 21, X)
    # scale = exp(raw): the parts at the Normal's scale are the parameter's over d scale/d raw
    dsc = pyro.param("q_sc").detach()
    path = torch.cat([stl["q_loc"], stl["q_sc"] / dsc])
    score = torch.cat([trace["q_loc"] - stl["q_loc"], (trace["q_sc"] - stl["q_sc"]) / dsc])
    (key,) = elbo.control_variate.state
    moments = elbo.control_variate.moments(key)
    torch.testing.assert_close(moments["sp"], path, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moments["sc"], score, rtol=1e-5, atol=1e-5)
    for k in ours:
        torch.testing.assert_close(ours[k], (1 - b) * stl[k] + b * trace[k])


def _lognormal_guide(x):
    loc = pyro.param("q_loc", torch.tensor([0.3, -0.2]))
    sc = pyro.param("q_sc", torch.tensor([0.7, 1.3]), constraint=constraints.positive)
    pyro.sample("mu", dist.LogNormal(loc, sc).to_event(1))


def _gamma_guide(x):
    c = pyro.param("q_c", torch.tensor([2.0, 3.0]), constraint=constraints.positive)
    pyro.sample("mu", dist.Gamma(c, 1.0).to_event(1))


@pytest.mark.parametrize("b", [0.0, -0.5, 2.0])
def test_one_pass_step_reads_a_log_normal_site_at_its_normal(b):
    """A LogNormal site (a Normal pushed forward by exp) takes one pass, its score part read at
    the Normal's loc/scale at log(z): with b frozen the step is (1 - b) STL + b Trace_ELBO on the
    same seed."""
    _lognormal_guide(X)
    elbo = TraceAdaptiveSTL_ELBO(fixed_weight=b)
    assert _one_pass_after_first(elbo, _mean_field_model, _lognormal_guide, X) is True
    ours = grads_on_seed(elbo, _mean_field_model, _lognormal_guide, 61, X)
    trace = grads_on_seed(PyroTrace_ELBO(), _mean_field_model, _lognormal_guide, 61, X)
    stl = grads_on_seed(TraceSTL_ELBO(), _mean_field_model, _lognormal_guide, 61, X)
    for k in ours:
        torch.testing.assert_close(ours[k], (1 - b) * stl[k] + b * trace[k])


def _encoder_guide(x):
    w = pyro.param("enc_w", torch.full((len(x), 4), 0.1))
    h = x @ w  # an encoder layer: each output mixes every input
    pyro.sample("mu", dist.Normal(h[:2], h[2:].exp()).to_event(1))


def test_one_pass_only_where_the_guide_allows_it():
    """Conditional sites, other families and block_grad routes keep the general step."""
    _mean_field_guide(X)
    for model, guide, expected in [
        (_mean_field_model, _mean_field_guide, True),
        (conditional_model, conditional_guide, False),  # z's loc reads mu
        (_mean_field_model, _lognormal_guide, True),  # a Normal pushed forward by exp
        (_mean_field_model, _gamma_guide, False),  # not a Normal
        (conditional_model, block_grad(conditional_guide, sites=["z"], params=["a"]), False),
        (_mean_field_model, _encoder_guide, False),  # amortized: loc from a network layer
    ]:
        pyro.clear_param_store()
        elbo = TraceAdaptiveSTL_ELBO(max_plate_nesting=1)
        assert _one_pass_after_first(elbo, model, guide, X) is expected, guide


def test_one_pass_falls_back_to_trace_elbo_where_a_later_trace_does_not_qualify():
    """A guide whose family changes after the path was chosen: that step is Pyro's Trace_ELBO
    on the same seed (b = 1, nothing measured), and later measured steps take the general path;
    a block_grad route that appears later is the routed Trace_ELBO's step."""
    flag = {"gamma": False}

    def guide(x):
        if flag["gamma"]:
            _gamma_guide(x)
        else:
            _mean_field_guide(x)

    _mean_field_guide(X)
    elbo = TraceAdaptiveSTL_ELBO(fixed_weight=0.0)
    assert _one_pass_after_first(elbo, _mean_field_model, guide, X) is True
    flag["gamma"] = True
    before = {k: st["n"] for k, st in elbo.control_variate.state.items()}
    ours = grads_on_seed(elbo, _mean_field_model, guide, 31, X)
    assert {k: st["n"] for k, st in elbo.control_variate.state.items()} == before
    assert_same(ours, grads_on_seed(PyroTrace_ELBO(), _mean_field_model, guide, 31, X))
    assert elbo.schedule.one_pass is False
    # a route that appears after the one-pass path was chosen
    pyro.clear_param_store()
    conditional_guide(X)
    elbo = TraceAdaptiveSTL_ELBO(max_plate_nesting=1)
    elbo.schedule.one_pass = True
    routed = block_grad(conditional_model, sites=["x"], params=["a"])
    ours = grads_on_seed(elbo, routed, conditional_guide, 32, X)
    ref = grads_on_seed(Trace_ELBO(max_plate_nesting=1), routed, conditional_guide, 32, X)
    assert_same(ours, ref)
    unrouted = grads_on_seed(
        Trace_ELBO(max_plate_nesting=1), conditional_model, conditional_guide, 32, X
    )
    assert not torch.allclose(ours["a"], unrouted["a"])


def test_a_used_one_pass_estimator_pickles_and_takes_the_same_step():
    import pickle

    _mean_field_guide(X)
    elbo = TraceAdaptiveSTL_ELBO(mix_gain=None)
    for seed in range(8):
        grads_on_seed(elbo, _mean_field_model, _mean_field_guide, seed, X)
    assert elbo.schedule.one_pass is True
    clone = pickle.loads(pickle.dumps(elbo))
    assert_same(
        grads_on_seed(clone, _mean_field_model, _mean_field_guide, 40, X),
        grads_on_seed(elbo, _mean_field_model, _mean_field_guide, 40, X),
        atol=0,
    )


@pytest.mark.parametrize("b", [0.0, -0.5, 2.0])
def test_one_pass_step_with_a_loop_over_particles(b):
    """num_particles=3 (a loop): the one-pass step averages the particles' parts; with b frozen
    it equals (1 - b) STL + b Trace_ELBO with the same particles, on the same seed."""
    _mean_field_guide(X)
    elbo = TraceAdaptiveSTL_ELBO(num_particles=3, fixed_weight=b)
    assert _one_pass_after_first(elbo, _mean_field_model, _mean_field_guide, X) is True
    ours = grads_on_seed(elbo, _mean_field_model, _mean_field_guide, 51, X)
    trace = grads_on_seed(
        PyroTrace_ELBO(num_particles=3), _mean_field_model, _mean_field_guide, 51, X
    )
    stl = grads_on_seed(TraceSTL_ELBO(num_particles=3), _mean_field_model, _mean_field_guide, 51, X)
    for k in ours:
        torch.testing.assert_close(ours[k], (1 - b) * stl[k] + b * trace[k])


# ------------------------------------------------------------------ state, shapes, the uncentred switch, arguments
def _sgd_steps(elbo, model, guide, seeds, *args):
    """Steps of plain SGD (lr 0.01) on the given seeds; their gradients."""
    out = []
    for seed in seeds:
        g = grads_on_seed(elbo, model, guide, seed, *args)
        with torch.no_grad():
            for k, p in leaves():
                p.sub_(0.01 * g[k])
        out.append(g)
    return out


def _round_trips():
    def via_torch_save(elbo):
        buf = io.BytesIO()
        torch.save(elbo, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    def via_state_dict(elbo):
        clone = copy.deepcopy(elbo)
        clone.reset()
        clone.load_state_dict(elbo.state_dict())
        return clone

    return {
        "pickle": lambda e: pickle.loads(pickle.dumps(e)),
        "deepcopy": copy.deepcopy,
        "torch.save": via_torch_save,
        "state_dict": via_state_dict,
    }


_USED = {
    "stl-mix": lambda: TraceAdaptiveSTL_ELBO(mix_gain=None, max_plate_nesting=1),
    "stl-default": lambda: TraceAdaptiveSTL_ELBO(max_plate_nesting=1),
    "dreg": lambda: TraceAdaptiveDReG_ELBO(num_particles=4, max_plate_nesting=1),
}


@pytest.mark.parametrize("how", sorted(_round_trips()))
@pytest.mark.parametrize("kind", sorted(_USED))
def test_a_used_estimator_survives_every_round_trip(kind, how):
    """After 20 steps, a copy (pickle, deepcopy, torch.save, state_dict) takes the same next 12
    steps as the original, from identical parameters and seeds (the moments were views
    of one buffer, which pickle stored separately)."""
    conditional_guide(X)
    elbo = _USED[kind]()
    _sgd_steps(elbo, conditional_model, conditional_guide, range(20), X)
    clone = _round_trips()[how](elbo)
    start = {k: p.detach().clone() for k, p in leaves()}
    ours = _sgd_steps(elbo, conditional_model, conditional_guide, range(100, 112), X)
    with torch.no_grad():
        for k, p in leaves():
            p.copy_(start[k])
    theirs = _sgd_steps(clone, conditional_model, conditional_guide, range(100, 112), X)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=f"step {step}, {k}")


def _auto_normal_at_posterior(D):
    """``AutoNormal`` on a conjugate model, its parameters set to the exact posterior."""
    gm = GaussianModel(D=D, n=5, prior_cov=torch.eye(D), seed=1)
    mean, cov = gm.posterior()
    guide = ag.AutoNormal(gm.model)
    guide()
    store = pyro.get_param_store()
    store["AutoNormal.locs.z"] = mean.clone()
    store["AutoNormal.scales.z"] = cov.diagonal().sqrt()
    return gm, guide


@pytest.mark.parametrize("steps", [29, 30, 31, 32])  # measured and direct steps next
@pytest.mark.parametrize("guide_kind", ["hand-written", "AutoNormal"])
def test_a_parameter_whose_shape_changes_restarts_at_trace_elbo(guide_kind, steps):
    """After 30 steps at STL, a new problem reusing the names with other shapes: the next steps
    are Pyro's Trace_ELBO on the same seed, not STL."""
    problem = (
        _exact_posterior_problem if guide_kind == "hand-written" else _auto_normal_at_posterior
    )
    gm, guide = problem(D=2)
    elbo = TraceAdaptiveSTL_ELBO()
    gradient_draws(elbo, gm.model, guide, steps)
    stl = grads_on_seed(TraceSTL_ELBO(), gm.model, guide, 1)
    assert_same(grads_on_seed(elbo, gm.model, guide, 1), stl)  # at STL
    pyro.clear_param_store()
    gm, guide = problem(D=3)
    guide()
    for seed in range(4):
        ours = grads_on_seed(elbo, gm.model, guide, seed)
        assert_same(ours, grads_on_seed(PyroTrace_ELBO(), gm.model, guide, seed))


@pytest.mark.slow
def test_uncentred_switch_never_mixes():
    """mix_gain=inf with center=False is a switch too: every step of 60, with the default
    gate, is Pyro's Trace_ELBO's or STL's gradient on the same seed."""
    gm, guide = _settling_problem()
    elbo = TraceAdaptiveSTL_ELBO(mix_gain=math.inf, center=False)
    for seed in range(60):
        ours = grads_on_seed(elbo, gm.model, guide, seed)
        refs = (
            grads_on_seed(PyroTrace_ELBO(), gm.model, guide, seed),
            grads_on_seed(TraceSTL_ELBO(), gm.model, guide, seed),
        )
        assert any(all(torch.allclose(ours[k], r[k], atol=1e-6) for k in r) for r in refs), seed
        with torch.no_grad():
            for k, p in leaves():
                p.sub_(0.01 * ours[k])


@pytest.mark.parametrize(
    "name, value",
    [
        ("decay", "0.9"),
        ("clip", "2"),
        ("warmup", "3"),
        ("warmup", 2.5),
        ("confidence", "2"),
        ("fixed_weight", "a"),
        ("fixed_weight", torch.tensor([0.5, 0.2])),
        ("center", "yes"),
        ("distributed", "yes"),
        ("schedule", {"measure_every": 2}),
        ("mix_gain", "2"),
    ],
)
@pytest.mark.parametrize("cls", [TraceAdaptiveSTL_ELBO, TraceAdaptiveDReG_ELBO])
def test_bad_argument_types_name_the_argument(cls, name, value):
    if name == "mix_gain" and cls is TraceAdaptiveDReG_ELBO:
        return  # (DReG has no mix_gain)
    with pytest.raises(TypeError, match=f"{cls.__name__}: {name} must be"):
        cls(**{name: value})


@pytest.mark.parametrize(
    "field, value, exc",
    [
        ("measure_every", 0, ValueError),
        ("switch_gate", -1.0, ValueError),
        ("refit", "4", TypeError),
    ],
)
def test_bad_schedule_config(field, value, exc):
    with pytest.raises(exc, match=f"ScheduleConfig: {field} must be"):
        ScheduleConfig(**{field: value})
    with pytest.raises(ValueError, match="measure_max must be >= measure_every"):
        ScheduleConfig(measure_every=8, measure_max=4)


def test_schedule_config_sets_when_settled_steps_measure():
    """The schedule's constants come from the constructor: ``measure_every=2, measure_max=4``
    measures after 1, then 3, then 3 direct steps."""
    config = ScheduleConfig(measure_every=2, measure_max=4)
    gm, guide = _settling_problem()
    elbo = TraceAdaptiveSTL_ELBO(schedule=config)
    elbo.schedule.gate.bound = lambda: math.inf  # the measurement schedule alone
    gradient_draws(elbo, gm.model, guide, 40)
    _fit_at_endpoint(elbo, 1.0)
    (st,) = elbo.control_variate.state.values()
    elbo.schedule.last_end = None
    measured = []
    for seed in range(12):
        before = st["n"]
        grads_on_seed(elbo, gm.model, guide, seed)
        if st["n"] != before:
            measured.append(seed)
    assert measured == _measured_steps(config, 12) == [1, 5, 9]


def test_a_tensor_whose_mean_gradient_dominates_keeps_trace_elbo_while_another_takes_stl():
    """Step 5 in training: one site far from its posterior (its ``loc`` gradient is mostly
    mean), one at its posterior (STL's gradient there is exact). The fit keeps ``Trace_ELBO``'s
    gradient on the first site and takes STL's on the second; the schedule takes that split
    directly (no step measures), and each step applies, on the same draws, ``Trace_ELBO``'s
    gradient there and STL's here."""
    D, n = 4, 10
    x = torch.linspace(-1.0, 1.0, n)[:, None] + torch.arange(D, dtype=torch.float32)
    post_sd, post_mean = (1.0 / (1 + n)) ** 0.5, x.sum(0) / (1 + n)

    def model():
        a = pyro.sample("a", dist.Normal(torch.zeros(D), 1.0).to_event(1))
        b = pyro.sample("b", dist.Normal(torch.zeros(D), 1.0).to_event(1))
        with pyro.plate("data", n):
            pyro.sample("xa", dist.Normal(a, 1.0).to_event(1), obs=x)
            pyro.sample("xb", dist.Normal(b, 1.0).to_event(1), obs=x)

    def guide():
        sd = torch.full((D,), post_sd)
        loc_a = pyro.param("loc_a", post_mean + 30 * post_sd)
        scale_a = pyro.param("scale_a", sd.clone(), constraint=constraints.positive)
        loc_b = pyro.param("loc_b", post_mean.clone())
        scale_b = pyro.param("scale_b", sd.clone(), constraint=constraints.positive)
        pyro.sample("a", dist.Normal(loc_a, scale_a).to_event(1))
        pyro.sample("b", dist.Normal(loc_b, scale_b).to_event(1))

    elbo = TraceAdaptiveSTL_ELBO()
    elbo.schedule.gate.bound = lambda: math.inf  # the fit's choice alone, every few steps
    gradient_draws(elbo, model, guide, 40)
    cv = elbo.control_variate
    (key,) = cv.state
    b = {k: v for k, v in cv.split(key, cv.fit(key)["b"]).items()}
    assert bool((b["a.loc"] == 1).all()) and bool((b["b.loc"] == 0).all())
    assert bool((b["b.scale"] == 0).all()) and bool((b["a.scale"] == 1).all())
    assert elbo.schedule.endpoint(cv) == frozenset({"a.loc", "a.scale"})  # a split
    measured = cv.count(key)
    for seed in range(3):
        ours = grads_on_seed(elbo, model, guide, seed)
        trace = grads_on_seed(PyroTrace_ELBO(), model, guide, seed)
        stl = grads_on_seed(TraceSTL_ELBO(), model, guide, seed)
        for name, ref in (("loc_a", trace), ("scale_a", trace), ("loc_b", stl), ("scale_b", stl)):
            torch.testing.assert_close(ours[name], ref[name], msg=name)
    assert cv.count(key) == measured  # direct steps


def test_a_split_direct_step_keeps_the_score_part_at_the_tensors_at_one_only():
    """A direct step at a split (``z.loc`` at 1, ``z.scale`` and ``w``'s at 0) is the gradient
    of the hand-written surrogate ``log p(x, z, w) - log q(z; loc, stop(scale)) - log q(w;
    stop(loc_w), stop(scale_w))`` on the same draws; it measures nothing."""
    x = torch.tensor([0.3, -1.2, 0.8, 2.0])

    def model():
        z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        w = pyro.sample("w", dist.LogNormal(0.0, 1.0))
        with pyro.plate("d", 4):
            pyro.sample("x", dist.Normal(z.sum(), w), obs=x)

    def guide():
        loc = pyro.param("loc", torch.tensor([0.2, -0.1]))
        scale = pyro.param("scale", torch.tensor([0.8, 0.5]), constraint=constraints.positive)
        loc_w = pyro.param("loc_w", torch.tensor(0.1))
        scale_w = pyro.param("scale_w", torch.tensor(0.3), constraint=constraints.positive)
        pyro.sample("z", dist.Normal(loc, scale).to_event(1))
        pyro.sample("w", dist.LogNormal(loc_w, scale_w))

    pyro.clear_param_store()
    elbo = TraceAdaptiveSTL_ELBO()
    gate = elbo.schedule.gate
    gate.known, gate.bound = (lambda: True), (lambda: math.inf)  # every step measures
    for seed in range(3):  # measured steps name the tensors
        grads_on_seed(elbo, model, guide, seed)
    assert elbo.schedule.sites  # one pass: the names are the sites' parameters
    key = settle_at_split(elbo, {"z.loc"})
    assert elbo.schedule.endpoint(elbo.control_variate) == frozenset({"z.loc"})
    measured = elbo.control_variate.count(key)
    for seed in (10, 11):
        ours = grads_on_seed(elbo, model, guide, seed)
        pyro.set_rng_seed(seed)  # the same draws, by hand
        store = pyro.get_param_store()
        loc, scale, loc_w, scale_w = (store[n] for n in ("loc", "scale", "loc_w", "scale_w"))
        z = loc + scale * torch.randn(2)
        w = (loc_w + scale_w * torch.randn(())).exp()
        log_p = (
            dist.Normal(0.0, 1.0).log_prob(z).sum()
            + dist.LogNormal(0.0, 1.0).log_prob(w)
            + dist.Normal(z.sum(), w).log_prob(x).sum()
        )
        log_q = dist.Normal(loc, scale.detach()).log_prob(z).sum() + dist.LogNormal(
            loc_w.detach(), scale_w.detach()
        ).log_prob(w)
        names = ["loc", "scale", "loc_w", "scale_w"]
        leaves_ = [store.get_param(n).unconstrained() for n in names]
        ref = torch.autograd.grad(-(log_p - log_q), leaves_)
        for n, r in zip(names, ref):
            torch.testing.assert_close(ours[n], r, msg=n)
    assert elbo.control_variate.count(key) == measured  # direct steps


def test_two_backward_measured_steps_take_no_split():
    """With vectorized particles the measured steps form the parts per param-store tensor (a
    second backward), which a direct step cannot split: the schedule keeps measuring."""

    def model():
        pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))

    def guide():
        loc = pyro.param("loc", torch.tensor([0.2, -0.1]))
        scale = pyro.param("scale", torch.tensor([0.8, 0.5]), constraint=constraints.positive)
        pyro.sample("z", dist.Normal(loc, scale).to_event(1))

    pyro.clear_param_store()
    elbo = TraceAdaptiveSTL_ELBO(num_particles=2, vectorize_particles=True)
    gate = elbo.schedule.gate
    gate.known, gate.bound = (lambda: True), (lambda: math.inf)  # every step measures
    for seed in range(3):
        grads_on_seed(elbo, model, guide, seed)
    assert not elbo.schedule.sites
    key = settle_at_split(elbo, {"loc"})
    assert elbo.schedule.endpoint(elbo.control_variate) is None
    before = elbo.control_variate.count(key)
    grads_on_seed(elbo, model, guide, 7)
    assert elbo.control_variate.count(key) == before + 1  # it measured


def test_a_tensor_outside_the_param_store_gets_stls_gradient_on_a_measured_step():
    """Only param sites are weighed: a tensor the guide reads without ``pyro.param`` gets STL's
    gradient from a measured step (``differentiable_loss`` measures every call), on the same
    draws, while a param site gets ``Trace_ELBO``'s (``b = 1`` at the start)."""
    x = torch.tensor([0.5, 1.5, 1.0])
    raw_loc = torch.tensor(0.2, requires_grad=True)

    def model():
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        with pyro.plate("d", 3):
            pyro.sample("x", dist.Normal(z, 1.0), obs=x)

    def guide():
        scale = pyro.param("scale", torch.tensor(0.7), constraint=constraints.positive)
        pyro.sample("z", dist.Normal(raw_loc, scale))

    def grads(elbo):
        pyro.set_rng_seed(0)
        loss = elbo.differentiable_loss(model, guide)
        scale = pyro.param("scale").unconstrained()
        return torch.autograd.grad(loss, [raw_loc, scale])

    pyro.clear_param_store()
    ours = grads(TraceAdaptiveSTL_ELBO())
    stl, trace = grads(TraceSTL_ELBO()), grads(PyroTrace_ELBO())
    torch.testing.assert_close(ours[0], stl[0])
    torch.testing.assert_close(ours[1], trace[1])
    assert not torch.allclose(stl[0], trace[0])  # the two differ on this draw
