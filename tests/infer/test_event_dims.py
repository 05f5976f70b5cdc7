"""Event dimensions through transforms that change them follow torch's own bookkeeping."""

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.distributions.transforms as T
from pyro.infer import RenyiELBO
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from torch.distributions import biject_to, constraints

from pyro_gradroute.distributions.split import _transformed_log_prob
from pyro_gradroute.guides import AutoMeanField
from pyro_gradroute.infer import TraceDReG_ELBO, TraceSTL_ELBO


@pytest.mark.parametrize(
    "event, transforms",
    [
        ((3,), [T.CorrCholeskyTransform(cache_size=1)]),
        ((6,), [T.ReshapeTransform((6,), (2, 3)), T.ExpTransform()]),
        ((6,), [T.ExpTransform(), T.ReshapeTransform((6,), (3, 2))]),
    ],
)
def test_forward_log_prob_equals_torchs(event, transforms):
    base = dist.Normal(torch.zeros(5, *event), 1.0).to_event(1)
    fn = dist.TransformedDistribution(base, transforms)
    x = base.sample()
    y = x
    for t in transforms:
        y = t(y)
    assert torch.allclose(_transformed_log_prob(fn, x), fn.log_prob(y), atol=1e-5)


def _lkj_model(data):
    L = pyro.sample("L", dist.LKJCholesky(3, 2.0))
    with pyro.plate("d", len(data)):
        pyro.sample("x", dist.MultivariateNormal(torch.zeros(3), scale_tril=L), obs=data)


def test_dreg_on_an_lkj_site_equals_renyi():
    pyro.clear_param_store()
    data = torch.randn(10, 3, generator=torch.Generator().manual_seed(0))
    guide = AutoMeanField(_lkj_model)
    pyro.set_rng_seed(1)
    guide(data)
    kw = dict(num_particles=3, vectorize_particles=True, max_plate_nesting=1)
    for seed in range(3):
        pyro.set_rng_seed(seed)
        got = TraceDReG_ELBO(**kw).loss_and_grads(_lkj_model, guide, data)
        pyro.set_rng_seed(seed)
        want = RenyiELBO(alpha=0, **kw).loss(_lkj_model, guide, data)
        assert got == pytest.approx(want, rel=1e-6)


def _masked_model():
    pyro.sample("a", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    with pyro.plate("p", 4):
        pyro.sample("L", dist.LKJCholesky(3, 2.0))


def _masked_guide():
    m = pyro.param("m", torch.zeros(4, 3))
    loc = pyro.param("a_loc", torch.zeros(2))
    mask = torch.tensor([True, False])
    pyro.sample("a", dist.Normal(loc, 1.0).mask(mask).to_event(1))  # (its own score_parts)
    with pyro.plate("p", 4):
        t = biject_to(constraints.corr_cholesky).with_cache(1)
        pyro.sample("L", dist.TransformedDistribution(dist.Normal(m, 1.0).to_event(1), [t]))


@pytest.mark.parametrize("k", [1, 3])
def test_stl_with_a_masked_site_and_an_lkj_site_equals_trace_elbo(k):
    pyro.clear_param_store()
    kw = dict(num_particles=k, vectorize_particles=k > 1, max_plate_nesting=1)
    for seed in range(2):
        pyro.set_rng_seed(seed)
        got = TraceSTL_ELBO(**kw).loss_and_grads(_masked_model, _masked_guide)
        pyro.set_rng_seed(seed)
        want = PyroTrace_ELBO(**kw).loss_and_grads(_masked_model, _masked_guide)
        assert got == pytest.approx(want, rel=1e-6)
