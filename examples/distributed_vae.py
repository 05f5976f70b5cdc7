"""Data-parallel SVI for the digits VAE on torch.distributed: per-step time and communication share.

Run on 2 processes (CPU, gloo)::

    torchrun --nproc_per_node=2 examples/distributed_vae.py [--smoke]

or on one process without torchrun: ``python examples/distributed_vae.py [--smoke]``.

With R processes, rank 0 first times the *1-process* baseline alone (global batch B,
``--threads`` threads like each rank) while the other ranks wait; then all
R ranks train the same VAE data-parallel: each takes its own B/R images per step
(``ShardedPlate``: a ``DistributedSampler`` shard; the likelihood is scaled by the global
data size N, so the averaged gradient is the gradient of the union), gradients are
averaged by ``DistributedOptimizer`` (bucketed ``all_reduce``), and the params were made
identical once by ``broadcast_param_store``. It prints the per-step time of both, the
speed-up, and the communication share (seconds in the gradient all_reduce / step time;
this includes waiting for the slowest rank, so it also prints the time of the same
all_reduce alone, back to back after a barrier).
``--hidden 512`` makes the networks ~60x larger, to see the cost of bandwidth rather
than of latency.
"""

from __future__ import annotations

import argparse
import os
import time

import pyro
import torch
import torch.distributed as dist
from pyro import poutine
from pyro.infer import SVI

from pyro_gradroute.app.models.digits_vae import VAE, load_binarized_digits
from pyro_gradroute.distributed import (
    DistributedOptimizer,
    ShardedPlate,
    average_gradients,
    broadcast_param_store,
    init_distributed,
)
from pyro_gradroute.infer import Trace_ELBO, TraceSTL_ELBO


def make_svi(vae: VAE, n_data: int, elbo, optim) -> SVI:
    """SVI whose model and guide take ``(data, idx)`` and scale by the global size ``n_data``."""

    # All of the VAE's sites lie in its "data" plate, so scaling by N / len(idx) is exactly
    # pyro.plate("data", N, subsample=idx); for your own model use ShardedPlate.plate(idx).
    def model(data, idx):
        with poutine.scale(scale=n_data / len(idx)):
            vae.model(data[idx])

    def guide(data, idx):
        with poutine.scale(scale=n_data / len(idx)):
            vae.guide(data[idx])

    return SVI(model, guide, optim, elbo)


def time_steps(svi: SVI, data, batches, optim=None) -> tuple[float, float, float]:
    """(seconds per step, communication seconds per step, mean loss per image)."""
    comm0 = optim.comm_seconds if optim is not None else 0.0
    losses = 0.0
    t0 = time.perf_counter()
    for idx in batches:
        losses += svi.step(data, idx) / len(data)
    steps = len(batches)
    seconds = (time.perf_counter() - t0) / steps
    comm = ((optim.comm_seconds - comm0) / steps) if optim is not None else 0.0
    return seconds, comm, losses / steps


