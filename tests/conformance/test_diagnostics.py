"""Diagnostics in the conformance matrix: subsampled plates and enumerated discrete latents.

Each cell draws from a guide with ``importance_draws`` / ``to_inference_data`` and compares,
on the same guide draws, with log-densities written by hand on the full data:

* ``log_likelihood``: ``log p(x_i | z_s)`` for every point ``i`` (the enumerated site summed out,
  ``logsumexp_k [log p(k) + log p(x_i | k, z_s)]``), next to ``observed_data`` equal to all points;
* ``log_ratio``: ``log p(x_{1..N}, z_s) - log q(z_s)`` per draw (float32 round-off);
* ``khat``: PSIS k-hat of the package's log-ratios equals that of the hand-written ones;
* ``raises``: the cases with no exact answer raise an error naming the plate or the site.

Cases x drawing modes (``vec``: one vectorized pass; ``seq``: one draw at a time).
"""

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_gradroute.diagnostics import pareto_khat, to_inference_data
from pyro_gradroute.diagnostics.enumerated import EnumerationError
from pyro_gradroute.diagnostics.plates import FullDataError
from tests.diagnostics import test_full_data_enumerated as m

S = 200
Normal = torch.distributions.Normal


def _subsampled_global(idata):
    mu = torch.as_tensor(idata["posterior"]["mu"].values[0], dtype=torch.float32)
    ll = Normal(mu[:, None], 1.0).log_prob(m.X)
    ratio = Normal(0.0, 1.0).log_prob(mu) + ll.sum(-1) - Normal(0.9, 0.2).log_prob(mu)
    return ll, ratio


def _mixture(idata):
    return m.hand_marginal(torch.as_tensor(idata["posterior"]["locs"].values[0]).float())


def _subsampled_mixture_model(data):
    with pyro.plate("components", 2):
        locs = pyro.sample("locs", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(data), subsample_size=4) as ind:
        k = pyro.sample("k", dist.Categorical(m.W), infer={"enumerate": "parallel"})
        loc = torch.where(k == 0, locs[..., :1], locs[..., 1:])
        pyro.sample("x", dist.Normal(loc, 1.0), obs=data[ind])


def _sequential_mixture_model(data):
    with pyro.plate("components", 2):
        locs = pyro.sample("locs", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(data)):
        k = pyro.sample("k", dist.Categorical(m.W), infer={"enumerate": "sequential"})
        loc = torch.where(k == 0, locs[..., :1], locs[..., 1:])
        pyro.sample("x", dist.Normal(loc, 1.0), obs=data)


CASES = {
    "subsampled_global": (m.subsampled, m.mu_guide, m.X, _subsampled_global),
    "mixture_enumerated": (m.mixture, m.locs_guide, m.DATA, _mixture),
    "mixture_sequential_enum": (_sequential_mixture_model, m.locs_guide, m.DATA, _mixture),
    "mixture_enumerated_subsampled": (_subsampled_mixture_model, m.locs_guide, m.DATA, _mixture),
}
MODES = {"vec": True, "seq": False}


@pytest.fixture(scope="module")
def results():
    cache = {}

    def get(case, mode):
        if (case, mode) not in cache:
            model, guide, data, ref = CASES[case]
            pyro.set_rng_seed(0)
            idata = to_inference_data(model, guide, data, num_samples=S, vectorize=MODES[mode],
                                      progress=False)  # fmt: skip
            cache[case, mode] = idata, ref(idata), data
        return cache[case, mode]

    return get


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("check", ["log_likelihood", "log_ratio", "khat"])
def test_diagnostics_cell(results, case, mode, check):
    idata, (ll, ratio), data = results(case, mode)
    if check == "log_likelihood":
        np.testing.assert_allclose(idata["observed_data"]["x"].values, data.numpy(), rtol=1e-6)
        np.testing.assert_allclose(idata["log_likelihood"]["x"].values[0], ll, rtol=1e-5,
                                   atol=1e-4)  # fmt: skip
    lw = idata["sample_stats"]["log_importance_ratio"].values[0]
    if check == "log_ratio":
        np.testing.assert_allclose(lw, ratio, rtol=1e-5, atol=1e-3)
    if check == "khat":
        assert pareto_khat(lw).khat == pytest.approx(pareto_khat(ratio).khat, abs=0.02)


def _minibatch_only(batch):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", 40, subsample_size=len(batch)):
        pyro.sample("x", dist.Normal(mu, 1.0), obs=batch)


def _two_children(data):
    with pyro.plate("components", 2):
        locs = pyro.sample("locs", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(data)):
        k = pyro.sample("k", dist.Categorical(m.W), infer={"enumerate": "parallel"})
        loc = torch.where(k == 0, locs[..., :1], locs[..., 1:])
        pyro.sample("x", dist.Normal(loc, 1.0), obs=data)
        pyro.sample("y", dist.Normal(loc, 2.0), obs=data)


RAISES = {
    "minibatch_only_obs": (_minibatch_only, m.mu_guide, m.X[:8], FullDataError, "'data'"),
    "enum_two_children": (_two_children, m.locs_guide, m.DATA, EnumerationError, "'k'"),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(RAISES))
def test_diagnostics_raises_cell(case, mode):
    model, guide, data, error, name = RAISES[case]
    with pytest.raises(error, match=name):
        to_inference_data(model, guide, data, num_samples=10, vectorize=MODES[mode],
                          progress=False)  # fmt: skip
