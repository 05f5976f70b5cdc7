"""Families whose parts depend on their sampler's state, and sites whose ``has_rsample`` is set.

* RSVI's ``ShapeAugmentedGamma`` answers ``score_parts`` only for the exact tensor its
  sampler returned. Reference: Pyro's ``Trace_ELBO`` on the same draw (float64, seed 0:
  loss 5.0811, gradients 2.5225 / -1.664), and for STL the same Pyro ELBO with a guide
  whose entropy term is hand-written as ``log q(z; stop(alpha), stop(beta))`` (Pyro's
  score-function term of the rejection sampler is kept); under the JIT ELBOs the same
  JIT ELBO with that guide.
* A site marked ``.has_rsample_(False)`` inside a plate: Pyro's broadcast assigns
  ``fn.has_rsample``. Not reparameterized, the site has no pathwise part, so sticking the
  landing leaves its gradient as it is: the reference is Pyro's ELBO without the handler.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.distributions.score_parts import ScoreParts
from pyro.distributions.testing.rejection_gamma import ShapeAugmentedGamma
from pyro.infer import JitTrace_ELBO, JitTraceGraph_ELBO, TraceEnum_ELBO, TraceGraph_ELBO
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from torch.distributions import constraints

from pyro_gradroute.infer import (
    Trace_ELBO,
    TraceAdaptiveSTL_ELBO,
    TraceDReG_ELBO,
    TraceSTL_ELBO,
)
from pyro_gradroute.poutine import stick_the_landing


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


class _StoppedEntropyGamma(ShapeAugmentedGamma):
    """The hand-written STL reference: the entropy term with the parameters stopped."""

    def score_parts(self, boosted_x=None):
        log_prob, score_function, _ = super().score_parts(boosted_x)
        stopped = dist.Gamma(self.concentration.detach(), self.rate.detach()).log_prob(boosted_x)
        return ScoreParts(log_prob, score_function, stopped)


DATA = (3.0, 2.0)


def _problem(family=ShapeAugmentedGamma):
    data = torch.tensor(DATA)

    def model():
        lam = pyro.sample(
            "lambda_latent", ShapeAugmentedGamma(data.new_tensor(1.0), data.new_tensor(1.0))
        )
        with pyro.plate("data", 2):
            pyro.sample("obs", dist.Exponential(lam), obs=data)

    def guide():
        a = pyro.param(
            "alpha_q", torch.tensor(3.0 * math.exp(0.17)), constraint=constraints.positive
        )
        b = pyro.param(
            "beta_q", torch.tensor(6.0 / math.exp(0.143)), constraint=constraints.positive
        )
        pyro.sample("lambda_latent", family(a, b))

    return model, guide


def _step(elbo, model, guide):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide()
    pyro.set_rng_seed(0)
    loss = elbo.loss_and_grads(model, guide)
    store = pyro.get_param_store()
    return loss, [store._params[k].grad.item() for k in ("alpha_q", "beta_q")]


def test_rsvi_pyro_reference_values(float64):
    model, guide = _problem()
    loss, grads = _step(PyroTrace_ELBO(max_plate_nesting=1), model, guide)
    assert loss == pytest.approx(5.0811, abs=1e-4)
    assert grads == pytest.approx([2.5225, -1.6640], abs=1e-4)
    assert _step(Trace_ELBO(max_plate_nesting=1), model, guide) == (loss, grads)


@pytest.mark.parametrize(
    "make,Ref",
    [
        (lambda m, g: (TraceSTL_ELBO(max_plate_nesting=1), m, g), PyroTrace_ELBO),
        (
            lambda m, g: (PyroTrace_ELBO(max_plate_nesting=1), m, stick_the_landing(g)),
            PyroTrace_ELBO,
        ),
        (
            lambda m, g: (TraceGraph_ELBO(max_plate_nesting=1), m, stick_the_landing(g)),
            TraceGraph_ELBO,
        ),
        (
            lambda m, g: (JitTrace_ELBO(max_plate_nesting=1), m, stick_the_landing(g)),
            JitTrace_ELBO,
        ),
        (
            lambda m, g: (JitTraceGraph_ELBO(max_plate_nesting=1), m, stick_the_landing(g)),
            JitTraceGraph_ELBO,
        ),
    ],
    ids=[
        "TraceSTL_ELBO",
        "stick_the_landing-Trace_ELBO",
        "stick_the_landing-TraceGraph_ELBO",
        "stick_the_landing-JitTrace_ELBO",
        "stick_the_landing-JitTraceGraph_ELBO",
    ],
)
def test_rsvi_stl_equals_hand_written_surrogate(make, Ref, float64):
    model, guide = _problem()
    _, ref_guide = _problem(_StoppedEntropyGamma)
    ref_loss, ref_grads = _step(Ref(max_plate_nesting=1), model, ref_guide)
    pyro_loss, pyro_grads = _step(Ref(max_plate_nesting=1), model, guide)
    assert ref_loss == pyro_loss and ref_grads != pytest.approx(pyro_grads, abs=0.1)
    loss, grads = _step(*make(model, guide))
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    assert grads == pytest.approx(ref_grads, rel=1e-10)


def test_rsvi_adaptive_runs_and_keeps_the_loss(float64):
    model, guide = _problem()
    ref_loss, _ = _step(PyroTrace_ELBO(max_plate_nesting=1), model, guide)
    loss, grads = _step(TraceAdaptiveSTL_ELBO(max_plate_nesting=1), model, guide)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    assert all(math.isfinite(g) for g in grads)


def test_rsvi_dreg_is_a_clear_error_naming_the_site(float64):
    model, guide = _problem()
    with pytest.raises(ValueError, match="lambda_latent.*score-function term"):
        _step(TraceDReG_ELBO(num_particles=2, max_plate_nesting=1), model, guide)


# ----------------------------------------------------------------------------- has_rsample_
def _subsample_problem(subsample_size):
    data = torch.tensor([-0.5, 2.0])

    def model():
        with pyro.plate("data", 2, subsample_size, subsample=torch.tensor([0])) as ind:
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z, 1.0), obs=data[ind])

    def guide():
        scale = pyro.param("scale", lambda: torch.tensor([1.0]))
        with pyro.plate("data", 2, subsample_size, subsample=torch.tensor([0])):
            loc = pyro.param("loc", lambda: torch.tensor([0.3, -0.2]), event_dim=0)
            pyro.sample("z", dist.Normal(loc, scale).has_rsample_(False))

    return model, guide


@pytest.mark.parametrize("Elbo", [PyroTrace_ELBO, TraceGraph_ELBO, TraceEnum_ELBO])
def test_has_rsample_false_in_a_plate_under_stick_the_landing(Elbo):
    model, guide = _subsample_problem(1)

    def step(g):
        pyro.clear_param_store()
        pyro.set_rng_seed(3)
        elbo = Elbo(
            max_plate_nesting=1,
            num_particles=4,
            vectorize_particles=True,
            strict_enumeration_warning=False,
        )
        loss = elbo.loss_and_grads(model, g)
        store = pyro.get_param_store()
        return loss, [store._params[k].grad.clone() for k in ("loc", "scale")]

    ref_loss, ref_grads = step(guide)
    loss, grads = step(stick_the_landing(guide))
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
