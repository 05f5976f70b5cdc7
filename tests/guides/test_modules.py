"""AutoMeanField and ParametrizedDistribution are PyroModules like AutoNormal: parameters as
module attributes (``parameters()``, ``state_dict()``, ``torch.save``, module-local params),
and still registered in the param store under their documented names."""

import io

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_gradroute.guides import AutoMeanField, ParametrizedDistribution
from pyro_gradroute.infer import TraceSTL_ELBO


def model(x):
    rate = pyro.sample("rate", dist.Gamma(2.0, 1.0))
    loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.Normal(loc, rate.reciprocal().sqrt()), obs=x)


X = torch.tensor([0.5, 1.5, 1.0, 2.0])
NAMES = ["AutoMeanField.loc.loc", "AutoMeanField.loc.scale", "AutoMeanField.rate.concentration",
         "AutoMeanField.rate.rate"]  # fmt: skip


def make_guide():
    guide = AutoMeanField(model, family={"rate": dist.Gamma})
    guide(X)  # set up, like any AutoGuide
    return guide


@pytest.fixture(autouse=True)
def _clean():
    pyro.clear_param_store()
    yield
    pyro.settings.set(module_local_params=False)
    pyro.clear_param_store()


def test_elbo_module_parameters_train_the_guide_with_torch_optim():
    guide = make_guide()
    elbo = TraceSTL_ELBO(num_particles=8, vectorize_particles=True)(model, guide)
    params = list(elbo.parameters())
    assert len(params) == 4
    before = guide.median(X)["rate"].clone()
    opt = torch.optim.Adam(params, lr=0.05)
    for _ in range(20):
        opt.zero_grad()
        elbo(X).backward()
        opt.step()
    assert not torch.equal(before, guide.median(X)["rate"])
    assert sorted(pyro.get_param_store().keys()) == NAMES  # the documented names


def test_state_dict_holds_the_parameters_and_loads_into_a_fresh_guide():
    guide = make_guide()
    keys = sorted(guide.state_dict())
    assert keys == ["factor_modules.loc.loc_unconstrained", "factor_modules.loc.scale_unconstrained",
                    "factor_modules.rate.concentration_unconstrained",
                    "factor_modules.rate.rate_unconstrained"]  # fmt: skip
    with torch.no_grad():
        guide.factor_modules.rate.rate_unconstrained.add_(1.0)
    target = guide.get_posterior(X)["rate"].rate.detach().clone()
    state = {k: v.clone() for k, v in guide.state_dict().items()}
    pyro.clear_param_store()
    fresh = make_guide()
    assert not torch.equal(fresh.get_posterior(X)["rate"].rate, target)
    fresh.load_state_dict(state)
    assert torch.allclose(fresh.get_posterior(X)["rate"].rate, target)
    pyro.clear_param_store()  # re-registered from the module's values
    assert torch.allclose(fresh.get_posterior(X)["rate"].rate, target)


def test_torch_save_round_trip_keeps_the_fitted_values():
    guide = make_guide()
    with torch.no_grad():
        guide.factor_modules.loc.loc_unconstrained.fill_(3.0)
    buf = io.BytesIO()
    torch.save(guide, buf)
    buf.seek(0)
    pyro.clear_param_store()
    loaded = torch.load(buf, weights_only=False)
    assert float(loaded.median(X)["loc"]) == pytest.approx(3.0)
    assert float(loaded.get_posterior(X)["loc"].loc.detach()) == pytest.approx(3.0)


def test_module_local_params_train_without_the_param_store():
    pyro.settings.set(module_local_params=True)
    guide = make_guide()
    elbo = TraceSTL_ELBO(num_particles=4, vectorize_particles=True)(model, guide)
    opt = torch.optim.Adam(elbo.parameters(), lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        elbo(X).backward()
        opt.step()
    assert len(pyro.get_param_store()) == 0


def test_param_store_save_and_load_still_round_trip(tmp_path):
    guide = make_guide()
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), TraceSTL_ELBO())
    for _ in range(5):
        svi.step(X)
    fitted = guide.median(X)
    pyro.get_param_store().save(tmp_path / "params.pt")
    pyro.clear_param_store()
    fresh = make_guide()
    pyro.get_param_store().load(tmp_path / "params.pt")
    for name, value in fresh.median(X).items():
        assert torch.allclose(value, fitted[name]), name


def test_parametrized_distribution_is_a_module():
    q = ParametrizedDistribution("q", dist.Gamma, concentration=2.0, rate=0.5)
    assert sorted(q.state_dict()) == ["concentration_unconstrained", "rate_unconstrained"]
    assert len(list(q.parameters())) == 2
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert float(loaded().rate) == pytest.approx(0.5)
    pyro.settings.set(module_local_params=True)
    local = ParametrizedDistribution("local", dist.Normal, loc=1.0, scale=2.0)
    assert float(local().scale) == pytest.approx(2.0) and "local.loc" not in pyro.get_param_store()
