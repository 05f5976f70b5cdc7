"""``stick_the_landing`` used the wrong way: estimators it is not valid in, the wrong callable.

References: Pyro's ``Trace_ELBO`` with the guide wrapped (the documented use), and the
closed-form prior gradient of a conjugate model.
"""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO, TraceEnum_ELBO, TraceTailAdaptive_ELBO
from pyro.infer.autoguide import AutoDelta

from pyro_gradroute.poutine import StickTheLandingMessenger, stick_the_landing

X = torch.tensor([0.5, 1.5, 1.0])


def model(x):
    m = pyro.param("prior_m", torch.tensor(0.3))
    z = pyro.sample("z", dist.Normal(m, 1.0))
    with pyro.plate("d", len(x)):
        pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def guide(x):
    loc = pyro.param("q_loc", torch.tensor(0.1))
    scale = pyro.param("q_scale", torch.tensor(0.8), constraint=dist.constraints.positive)
    pyro.sample("z", dist.Normal(loc, scale))


def _grads(fn, seed):
    pyro.set_rng_seed(seed)
    for p in pyro.get_param_store().values():
        p.unconstrained().grad = None
    loss = fn()
    return loss, {k: v.unconstrained().grad.clone() for k, v in pyro.get_param_store().items()}


@pytest.fixture(autouse=True)
def _store():
    pyro.clear_param_store()
    guide(X)
    model(X)
    yield
    pyro.clear_param_store()


@pytest.mark.parametrize("first", [True, False], ids=["first-run", "later-run"])
def test_context_manager_around_the_elbo_equals_the_wrapped_guide(first):
    wrapped = stick_the_landing(guide)
    if not first:
        _grads(lambda: Trace_ELBO().loss_and_grads(model, wrapped, X), 99)
    msngr = stick_the_landing()
    if not first:
        with msngr:
            Trace_ELBO().loss_and_grads(model, guide, X)  # its learning run
    for seed in range(3):
        ref_loss, ref = _grads(lambda: Trace_ELBO().loss_and_grads(model, wrapped, X), seed)

        def ours():
            with msngr:
                return Trace_ELBO().loss_and_grads(model, guide, X)

        loss, g = _grads(ours, seed)
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        for k in ref:
            torch.testing.assert_close(g[k], ref[k])
        # the prior parameter gets its ordinary gradient: d/dm log N(z; m, 1) = z - m
        pyro.set_rng_seed(seed)
        z = pyro.poutine.trace(guide).get_trace(X).nodes["z"]["value"].detach()
        torch.testing.assert_close(g["prior_m"], -(z - 0.3))


@pytest.mark.parametrize("warm", [False, True], ids=["first-run", "later-run"])
def test_wrapping_the_model_raises(warm):
    msngr = StickTheLandingMessenger()
    if warm:  # as after a first run that found a guide of plain sites
        msngr._fast = True
    wrapped_model = msngr(model)
    with pytest.raises(ValueError, match="site 'z'.*wraps the model instead of the guide"):
        Trace_ELBO().loss_and_grads(wrapped_model, guide, X)


@pytest.mark.parametrize("warm", [False, True], ids=["first-run", "later-run"])
def test_replaced_value_raises(warm):
    tr = pyro.poutine.trace(guide).get_trace(X)
    wrapped = stick_the_landing(guide)
    if warm:
        Trace_ELBO().loss_and_grads(model, wrapped, X)
    replayed = pyro.poutine.replay(wrapped, trace=tr)  # outside the handler: replaces z
    with pytest.raises(ValueError, match="site 'z'.*not the sample its distribution drew"):
        Trace_ELBO().loss_and_grads(model, replayed, X)


@pytest.mark.parametrize("Elbo", [TraceTailAdaptive_ELBO, pyro.infer.RenyiELBO])
def test_importance_weighted_elbos_are_refused(Elbo):
    elbo = Elbo(num_particles=2, vectorize_particles=True)
    with pytest.raises(ValueError, match=f"cannot be used with {Elbo.__name__}"):
        elbo.loss_and_grads(model, stick_the_landing(guide), X)


@pytest.mark.parametrize("wrappers", [0, 60])
def test_refusal_is_not_hidden_by_handlers_around_the_guide(wrappers):
    """The estimator is found however many handlers wrap the guide (a deep call stack)."""
    g = stick_the_landing(guide)
    for _ in range(wrappers):
        g = pyro.poutine.scale(g, scale=1.0)
    elbo = TraceTailAdaptive_ELBO(num_particles=2, vectorize_particles=True)
    with pytest.raises(ValueError, match="cannot be used with TraceTailAdaptive_ELBO"):
        elbo.loss_and_grads(model, g, X)


def test_a_subclass_that_keeps_the_gradient_is_allowed():
    class Named(TraceEnum_ELBO):
        pass

    Named().loss_and_grads(model, stick_the_landing(guide), X)


