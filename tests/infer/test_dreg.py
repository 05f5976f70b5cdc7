"""TraceDReG_ELBO and ReweightedWakeSleepDReG against RenyiELBO(alpha=0) / ReweightedWakeSleep."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import RenyiELBO, ReweightedWakeSleep
from pyro.infer import autoguide as ag
from pyro.nn import PyroModule
from torch.distributions import constraints

from pyro_gradroute.infer import (
    ReweightedWakeSleepDReG,
    TraceAdaptiveDReG_ELBO,
    TraceDReG_ELBO,
    TraceSTL_ELBO,
)
from tests.conjugate import HierarchicalModel, gradient_draws, leaves


class LearnablePriorModel:
    """``z ~ N(theta, 1)`` (D=2), ``x_i ~ N(z, 1)``: a model parameter and a data plate."""

    def __init__(self, n=4, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 2, generator=g) + 1.0

    def model(self):
        theta = pyro.param("theta", torch.tensor([0.3, -0.2]))
        z = pyro.sample("z", dist.Normal(theta, 1.0).to_event(1))
        with pyro.plate("data", len(self.x)):
            pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=self.x)

    def guide(self):
        loc = pyro.param("q_loc", torch.tensor([0.1, 0.4]))
        scale = pyro.param("q_scale", torch.tensor([0.5, 0.9]), constraint=constraints.positive)
        pyro.sample("z", dist.Normal(loc, scale).to_event(1))


class LocalLatentModel(PyroModule):
    """A VAE-like model: local ``z_i`` per data point, amortized linear encoder, linear decoder."""

    def __init__(self, n=6):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 3, generator=g)
        self.dec = PyroModule[torch.nn.Linear](2, 3)
        self.enc = PyroModule[torch.nn.Linear](3, 4)

    def model(self):
        with pyro.plate("data", len(self.x)):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(self.dec(z), 0.5).to_event(1), obs=self.x)

    def guide(self):
        with pyro.plate("data", len(self.x)):
            h = self.enc(self.x)
            pyro.sample(
                "z",
                dist.Normal(h[..., :2], torch.nn.functional.softplus(h[..., 2:]) + 0.1).to_event(1),
            )


def _setup(kind):
    if kind == "learnable_prior":
        m = LearnablePriorModel()
        m.model(), m.guide()
        return m.model, m.guide
    if kind == "local_latent":
        m = LocalLatentModel()
        m.model(), m.guide()
        return m.model, m.guide
    if kind == "hierarchical_guide":
        m = HierarchicalModel()
        m.guide()
        return m.model, m.guide
    m = LearnablePriorModel()
    guide = getattr(ag, kind)(m.model)
    guide()
    return m.model, guide


KINDS = [
    "learnable_prior",
    "local_latent",
    "hierarchical_guide",
    "AutoNormal",
    "AutoMultivariateNormal",
]


def _guide_mask(model, guide):
    """Which flat gradient coordinates belong to guide parameters."""
    tr = pyro.poutine.trace(guide).get_trace()
    guide_params = {n for n, s in tr.nodes.items() if s["type"] == "param"}
    return torch.cat([torch.full((p.numel(),), n in guide_params) for n, p in leaves()])


@pytest.mark.parametrize("kind", KINDS)
def test_loss_equals_renyi_alpha0(kind):
    model, guide = _setup(kind)
    for seed in range(2):
        pyro.set_rng_seed(seed)
        ref = RenyiELBO(alpha=0, num_particles=5, vectorize_particles=True).loss(model, guide)
        pyro.set_rng_seed(seed)
        ours = TraceDReG_ELBO(num_particles=5).loss(model, guide)
        pyro.set_rng_seed(seed)
        ours_lg = TraceDReG_ELBO(num_particles=5).loss_and_grads(model, guide)
        assert ours == pytest.approx(ref, rel=1e-6) and ours_lg == pytest.approx(ref, rel=1e-6)


@pytest.mark.parametrize("kind", ["learnable_prior", "local_latent"])
def test_model_gradients_equal_renyi_on_same_samples(kind):
    torch.set_default_dtype(torch.float64)  # the math is identical: compare at float64 round-off
    model, guide = _setup(kind)
    is_guide = _guide_mask(model, guide)
    pyro.set_rng_seed(3)
    ref = gradient_draws(
        RenyiELBO(alpha=0, num_particles=7, vectorize_particles=True), model, guide, 1
    )[0]
    pyro.set_rng_seed(3)
    ours = gradient_draws(TraceDReG_ELBO(num_particles=7), model, guide, 1)[0]
    assert (~is_guide).any()
    torch.testing.assert_close(ours[~is_guide], ref[~is_guide], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ours[is_guide], ref[is_guide])  # the guide's estimator differs


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_dreg_guide_gradient_is_unbiased_for_iwae(kind):
    model, guide = _setup(kind)
    is_guide = _guide_mask(model, guide)
    K, draws = 8, 200
    dreg = gradient_draws(TraceDReG_ELBO(num_particles=K), model, guide, draws)[:, is_guide]
    iwae = gradient_draws(
        RenyiELBO(alpha=0, num_particles=K, vectorize_particles=True), model, guide, draws
    )[:, is_guide]
    se = (dreg.var(0) / draws + iwae.var(0) / draws).sqrt()
    diff = (dreg.mean(0) - iwae.mean(0)).abs()
    assert (diff <= 4 * se + 1e-5).all(), (diff, se)
    if kind == "learnable_prior":  # a guide of about the posterior's width: DReG has less variance
        assert dreg.var(0).sum() < iwae.var(0).sum()


@pytest.mark.parametrize("kind", ["learnable_prior", "hierarchical_guide", "AutoNormal"])
def test_one_particle_is_stl(kind):
    model, guide = _setup(kind)
    pyro.set_rng_seed(5)
    stl = gradient_draws(TraceSTL_ELBO(), model, guide, 2)
    pyro.set_rng_seed(5)
    dreg = gradient_draws(TraceDReG_ELBO(num_particles=1), model, guide, 2)
    torch.testing.assert_close(dreg, stl, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_rws_dreg_against_pyro_rws():
    m = LearnablePriorModel()
    m.model(), m.guide()
    is_guide = _guide_mask(m.model, m.guide)
    K = 6
    pyro.set_rng_seed(2)
    ref_one = gradient_draws(
        ReweightedWakeSleep(num_particles=K, insomnia=1.0), m.model, m.guide, 1
    )[0]
    pyro.set_rng_seed(2)
    ours_one = gradient_draws(ReweightedWakeSleepDReG(num_particles=K), m.model, m.guide, 1)[0]
    # wake-theta: identical on the same samples
    torch.testing.assert_close(ours_one[~is_guide], ref_one[~is_guide], rtol=1e-5, atol=1e-6)
    # wake-phi: same expectation, lower variance
    draws = 400
    ours = gradient_draws(ReweightedWakeSleepDReG(num_particles=K), m.model, m.guide, draws)[
        :, is_guide
    ]
    ref = gradient_draws(
        ReweightedWakeSleep(num_particles=K, insomnia=1.0), m.model, m.guide, draws
    )[:, is_guide]
    se = (ours.var(0) / draws + ref.var(0) / draws).sqrt()
    assert ((ours.mean(0) - ref.mean(0)).abs() <= 4 * se + 1e-5).all()
    assert ours.var(0).sum() < ref.var(0).sum()


def test_non_reparameterized_guide_site_is_an_error():
    def model():
        pyro.sample("k", dist.Poisson(3.0))
        pyro.sample("z", dist.Normal(0.0, 1.0))

    def guide():
        rate = pyro.param("rate", torch.tensor(2.0), constraint=constraints.positive)
        pyro.sample("k", dist.Poisson(rate))
        pyro.sample("z", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match="Guide site 'k'.*not reparameterized"):
        TraceDReG_ELBO(num_particles=3).loss_and_grads(model, guide)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="vectorize_particles=True"):
        TraceAdaptiveDReG_ELBO(num_particles=4, vectorize_particles=False)
    with pytest.raises(ValueError, match="alpha=0.5.*TraceDReG_ELBO"):
        ReweightedWakeSleepDReG(num_particles=4, alpha=0.5)
    ReweightedWakeSleepDReG(num_particles=4, alpha=0)  # the IWAE order is its own
    with pytest.raises(ValueError, match="num_particles > 1"):
        ReweightedWakeSleepDReG(num_particles=1)


@pytest.mark.slow
def test_svi_with_subsampling_and_autoguide():
    g = torch.Generator().manual_seed(0)
    data = torch.randn(50, generator=g) + 2.0

    def model():
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        sigma = pyro.sample("sigma", dist.LogNormal(0.0, 1.0))
        with pyro.plate("data", len(data), subsample_size=10) as idx:
            pyro.sample("x", dist.Normal(mu, sigma), obs=data[idx])

    guide = ag.AutoNormal(model)
    svi = pyro.infer.SVI(
        model, guide, pyro.optim.Adam({"lr": 0.05}), TraceDReG_ELBO(num_particles=8)
    )
    for _ in range(400):
        svi.step()
    assert abs(guide.median()["mu"].item() - data.mean().item()) < 0.3


def test_flow_without_rule_or_inverse_is_an_error_naming_the_site():
    from pyro_gradroute.distributions import SplitNotSupported
    from tests.infer.test_stl import _NoRuleNoInverse

    def model():
        pyro.sample("z", pyro.distributions.Normal(torch.zeros(2), 1.0).to_event(1))

    def guide():
        s = pyro.param(
            "nr_s", torch.tensor(0.5), constraint=pyro.distributions.constraints.positive
        )
        base = pyro.distributions.Normal(torch.zeros(2), 1.0).to_event(1)
        pyro.sample("z", pyro.distributions.TransformedDistribution(base, [_NoRuleNoInverse(s)]))

    with pytest.raises(SplitNotSupported, match="Guide site 'z'"):
        TraceDReG_ELBO(num_particles=3).loss_and_grads(model, guide)


class LinearRegression:
    """The Bayesian-regression tutorial's model: ``PyroModule[nn.Linear]`` with sampled weights.

    ``nn.Linear`` transposes the sampled weight, so the model does not vectorize over particles.
    """

    def __init__(self):
        from pyro.nn import PyroSample

        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(8, 3, generator=g)
        self.y = self.x @ torch.tensor([1.0, -0.5, 0.2]) + 0.3 * torch.randn(8, generator=g)
        self.linear = PyroModule[torch.nn.Linear](3, 1)
        self.linear.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 3]).to_event(2))
        self.linear.bias = PyroSample(dist.Normal(0.0, 5.0).expand([1]).to_event(1))

    def model(self):
        mean = self.linear(self.x).squeeze(-1)
        with pyro.plate("data", len(self.x)):
            pyro.sample("obs", dist.Normal(mean, 0.5), obs=self.y)


def _regression_setup():
    pyro.clear_param_store()
    reg = LinearRegression()
    guide = ag.AutoDiagonalNormal(reg.model, init_scale=0.3)
    guide()  # create the parameters
    return reg, guide


def test_model_that_does_not_vectorize_gets_a_clear_error():
    reg, guide = _regression_setup()
    with pytest.raises(
        RuntimeError, match="does not vectorize over particles.*vectorize_particles=False"
    ):
        TraceDReG_ELBO(num_particles=4).loss_and_grads(reg.model, guide)


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_particle_loop_equals_vectorized_pass_on_the_same_draws(alpha):
    """The loop's loss and gradients equal the vectorized pass's, on the same draws.

    The vectorized reference is the same linear model written with a matmul (it
    vectorizes); the loop runs the ``nn.Linear`` one. AutoDiagonalNormal draws one
    ``(K, D)`` block vectorized and ``K`` rows in the loop: the same draws when the
    loop's standard normals are the rows of the vectorized block.
    """
    K = 3  # K * D < 16: torch draws the (K, D) block element by element, as the loop does
    reg, guide = _regression_setup()

    def vec_model():
        w = pyro.sample("weight", dist.Normal(0.0, 1.0).expand([1, 3]).to_event(2))
        b = pyro.sample("bias", dist.Normal(0.0, 5.0).expand([1]).to_event(1))
        mean = (w[..., 0, :] * reg.x).sum(-1) + b[..., 0]  # (K, 1, 3) * (8, 3): (K, 8)
        with pyro.plate("data", len(reg.x)):
            pyro.sample("obs", dist.Normal(mean, 0.5), obs=reg.y)

    params = [
        pyro.param(n).unconstrained()
        for n in ("AutoDiagonalNormal.loc", "AutoDiagonalNormal.scale")
    ]

    def run(elbo, model):
        for p in params:
            p.grad = None
        torch.manual_seed(7)
        loss = elbo.loss_and_grads(model, guide)
        return loss, [p.grad.clone() for p in params]

    loop = TraceDReG_ELBO(num_particles=K, vectorize_particles=False, alpha=alpha)
    vec = TraceDReG_ELBO(num_particles=K, max_plate_nesting=1, alpha=alpha)
    loss_loop, g_loop = run(loop, reg.model)
    loss_vec, g_vec = run(vec, vec_model)
    assert loss_loop == pytest.approx(loss_vec, rel=1e-5)
    for a, b in zip(g_loop, g_vec):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    # and the loop's loss is RenyiELBO's (its default is a particle loop) on the same draws
    torch.manual_seed(7)
    renyi = RenyiELBO(alpha=alpha, num_particles=K).loss(reg.model, guide)
    assert loss_loop == pytest.approx(renyi, rel=1e-5)


@pytest.mark.parametrize(
    "make",
    [
        lambda: TraceDReG_ELBO(num_particles=4, alpha=0.3),
        lambda: TraceAdaptiveDReG_ELBO(num_particles=4, warmup=0),
        lambda: ReweightedWakeSleepDReG(num_particles=4),
    ],
    ids=["dreg", "adaptive_dreg", "rws_dreg"],
)
def test_pickle_round_trip_gives_the_same_loss_and_gradients(make):
    import pickle

    m = LearnablePriorModel()
    elbo = make()
    pyro.clear_param_store()
    torch.manual_seed(0)
    elbo.loss_and_grads(m.model, m.guide)  # a used estimator (the adaptive one has state)
    clone = pickle.loads(pickle.dumps(elbo))
    assert type(clone) is type(elbo)
    results = []
    for e in (elbo, clone):
        params = [pyro.param(n).unconstrained() for n in ("theta", "q_loc", "q_scale")]
        for p in params:
            p.grad = None
        torch.manual_seed(1)
        loss = e.loss_and_grads(m.model, m.guide)
        results.append((loss, [p.grad.clone() for p in params]))
    (l1, g1), (l2, g2) = results
    assert l1 == l2
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("vectorize", [True, False])
@pytest.mark.parametrize(
    "Elbo", [TraceDReG_ELBO, ReweightedWakeSleepDReG], ids=["dreg", "rws_dreg"]
)
def test_guide_messenger_at_several_particles_is_the_documented_refusal(Elbo, vectorize):
    """Not wrapped in the vectorized-pass message, whose vectorize_particles=False would not help."""

    def model():
        pyro.sample("x", dist.Normal(0.0, 1.0))

    pyro.clear_param_store()
    guide = ag.AutoNormalMessenger(model)
    with pytest.raises(NotImplementedError, match="^GuideMessenger guides are not supported") as e:
        Elbo(num_particles=3, vectorize_particles=vectorize, max_plate_nesting=0).loss_and_grads(
            model, guide
        )
    assert "vectorize_particles=False" not in str(e.value)


def _scaled_link_problem(subsample_size):
    data = torch.tensor([0.3, -1.2, 0.8, 2.0, -0.1, 0.5])

    def model():
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("d", len(data), subsample_size=subsample_size) as i:
            z = pyro.sample("z", dist.Normal(mu, 1.0))
            pyro.sample("x", dist.Normal(z, 1.0), obs=data[i])

    def guide():
        m = pyro.param("m", torch.tensor(0.1))
        a = pyro.param("a", torch.zeros(len(data)))
        mu = pyro.sample("mu", dist.Normal(m, 1.0))
        with pyro.plate("d", len(data), subsample_size=subsample_size) as i:
            pyro.sample("z", dist.Normal(a[i] + mu, 1.0))  # reads mu, of another scale

    return model, guide


def test_conditional_link_between_draws_of_different_scales_is_a_clear_error():
    """A nested subsampled plate: the link's per-path factor would depend on the scale."""
    model, guide = _scaled_link_problem(subsample_size=2)
    pyro.clear_param_store()
    with pytest.raises(ValueError, match="site 'z'.*different scales.*RenyiELBO\\(alpha=0\\)"):
        TraceDReG_ELBO(num_particles=3, max_plate_nesting=1).loss_and_grads(model, guide)
    # without subsampling the link joins draws of one scale: the loss is RenyiELBO's
    model, guide = _scaled_link_problem(subsample_size=None)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    ours = TraceDReG_ELBO(num_particles=3, max_plate_nesting=1).loss_and_grads(model, guide)
    pyro.set_rng_seed(0)
    ref = RenyiELBO(alpha=0, num_particles=3, vectorize_particles=True, max_plate_nesting=1)
    assert ours == pytest.approx(ref.loss(model, guide), rel=1e-6)
