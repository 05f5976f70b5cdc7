r"""``y = B(A(x))`` with a main loss training A and B and an auxiliary loss
that may train A only -- from one forward pass.

.. math::

    \sigma \sim \text{LogNormal}(0, 1),\quad
    y_i \sim N(B(A(x_i)), \sigma^2)\ \text{(A and B)},\quad
    a_i \sim N(B(A(x_i)), 1)\ \text{(A only: } \texttt{block\_grad(sites=["aux"], modules=["B"])}\text{)}.

The networks are ``pyro.module`` parameters (point estimates); the guide is AutoNormal on
``sigma``. The routing engine sends the auxiliary site's gradient to A and stops it at B, in the
same backward pass as the rest (plain-PyTorch version: :func:`pyro_gradroute.routing.backward`).

Example::

    >>> import pyro
    >>> from pyro_gradroute.app.models.nested_aux_loss import problem
    >>> p = problem()
    >>> tuple(p.args[0].shape), tuple(p.heldout_args[0].shape)
    ((160, 4), (40, 4))
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.autoguide import AutoNormal
from torch import nn

from .problem import Problem


class NestedModel:
    """The model, holding the two networks ``A`` (encoder) and ``B`` (head)."""

    def __init__(self, x_dim: int = 4, hidden: int = 16) -> None:
        self.A = nn.Sequential(nn.Linear(x_dim, hidden), nn.Tanh())
        self.B = nn.Linear(hidden, 1)

    def __call__(self, x: torch.Tensor, y: torch.Tensor | None = None, aux=None) -> None:
        from ...poutine import block_grad

        pyro.module("A", self.A)
        pyro.module("B", self.B)
        sigma = pyro.sample("sigma", dist.LogNormal(0.0, 1.0))
        out = self.B(self.A(x)).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Normal(out, sigma), obs=y)
            with block_grad(sites=["aux"], modules=["B"]):
                pyro.sample("aux", dist.Normal(out, 1.0), obs=aux)


def simulate(n: int = 200, x_dim: int = 4, seed: int = 0):
    """``(x, y, aux)``: ``y = sin(x . a) + 0.1 noise``, ``aux = y + noise``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, x_dim, generator=g)
    y = torch.sin(x @ torch.randn(x_dim, generator=g)) + 0.1 * torch.randn(n, generator=g)
    return x, y, y + torch.randn(n, generator=g)


def problem() -> Problem:
    """The bundled problem: 160 training and 40 held-out points, 400 steps at lr 0.02."""
    x, y, aux = simulate()
    model = NestedModel(x.shape[-1])
    return Problem(
        model=model,
        guide=AutoNormal(model),
        args=(x[:160], y[:160], aux[:160]),
        heldout_args=(x[160:], y[160:], aux[160:]),
        var_names=["sigma"],
        steps=400,
        lr=0.02,
    )
