"""gradient_stats leaves the param store and the estimator's state as they were.

Every draw starts from that state: the reference for the draws is the estimator's next step
from a saved copy (a pickle round trip), on the same random stream; for ``trace_steps``
before the switch, Pyro's own ``Trace_ELBO``.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, TraceGraph_ELBO
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.optim import Adam
from torch.distributions import constraints

from pyro_gradroute.diagnostics import gradient_stats
from pyro_gradroute.infer import TraceAdaptiveDReG_ELBO, TraceAdaptiveSTL_ELBO, TraceSTL_ELBO
from pyro_gradroute.poutine import stick_the_landing

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


# ------------------------------------------------- every draw is the estimator's next step
def _next_step_draws(make_elbo, guide, num_draws, seed):
    """The reference: the estimator's next step, ``num_draws`` times from one saved state.

    Each draw is the next step of a fresh copy of the estimator (a pickle round trip of the
    state before), on the random stream ``gradient_stats`` uses (its seed, then one guide and
    model trace to find the parameters).
    """
    import pickle

    elbo = make_elbo()
    saved = pickle.dumps(elbo)
    torch.manual_seed(seed)
    tr = pyro.poutine.trace(guide).get_trace()
    pyro.poutine.trace(pyro.poutine.replay(model, trace=tr)).get_trace()
    names = [n for n, s in tr.nodes.items() if s["type"] == "param"]
    store = pyro.get_param_store()
    draws = []
    for _ in range(num_draws):
        for _, p in store.named_parameters():
            p.grad = None
        pickle.loads(saved).loss_and_grads(model, guide)
        draws.append({n: store[n].unconstrained().grad.clone() for n in names})
    for _, p in store.named_parameters():
        p.grad = None
    return draws


def _settled_adaptive(kind):
    """An adaptive estimator after enough steps to pass warm-up (STL: into direct steps)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(model)
    if kind == "stl":
        elbo = TraceAdaptiveSTL_ELBO(warmup=2)
    else:
        elbo = TraceAdaptiveDReG_ELBO(num_particles=3, warmup=2, max_plate_nesting=1)
    svi = SVI(model, guide, Adam({"lr": 0.01}), elbo)
    for _ in range(40):
        svi.step()
    return elbo, guide


@pytest.mark.parametrize("kind", ["stl", "dreg"])
def test_adaptive_draws_are_the_next_step_and_leave_it_unchanged(kind):
    import pickle

    elbo, guide = _settled_adaptive(kind)
    saved = pickle.dumps(elbo)
    stats = gradient_stats(model, guide, elbo, num_draws=6, seed=3, keep_draws=True)
    ref = _next_step_draws(lambda: pickle.loads(saved), guide, 6, seed=3)
    for n in stats.draws:
        torch.testing.assert_close(stats.draws[n].float(), torch.stack([r[n] for r in ref]))
    # the next step after gradient_stats is the step it would have been without the call
    ref = _next_step_draws(lambda: pickle.loads(saved), guide, 1, seed=5)[0]
    assert _next_step_draws(lambda: elbo, guide, 1, seed=5)[0].keys() == ref.keys()
    store = pyro.get_param_store()
    torch.manual_seed(5)
    tr = pyro.poutine.trace(guide).get_trace()
    pyro.poutine.trace(pyro.poutine.replay(model, trace=tr)).get_trace()
    for _, p in store.named_parameters():
        p.grad = None
    elbo.loss_and_grads(model, guide)
    for n, g in ref.items():
        torch.testing.assert_close(store[n].unconstrained().grad, g)


@pytest.mark.parametrize("where", ["estimator", "handler"])
def test_trace_steps_are_not_advanced_by_the_draws(where):
    """Two steps before the switch to STL: every draw (and the next step) is Trace_ELBO's."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(model)
    if where == "estimator":
        elbo, g = TraceSTL_ELBO(trace_steps=5), guide
    else:
        elbo, g = PyroTrace_ELBO(), stick_the_landing(guide, trace_steps=5)
    for _ in range(3):
        elbo.loss_and_grads(model, g)
    stats = gradient_stats(model, g, elbo, num_draws=6, seed=3, keep_draws=True)
    ref = _next_step_draws(PyroTrace_ELBO, guide, 6, seed=3)
    for n in stats.draws:
        torch.testing.assert_close(stats.draws[n].float(), torch.stack([r[n] for r in ref]))
    # still two Trace_ELBO steps to go, then STL
    policy = elbo._policy if where == "estimator" else g.func.args[0]._policy
    assert policy.steps == 3
