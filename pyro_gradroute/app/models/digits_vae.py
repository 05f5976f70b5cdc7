"""A VAE on binarized 8x8 digits (scikit-learn's bundled ``load_digits``; no download).

Model: :math:`z \\sim N(0, I_d)`, :math:`x \\mid z \\sim \\text{Bernoulli}(\\text{logits}=f_\\theta(z))`;
guide: :math:`q_\\phi(z \\mid x) = N(\\mu_\\phi(x), \\text{diag}\\,\\sigma_\\phi(x)^2)`,
both MLPs registered with ``pyro.module`` as ``"decoder"`` and ``"encoder"``.

Example::

    >>> import pyro
    >>> from pyro_gradroute.app.models.digits_vae import VAE, load_binarized_digits
    >>> train, test = load_binarized_digits()
    >>> vae = VAE()
    >>> loss = pyro.infer.Trace_ELBO().loss(vae.model, vae.guide, train[:32])
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from torch import nn


def load_binarized_digits(
    test_fraction: float = 0.2, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Binarized (pixel > 8 of 16) digits as float tensors ``(train, test)`` of shape ``(n, 64)``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "The digits data set comes with scikit-learn: pip install -e '.[examples]'"
        ) from e
    x = torch.as_tensor(load_digits().data > 8, dtype=torch.get_default_dtype())
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    return x[perm[n_test:]], x[perm[:n_test]]


def mlp(sizes: list[int], activation=nn.Tanh) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)


class VAE(nn.Module):
    """Bernoulli-likelihood VAE with MLP encoder and decoder (64-64 tanh by default)."""

    def __init__(self, x_dim: int = 64, z_dim: int = 8, hidden: int = 64, layers: int = 2):
        super().__init__()
        self.z_dim = z_dim
        self.decoder = mlp([z_dim] + [hidden] * layers + [x_dim])
        self.encoder = mlp([x_dim] + [hidden] * layers + [2 * z_dim])

    def model(self, x: torch.Tensor) -> None:
        pyro.module("decoder", self.decoder)
        with pyro.plate("data", x.shape[0]):
            loc = x.new_zeros(x.shape[:-1] + (self.z_dim,))
            z = pyro.sample("z", dist.Normal(loc, 1.0).to_event(1))
            logits = self.decoder(z)
            pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)

    def guide(self, x: torch.Tensor) -> None:
        pyro.module("encoder", self.encoder)
        with pyro.plate("data", x.shape[0]):
            h = self.encoder(x)
            loc, log_scale = h[..., : self.z_dim], h[..., self.z_dim :]
            pyro.sample("z", dist.Normal(loc, log_scale.exp()).to_event(1))


def problem():
    """The bundled problem: the VAE on the digits, 20% held out, 300 steps at lr 3e-3."""
    from .problem import Problem

    train, test = load_binarized_digits()
    vae = VAE()
    return Problem(
        model=vae.model,
        guide=vae.guide,
        args=(train,),
        heldout_args=(test,),
        heldout="marginal",
        diag_args=(test[:4],),
        var_names=["z"],
        steps=300,
        lr=3e-3,
        num_particles=8,
    )
