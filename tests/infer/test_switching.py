"""``trace_steps``: Trace_ELBO's gradient for the first steps, then sticking the landing.

References: Pyro's ``Trace_ELBO`` and the package's ``TraceSTL_ELBO`` on the same seeds.
"""

from __future__ import annotations

import pickle

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_gradroute.infer import TraceSTL_ELBO
from pyro_gradroute.poutine import stick_the_landing


def model(x):
    mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.Normal(mu, 1.0), obs=x)


X = torch.tensor([0.3, 1.2, -0.4, 2.0])


def _grads(elbo, guide, seed):
    store = pyro.get_param_store()
    for p in store.values():
        p.unconstrained().grad = None
    pyro.set_rng_seed(seed)
    loss = elbo.loss_and_grads(model, guide, X)
    return loss, torch.cat([p.unconstrained().grad.reshape(-1) for p in store.values()])


@pytest.mark.parametrize("form", ["elbo", "handler"])
def test_trace_steps_then_stl(form):
    pyro.clear_param_store()
    guide = AutoNormal(model)
    guide(X)
    if form == "elbo":
        elbo, g = TraceSTL_ELBO(trace_steps=3), guide
    else:
        elbo, g = PyroTrace_ELBO(), stick_the_landing(guide, trace_steps=3)
    for seed in range(6):
        loss, ours = _grads(elbo, g, seed)
        ref_loss, ref = _grads(PyroTrace_ELBO() if seed < 3 else TraceSTL_ELBO(), guide, seed)
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        torch.testing.assert_close(ours, ref)
        if seed >= 3:  # STL really differs from Trace_ELBO here
            _, trace = _grads(PyroTrace_ELBO(), guide, seed)
            assert (trace - ours).abs().max() > 1e-3


def test_trace_steps_survive_pickling_and_loss_does_not_count():
    pyro.clear_param_store()
    guide = AutoNormal(model)
    guide(X)
    elbo = TraceSTL_ELBO(trace_steps=2)
    elbo.loss(model, guide, X)  # a loss evaluation is not a step
    _grads(elbo, guide, 0)
    clone = pickle.loads(pickle.dumps(elbo))
    _, a = _grads(clone, guide, 1)  # the second step: still Trace_ELBO
    _, ref = _grads(PyroTrace_ELBO(), guide, 1)
    torch.testing.assert_close(a, ref)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "300"])
def test_bad_trace_steps(bad):
    with pytest.raises(ValueError, match="trace_steps must be an integer >= 0"):
        TraceSTL_ELBO(trace_steps=bad)
    with pytest.raises(ValueError, match="trace_steps must be an integer >= 0"):
        stick_the_landing(lambda: None, trace_steps=bad)
