"""A parameter-free transform whose cache holds a sample is not a flow, and its cache is kept.

A guide that reuses one cached ``SigmoidTransform`` across calls gets STL's exact gradient at
saturating draws (loc 14, scale 2), on the first step too (where the default path checks, once
per kind of distribution, that a detached copy holds every parameter: that check must not
replace the transform's cache, or the sample's pre-image is lost and the sigmoid inverted).
Reference: Pyro's ``Trace_ELBO`` gradient on the same draw minus the score part at the cached
pre-image ``u``.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from torch.distributions.transforms import SigmoidTransform

from pyro_gradroute._compat import transform_cache
from pyro_gradroute.infer import TraceSTL_ELBO
from pyro_gradroute.poutine import stick_the_landing

N = 20
SHARED = SigmoidTransform(cache_size=1)


def model():
    with pyro.plate("n", N):
        p = pyro.sample("p", dist.Beta(2.0, 2.0))
        pyro.sample("x", dist.Bernoulli(p), obs=torch.zeros(N))


def guide():
    loc = pyro.param("loc", torch.full((N,), 14.0))
    log_s = pyro.param("log_s", torch.full((N,), 0.6931472))
    with pyro.plate("n", N):
        pyro.sample("p", dist.TransformedDistribution(dist.Normal(loc, log_s.exp()), [SHARED]))


@pytest.mark.parametrize("est", ["TraceSTL_ELBO", "stick_the_landing"])
def test_shared_cached_sigmoid_is_exact_at_saturation(est):
    pyro.clear_param_store()
    guide()
    store = pyro.get_param_store()

    def grads(fn, seed):
        for p in store.values():
            p.unconstrained().grad = None
        pyro.set_rng_seed(seed)
        fn()
        return [store[k].unconstrained().grad.clone() for k in ("loc", "log_s")]

    elbo = TraceSTL_ELBO()
    for seed in range(3):
        pyro.set_rng_seed(seed)
        t = poutine.trace(guide).get_trace().nodes["p"]["fn"].transforms[0]
        eps = (transform_cache(t)[0].detach() - 14.0) / 2.0
        gl, gs = grads(lambda: PyroTrace_ELBO().loss_and_grads(model, guide), seed)
        ref = (gl - eps / 2.0, gs - (eps.square() - 1))
        if est == "TraceSTL_ELBO":
            got = grads(lambda: elbo.loss_and_grads(model, guide), seed)
        else:
            got = grads(
                lambda: PyroTrace_ELBO().loss_and_grads(model, stick_the_landing(guide)), seed
            )
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
