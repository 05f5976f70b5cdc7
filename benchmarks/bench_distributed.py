"""Step time of the two data-parallel paths on the same model, ranks and batches.

* ``DistributedOptimizer``: ``SVI`` with ``pyro.optim.Adam`` and the param store; after the
  backward, the gradients are averaged in 25 MB buckets (one ``all_reduce`` each) plus one
  small parameter-check collective (``check_params=True``, the default; also timed without);
* DDP: ``DistributedDataParallel(elbo(model, guide))`` with ``torch.optim.Adam``, whose
  reducer starts each bucket's ``all_reduce`` during the backward;
* the DDP loop without DDP: the same ``ELBOModule`` and ``torch.optim.Adam``, with
  :func:`~pyro_gradroute.distributed.average_gradients` (this package's buckets, after the
  backward) before the step, with and without the parameter check. Against DDP this is the
  reduction alone; against ``SVI + DistributedOptimizer`` it is ``SVI``'s and ``pyro.optim``'s
  own per-step cost.

Both run the digits VAE (``TraceSTL_ELBO``, global batch ``--batch-size`` split over the
ranks), one step of each per round, interleaved; the median wall time per step is reported
(wall, not thread time: the collectives wait on the other ranks).

Run: ``torchrun --nproc_per_node=2 benchmarks/bench_distributed.py [--hidden 512]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import pyro
import torch
import torch.distributed as dist
from pyro import poutine
from pyro.infer import SVI
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pyro_gradroute.app.models.digits_vae import VAE, load_binarized_digits
from pyro_gradroute.distributed import (
    DistributedOptimizer,
    ShardedPlate,
    average_gradients,
    broadcast_param_store,
    init_distributed,
)
from pyro_gradroute.infer import TraceSTL_ELBO


class _Part(nn.Module):
    """The VAE's model or guide as a module of ``(data, idx)``, scaled by the global size."""

    def __init__(self, vae: VAE, which: str, n: int):
        super().__init__()
        self.vae, self.which, self.n = vae, which, n

    def forward(self, data, idx):
        with poutine.scale(scale=self.n / len(idx)):
            getattr(self.vae, self.which)(data[idx])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch")
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args(argv)

    init_distributed(timeout_s=120, backend="gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    train = load_binarized_digits()[0]
    n = len(train)
    shard = ShardedPlate("data", n, args.batch_size // world, seed=0)
    batches = [b for e in range(50) for b in (shard.set_epoch(e), list(shard))[1]]
    batches = [b for b in batches if len(b) == args.batch_size // world]

    pyro.clear_param_store()
    pyro.set_rng_seed(rank)
    svis = {}
    for check in (True, False):
        vae = VAE(hidden=args.hidden)
        optim = DistributedOptimizer(pyro.optim.Adam({"lr": 1e-3}), check_params=check)
        model, guide = _Part(vae, "model", n), _Part(vae, "guide", n)
        svis[check] = SVI(model, guide, optim, TraceSTL_ELBO())
        svis[check].evaluate_loss(train, batches[0])
        broadcast_param_store(src=0)
        pyro.get_param_store().clear()  # the next VAE reuses the names (see below)

    vae = VAE(hidden=args.hidden)
    pyro.get_param_store().clear()
    module = TraceSTL_ELBO()(_Part(vae, "model", n), _Part(vae, "guide", n))
    module(train, batches[0])
    ddp = DistributedDataParallel(module)
    torch_optim = torch.optim.Adam(module.parameters(), lr=1e-3)

    vae = VAE(hidden=args.hidden)
    pyro.get_param_store().clear()
    plain = TraceSTL_ELBO()(_Part(vae, "model", n), _Part(vae, "guide", n))
    plain(train, batches[0])
    with torch.no_grad():  # rank 0's start, as DDP's broadcast gives the other module
        for p in plain.parameters():
            dist.broadcast(p, src=0)
    plain_optim = torch.optim.Adam(plain.parameters(), lr=1e-3)

    # Each VAE registers its networks as "decoder" / "encoder" (pyro.module): the store is
    # cleared before every step of every candidate, so each step registers its own.
    def ddp_step(idx):
        pyro.get_param_store().clear()
        torch_optim.zero_grad()
        ddp(train, idx).backward()
        torch_optim.step()

    def plain_step(check):
        def step(idx):
            pyro.get_param_store().clear()
            plain_optim.zero_grad()
            plain(train, idx).backward()  # registers the modules' params in the store again
            average_gradients(list(plain.parameters()), check_params=check)
            plain_optim.step()

        return step

    def svi_step(check):
        def step(idx):
            pyro.get_param_store().clear()
            svis[check].step(train, idx)

        return step

    fns = {
        "DDP(ELBOModule) + torch.optim.Adam": ddp_step,
        "SVI + DistributedOptimizer": svi_step(True),
        "same, check_params=False": svi_step(False),
        "ELBOModule + average_gradients + Adam": plain_step(True),
        "same, average_gradients(check_params=False)": plain_step(False),
    }
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(args.rounds + 5):
        idx = batches[i % len(batches)]
        for k, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn(idx)
            if i >= 5:
                times[k].append(time.perf_counter() - t0)
    med = torch.tensor([statistics.median(v) for v in times.values()], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    if rank == 0:
        n_params = sum(p.numel() for p in module.parameters())
        print(
            f"digits VAE hidden={args.hidden} ({n_params} params), TraceSTL_ELBO, "
            f"{world} ranks (gloo, 1 thread each), global batch {args.batch_size}, "
            f"{args.rounds} interleaved rounds, {os.cpu_count()} CPUs, load "
            f"{os.getloadavg()[0]:.1f}"
        )
        base = med[0].item()
        for (k, _), t in zip(fns.items(), med.tolist()):
            print(f"  {k:44s} {1e3 * t:7.2f} ms/step  ({t / base:.2f}x DDP)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
