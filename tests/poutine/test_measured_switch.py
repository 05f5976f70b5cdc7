"""stick_the_landing(switch="measured"): Trace_ELBO's gradient first, STL's once it measures better.

References on the same seed: Pyro's ``Trace_ELBO`` (``TraceEnum_ELBO``) with the plain guide and
with the guide under ``stick_the_landing`` (every run's gradient must be one of them, the choice
coming from earlier runs), and the direction of the choice where it is known: at an exact
posterior STL's gradient is zero (STL wins), far from it from a narrow scale ``Trace_ELBO``'s
entropy gradient is exact (``Trace_ELBO`` wins).
"""

import pickle

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import infer as pinfer

from pyro_gradroute.poutine import stick_the_landing

from .test_stick_the_landing import _grads, mixture, normal_loc

X = torch.tensor([0.3, 1.2, -0.4])


def _flat(g):
    return torch.cat([g[k].reshape(-1) for k in sorted(g)])


def _run(model, guide, elbo, steps, seed0=0):
    """Each step: (ours, plain reference, STL reference) gradients on the same seed."""
    switched = stick_the_landing(guide, switch="measured")
    out = []
    for i in range(steps):
        ours = _flat(_grads(elbo, model, switched, seed=seed0 + i)[1])
        trace = _flat(_grads(elbo, model, guide, seed=seed0 + i)[1])
        stl = _flat(_grads(elbo, model, stick_the_landing(guide), seed=seed0 + i)[1])
        out.append((ours, trace, stl))
    return out


def _which(steps, atol=1e-6):
    ends = []
    for ours, trace, stl in steps:
        is_trace = torch.allclose(ours, trace, atol=atol)
        is_stl = torch.allclose(ours, stl, atol=atol)
        assert is_trace or is_stl, "a step is neither Trace_ELBO's nor STL's"
        ends.append(
            "trace" if is_trace and not is_stl else "stl" if is_stl and not is_trace else "both"
        )
    return ends


def test_at_the_exact_posterior_it_moves_to_stl():
    pyro.clear_param_store()
    model, guide = normal_loc()
    ends = _which(_run(model, guide, pinfer.Trace_ELBO(), 70))
    assert ends[0] == "trace"  # the first run: Trace_ELBO's gradient
    assert ends[-5:] == ["stl"] * 5


def test_far_from_the_posterior_from_a_narrow_scale_it_keeps_trace_elbo():
    pyro.clear_param_store()
    model, _ = normal_loc()

    def guide():
        m = pyro.param("m", torch.tensor(3.0))
        s = pyro.param("s", torch.tensor(0.05), constraint=dist.constraints.positive)
        pyro.sample("loc", dist.Normal(m, s))

    ends = _which(_run(model, guide, pinfer.Trace_ELBO(), 30))
    assert set(ends) == {"trace"}


def test_under_trace_graph_elbo_every_step_is_one_estimator():
    pyro.clear_param_store()
    model, guide = normal_loc()
    ends = _which(_run(model, guide, pinfer.TraceGraph_ELBO(), 70))
    assert ends[0] == "trace" and ends[-5:] == ["stl"] * 5  # an exact posterior: STL wins


def test_under_trace_enum_elbo_every_step_is_one_estimator():
    pyro.clear_param_store()
    model, guide = mixture()
    ends = _which(_run(model, guide, pinfer.TraceEnum_ELBO(max_plate_nesting=1), 20), atol=1e-5)
    assert ends[0] == "trace"


def test_sites_it_cannot_read_are_refused_naming_them():
    pyro.clear_param_store()
    model, _ = normal_loc()

    def gamma_guide():
        a = pyro.param("a", torch.tensor(2.0), constraint=dist.constraints.positive)
        pyro.sample("loc", dist.Gamma(a, 1.0))

    elbo = pinfer.Trace_ELBO()
    switched = stick_the_landing(gamma_guide, switch="measured")
    with pytest.raises(ValueError, match="site 'loc' is a Gamma.*trace_steps"):
        for _ in range(8):  # at the first measured run
            elbo.loss_and_grads(model, switched)
    with pytest.raises(ValueError, match="switch must be None or 'measured'"):
        stick_the_landing(gamma_guide, switch="auto")


def test_state_pickles_with_the_handler():
    pyro.clear_param_store()
    model, guide = normal_loc()
    handler = stick_the_landing(switch="measured")
    elbo = pinfer.Trace_ELBO()
    for i in range(12):
        _grads(elbo, model, handler(guide), seed=i)
    policy = pickle.loads(pickle.dumps(handler._policy))
    assert policy.switch.stl == handler._switch.stl and policy.switch.n == handler._switch.n


def test_a_guide_of_delta_sites_gets_the_warning_that_nothing_changes():
    pyro.clear_param_store()
    model, _ = normal_loc()

    def delta_guide():
        pyro.sample("loc", dist.Delta(pyro.param("m", torch.tensor(0.2))))

    switched = stick_the_landing(delta_guide, switch="measured")
    with pytest.warns(UserWarning, match="changes nothing"):
        for i in range(8):
            _grads(pinfer.Trace_ELBO(), model, switched, seed=i)
