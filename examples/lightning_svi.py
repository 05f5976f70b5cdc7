"""Data-parallel SVI with PyTorch Lightning: a ``LightningModule`` over an ``ELBOModule``.

Pyro's own distributed recipe (its ``examples/svi_lightning.py``), run on this package's
estimators. ``TraceSTL_ELBO()(model, guide)`` is a ``torch.nn.Module`` whose forward is
the differentiable loss; Lightning's ``strategy="ddp"`` wraps it in
``DistributedDataParallel``, which averages the ranks' gradients during the backward, and
gives every rank its shard through a ``DistributedSampler``.

The model is conjugate, :math:`\\mu \\sim N(0, 10^2)`, :math:`x_i \\mid \\mu \\sim N(\\mu, 1)`,
:math:`i = 1..N`, with exact posterior :math:`N(m, s^2)`, :math:`s^2 = 1/(N + 10^{-2})`,
:math:`m = s^2 \\sum_i x_i`. The plate has the global size ``N`` and each step's indices
(``subsample=idx``): the likelihood is scaled by ``N / b``, and the average over ranks is
the gradient of the union of their batches.

Run (one machine, 2 processes; Lightning starts the second one itself)::

    python examples/lightning_svi.py --devices 2
    torchrun --nproc_per_node=2 examples/lightning_svi.py --devices 2   # or under torchrun

Multi-node: ``--num-nodes 2`` on every machine, under ``torchrun --nnodes=2 ...`` or a
cluster launcher (SLURM). GPUs: ``--accelerator gpu`` (nccl). ``--smoke``: a few steps.
Needs ``pip install -c constraints.txt -e ".[distributed]"`` (``pytorch-lightning``).
"""

from __future__ import annotations

import argparse
import time

import pyro
import pyro.distributions as dist
import torch

from pyro_gradroute.infer import (
    Trace_ELBO,
    TraceAdaptiveSTL_ELBO,
    TraceDReG_ELBO,
    TraceSTL_ELBO,
)

ESTIMATORS = {
    "trace": Trace_ELBO,
    "stl": TraceSTL_ELBO,
    "adaptive": TraceAdaptiveSTL_ELBO,
    "dreg": lambda: TraceDReG_ELBO(num_particles=8, max_plate_nesting=1),
}


class Model(pyro.nn.PyroModule):
    def __init__(self, data: torch.Tensor):
        super().__init__()
        self.data = data

    def forward(self, idx: torch.Tensor):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        with pyro.plate("data", len(self.data), subsample=idx):  # GLOBAL size N
            pyro.sample("x", dist.Normal(mu, 1.0), obs=self.data[idx])


def make_module(loss_fn, lr: float):
    import pytorch_lightning as pl

    class SVIModule(pl.LightningModule):
        """Pyro's pattern: the ELBOModule is the loss; a torch optimizer on its parameters."""

        def __init__(self):
            super().__init__()
            self.loss_fn = loss_fn

        def training_step(self, batch, batch_idx):
            (idx,) = batch
            loss = self.loss_fn(idx)
            self.log("train_loss", loss, prog_bar=False)
            return loss

        def configure_optimizers(self):
            optim = torch.optim.Adam(self.loss_fn.parameters(), lr=lr)
            # the learning rate decays 50x over the run (minibatch noise of the mean)
            gamma = 0.02 ** (1 / max(1, self.trainer.estimated_stepping_batches))
            sched = torch.optim.lr_scheduler.ExponentialLR(optim, gamma)
            return {"optimizer": optim, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return SVIModule()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--estimator", choices=sorted(ESTIMATORS), default="stl")
    parser.add_argument("--n", type=int, default=1000, help="global data size N")
    parser.add_argument("--batch-size", type=int, default=50, help="per-rank batch b")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="a few steps, for the tests")
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs = 1

    import pytorch_lightning as pl
    from pyro.infer.autoguide import AutoNormal

    pl.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    data = 3.0 + torch.randn(args.n, generator=torch.Generator().manual_seed(0))
    model = Model(data)
    guide = AutoNormal(model)
    loss_fn = ESTIMATORS[args.estimator]()(model, guide)
    loss_fn(torch.arange(args.batch_size))  # creates the guide's parameters
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(args.n)),
        batch_size=args.batch_size,
        shuffle=True,  # under ddp Lightning swaps in a DistributedSampler (shuffled, seeded)
        drop_last=True,
    )
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy="ddp" if args.devices * args.num_nodes > 1 else "auto",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(make_module(loss_fn, args.lr), train_dataloaders=loader)
    elapsed = time.perf_counter() - start
    exact_var = 1.0 / (args.n + 1e-2)
    exact = (exact_var * data.sum().item(), exact_var**0.5)
    mean, sd = guide.locs.mu.item(), guide.scales.mu.item()
    # every rank holds the same guide: compare with rank 0's
    same = torch.tensor([mean, sd], dtype=torch.float64)
    if torch.distributed.is_initialized():
        ref = same.clone()
        torch.distributed.broadcast(ref, src=0)
        identical = bool(torch.equal(ref, same))
    else:
        identical = True
    out = {"exact": exact, "fit": (mean, sd), "identical": identical, "seconds": elapsed}
    if trainer.is_global_zero:
        note = "  (smoke run: not converged)" if args.smoke else ""
        world = trainer.world_size
        steps = trainer.global_step
        print(
            f"{world} rank(s), {args.estimator}, N={args.n}, b={args.batch_size} per rank, "
            f"{steps} steps"
        )
        print(f"  exact posterior  mean {exact[0]:.4f}  sd {exact[1]:.4f}")
        print(f"  AutoNormal fit   mean {mean:.4f}  sd {sd:.4f}{note}")
        print(f"  params identical across ranks: {identical}")
    if torch.distributed.is_initialized():
        # Lightning leaves the gloo group open; its threads must stop before the interpreter
        # exits, or the C++ runtime aborts the process ("terminate called ...")
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
