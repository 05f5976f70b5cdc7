"""Small seeded Pyro models with a ``detach`` switch: the naive reference for ``block_grad``.

``model(..., detach={"B"})`` recomputes the blocked term's forward with the blocked
parameters detached (``torch.func.functional_call``): the second pass of the naive
two-pass computation, valid for every ELBO (also non-additive ones such as Renyi).
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from torch import nn
from torch.distributions import constraints


def frozen(module: nn.Module):
    """``module`` evaluated with its parameters detached."""
    params = {n: p.detach() for n, p in module.named_parameters()}
    return lambda inp: torch.func.functional_call(module, params, (inp,))


def mlp(n: int, w: int) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(n) for m in (nn.Linear(w, w), nn.Tanh())])


class Seed:
    """``y = B(A(x + z))``; ``pyro.factor("loss1", f(y))``, ``pyro.factor("loss2", g(y))``."""

    def __init__(self):
        torch.manual_seed(0)
        self.A, self.B = mlp(2, 4), mlp(2, 4)
        self.x = torch.randn(6, 4)

    def model(self, detach=()):
        A, B = pyro.module("A", self.A), pyro.module("B", self.B)
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        h = A(self.x + z)
        y = B(h)
        pyro.factor("loss1", -y.pow(2).mean())
        y2 = frozen(B)(h) if "B" in detach else y
        pyro.factor("loss2", -y2.sin().mean() * 3)

    def guide(self, detach=()):
        loc = pyro.param("q_loc", torch.tensor(0.1))
        scale = pyro.param("q_scale", torch.tensor(0.5), constraint=constraints.positive)
        pyro.sample("z", dist.Normal(loc, scale))


class VAE:
    """A VAE with an auxiliary label likelihood ``y`` read from the decoder's hidden layer."""

    N, D, Z, H, K = 8, 5, 2, 6, 3

    def __init__(self, subsample_size=None):
        torch.manual_seed(1)
        self.encoder = nn.Linear(self.D, 2 * self.Z)
        self.decoder = nn.ModuleDict(
            {"hidden": nn.Linear(self.Z, self.H), "out": nn.Linear(self.H, self.D)}
        )
        self.classifier = nn.Linear(self.H, self.K)
        self.x = torch.randn(self.N, self.D)
        self.y = torch.randint(0, self.K, (self.N,))
        self.subsample_size = subsample_size

    def model(self, detach=()):
        dec = pyro.module("decoder", self.decoder)
        clf = pyro.module("classifier", self.classifier)
        with pyro.plate("data", self.N, subsample_size=self.subsample_size) as idx:
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([self.Z]).to_event(1))
            zx = z.detach() if "encoder@x" in detach else z
            hx = torch.tanh(dec["hidden"](zx))
            pyro.sample("x", dist.Normal(dec["out"](hx), 1.0).to_event(1), obs=self.x[idx])
            hidden = frozen(dec["hidden"]) if "decoder@y" in detach else dec["hidden"]
            hy = torch.tanh(hidden(z))
            pyro.sample("y", dist.Categorical(logits=clf(hy)), obs=self.y[idx])

    def guide(self, detach=()):
        enc = pyro.module("encoder", self.encoder)
        with pyro.plate("data", self.N, subsample_size=self.subsample_size) as idx:
            out = enc(self.x[idx])
            loc, scale = out[..., : self.Z], nn.functional.softplus(out[..., self.Z :]) + 0.1
            pyro.sample("z", dist.Normal(loc, scale).to_event(1))
