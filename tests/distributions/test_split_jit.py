"""Under a JIT ELBO, a flow whose transforms have no inverse is a clear error naming the site."""

import pyro
import pyro.distributions as dist
import pyro.distributions.transforms as T
import pytest
import torch
from pyro.infer import JitTrace_ELBO, Trace_ELBO

from pyro_gradroute.distributions import SplitNotSupported
from pyro_gradroute.poutine import stick_the_landing
from tests.conjugate import GaussianModel


def _planar_guide():
    flow = T.planar(2)

    def guide(x):
        pyro.module("flow", flow)
        loc = pyro.param("loc", torch.zeros(2))
        pyro.sample("z", dist.TransformedDistribution(dist.Normal(loc, 1.0).to_event(1), [flow]))

    return guide


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pyro's JIT tracer warnings
def test_jit_planar_flow_under_stick_the_landing_names_the_site():
    gm = GaussianModel(D=2)
    pyro.clear_param_store()
    guide = _planar_guide()
    pyro.set_rng_seed(0)
    JitTrace_ELBO().loss_and_grads(gm.model, guide, gm.x)  # the plain JIT works
    pyro.set_rng_seed(0)
    Trace_ELBO().loss_and_grads(gm.model, stick_the_landing(guide), gm.x)  # the non-JIT handler too
    pyro.set_rng_seed(0)
    with pytest.raises(SplitNotSupported, match="guide site 'z'.*non-JIT ELBO"):
        JitTrace_ELBO().loss_and_grads(gm.model, stick_the_landing(guide), gm.x)
