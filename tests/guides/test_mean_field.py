"""AutoMeanField: exact conjugate posteriors, AutoNormal equivalence, plates, errors, save/load."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoNormal, init_to_median, init_to_value
from torch.distributions import constraints

from pyro_gradroute.guides import AutoMeanField
from pyro_gradroute.infer import TraceSTL_ELBO
from tests.conjugate import ALL, fit, poisson_gamma, relative_errors


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["Trace_ELBO", "TraceSTL_ELBO"])
@pytest.mark.parametrize("make", ALL, ids=lambda m: m.__name__)
def test_conjugate_factor_matches_closed_form_posterior(make, estimator):
    case = make()
    _, q = fit(case, estimator)
    assert type(q) is case.family  # the factor is the family itself, no transform
    rel_mean, rel_sd = relative_errors(q, case.posterior)
    assert rel_mean < 0.03 and rel_sd < 0.03, (case.name, estimator, rel_mean, rel_sd)


def mixed_model(data):
    """Real, positive, unit-interval and simplex sites, some in a plate."""
    loc = pyro.sample("loc", dist.Normal(0.0, 2.0))
    scale = pyro.sample("scale", dist.LogNormal(0.0, 1.0))
    p = pyro.sample("p", dist.Beta(2.0, 2.0))
    w = pyro.sample("w", dist.Dirichlet(torch.ones(3)))
    with pyro.plate("groups", 4):
        z = pyro.sample("z", dist.Normal(loc, scale))
        pyro.sample("obs", dist.Normal(z * p + w[0], 1.0), obs=data)


DATA = torch.tensor([0.5, 1.0, -0.3, 2.0])


def test_default_family_is_autonormal_pushed_through_biject_to():
    kw = {"init_loc_fn": init_to_median(num_samples=3), "init_scale": 0.2}
    pyro.set_rng_seed(1)
    ours = AutoMeanField(mixed_model, **kw)
    ours(DATA)
    pyro.set_rng_seed(1)
    theirs = AutoNormal(mixed_model, **kw)
    theirs(DATA)
    for k, v in ours.median(DATA).items():
        # simplex: AutoNormal returns T(loc), ours the marginal medians (Monte Carlo)
        assert torch.allclose(v, theirs.median(DATA)[k], atol=0.01 if k == "w" else 1e-6), k
    q = [0.1, 0.9]
    for name in ["loc", "scale", "p", "z"]:  # elementwise bijections: exact quantiles
        assert torch.allclose(
            ours.quantiles(q, DATA)[name], theirs.quantiles(q, DATA)[name], atol=1e-5
        )
    for _ in range(3):
        seed = torch.randint(1000, ()).item()
        pyro.set_rng_seed(seed)
        a = Trace_ELBO().loss(mixed_model, ours, DATA)
        pyro.set_rng_seed(seed)
        b = Trace_ELBO().loss(mixed_model, theirs, DATA)
        assert a == pytest.approx(b, rel=1e-5)


def test_family_dict_callable_and_default_factors():
    guide = AutoMeanField(
        mixed_model, family={"scale": dist.Gamma, "p": dist.Beta, "w": dist.Dirichlet}
    )
    post = guide.get_posterior(DATA)
    assert isinstance(post["scale"], dist.Gamma) and isinstance(post["p"], dist.Beta)
    assert isinstance(post["w"], dist.Dirichlet)
    assert isinstance(post["loc"], dist.Normal)
    assert isinstance(post["z"], dist.Normal) and post["z"].batch_shape == (4,)
    pyro.clear_param_store()

    def family(site):
        return torch.distributions.LogNormal if site["fn"].support is constraints.positive else None

    post = AutoMeanField(mixed_model, family=family).get_posterior(DATA)
    assert isinstance(post["scale"], dist.LogNormal)
    assert isinstance(post["p"], dist.TransformedDistribution)  # Normal pushed to (0, 1)


@pytest.mark.slow
@pytest.mark.parametrize("estimator", [Trace_ELBO, TraceSTL_ELBO])
def test_all_moment_matched_families_train_and_keep_constraints_at_large_lr(estimator):
    family = {
        "loc": dist.StudentT,
        "scale": dist.Gamma,
        "p": dist.Beta,
        "w": dist.Dirichlet,
        "z": dist.Laplace,
    }
    guide = AutoMeanField(mixed_model, family=family)
    svi = SVI(mixed_model, guide, pyro.optim.Adam({"lr": 0.5}), estimator())
    losses = [svi.step(DATA) for _ in range(100)]
    assert all(torch.isfinite(torch.tensor(losses)))
    store = pyro.get_param_store()
    assert len(store) == 10  # StudentT 3, Gamma 2, Beta 2, Dirichlet 1, Laplace 2
    for name in store.keys():
        value = store[name]
        assert torch.isfinite(value).all() and store._constraints[name].check(value).all(), name
    sample = guide(DATA)
    for name, site in guide.prototype_trace.iter_stochastic_nodes():
        assert site["fn"].support.check(sample[name]).all(), name


@pytest.mark.parametrize("family", ["InverseGamma", "Weibull", "LogNormal", "Gamma"])
def test_moment_init_starts_at_init_loc_with_autonormal_spread(family):
    def model():
        pyro.sample("s", dist.LogNormal(1.0, 0.5))

    init = init_to_value(values={"s": torch.tensor(2.5)})
    guide = AutoMeanField(model, family=getattr(dist, family), init_scale=0.05, init_loc_fn=init)
    q = guide.get_posterior()["s"]
    assert q.mean.item() == pytest.approx(2.5, rel=1e-3)
    assert q.stddev.item() == pytest.approx(0.05 * q.mean.item(), rel=1e-2)


@pytest.mark.slow
def test_subsampled_plate_indexes_local_factors_and_converges():
    y = torch.tensor([0.0, 1.0, 3.0, 2.0, 5.0, 1.0, 0.0, 4.0, 2.0, 6.0])

    def model(y):
        with pyro.plate("groups", len(y), subsample_size=5) as idx:
            rate = pyro.sample("rate", dist.Gamma(2.0, 1.0))
            pyro.sample("y", dist.Poisson(rate), obs=y[idx])

    guide = AutoMeanField(model, family=dist.Gamma, init_loc_fn=init_to_median, init_scale=0.5)
    TraceSTL_ELBO().loss_and_grads(model, guide, y)
    conc = pyro.param("AutoMeanField.rate.concentration").unconstrained()
    assert conc.shape == (10,)  # full size, not the subsample
    assert (conc.grad != 0).sum().item() == 5  # only the subsample's factors get gradient
    elbo = TraceSTL_ELBO(num_particles=4, vectorize_particles=True, max_plate_nesting=1)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), elbo)
    for _ in range(600):
        svi.step(y)
    q = guide.get_posterior(y)["rate"]
    exact = dist.Gamma(2.0 + y, 2.0)
    rel_mean, rel_sd = relative_errors(q, exact)
    assert rel_mean < 0.03 and rel_sd < 0.03, (rel_mean, rel_sd)


@pytest.mark.slow
def test_median_quantiles_predictive_and_posterior():
    case = poisson_gamma()
    guide, q = fit(case, "TraceSTL_ELBO")
    qs = guide.quantiles([0.1, 0.5, 0.9], case.data)["rate"]  # Gamma has no icdf: Monte Carlo
    assert torch.allclose(q.cdf(qs), torch.tensor([0.1, 0.5, 0.9]), atol=0.02)
    assert torch.equal(guide.median(case.data)["rate"], qs[1])  # deterministic
    samples = Predictive(case.model, guide=guide, num_samples=2000)(case.data)
    # Predictive puts its sample dim left of the model's plates (dim -2 here), as for AutoNormal
    assert samples["rate"].shape == (2000, 1) and samples["x"].shape == (2000, len(case.data))
    assert samples["rate"].mean().item() == pytest.approx(q.mean.item(), rel=0.03)


@pytest.mark.slow
def test_param_store_save_load_round_trips_a_fitted_guide(tmp_path):
    case = poisson_gamma()
    guide, q = fit(case, "TraceSTL_ELBO")
    pyro.set_rng_seed(3)
    loss = Trace_ELBO().loss(case.model, guide, case.data)
    path = tmp_path / "params.pt"
    pyro.get_param_store().save(path)
    pyro.clear_param_store()
    pyro.get_param_store().load(path)
    restored = AutoMeanField(case.model, family=dist.Gamma)  # a fresh guide: reads the store
    r = restored.get_posterior(case.data)["rate"]
    assert torch.equal(r.concentration, q.concentration) and torch.equal(r.rate, q.rate)
    constraint = pyro.get_param_store()._constraints["AutoMeanField.rate.rate"]
    assert isinstance(constraint, constraints.greater_than) and constraint.lower_bound == 0
    pyro.set_rng_seed(3)
    assert Trace_ELBO().loss(case.model, restored, case.data) == loss


def positive_model():
    pyro.sample("s", dist.Gamma(2.0, 1.0))


def test_family_without_rsample_is_an_error_unless_score_function_allowed():
    def model(x):
        z = pyro.sample("z", dist.Bernoulli(0.3))
        pyro.sample("x", dist.Normal(2.0 * z, 1.0), obs=x)

    x = torch.tensor(2.5)  # exact posterior P(z=1 | x) = 0.895, far from the initial 0.5
    guide = AutoMeanField(model, family={"z": dist.Bernoulli}, init_params={"z": {"probs": 0.5}})
    with pytest.raises(
        ValueError, match="site 'z'.*Bernoulli has no rsample.*allow_score_function=True"
    ):
        guide(x)
    guide = AutoMeanField(
        model,
        family={"z": dist.Bernoulli},
        init_params={"z": {"probs": 0.5}},
        allow_score_function=True,
    )
    svi = SVI(
        model,
        guide,
        pyro.optim.ClippedAdam({"lr": 0.1, "lrd": 0.98}),
        TraceSTL_ELBO(num_particles=16, vectorize_particles=True, max_plate_nesting=0),
    )
    for _ in range(100):
        svi.step(x)
    like = dist.Normal(torch.tensor([0.0, 2.0]), 1.0).log_prob(x).exp() * torch.tensor([0.7, 0.3])
    exact = (like[1] / like.sum()).item()
    assert exact > 0.85
    assert pyro.param("AutoMeanField.z.probs").item() == pytest.approx(exact, abs=0.04)
    with pytest.raises(ValueError, match="site 's'.*VonMises has no rsample"):
        AutoMeanField(positive_model, family=dist.VonMises)()


def test_support_mismatch_names_site_and_both_supports():
    with pytest.raises(
        ValueError, match=r"site 's'.*GreaterThanEq\(lower_bound=0.0\).*Beta lives on Interval"
    ):
        AutoMeanField(positive_model, family=dist.Beta)()


def test_unknown_site_in_family_dict_lists_latent_sites():
    with pytest.raises(
        ValueError,
        match=r"unknown site\(s\) \['sigma'\].*latent sites are \['loc', 'scale', 'p', 'w', 'z'\]",
    ):
        AutoMeanField(mixed_model, family={"sigma": dist.Gamma})(DATA)
    with pytest.raises(ValueError, match=r"init_params names unknown site\(s\) \['q'\]"):
        AutoMeanField(mixed_model, init_params={"q": {}})(DATA)
    with pytest.raises(TypeError, match="family for site 'scale'"):
        AutoMeanField(mixed_model, family={"scale": "Gamma"})


def test_family_without_moment_rule_asks_for_init_params():
    def model():
        pyro.sample("g", dist.Normal(0.0, 1.0))

    with pytest.raises(
        ValueError, match=r"no moment-matching initialisation for Gumbel; pass init_params=\{'g'"
    ):
        AutoMeanField(model, family=dist.Gumbel)()
    guide = AutoMeanField(model, family=dist.Gumbel, init_params={"g": {"loc": 0.5, "scale": 2.0}})
    assert guide.get_posterior()["g"].loc.item() == 0.5


def test_discrete_site_with_real_family_gets_autonormal_error():
    def model():
        pyro.sample("k", dist.Poisson(3.0))

    with pytest.raises(ValueError, match="discrete sample site 'k'"):
        AutoMeanField(model)()


def test_multivariate_normal_factor_for_a_vector_site_in_a_plate():
    def model():
        with pyro.plate("groups", 4):
            pyro.sample("v", dist.Normal(torch.zeros(3), 1.0).to_event(1))
            pyro.sample("s", dist.Gamma(torch.ones(2), 1.0).to_event(1))

    guide = AutoMeanField(model, family={"v": dist.MultivariateNormal, "s": dist.LogNormal})
    post = guide.get_posterior()
    assert isinstance(post["v"], dist.MultivariateNormal)
    assert post["v"].batch_shape == (4,) and post["v"].event_shape == (3,)
    assert post["v"].scale_tril.shape == (4, 3, 3)
    assert post["s"].batch_shape == (4,) and post["s"].event_shape == (2,)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), TraceSTL_ELBO())
    for _ in range(5):
        svi.step()
    assert guide.median()["v"].shape == (4, 3) and guide.median()["s"].shape == (4, 2)


@pytest.mark.parametrize("make", ALL, ids=lambda m: m.__name__)
def test_stl_gradient_vanishes_at_the_exact_posterior_for_every_family(make):
    """TraceSTL_ELBO uses the one-pass pathwise part for Gamma, Beta and Dirichlet factors too
    (implicit reparameterization): at q = posterior its gradient is zero for every draw."""
    from ..conjugate import leaves, set_param

    case = make()
    guide = AutoMeanField(case.model, family=case.family)
    guide(case.data)
    for arg in guide.factors[case.site].init:
        set_param(f"AutoMeanField.{case.site}.{arg}", getattr(case.posterior, arg))
    for elbo, zero in (
        (TraceSTL_ELBO(num_particles=3), True),
        (Trace_ELBO(num_particles=3), False),
    ):
        for _, p in leaves():
            p.grad = None
        elbo.loss_and_grads(case.model, guide, case.data)
        grads = torch.cat([p.grad.reshape(-1) for _, p in leaves()])
        assert (grads.abs().max().item() < 1e-3) == zero, (type(elbo).__name__, grads)


def test_failed_setup_raises_again_on_the_next_call():
    guide = AutoMeanField(positive_model, family=dist.Beta)
    for _ in range(2):
        with pytest.raises(ValueError, match="support mismatch"):
            guide()


def test_init_params_with_a_wrong_shape_is_a_clear_error():
    def model():
        with pyro.plate("groups", 4):
            pyro.sample("s", dist.Gamma(2.0, 1.0))

    guide = AutoMeanField(model, family=dist.Gamma, init_params={"s": {"rate": torch.ones(3)}})
    with pytest.raises(
        ValueError, match=r"site 's'.*'rate' has shape \(3,\).*factor's shape \(4,\)"
    ):
        guide()
    pyro.clear_param_store()
    guide = AutoMeanField(model, family=dist.Gamma, init_params={"s": {"rate": 2.0}})
    assert torch.equal(guide.get_posterior()["s"].rate, torch.full((4,), 2.0))
