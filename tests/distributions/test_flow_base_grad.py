"""The closed-form base gradient of a flow, (mu - x) / sigma^2 for a Normal base, against autograd."""

import pyro.distributions as dist
import pyro.distributions.transforms as T
import pytest
import torch

from pyro_gradroute.distributions import flows
from pyro_gradroute.distributions.flows import path as flow_path


def _autograd(base, x):
    xx = x.detach().clone().requires_grad_()
    return torch.autograd.grad(base.log_prob(xx).sum(), xx)[0]


def _g(seed, *shape):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


BASES = {
    "Normal, scalar": lambda: dist.Normal(_g(0, ()), _g(1, ()).exp()),
    "Normal, batch (2, 3)": lambda: dist.Normal(_g(0, 2, 3), _g(1, 2, 3).exp()),
    "Normal, broadcast scale": lambda: dist.Normal(_g(0, 2, 3), _g(1, 3).exp()),
    "Independent(Normal), event 3": lambda: dist.Normal(_g(0, 3), _g(1, 3).exp()).to_event(1),
    "Independent(Normal), batch 2, event (4, 3)": lambda: dist.Normal(
        _g(0, 2, 4, 3), _g(1, 2, 4, 3).exp()
    ).to_event(2),
    "Independent(Independent(Normal))": lambda: torch.distributions.Independent(
        torch.distributions.Independent(
            torch.distributions.Normal(_g(0, 2, 4, 3), _g(1, 2, 4, 3).exp()), 1
        ),
        1,
    ),
    "expanded Normal": lambda: dist.Normal(_g(0, ()), 0.3).expand([5]).to_event(1),
}


@pytest.mark.parametrize("name", sorted(BASES))
@pytest.mark.parametrize("sample_shape", [(), (7,), (2, 5)], ids=str)
def test_closed_form_equals_autograd_float64(name, sample_shape):
    base = BASES[name]()
    x = base.sample(sample_shape)
    g = flows.normal_base_grad(base, x)
    ref = _autograd(base, x)
    assert g is not None and g.dtype == torch.float64 and g.shape == ref.shape == x.shape
    # to round-off: a few ulp of the largest entry
    assert (g - ref).abs().max() <= 4 * torch.finfo(torch.float64).eps * ref.abs().max()


class _ShiftedNormal(dist.Normal):
    """A Normal subclass with its own log_prob: not the closed form."""

    def log_prob(self, value):
        return super().log_prob(value) + 0.1 * value


NON_NORMAL = {
    "Laplace": lambda: dist.Laplace(_g(0, 3), _g(1, 3).exp()).to_event(1),
    "StudentT": lambda: dist.StudentT(4.0, _g(0, 3), _g(1, 3).exp()).to_event(1),
    "Normal subclass with its own log_prob": lambda: _ShiftedNormal(
        _g(0, 3), _g(1, 3).exp()
    ).to_event(1),
    "MultivariateNormal": lambda: dist.MultivariateNormal(
        _g(0, 3), scale_tril=torch.eye(3, dtype=torch.float64) * 0.5
    ),
}


def _path(base, sample_shape):
    q = dist.TransformedDistribution(base, [T.planar(3).double()])
    path = flows.forward_path(q, torch.Size(sample_shape))
    path.log_prob()
    return path


@pytest.mark.parametrize("name", sorted(NON_NORMAL))
def test_other_bases_take_the_autograd_path(name, monkeypatch):
    base = NON_NORMAL[name]()
    path = _path(base, (4,))
    assert flows.normal_base_grad(base, path.xs[0].detach()) is None
    calls = []
    vjp = flow_path.vjp  # (the engine call through which the path's gradients go)
    monkeypatch.setattr(flow_path, "vjp", lambda *a, **k: calls.append(1) or vjp(*a, **k))
    g = path.base_grad()
    assert calls, "the autograd path was not taken"
    torch.testing.assert_close(g, _autograd(base, path.xs[0]), rtol=1e-14, atol=0)


def test_a_normal_base_takes_no_autograd_call(monkeypatch):
    base = BASES["Independent(Normal), event 3"]()
    path = _path(base, (4,))
    calls = []
    vjp = flow_path.vjp  # (the engine call through which the path's gradients go)
    monkeypatch.setattr(flow_path, "vjp", lambda *a, **k: calls.append(1) or vjp(*a, **k))
    g = path.base_grad()
    assert not calls
    assert (g - _autograd(base, path.xs[0])).abs().max() <= 4 * 2.0**-52 * g.abs().max()
