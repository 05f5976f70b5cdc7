"""block_grad on obs_mask sites (split by Pyro into *_observed / *_unobserved) and on plate names."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO as PyroTrace_ELBO

from pyro_gradroute.infer import Trace_ELBO
from pyro_gradroute.poutine import block_grad

X = torch.tensor([1.0, 2.0, 3.0])
MASK = torch.tensor([True, False, True])


def model():
    w = pyro.param("w", torch.tensor(0.5))
    v = pyro.param("v", torch.tensor(0.2))
    pyro.sample("prior", dist.Normal(v, 1.0), obs=w)  # a term reaching v and w
    with pyro.plate("d", 3):
        pyro.sample("x", dist.Normal(w, 1.0), obs=X, obs_mask=MASK)


def guide():
    with pyro.plate("d", 3):
        pyro.sample("x_unobserved", dist.Normal(0.0, 1.0))


@pytest.mark.parametrize("Elbo", [Trace_ELBO, PyroTrace_ELBO])
def test_obs_mask_site_terms_are_blocked(Elbo):
    model()
    store = pyro.get_param_store()
    pyro.set_rng_seed(0)
    with block_grad(sites=["x"], params=["w"]):
        Elbo().loss_and_grads(model, guide)
    routed = store._params["w"].grad.clone()
    # reference: only the "prior" term reaches w
    store._params["w"].grad = None
    w, v = store["w"], store["v"]
    (-dist.Normal(v, 1.0).log_prob(w)).backward()
    torch.testing.assert_close(routed, store._params["w"].grad)


def test_plate_name_is_a_clear_error():
    def m():
        w = pyro.param("w", torch.tensor(0.5))
        with pyro.plate("d", 3):
            pyro.sample("x", dist.Normal(w, 1.0), obs=X)

    with pytest.raises(ValueError, match="'d' is a plate"):
        with block_grad(sites=["d"], params=["w"]):
            Trace_ELBO().loss_and_grads(m, lambda: None)
