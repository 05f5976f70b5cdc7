"""Bad estimator arguments are clear errors (they were silent: a loss of 0.0 for no particles)."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_gradroute.infer import (
    ReweightedWakeSleepDReG,
    TraceAdaptiveDReG_ELBO,
    TraceAdaptiveSTL_ELBO,
    TraceDReG_ELBO,
    TraceEnumAdaptiveSTL_ELBO,
    TraceSTL_ELBO,
)

ESTIMATORS = [
    TraceSTL_ELBO,
    TraceAdaptiveSTL_ELBO,
    TraceEnumAdaptiveSTL_ELBO,
    TraceDReG_ELBO,
    TraceAdaptiveDReG_ELBO,
]


@pytest.mark.parametrize("n", [0, -1, 2.5, True])
@pytest.mark.parametrize("Elbo", ESTIMATORS, ids=lambda c: c.__name__)
def test_num_particles_that_is_not_a_positive_integer_is_an_error(Elbo, n):
    with pytest.raises(ValueError, match=f"{Elbo.__name__}: num_particles must be an integer >= 1"):
        Elbo(num_particles=n)


@pytest.mark.parametrize("n", [0, 1, 2.5])
def test_reweighted_wake_sleep_dreg_needs_several_particles(n):
    with pytest.raises(ValueError, match="num_particles"):
        ReweightedWakeSleepDReG(num_particles=n)


def test_reweighted_wake_sleep_dreg_has_no_renyi_order():
    with pytest.raises(ValueError, match="alpha=0.5"):
        ReweightedWakeSleepDReG(num_particles=3, alpha=0.5)


@pytest.mark.parametrize("Elbo", [TraceSTL_ELBO, TraceAdaptiveSTL_ELBO], ids=lambda c: c.__name__)
def test_one_particle_is_accepted_and_gives_a_loss(Elbo):
    def model():
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(z, 1.0), obs=torch.tensor(0.3))

    def guide():
        pyro.sample("z", dist.Normal(pyro.param("m", torch.tensor(0.1)), 1.0))

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    ref = pyro.infer.Trace_ELBO().loss(model, guide)
    pyro.set_rng_seed(0)
    assert Elbo(num_particles=1).loss_and_grads(model, guide) == pytest.approx(ref, rel=1e-6)
