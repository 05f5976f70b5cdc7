"""How often the estimators run the guide and the model: once per particle on every step,
the first included, and with Pyro's estimator's draws and loss on the same seed."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pyro.distributions.transforms as T
import pytest
import torch

from pyro_gradroute.infer import TraceDReG_ELBO, TraceSTL_ELBO
from pyro_gradroute.poutine import stick_the_landing

KINDS = ["plain", "flow", "conditional flow", "masked", "straight-through"]


def make_model(calls: list, kind: str):
    def model():
        calls.append(1)
        pyro.sample("w", dist.Normal(0.0, 1.0))
        pyro.sample("z", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        if kind == "straight-through":  # (the guide's value is one-hot)
            pyro.sample("c", dist.OneHotCategorical(logits=torch.zeros(3)))
        else:
            pyro.sample(
                "c", dist.RelaxedOneHotCategorical(torch.tensor(0.5), logits=torch.zeros(3))
            )

    return model


def make_guide(calls: list, kind: str):
    planar = T.Planar(3)

    def guide():
        calls.append(1)
        w = pyro.sample("w", dist.Normal(pyro.param("m", torch.tensor(0.0)), 1.0))
        loc = pyro.param("loc", torch.zeros(3))
        if kind == "conditional flow":  # the flow's base reads w: the split node
            loc = loc + w.unsqueeze(-1)
        base = dist.Normal(loc, 1.0).to_event(1)
        if kind in ("plain", "straight-through"):
            pyro.sample("z", base)
        elif kind == "masked":  # MaskedDistribution has its own score_parts: the split node
            mask = torch.tensor([True, False, True])
            pyro.sample("z", dist.Normal(loc, 1.0).mask(mask).to_event(1))
        else:  # an unconditional flow takes the default path (forward-carried, no split node)
            pyro.module("planar", planar)
            pyro.sample("z", dist.TransformedDistribution(base, [planar]))
        logits = pyro.param("logits", torch.zeros(3))
        cls = (
            dist.RelaxedOneHotCategoricalStraightThrough
            if kind == "straight-through"
            else dist.RelaxedOneHotCategorical
        )
        pyro.sample("c", cls(torch.tensor(0.5), logits=logits))

    return guide


def _runs(elbo, kind, steps=3, wrap=None):
    guide_calls: list = []
    model_calls: list = []
    pyro.set_rng_seed(100)  # (the flow's initial weights)
    guide = make_guide(guide_calls, kind)
    model = make_model(model_calls, kind)
    if wrap is not None:
        guide = wrap(guide)
    out, losses = [], []
    for step in range(steps):
        n, m = len(guide_calls), len(model_calls)
        pyro.set_rng_seed(step)
        losses.append(elbo.loss_and_grads(model, guide))
        out.append((len(guide_calls) - n, len(model_calls) - m))
    return out, losses


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("particles", [1, 3])
def test_stl_runs_guide_and_model_once_per_particle_on_every_step(kind, particles):
    pyro.clear_param_store()
    runs, losses = _runs(TraceSTL_ELBO(num_particles=particles), kind)
    assert runs == [(particles, particles)] * 3, runs
    pyro.clear_param_store()
    ref_runs, ref_losses = _runs(pyro.infer.Trace_ELBO(num_particles=particles), kind)
    assert runs == ref_runs
    assert losses == pytest.approx(ref_losses, rel=1e-6)  # the same draws as Pyro's


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("particles", [1, 3])
def test_the_handler_runs_guide_and_model_once_per_particle_on_every_step(kind, particles):
    pyro.clear_param_store()
    elbo = pyro.infer.Trace_ELBO(num_particles=particles)
    runs, losses = _runs(elbo, kind, wrap=stick_the_landing)
    assert runs == [(particles, particles)] * 3, runs
    pyro.clear_param_store()
    _, ref_losses = _runs(pyro.infer.Trace_ELBO(num_particles=particles), kind)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


@pytest.mark.parametrize("kind", ["plain", "flow", "conditional flow", "masked"])
def test_dreg_runs_guide_and_model_once_per_step(kind):
    pyro.clear_param_store()
    runs, _ = _runs(TraceDReG_ELBO(num_particles=3), kind)
    # one vectorized run of each (and on the first step, as Pyro's RenyiELBO, one run that
    # guesses max_plate_nesting)
    pyro.clear_param_store()
    ref, _ = _runs(pyro.infer.RenyiELBO(num_particles=3, vectorize_particles=True), kind)
    assert runs == ref and runs[1:] == [(1, 1)] * 2, runs
    pyro.clear_param_store()
    runs, _ = _runs(TraceDReG_ELBO(num_particles=3, max_plate_nesting=0), kind)
    assert runs == [(1, 1)] * 3, runs


@pytest.mark.parametrize("particles", [1, 4])
def test_vectorized_stl_runs_as_pyros(particles):
    pyro.clear_param_store()
    kw = dict(num_particles=particles, vectorize_particles=particles > 1, max_plate_nesting=1)
    runs, losses = _runs(TraceSTL_ELBO(**kw), "masked")
    pyro.clear_param_store()
    ref_runs, ref_losses = _runs(pyro.infer.Trace_ELBO(**kw), "masked")
    assert runs == ref_runs  # (Pyro's first vectorized step guesses max_plate_nesting: none here)
    assert runs[1:] == [(1, 1)] * 2
    assert losses == pytest.approx(ref_losses, rel=1e-6)
