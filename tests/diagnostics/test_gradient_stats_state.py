"""gradient_stats leaves the param store and the estimator's state as they were."""

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, TraceGraph_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.optim import Adam
from torch.distributions import constraints

from pyro_gradroute.diagnostics import gradient_stats
from pyro_gradroute.infer import TraceAdaptiveSTL_ELBO

X = torch.tensor([0.3, 1.2, -0.4, 0.8])


def model():
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(X)):
        pyro.sample("x", dist.Normal(mu, 1.0), obs=X)


def nonreparam_guide():
    loc = pyro.param("loc", torch.tensor(0.1))
    scale = pyro.param("scale", torch.tensor(0.8), constraint=constraints.positive)
    d = dist.Normal(loc, scale).has_rsample_(False)
    pyro.sample("mu", d, infer={"baseline": {"use_decaying_avg_baseline": True}})


def _store_state():
    return {n: (p, p.detach().clone()) for n, p in pyro.get_param_store().named_parameters()}


def _assert_same_store(before):
    after = dict(pyro.get_param_store().named_parameters())
    assert set(after) == set(before)
    for n, (leaf, value) in before.items():
        assert after[n] is leaf, n  # the same leaf tensor (optimizers refer to it)
        assert torch.equal(after[n].detach(), value), n


def test_tracegraph_baseline_is_left_as_it_was():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    elbo = TraceGraph_ELBO()
    svi = SVI(model, nonreparam_guide, Adam({"lr": 0.01}), elbo)
    for _ in range(3):
        svi.step()
    names = [n for n in pyro.get_param_store().keys() if "baseline" in n]
    assert names  # the decaying-average baseline lives in the param store
    before = _store_state()
    gradient_stats(model, nonreparam_guide, elbo, num_draws=5, seed=1)
    _assert_same_store(before)


def test_baseline_created_by_the_draws_is_removed():
    pyro.clear_param_store()
    nonreparam_guide()
    before = _store_state()
    gradient_stats(model, nonreparam_guide, TraceGraph_ELBO(), num_draws=3, seed=1)
    _assert_same_store(before)


def test_adaptive_estimator_state_is_left_as_it_was():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(model)
    elbo = TraceAdaptiveSTL_ELBO()
    svi = SVI(model, guide, Adam({"lr": 0.01}), elbo)
    for _ in range(3):
        svi.step()
    state = elbo.state_dict()
    before = _store_state()
    gradient_stats(model, guide, elbo, num_draws=4, seed=1)
    _assert_same_store(before)
    after = elbo.state_dict()
    assert after.keys() == state.keys()
    for k, st in state["moments"].items():
        for kk, v in st.items():
            w = after["moments"][k][kk]
            assert torch.equal(w, v) if torch.is_tensor(v) else w == v, (k, kk)
