"""An auxiliary label likelihood that shapes the encoder but never trains the decoder.

Digits VAE (``pyro_gradroute.app.models.digits_vae``) plus a label site
``y ~ Categorical(logits=classifier(decoder_hidden(z)))`` read from the decoder's first
hidden layer. Wrapping the model in
``block_grad(sites=["y"], modules=["decoder"])`` keeps the label term from the decoder:
the decoder learns only from the pixels, while the encoder (through ``z``) and the
classifier learn from the labels too. One forward pass per step; ``pyro_gradroute``'s
``Trace_ELBO`` routes the gradients with the routing engine.

The script checks the route on the first batch: the decoder's routed gradient equals its
gradient without the label site (same random draws), to 1e-5 relative. Then it trains and
prints the test ELBO and the label accuracy read from ``z``.

Run: ``python examples/vae_aux_loss_routing.py`` (``--smoke`` for a seconds-long run).
"""

from __future__ import annotations

import argparse

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI
from torch import nn

from pyro_gradroute.app.models.digits_vae import VAE
from pyro_gradroute.infer import Trace_ELBO
from pyro_gradroute.poutine import block_grad


class LabelledVAE(VAE):
    """The digits VAE with an auxiliary label likelihood on the decoder's first hidden layer."""

    def __init__(self, n_classes: int = 10, **kw):
        super().__init__(**kw)
        self.classifier = nn.Linear(self.decoder[0].out_features, n_classes)

    def model(self, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        pyro.module("decoder", self.decoder)
        pyro.module("classifier", self.classifier)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(x.shape[0], self.z_dim), 1.0).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=self.decoder(z)).to_event(1), obs=x)
            if y is not None:
                logits = self.classifier(self.decoder[:2](z))
                pyro.sample("y", dist.Categorical(logits=logits), obs=y)

    def guide(self, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        super().guide(x)


def load_labelled_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """Binarized 8x8 digits (pixel > 8 of 16) and their labels, from scikit-learn."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return torch.as_tensor(digits.data > 8, dtype=torch.float32), torch.as_tensor(digits.target)


def decoder_grads(elbo, model, guide, x, y, seed: int) -> list[torch.Tensor]:
    store = pyro.get_param_store()
    for p in store._params.values():
        p.grad = None
    pyro.set_rng_seed(seed)
    elbo.loss_and_grads(model, guide, x, y)
    return [store._params[n].grad.clone() for n in sorted(store._params) if n.startswith("decoder")]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--smoke", action="store_true", help="a few steps, for the test suite")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    x_all, y_all = load_labelled_digits()
    perm = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(0))
    test_idx, train_idx = perm[: len(perm) // 5], perm[len(perm) // 5 :]
    train, y_train, test, y_test = (
        x_all[train_idx],
        y_all[train_idx],
        x_all[test_idx],
        y_all[test_idx],
    )
    if args.smoke:
        train, y_train, test, y_test, args.epochs = (
            train[:64],
            y_train[:64],
            test[:64],
            y_test[:64],
            1,
        )

    vae = LabelledVAE()
    routed_model = block_grad(vae.model, sites=["y"], modules=["decoder"])
    elbo = Trace_ELBO()
    xb, yb = train[: args.batch], y_train[: args.batch]
    routed = decoder_grads(elbo, routed_model, vae.guide, xb, yb, seed=1)
    unlabelled = decoder_grads(elbo, vae.model, vae.guide, xb, None, seed=1)
    rel = max(((a - b).norm() / b.norm()).item() for a, b in zip(routed, unlabelled))
    print(f"decoder gradient, routed vs without the label site: max relative difference {rel:.1e}")
    if rel > 1e-5:
        raise SystemExit("the label likelihood leaked into the decoder's gradient")

    svi = SVI(routed_model, vae.guide, pyro.optim.Adam({"lr": 3e-3}), elbo)
    for epoch in range(args.epochs):
        order = torch.randperm(len(train))
        total = sum(svi.step(train[idx], y_train[idx]) for idx in order.split(args.batch))
        if epoch % 5 == 4 or epoch == args.epochs - 1:
            print(f"epoch {epoch + 1}: train loss per digit {total / len(train):.2f}")
    with torch.no_grad():
        test_loss = Trace_ELBO().loss(vae.model, vae.guide, test) / len(test)
        loc = vae.encoder(test)[..., : vae.z_dim]
        acc = (vae.classifier(vae.decoder[:2](loc)).argmax(-1) == y_test).float().mean().item()
    note = "  (smoke run: not converged)" if args.smoke else ""
    print(
        f"test -ELBO per digit (pixels only): {test_loss:.2f}; label accuracy from z: {acc:.2f}{note}"
    )
    return {"rel": rel, "test_loss": test_loss, "accuracy": acc}


if __name__ == "__main__":
    main()
