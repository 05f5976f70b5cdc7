"""Diagnostics on subsampled plates (evaluated on all points) and on models with an enumerated
discrete latent (summed out), against log-densities computed by hand on the guide's draws."""

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoNormal

from pyro_gradroute.diagnostics import pareto_khat, psis_khat, to_inference_data
from pyro_gradroute.diagnostics.draws import importance_draws
from pyro_gradroute.diagnostics.enumerated import EnumerationError
from pyro_gradroute.diagnostics.plates import FullDataError

S, N = 200, 40
X = torch.randn(N, generator=torch.Generator().manual_seed(1)) + 1.0
Normal = torch.distributions.Normal


def subsampled(x):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(x), subsample_size=8) as ind:
        pyro.sample("x", dist.Normal(mu, 1.0), obs=x[ind])


def mu_guide(x):
    pyro.sample("mu", dist.Normal(0.9, 0.2))


@pytest.mark.parametrize("vectorize", [True, False])
def test_subsampled_plate_log_likelihood_and_ratio_use_every_point(vectorize):
    pyro.set_rng_seed(0)
    idata = to_inference_data(subsampled, mu_guide, X, num_samples=S, vectorize=vectorize,
                              progress=False)  # fmt: skip
    mu = torch.as_tensor(idata["posterior"]["mu"].values[0])  # (S,)
    ll = Normal(mu[:, None], 1.0).log_prob(X)  # (S, N): every point, by hand
    np.testing.assert_allclose(idata["observed_data"]["x"].values, X.numpy(), rtol=1e-6)
    np.testing.assert_allclose(idata["log_likelihood"]["x"].values[0], ll, rtol=1e-5, atol=1e-5)
    ratio = Normal(0.0, 1.0).log_prob(mu) + ll.sum(-1) - Normal(0.9, 0.2).log_prob(mu)
    lw = idata["sample_stats"]["log_importance_ratio"].values[0]
    np.testing.assert_allclose(lw, ratio, rtol=1e-5, atol=1e-4)
    assert (
        "data: all 40 points"
        in idata["log_likelihood"].attrs["subsampled_plates_evaluated_in_full"]
    )
    assert pareto_khat(lw).khat == pytest.approx(pareto_khat(ratio).khat, abs=0.02)


def test_subsampled_local_latents_with_autonormal_use_every_point():
    def model(x):
        with pyro.plate("data", len(x), subsample_size=5) as ind:
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z, 1.0), obs=x[ind])

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoNormal(model)
    guide(X)
    d = importance_draws(model, guide, X, num_samples=S)
    loc, scale = guide.locs.z.detach(), guide.scales.z.detach()
    z = d.site_draws("z")  # (S, N)
    assert z.shape == (S, N)
    ratio = (Normal(0.0, 1.0).log_prob(z) + Normal(z, 1.0).log_prob(X)
             - Normal(loc, scale).log_prob(z)).sum(-1)  # fmt: skip
    torch.testing.assert_close(d.log_ratios, ratio, rtol=1e-5, atol=1e-4)


def test_minibatch_only_model_is_a_clear_error_naming_the_plate():
    def model(batch):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", N, subsample_size=len(batch)):
            pyro.sample("x", dist.Normal(mu, 1.0), obs=batch)

    with pytest.raises(FullDataError, match=r"'data' \(8 of 40 points\)"):
        to_inference_data(model, mu_guide, X[:8], num_samples=10)
    with pytest.raises(FullDataError, match="obs=data\\[ind\\]"):
        psis_khat(model, mu_guide, X[:8], num_samples=10)


# ------------------------------------------------------------------ enumerated mixtures
W = torch.tensor([0.3, 0.7])
DATA = torch.cat([torch.randn(6, generator=torch.Generator().manual_seed(2)) - 2,
                  torch.randn(6, generator=torch.Generator().manual_seed(3)) + 2])  # fmt: skip


def mixture(data):
    with pyro.plate("components", 2):
        locs = pyro.sample("locs", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(data)):
        k = pyro.sample("k", dist.Categorical(W), infer={"enumerate": "parallel"})
        loc = torch.where(k == 0, locs[..., :1], locs[..., 1:])  # vectorizes over draws
        pyro.sample("x", dist.Normal(loc, 1.0), obs=data)


def readme_mixture(data):  # the README recipe: locs[k], one draw at a time
    with pyro.plate("components", 2):
        locs = pyro.sample("locs", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(data)):
        k = pyro.sample("k", dist.Categorical(W), infer={"enumerate": "parallel"})
        pyro.sample("x", dist.Normal(locs[k], 1.0), obs=data)


