"""block_grad under SVI: every ELBO Pyro users train with equals the naive reference (1e-5 relative)."""

import contextlib
from functools import partial

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import infer as pinfer
from pyro import poutine

from pyro_gradroute import infer as rinfer
from pyro_gradroute.poutine import block_grad

from ..routing.reference import assert_rel_close
from .models import VAE, Seed

_nothing = contextlib.nullcontext

ELBOS = {
    "ours.Trace_ELBO": lambda **kw: rinfer.Trace_ELBO(**kw),
    "ours.TraceSTL_ELBO": lambda **kw: rinfer.TraceSTL_ELBO(**kw),
    "pyro.Trace_ELBO": lambda **kw: pinfer.Trace_ELBO(**kw),
    "pyro.TraceMeanField_ELBO": lambda **kw: pinfer.TraceMeanField_ELBO(**kw),
    "pyro.TraceGraph_ELBO": lambda **kw: pinfer.TraceGraph_ELBO(**kw),
    "pyro.RenyiELBO": lambda **kw: pinfer.RenyiELBO(alpha=0.5, **{"num_particles": 2, **kw}),
}
# TraceDReG_ELBO draws its particles vectorized: it runs on the (vectorizable) VAE models.
DREG = {
    "ours.TraceDReG_ELBO": lambda **kw: rinfer.TraceDReG_ELBO(
        **{"num_particles": 2, "vectorize_particles": True, "max_plate_nesting": 1, **kw}
    )
}
ALL = {**ELBOS, **DREG}


def grads(elbo, model, guide, seed=3):
    """``{param name: grad}`` after one ``loss_and_grads`` (what ``svi.step`` calls)."""
    store = pyro.get_param_store()
    for p in store._params.values():
        p.grad = None
    pyro.set_rng_seed(seed)
    elbo.loss_and_grads(model, guide)
    return {n: p.grad.clone() for n, p in store._params.items() if p.grad is not None}


def compare(routed, reference, unrouted=None, must_differ=()):
    assert routed.keys() == reference.keys()
    for n in reference:
        assert_rel_close(routed[n], reference[n], what=n)
    for n in must_differ:  # the route has an effect: the test can fail
        assert not torch.allclose(unrouted[n], reference[n], rtol=1e-4), n


def check_route(elbo, routed_model, reference_model, plain_model, guide, must_differ=()):
    """Routed gradients equal the reference's; the route changes ``must_differ``."""
    grads(elbo, plain_model, guide)  # create the params
    routed = grads(elbo, routed_model, guide)
    reference = grads(elbo, reference_model, guide)
    unrouted = grads(elbo, plain_model, guide) if must_differ else None
    compare(routed, reference, unrouted, must_differ)


@pytest.mark.parametrize("elbo_name", list(ELBOS))
def test_seed_factors(elbo_name):
    s, elbo = Seed(), ELBOS[elbo_name]()
    routed_model = block_grad(s.model, sites=["loss2"], modules=["B"])
    reference = partial(s.model, detach={"B"})
    check_route(elbo, routed_model, reference, s.model, s.guide, must_differ=["B$$$0.weight"])


@pytest.mark.parametrize("elbo_name", list(ALL))
def test_vae_aux_label_does_not_train_decoder(elbo_name):
    v, elbo = VAE(), ALL[elbo_name]()
    routed_model = block_grad(v.model, sites=["y"], modules=["decoder"])
    reference = partial(v.model, detach={"decoder@y"})
    check_route(elbo, routed_model, reference, v.model, v.guide, ["decoder$$$hidden.weight"])


@pytest.mark.parametrize(
    "elbo_name",
    [
        "ours.Trace_ELBO",
        "ours.TraceSTL_ELBO",
        "ours.TraceDReG_ELBO",
        "pyro.Trace_ELBO",
        "pyro.TraceGraph_ELBO",
    ],
)
def test_guide_encoder_blocked_from_observed_site(elbo_name):
    v, elbo = VAE(), ALL[elbo_name]()
    routed_model = block_grad(v.model, sites=["x"], modules=["encoder"])
    reference = partial(v.model, detach={"encoder@x"})
    check_route(elbo, routed_model, reference, v.model, v.guide, ["encoder$$$weight"])


@pytest.mark.parametrize(
    "elbo_name", ["ours.Trace_ELBO", "ours.TraceSTL_ELBO", "ours.TraceDReG_ELBO", "pyro.Trace_ELBO"]
)
def test_vectorized_particles_and_subsampling(elbo_name):
    v = VAE(subsample_size=5)
    elbo = ALL[elbo_name](num_particles=3, vectorize_particles=True, max_plate_nesting=1)
    routed_model = block_grad(v.model, sites=["y"], modules=["decoder"])
    reference = partial(v.model, detach={"decoder@y"})
    check_route(elbo, routed_model, reference, v.model, v.guide, ["decoder$$$hidden.weight"])