def test_a_guide_of_only_delta_sites_warns():
    pyro.clear_param_store()
    delta = AutoDelta(model)
    with pytest.warns(UserWarning, match="changes nothing"):
        Trace_ELBO().loss_and_grads(model, stick_the_landing(delta), X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trace_ELBO().loss_and_grads(model, stick_the_landing(guide), X)  # a real draw: silent


def _mixed_model():
    c = pyro.sample("c", dist.Bernoulli(0.3))
    z = pyro.sample("z", dist.Normal(c, 1.0))
    pyro.sample("x", dist.Normal(z, 1.0), obs=torch.tensor(0.5))


def _mixed_guide():
    p = pyro.param("p", torch.tensor(0.4), constraint=dist.constraints.unit_interval)
    c = pyro.sample("c", dist.Bernoulli(p))
    pyro.sample("z", dist.Normal(pyro.param("m", torch.tensor(0.1)) + c, 1.0))


@pytest.mark.parametrize("Elbo", [Trace_ELBO, pyro.infer.TraceGraph_ELBO])
def test_non_reparameterized_sites_are_left_to_pyro(Elbo):
    """A Bernoulli site (TraceGraph_ELBO wraps its value for provenance) keeps Pyro's treatment."""
    pyro.clear_param_store()
    _mixed_guide()
    wrapped = stick_the_landing(_mixed_guide)
    for seed in range(4):  # the handler's first (general) run, then its default path
        pyro.set_rng_seed(seed)
        ours = Elbo().loss_and_grads(_mixed_model, wrapped)
        pyro.set_rng_seed(seed)
        ref = Elbo().loss(_mixed_model, _mixed_guide)
        assert ours == pytest.approx(ref, rel=1e-6)


def test_all_delta_guide_with_an_auxiliary_latent_equals_pyro():
    """AutoLaplaceApproximation: Deltas reading a parameter-valued auxiliary Delta; nothing to drop."""
    from pyro.infer.autoguide import AutoLaplaceApproximation

    pyro.clear_param_store()
    g = AutoLaplaceApproximation(model)
    g(X)
    wrapped = stick_the_landing(g)
    for seed in range(2):
        with (
            pytest.warns(UserWarning, match="changes nothing")
            if seed == 0
            else warnings.catch_warnings()
        ):
            _, ours = _grads(lambda: Trace_ELBO().loss_and_grads(model, wrapped, X), seed)
        _, ref = _grads(lambda: Trace_ELBO().loss_and_grads(model, g, X), seed)
        for k in ref:
            torch.testing.assert_close(ours[k], ref[k])


def test_sequential_enumeration_replays_the_handlers_own_draws():
    """TraceEnum_ELBO's sequential enumeration re-runs the guide, replaying the continuous draw:
    the handler accepts its own earlier sample and gives what parallel enumeration gives."""
    from pyro.infer import config_enumerate

    def enum_model():
        loc = pyro.sample("loc", dist.Normal(0.0, 10.0))
        pyro.sample("b", dist.Bernoulli(0.5))
        pyro.sample("obs", dist.Normal(loc, 1.0), obs=torch.tensor(1.0))

    def make(kind):
        @config_enumerate(default=kind)
        def enum_guide():
            m = pyro.param("m", torch.tensor(0.0))
            p = pyro.param("p", torch.tensor(0.5), constraint=dist.constraints.unit_interval)
            pyro.sample("loc", dist.Normal(m, 1.0))
            pyro.sample("b", dist.Bernoulli(p))

        return enum_guide

    pyro.clear_param_store()
    make("parallel")()
    seq, par = stick_the_landing(make("sequential")), stick_the_landing(make("parallel"))
    for seed in range(4):  # the first run of each handler is its general run
        ls, gs = _grads(
            lambda: TraceEnum_ELBO(max_plate_nesting=0).loss_and_grads(enum_model, seq), seed
        )
        lp, gp = _grads(
            lambda: TraceEnum_ELBO(max_plate_nesting=0).loss_and_grads(enum_model, par), seed
        )
        assert ls == pytest.approx(lp, rel=1e-6)
        for k in gp:
            torch.testing.assert_close(gs[k], gp[k])


def test_pyro_trace_elbo_stays_valid_when_its_public_name_is_rebound(monkeypatch):
    """Code that rebinds ``pyro.infer.Trace_ELBO`` (a test harness swapping estimators) does
    not make Pyro's own class look unknown to the handler: the step equals Pyro's."""
    import pyro.infer

    from pyro_gradroute.infer import TraceSTL_ELBO
    from pyro_gradroute.poutine import stick_the_landing_messenger as stl_module

    _, ref = _grads(lambda: TraceSTL_ELBO().loss_and_grads(model, guide, X), 0)
    monkeypatch.setattr(pyro.infer, "Trace_ELBO", TraceSTL_ELBO)
    monkeypatch.setattr(stl_module, "_VALID", {})
    _, ours = _grads(lambda: Trace_ELBO().loss_and_grads(model, stick_the_landing(guide), X), 0)
    assert ours.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(ours[k], ref[k])
