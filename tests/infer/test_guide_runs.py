"""How often TraceSTL_ELBO runs the guide: once per step after the first, vectorized or not."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pyro.distributions.transforms as T
import pytest
import torch

from pyro_gradroute.infer import TraceSTL_ELBO


def model():
    pyro.sample("z", dist.Normal(torch.zeros(3), 1.0).to_event(1))


def make_guide(calls: list, flow: bool):
    planar = T.Planar(3)

    def guide():
        calls.append(1)
        loc = pyro.param("loc", torch.zeros(3))
        base = dist.Normal(loc, 1.0).to_event(1)
        if flow:  # a flow with parameters: the general split
            pyro.module("planar", planar)
            pyro.sample("z", dist.TransformedDistribution(base, [planar]))
        else:
            pyro.sample("z", base)

    return guide


@pytest.mark.parametrize("flow", [False, True], ids=["plain", "flow"])
@pytest.mark.parametrize("particles", [1, 4])
def test_guide_runs_once_per_step_after_the_first(flow, particles):
    calls: list = []
    guide = make_guide(calls, flow)
    elbo = TraceSTL_ELBO(num_particles=particles, vectorize_particles=particles > 1)
    per_step = []
    for _ in range(4):
        n = len(calls)
        elbo.loss_and_grads(model, guide)
        per_step.append(len(calls) - n)
    # after the first step the choice is remembered, also through a vectorized ELBO's
    # particle plate (a fresh wrapper on every call)
    assert per_step[1:] == [1, 1, 1], per_step
    # the first: as Pyro's Trace_ELBO (which guesses max_plate_nesting from one more run when
    # vectorized), plus the re-run of a guide found to need the general split
    ref: list = []
    pyro.infer.Trace_ELBO(
        num_particles=particles, vectorize_particles=particles > 1
    ).loss_and_grads(model, make_guide(ref, flow))
    assert per_step[0] == len(ref) + (1 if flow else 0)