@pytest.mark.parametrize("elbo_name", ["ours.Trace_ELBO", "pyro.Trace_ELBO", "pyro.RenyiELBO"])
def test_nested_handlers(elbo_name):
    v, elbo = VAE(), ELBOS[elbo_name]()
    inner = block_grad(v.model, sites=["y"], params=["decoder$$$hidden.weight"])
    same_site = block_grad(inner, sites="y", params=lambda n: n == "decoder$$$hidden.bias")
    routed_model = block_grad(same_site, sites=["x"], modules=[v.encoder])
    reference = partial(v.model, detach={"decoder@y", "encoder@x"})
    check_route(elbo, routed_model, reference, v.model, v.guide, ["decoder$$$hidden.bias"])


@pytest.mark.parametrize("elbo_name", ["ours.TraceSTL_ELBO", "pyro.TraceMeanField_ELBO"])
def test_handler_wrapping_whole_svi_step(elbo_name):
    """``with block_grad(...): svi.step()`` equals an SGD step on the reference gradient."""
    s = Seed()
    elbo = ELBOS[elbo_name]()
    grads(elbo, s.model, s.guide)
    store = pyro.get_param_store()
    start = {n: p.detach().clone() for n, p in store._params.items()}
    reference = grads(elbo, partial(s.model, detach={"B"}), s.guide)
    svi = pinfer.SVI(s.model, s.guide, pyro.optim.SGD({"lr": 0.1}), elbo)
    for p in store._params.values():
        p.grad = None
    pyro.set_rng_seed(3)
    with block_grad(sites=["loss2"], params=["B$$$*"]):
        svi.step()
    for n, p in store._params.items():
        assert_rel_close(start[n] - p.detach(), 0.1 * reference[n], rtol=1e-4, what=n)


def test_differentiable_loss_honours_routes():
    s, elbo = Seed(), rinfer.Trace_ELBO()
    routed_model = block_grad(s.model, sites=["loss2"], modules=["B"])
    grads(elbo, s.model, s.guide)
    reference = grads(elbo, partial(s.model, detach={"B"}), s.guide)
    store = pyro.get_param_store()
    for p in store._params.values():
        p.grad = None
    pyro.set_rng_seed(3)
    elbo.differentiable_loss(routed_model, s.guide).backward()
    compare({n: p.grad for n, p in store._params.items() if p.grad is not None}, reference)


def _naive_guide_site_reference(model, guide, site, blocked_names, seed=3):
    """Two passes: full Trace_ELBO gradient, minus the guide site's term on the blocked params."""
    full = grads(pinfer.Trace_ELBO(), model, guide, seed)
    pyro.set_rng_seed(seed)
    guide_trace = poutine.trace(guide).get_trace()
    guide_trace.compute_score_parts()
    term = -guide_trace.nodes[site]["score_parts"].entropy_term.sum()  # d(-ELBO) of -log q
    store = pyro.get_param_store()._params
    gs = torch.autograd.grad(-term, [store[n] for n in blocked_names])
    for n, g in zip(blocked_names, gs):
        full[n] = full[n] - g
    return full


@pytest.mark.parametrize(
    "elbo_name",
    ["ours.Trace_ELBO", "pyro.Trace_ELBO", "pyro.TraceGraph_ELBO", "pyro.TraceMeanField_ELBO"],
)
def test_guide_site_blocked(elbo_name):
    s, elbo = Seed(), ELBOS[elbo_name]()
    grads(elbo, s.model, s.guide)
    routed = grads(elbo, s.model, block_grad(s.guide, sites=["z"], params=["q_scale"]))
    reference = _naive_guide_site_reference(s.model, s.guide, "z", ["q_scale"])
    compare(routed, reference, grads(elbo, s.model, s.guide), must_differ=["q_scale"])


class Discrete:
    """A non-reparameterized guide site ``z``: its route covers the score-function term."""

    def __init__(self):
        self.x = torch.tensor([0.3, 1.2, 0.8])

    def model(self, detach=()):
        w = pyro.param("w", torch.tensor(0.7))
        z = pyro.sample("z", dist.Bernoulli(0.4))
        with pyro.plate("data", 3):
            pyro.sample("x", dist.Normal(z * w, 1.0), obs=self.x)

    def guide(self, detach=()):
        a, b = pyro.param("a", torch.tensor(0.5)), pyro.param("b", torch.tensor(1.5))
        pyro.param("c", torch.tensor(0.2))
        b = b.detach() if "b" in detach else b
        pyro.sample("z", dist.Bernoulli(logits=a * b + pyro.param("c")))


@pytest.mark.parametrize(
    "elbo_name", ["ours.Trace_ELBO", "pyro.Trace_ELBO", "pyro.TraceGraph_ELBO"]
)
def test_score_function_term_blocked(elbo_name):
    d, elbo = Discrete(), ELBOS[elbo_name](num_particles=4)
    grads(elbo, d.model, d.guide)
    with pytest.warns(UserWarning) if elbo_name.startswith("ours") else _nothing():
        routed = grads(elbo, d.model, block_grad(d.guide, sites="z", params=["b"]))
    reference = grads(elbo, d.model, partial(d.guide, detach={"b"}))
    assert "b" not in routed and "a" in routed
    compare(routed, reference)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_jit_elbo_raises_clearly():
    s = Seed()
    with pytest.raises(NotImplementedError, match="JIT"):
        pinfer.JitTrace_ELBO().loss_and_grads(
            block_grad(s.model, sites="loss2", modules=["B"]), s.guide
        )
