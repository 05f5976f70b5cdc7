"""The handler and the estimators on valid configurations found refused or silently wrong:
enumerated model sites, sequential enumeration of a discrete guide site, a used handler's copy."""

from __future__ import annotations

import copy
import pickle
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from pyro.infer import TraceEnum_ELBO, config_enumerate

from pyro_gradroute.infer import TraceDReG_ELBO, TraceSTL_ELBO
from pyro_gradroute.poutine import stick_the_landing


# ----------------------------------------------------------------------------- enumerated model sites
def _enum_model():
    k = pyro.sample("k", dist.Categorical(torch.ones(3) / 3), infer={"enumerate": "parallel"})
    loc = pyro.sample("loc", dist.Normal(0.0, 1.0))
    pyro.sample("x", dist.Normal(loc + k.float(), 1.0), obs=torch.tensor(0.7))


def _enum_guide():
    pyro.sample("loc", dist.Normal(pyro.param("m", torch.tensor(0.1)), 1.0))


@pytest.mark.parametrize(
    "make", [lambda: TraceSTL_ELBO(), lambda: TraceDReG_ELBO(num_particles=3)], ids=["STL", "DReG"]
)
def test_an_enumerated_model_site_is_refused_naming_it(make):
    pyro.clear_param_store()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            ValueError,
            match=r"'k' is marked for enumeration.*TraceEnum_ELBO.*stick_the_landing.*"
            "TraceEnumAdaptiveSTL_ELBO",
        ):
            make().loss_and_grads(_enum_model, _enum_guide)


def test_under_pyros_trace_elbo_the_handler_keeps_pyros_behaviour():
    pyro.clear_param_store()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pyro.set_rng_seed(0)
        got = PyroTrace_ELBO().loss(_enum_model, stick_the_landing(_enum_guide))
        pyro.set_rng_seed(0)
        want = PyroTrace_ELBO().loss(_enum_model, _enum_guide)
    assert got == want


# ----------------------------------------------------------------------------- sequential enumeration
def _plates_model():  # Pyro's test_enum_discrete_plate_shape_broadcasting_ok, model as guide
    x_plate = pyro.plate("x_plate", 10, 5, dim=-1)
    y_plate = pyro.plate("y_plate", 11, 6, dim=-2)
    with pyro.plate("num_particles", 50, dim=-3):
        with x_plate:
            b = pyro.sample("b", dist.Beta(torch.tensor(1.1), torch.tensor(1.1)))
        with y_plate:
            pyro.sample("c", dist.Bernoulli(0.5))
        with x_plate, y_plate:
            pyro.sample("d", dist.Bernoulli(b))


@pytest.mark.parametrize("expand", [True, False])
@pytest.mark.parametrize("num_particles", [1, 2])
def test_sequential_enumeration_of_a_discrete_guide_site(expand, num_particles):
    model = config_enumerate(_plates_model, "sequential", expand)
    kw = dict(max_plate_nesting=3, num_particles=num_particles)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pyro.set_rng_seed(0)
        got = TraceEnum_ELBO(**kw).loss_and_grads(model, stick_the_landing(model))
        pyro.set_rng_seed(0)
        want = TraceEnum_ELBO(**kw).loss_and_grads(model, model)
    assert got == pytest.approx(want, rel=1e-6)  # nothing to stick: Pyro's own result


# ----------------------------------------------------------------------------- copies of a used handler
def _guide():
    pyro.sample("z", dist.Normal(pyro.param("m", torch.tensor(0.2)), 1.0))


def _model():
    pyro.sample("z", dist.Normal(0.0, 1.0))


def test_a_used_handler_can_be_copied_and_pickled():
    pyro.clear_param_store()
    msngr = stick_the_landing(trace_steps=1)
    wrapped = msngr(_guide)
    for _ in range(2):
        PyroTrace_ELBO().loss_and_grads(_model, wrapped)
    clone = copy.deepcopy(msngr)
    assert clone._policy.steps == msngr._policy.steps == 2
    restored = pickle.loads(pickle.dumps(msngr))
    assert restored._policy.steps == 2
    PyroTrace_ELBO().loss_and_grads(_model, clone(_guide))  # the copy works
    elbo = TraceSTL_ELBO()
    elbo.loss_and_grads(_model, _guide)
    copy.deepcopy(elbo)  # the estimator's own handler too


def test_switch_points_to_the_adaptive_estimator():
    with pytest.raises(ValueError, match=r"TraceAdaptiveSTL_ELBO\(mix_gain=math.inf\)"):
        stick_the_landing(_guide, switch="measured")
