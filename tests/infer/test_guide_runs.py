"""How often TraceSTL_ELBO runs the guide: once per step after the first, vectorized or not."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pyro.distributions.transforms as T
import pytest
import torch

from pyro_gradroute.infer import TraceSTL_ELBO


def model():
    pyro.sample("w", dist.Normal(0.0, 1.0))
    pyro.sample("z", dist.Normal(torch.zeros(3), 1.0).to_event(1))


def make_guide(calls: list, kind: str):
    planar = T.Planar(3)

    def guide():
        calls.append(1)
        w = pyro.sample("w", dist.Normal(pyro.param("m", torch.tensor(0.0)), 1.0))
        loc = pyro.param("loc", torch.zeros(3))
        if kind == "conditional flow":  # the flow's base reads w: the general split
            loc = loc + w.unsqueeze(-1)
        base = dist.Normal(loc, 1.0).to_event(1)
        if kind == "plain":
            pyro.sample("z", base)
        else:  # an unconditional flow takes the default path (forward-carried, no split node)
            pyro.module("planar", planar)
            pyro.sample("z", dist.TransformedDistribution(base, [planar]))

    return guide


@pytest.mark.parametrize("kind", ["plain", "flow", "conditional flow"])
@pytest.mark.parametrize("particles", [1, 4])
def test_guide_runs_once_per_step_after_the_first(kind, particles):
    calls: list = []
    guide = make_guide(calls, kind)
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
    ).loss_and_grads(model, make_guide(ref, kind))
    general = kind == "conditional flow"
    assert per_step[0] == len(ref) + (1 if general else 0)
    assert elbo._policy.needs_general(guide) is general
