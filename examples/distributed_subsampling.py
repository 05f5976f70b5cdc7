"""Sharded subsampling done right: the plate carries the GLOBAL data size.

A conjugate model, :math:`\\mu \\sim N(0, 10^2)`, :math:`x_i \\mid \\mu \\sim N(\\mu, 1)`,
:math:`i = 1..N`, has the exact posterior :math:`N(m, s^2)` with
:math:`s^2 = 1 / (N + 10^{-2})`, :math:`m = s^2 \\sum_i x_i`. Each rank trains an
``AutoNormal`` guide on its own minibatches (``ShardedPlate``: a ``DistributedSampler``
shard) with gradients averaged by ``DistributedOptimizer``:

* ``pyro.plate("data", N, subsample=idx)`` (``shard.plate(idx)``) scales the likelihood
  by :math:`N / b`, and the fitted posterior matches the exact one;
* ``pyro.plate("data", b)`` (the shard's size, a common mistake) weighs the likelihood
  as if there were only :math:`b` data points: the posterior is far too wide.

Run: ``torchrun --nproc_per_node=2 examples/distributed_subsampling.py`` or
``python examples/distributed_subsampling.py`` (``--smoke`` for the test suite).
"""

from __future__ import annotations

import argparse

import pyro
import pyro.distributions as dist
import torch
import torch.distributed as tdist
from pyro.infer import SVI
from pyro.infer.autoguide import AutoNormal

from pyro_gradroute.distributed import (
    DistributedOptimizer,
    ShardedPlate,
    broadcast_param_store,
    init_distributed,
)
from pyro_gradroute.infer import TraceSTL_ELBO


def fit(data: torch.Tensor, shard: ShardedPlate, global_size: bool, epochs: int) -> tuple:
    """Posterior mean and sd of mu from AutoNormal, on every rank's shards."""

    def model(idx):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        plate = shard.plate(idx) if global_size else pyro.plate("data", len(idx))
        with plate:
            pyro.sample("x", dist.Normal(mu, 1.0), obs=data[idx])

    pyro.clear_param_store()
    guide = AutoNormal(model)
    lrd = 0.02 ** (1 / (epochs * len(shard)))  # learning rate decays 50x over the run
    optim = DistributedOptimizer(pyro.optim.ClippedAdam({"lr": 0.05, "lrd": lrd}))
    svi = SVI(model, guide, optim, TraceSTL_ELBO())
    svi.evaluate_loss(next(iter(shard)))  # create the params
    broadcast_param_store(src=0)
    for epoch in range(epochs):
        shard.set_epoch(epoch)
        for idx in shard:
            svi.step(idx)
    return guide.locs.mu.item(), guide.scales.mu.item()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="global data size N")
    parser.add_argument("--batch-size", type=int, default=50, help="per-rank batch b")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--smoke", action="store_true", help="a few steps, for the tests")
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs = 2

    own_group = not tdist.is_initialized()  # (the tests call main() inside their group)
    if own_group:
        init_distributed(timeout_s=60, backend="gloo")  # torchrun's group, or one process
    rank, world = tdist.get_rank(), tdist.get_world_size()
    pyro.set_rng_seed(rank)  # independent noise on every rank
    data = 3.0 + torch.randn(args.n, generator=torch.Generator().manual_seed(0))
    exact_var = 1.0 / (args.n + 1e-2)
    exact = (exact_var * data.sum().item(), exact_var**0.5)
    shard = ShardedPlate("data", args.n, args.batch_size)
    out = {"exact": exact}
    for name, global_size in (("plate(N, subsample=idx)", True), ("plate(b)", False)):
        out[name] = fit(data, shard, global_size, args.epochs)
    if rank == 0:
        print(f"{world} rank(s), N={args.n}, b={args.batch_size} per rank, {args.epochs} epochs")
        print(f"  {'exact posterior':26s} mean {exact[0]:.4f}  sd {exact[1]:.4f}")
        for name in ("plate(N, subsample=idx)", "plate(b)"):
            m, s = out[name]
            note = "  (smoke run: not converged)" if args.smoke else ""
            print(f"  {name:26s} mean {m:.4f}  sd {s:.4f}  (sd / exact {s / exact[1]:.2f}){note}")
    if own_group:
        tdist.barrier()  # all ranks done before any tears the group down
        tdist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