G_LOC, G_SCALE = torch.tensor([-2.0, 2.0]), torch.tensor([0.5, 0.5])


def locs_guide(data):
    with pyro.plate("components", 2):
        pyro.sample("locs", dist.Normal(G_LOC, G_SCALE))


def hand_marginal(locs):
    """log p(x_i | locs) = logsumexp_k [log w_k + log N(x_i; locs_k, 1)], and the ratio."""
    per_k = W.log() + Normal(locs[:, None, :], 1.0).log_prob(DATA[:, None])  # (S, N, K)
    ll = per_k.logsumexp(-1)
    ratio = (ll.sum(-1) + Normal(0.0, 10.0).log_prob(locs).sum(-1)
             - Normal(G_LOC, G_SCALE).log_prob(locs).sum(-1))  # fmt: skip
    return ll, ratio


@pytest.mark.parametrize("model, vectorize", [(mixture, True), (mixture, False),
                                              (readme_mixture, False)])  # fmt: skip
def test_enumerated_site_is_summed_out(model, vectorize):
    pyro.set_rng_seed(0)
    idata = to_inference_data(model, locs_guide, DATA, num_samples=S, vectorize=vectorize,
                              progress=False)  # fmt: skip
    assert "k" not in idata["posterior"]
    assert idata["log_likelihood"].attrs["enumerated_sites_summed_out"] == "k"
    locs = torch.as_tensor(idata["posterior"]["locs"].values[0], dtype=torch.float32)
    ll, ratio = hand_marginal(locs)
    np.testing.assert_allclose(idata["log_likelihood"]["x"].values[0], ll, rtol=1e-5, atol=1e-4)
    lw = idata["sample_stats"]["log_importance_ratio"].values[0]
    np.testing.assert_allclose(lw, ratio, rtol=1e-5, atol=1e-3)


def test_enumerated_mixture_khat_reads_the_marginal():
    pyro.set_rng_seed(0)
    k = psis_khat(mixture, locs_guide, DATA, num_samples=2000)
    pyro.set_rng_seed(0)
    d = importance_draws(mixture, locs_guide, DATA, num_samples=2000)
    _, ratio = hand_marginal(d.site_draws("locs"))
    assert k.khat == pytest.approx(pareto_khat(ratio).khat, abs=0.02)  # float32 vs float64 ratios
    assert k.reading == "good"  # k-hat 0.11-0.22 over seeds 0-4


def test_global_enumerated_site_sums_out_in_the_ratio_and_refuses_the_pointwise_ll():
    def model(data):
        locs = pyro.sample("locs", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
        k = pyro.sample("k", dist.Categorical(W), infer={"enumerate": "parallel"})
        with pyro.plate("data", len(data)):
            loc = torch.where(k == 0, locs[..., :1], locs[..., 1:])
            pyro.sample("x", dist.Normal(loc, 1.0), obs=data)

    def guide(data):
        pyro.sample("locs", dist.Normal(G_LOC, G_SCALE).to_event(1))

    pyro.set_rng_seed(0)
    d = importance_draws(model, guide, DATA, num_samples=S, vectorize=False, progress=False)
    locs = d.site_draws("locs")
    per_k = W.log() + Normal(locs[:, None, :], 1.0).log_prob(DATA[:, None]).sum(1)  # (S, K)
    ratio = (per_k.logsumexp(-1) + Normal(0.0, 10.0).log_prob(locs).sum(-1)
             - Normal(G_LOC, G_SCALE).log_prob(locs).sum(-1))  # fmt: skip
    torch.testing.assert_close(d.log_ratios, ratio, rtol=1e-5, atol=1e-3)
    with pytest.raises(EnumerationError, match="'k' is outside plate"):
        to_inference_data(model, guide, DATA, num_samples=10, vectorize=False, progress=False)


def test_nested_enumeration_is_a_clear_error_naming_the_site():
    def model(data):
        with pyro.plate("data", len(data)):
            a = pyro.sample("a", dist.Categorical(W), infer={"enumerate": "parallel"})
            b = pyro.sample("b", dist.Categorical(torch.tensor([[0.5, 0.5], [0.1, 0.9]])[a]),
                            infer={"enumerate": "parallel"})  # fmt: skip
            pyro.sample("x", dist.Normal(b.float(), 1.0), obs=data)

    with pytest.raises(EnumerationError, match="'b' reads enumerated site"):
        psis_khat(model, lambda data: None, DATA, num_samples=10, vectorize=False)