def optim_average(params, optim: DistributedOptimizer) -> float:
    """Seconds of one bucketed gradient average (what DistributedOptimizer does per step)."""
    return average_gradients(
        params, bucket_cap_mb=optim.bucket_cap_mb, check_params=optim.check_params
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per phase")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch B")
    parser.add_argument("--hidden", type=int, default=64, help="width of the MLPs")
    parser.add_argument("--elbo", choices=["trace", "stl"], default="stl")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument(
        "--no-param-check", action="store_true", help="skip the per-step parameter check"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="process group timeout (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a few small steps, for the tests")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.batch_size = 3, 32

    device = init_distributed(args.timeout)  # torchrun's group, or one process
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by {world} processes")
    train = load_binarized_digits()[0].to(device)
    n = len(train)
    elbo_cls = TraceSTL_ELBO if args.elbo == "stl" else Trace_ELBO
    warmup = 1 if args.smoke else 5

    def batches(local_batch, num_replicas, rank_, count):
        shard = ShardedPlate(
            "data", n, local_batch, num_replicas=num_replicas, rank=rank_, seed=args.seed
        )
        out, epoch = [], 0
        while len(out) < count:
            shard.set_epoch(epoch)
            out.extend(b for b in shard if len(b) == local_batch)  # full batches only, for timing
            epoch += 1
        return out[:count]

    # Phase 1: the 1-process baseline, on rank 0 only (the others wait at the barrier).
    base = None
    if rank == 0:
        torch.set_num_threads(args.threads)
        pyro.clear_param_store()
        pyro.set_rng_seed(args.seed)
        svi = make_svi(
            VAE(hidden=args.hidden).to(device), n, elbo_cls(), pyro.optim.Adam({"lr": 1e-3})
        )
        idx = batches(args.batch_size, 1, 0, warmup + args.steps)
        time_steps(svi, train, idx[:warmup])
        base = time_steps(svi, train, idx[warmup:])
    dist.barrier()

    # Phase 2: data-parallel on all ranks, B / R images each.
    torch.set_num_threads(args.threads)
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed + rank)  # independent noise per rank
    vae = VAE(hidden=args.hidden).to(
        device
    )  # different init per rank: the broadcast below fixes that
    optim = DistributedOptimizer(
        pyro.optim.Adam({"lr": 1e-3}),
        bucket_cap_mb=args.bucket_mb,
        check_params=not args.no_param_check,
    )
    svi = make_svi(vae, n, elbo_cls(), optim)
    idx = batches(args.batch_size // world, world, rank, warmup + args.steps)
    svi.evaluate_loss(train, idx[0])  # creates all params (encoder and decoder), no step
    broadcast_param_store(src=0)
    time_steps(svi, train, idx[:warmup], optim)
    step_s, comm_s, loss = time_steps(svi, train, idx[warmup:], optim)

    # The same bucketed all_reduce alone (ranks in step after a barrier): the pure cost.
    params = [p.unconstrained() for _, p in sorted(pyro.get_param_store().items())]
    for p in params:
        p.grad = torch.zeros_like(p)
    dist.barrier()
    pure = sum(optim_average(params, optim) for _ in range(args.steps)) / args.steps

    # The ranks' parameters must still be identical.
    flat = torch.cat([p.detach().reshape(-1) for _, p in sorted(pyro.get_param_store().items())])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    diff = torch.tensor([(flat - ref).abs().max().item(), step_s, comm_s, pure], device=device)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    if rank == 0:
        # a smoke run's few steps: its losses are of an untrained VAE, its times noise
        note = "  (smoke run: not converged)" if args.smoke else ""
        n_params = flat.numel()
        print(
            f"digits VAE, hidden={args.hidden} ({n_params} params, {4 * n_params / 2**20:.2f} MB), "
            f"{elbo_cls.__name__}, global batch {args.batch_size}, {args.steps} timed steps, "
            f"backend {dist.get_backend()}, device {device}, {os.cpu_count()} CPUs"
        )
        b_step, _, b_loss = base
        print(
            f"1 process  ({args.threads} thread{'s' if args.threads > 1 else ''}): {1e3 * b_step:7.2f} ms/step  "
            f"(batch {args.batch_size}; loss/image {b_loss:.2f}){note}"
        )
        print(
            f"{world} process{'es' if world > 1 else ''} ({args.threads} thread{'s' if args.threads > 1 else ''} each): "
            f"{1e3 * step_s:7.2f} ms/step on rank 0, {1e3 * diff[1].item():.2f} slowest rank "
            f"(batch {args.batch_size // world} per rank; loss/image {loss:.2f}){note}"
        )
        if args.smoke:  # 3 steps of 32 images: start-up and noise, not a speed-up
            print(
                f"speed-up and communication share not measured: a smoke run's {args.steps} "
                f"steps of batch {args.batch_size} are too small to time (run without --smoke)"
                f"{note}"
            )
        else:
            print(
                f"speed-up {b_step / diff[1].item():.2f}x; communication share "
                f"{100 * comm_s / step_s:.1f}% on rank 0 ({1e3 * comm_s:.2f} ms all_reduce per "
                f"step), max over ranks {100 * diff[2].item() / diff[1].item():.1f}%"
                + (
                    "  (one process: nothing to compare; run under torchrun --nproc_per_node=2)"
                    if world == 1
                    else ""
                )
            )
        print(
            f"all_reduce alone (after a barrier): {1e3 * diff[3].item():.2f} ms per step "
            f"= {100 * diff[3].item() / diff[1].item():.1f}% of the step"
        )
        print(
            f"params identical across ranks: {diff[0].item() == 0.0} (max |diff| {diff[0].item():.1e})"
        )
    dist.barrier()  # all ranks done before any tears the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
