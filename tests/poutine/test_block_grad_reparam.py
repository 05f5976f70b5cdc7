"""block_grad with poutine.reparam (both orders), deterministic sites, and REINFORCE paths."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import infer as pinfer
from pyro import poutine
from pyro.distributions.transforms import ExpTransform
from pyro.infer.reparam import LocScaleReparam, TransformReparam
from torch.distributions import constraints

from pyro_gradroute import infer as rinfer
from pyro_gradroute.poutine import block_grad

from ..routing.reference import assert_rel_close

C = 0.5  # LocScaleReparam(centered=C)
Y = torch.tensor(0.7)


def _params():
    loc = pyro.param("loc", torch.tensor(0.3))
    s = pyro.param("s", torch.tensor(1.2), constraint=constraints.positive)
    w = pyro.param("w", torch.tensor(0.5))
    return loc, s, w


def model():
    loc, s, w = _params()
    x = pyro.sample("x", dist.Normal(loc, s))
    pyro.sample("y", dist.Normal(w * x, 1.0), obs=Y)


def reference_model():
    """LocScaleReparam written out, with loc detached in x_decentered's log-density only."""
    loc, s, w = _params()
    xd = pyro.sample("x_decentered", dist.Normal(loc.detach() * C, s**C))
    x = loc + s ** (1 - C) * (xd - C * loc)
    pyro.sample("y", dist.Normal(w * x, 1.0), obs=Y)


def guide():
    q = pyro.param("q", torch.tensor(0.1))
    pyro.sample("x_decentered", dist.Normal(q, 0.8))


def grads(elbo, m, g):
    store = pyro.get_param_store()
    for p in store._params.values():
        p.grad = None
    pyro.set_rng_seed(3)
    elbo.loss_and_grads(m, g)
    return {n: p.grad.clone() for n, p in store._params.items() if p.grad is not None}


def reparam(fn):
    return poutine.reparam(fn, config={"x": LocScaleReparam(centered=C)})


@pytest.mark.parametrize("elbo_cls", [pinfer.Trace_ELBO, rinfer.Trace_ELBO])
def test_block_grad_outside_reparam_on_the_new_site_equals_reference(elbo_cls):
    elbo = elbo_cls()
    grads(elbo, reparam(model), guide)
    routed = grads(elbo, block_grad(reparam(model), sites=["x_decentered"], params=["loc"]), guide)
    want = grads(elbo, reference_model, guide)
    plain = grads(elbo, reparam(model), guide)
    assert routed.keys() == want.keys()
    for n in want:
        assert_rel_close(routed[n], want[n], what=n)
    assert not torch.allclose(plain["loc"], want["loc"])  # the route matters


def test_block_grad_on_a_reparameterized_deterministic_site_names_the_new_site():
    with pytest.raises(ValueError, match=r"'x' is deterministic.*\['x_decentered'\]"):
        pinfer.Trace_ELBO().loss_and_grads(
            block_grad(reparam(model), sites=["x"], params=["loc"]), guide
        )


def test_block_grad_on_pyro_deterministic_site_raises():
    def m():
        loc, _, _ = _params()
        pyro.deterministic("d", loc * 2)

    with pytest.raises(ValueError, match="'d' is deterministic"):
        with block_grad(sites=["d"], params=["loc"]):
            m()


def test_block_grad_inside_locscale_reparam_says_which_order_works():
    with pytest.raises(ValueError, match=r"site 'x'.*outside poutine.reparam.*x_decentered"):
        pinfer.Trace_ELBO().loss_and_grads(
            reparam(block_grad(model, sites=["x"], params=["loc"])), guide
        )


def test_block_grad_inside_transform_reparam_says_which_order_works():
    def m():
        loc, _, _ = _params()
        pyro.sample("x", dist.TransformedDistribution(dist.Normal(loc, 1.0), [ExpTransform()]))

    routed = poutine.reparam(block_grad(m, sites=["x"], params=["loc"]), {"x": TransformReparam()})
    with pytest.raises(ValueError, match="'x'.*outside poutine.reparam"):
        poutine.trace(routed).get_trace()


class Discrete:
    """Observed x depends on the encoder ``e`` only through a non-reparameterized latent z."""

    def model(self):
        w = pyro.param("w", torch.tensor(0.7))
        z = pyro.sample("z", dist.Bernoulli(0.4))
        pyro.sample("x", dist.Normal(z * w, 1.0), obs=torch.tensor(0.9))

    def guide(self):
        e = pyro.param("e", torch.tensor(0.2))
        pyro.sample("z", dist.Bernoulli(logits=e))


@pytest.mark.parametrize("elbo_cls", [pinfer.Trace_ELBO, pinfer.TraceGraph_ELBO])
def test_observed_site_blocked_from_encoder_through_reinforce_raises(elbo_cls):
    d = Discrete()
    grads(elbo_cls(), d.model, d.guide)
    with pytest.raises(NotImplementedError, match=r"site 'x'.*\['e'\].*pyro_gradroute.infer"):
        elbo_cls().loss_and_grads(block_grad(d.model, sites="x", params=["e"]), d.guide)
