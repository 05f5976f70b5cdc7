"""Code run on every rank by the distributed tests, and the single-process references.

Module-level functions so that ``spawn``-ed processes can import them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pyro
import pyro.distributions as dist
import pyro.infer
import torch
import torch.distributed as tdist
from pyro.infer import SVI
from pyro.infer.autoguide import AutoDelta, AutoNormal

import pyro_gradroute.infer as gr_infer
from pyro_gradroute.distributed import (
    DistributedOptimizer,
    ParameterMismatchError,
    ShardedPlate,
    broadcast_param_store,
)
from pyro_gradroute.poutine import block_grad

N = 20  # global data size
BATCH = 3  # per-rank minibatch size
EPOCHS = 2

ELBOS = {
    "pyro.Trace_ELBO": pyro.infer.Trace_ELBO,
    "pyro.TraceGraph_ELBO": pyro.infer.TraceGraph_ELBO,
    "gradroute.Trace_ELBO": gr_infer.Trace_ELBO,
    "gradroute.TraceSTL_ELBO": gr_infer.TraceSTL_ELBO,
    "gradroute.TraceDReG_ELBO": lambda num_particles=3: gr_infer.TraceDReG_ELBO(
        num_particles=num_particles
    ),
}
# with a route: the likelihood "x" may not train the local points "AutoDelta.z"
DELTA_RUNS = [*ELBOS] + [
    f"gradroute.{name}+block_grad" for name in ("Trace_ELBO", "TraceSTL_ELBO", "TraceDReG_ELBO")
]
STOCHASTIC_RUNS = ["pyro.Trace_ELBO", "gradroute.TraceSTL_ELBO", "gradroute.TraceDReG_ELBO"]


def data() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return 1.5 + torch.randn(N, generator=g, dtype=torch.float64)


def model(x, idx):
    """Global mean, one local latent per data point; the plate has the GLOBAL size N."""
    mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
    with pyro.plate("data", N, subsample=idx):
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        pyro.sample("x", dist.Normal(z, 0.5), obs=x[idx])


def _plates(x, idx):
    return pyro.plate("data", N, subsample=idx)


def shard_batches(rank: int, world_size: int) -> list[torch.Tensor]:
    """This rank's minibatch indices, epoch after epoch."""
    shard = ShardedPlate("data", N, BATCH, num_replicas=world_size, rank=rank, seed=3)
    batches = []
    for epoch in range(EPOCHS):
        shard.set_epoch(epoch)
        batches.extend(shard)
    return batches


def union_batches(world_size: int) -> list[torch.Tensor]:
    """Step by step, the union of all ranks' minibatches (the one-process reference)."""
    per_rank = [shard_batches(r, world_size) for r in range(world_size)]
    return [torch.cat(step) for step in zip(*per_rank)]


def train_delta(elbo_name: str, batches, seed: int, distributed: bool, start=None) -> dict:
    """AutoDelta + Adam; params created by a loss evaluation, broadcast, then SVI steps.

    ``start``: values to set the params to after creating them (the single-process
    reference starts where the broadcast left the ranks).
    """
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    x = data()
    guide = AutoDelta(model, create_plates=_plates)
    optim = pyro.optim.Adam({"lr": 0.05})
    if distributed:
        optim = DistributedOptimizer(optim)
    elbo_name, _, route = elbo_name.partition("+")
    elbo = ELBOS[elbo_name]()
    elbo.loss(model, guide, x, batches[0])  # creates the parameters without a step
    routed = block_grad(model, sites=["x"], params=["AutoDelta.z"]) if route else model
    svi = SVI(routed, guide, optim, elbo)
    init = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    if start is not None:
        with torch.no_grad():
            for k, v in start.items():
                pyro.get_param_store()[k].unconstrained().copy_(v)
    if distributed:
        broadcast_param_store(src=0)
    for idx in batches:
        svi.step(x, idx)
    final = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    return {"init": init, "final": final}


def stochastic_grads(elbo_name: str, rank: int) -> dict:
    """Per-rank gradients of a stochastic estimator, and the step SGD(lr=1) takes after averaging."""
    pyro.clear_param_store()
    pyro.set_rng_seed(100 + rank)  # different noise on every rank
    x = data()
    idx = shard_batches(rank, 2)[0]
    guide = AutoNormal(model, create_plates=_plates)
    elbo = ELBOS[elbo_name](num_particles=2)
    elbo.loss(model, guide, x, idx)  # create params
    broadcast_param_store(src=0)
    with pyro.poutine.trace(param_only=True) as tr:
        elbo.loss_and_grads(model, guide, x, idx)
    params = [site["value"].unconstrained() for site in tr.trace.nodes.values()]
    name = pyro.get_param_store().param_name
    grads = {name(p): p.grad.clone() for p in params}
    before = {name(p): p.detach().clone() for p in params}
    DistributedOptimizer(pyro.optim.SGD({"lr": 1.0}))(params)
    step = {name(p): before[name(p)] - p.detach() for p in params}
    return {"grads": grads, "step": step}


def grad_none_and_buckets(rank: int) -> dict:
    """Gradients None on some/all ranks; tiny buckets; count of collectives per call.

    'c' is float32 among float64 params: a bucket of its own dtype.
    """
    pyro.clear_param_store()
    store = pyro.get_param_store()
    ps = {
        n: pyro.param(n, torch.zeros(3, dtype=torch.float32 if n == "c" else torch.float64))
        for n in "abcdefgh"
    }
    ps = {n: p.unconstrained() for n, p in ps.items()}
    loss = (float(rank + 1) * ps["a"]).sum() + sum(
        (i + 1.0) * ps[n].sum() for i, n in enumerate("cdefgh")
    )
    if rank == 1:
        loss = loss + (5.0 * ps["b"]).sum()  # 'b' has a gradient on rank 1 only
    calls = []
    real_all_reduce = tdist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(1)
        return real_all_reduce(*args, **kwargs)

    out = {}
    # default buckets, one bucket per parameter, default buckets without the param check
    for cap, check in ((25.0, True), (1e-6, True), (25.0, False)):
        for p in ps.values():
            p.grad = None
        loss.backward(retain_graph=True)
        grad_z = torch.zeros(3, dtype=torch.float64)
        z = pyro.param("z", grad_z).unconstrained()  # in the step, gradient None everywhere
        calls.clear()
        tdist.all_reduce = counting_all_reduce
        try:
            DistributedOptimizer(
                pyro.optim.SGD({"lr": 1.0}), bucket_cap_mb=cap, check_params=check
            )(list(ps.values()) + [z])
        finally:
            tdist.all_reduce = real_all_reduce
        out[cap, check] = {
            "params": {n: store[n].detach().clone() for n in list(ps) + ["z"]},
            "z_grad_is_none": z.grad is None,
            "all_reduce_calls": len(calls),
        }
        with torch.no_grad():  # reset values for the next round
            for p in [*ps.values(), z]:
                p.zero_()
    return out


def mismatch(rank: int) -> str:
    """Rank 1 has a parameter rank 0 lacks: every rank must raise ParameterMismatchError."""
    pyro.clear_param_store()
    a = pyro.param("a", torch.ones(2)).unconstrained()
    params = [a]
    if rank == 1:
        params.append(pyro.param("only_on_rank_1", torch.ones(2)).unconstrained())
    sum(p.sum() for p in params).backward()
    try:
        DistributedOptimizer(pyro.optim.SGD({"lr": 1.0}))(params)
    except ParameterMismatchError as e:
        return str(e)
    return "no error"


def run_example(filename: str, argv: list[str]):
    """``main(argv)`` of ``examples/<filename>``, inside this rank's process group."""
    path = Path(__file__).resolve().parents[2] / "examples" / filename
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def main_worker(rank: int, world_size: int, out_dir: str) -> None:
    """Everything the tests need, in one 2-process run (process start-up is the main cost).

    Saves the results of the equality/stochastic/None/mismatch scenarios to
    ``out_dir/results{rank}.pt``, then runs :func:`failing_scenario`: the run must fail.
    """
    torch.set_default_dtype(torch.float64)
    pyro.enable_validation(True)
    out = {"delta": {}, "stochastic": {}}
    batches = shard_batches(rank, world_size)
    for name in DELTA_RUNS:
        out["delta"][name] = train_delta(name, batches, seed=rank, distributed=True)
    for name in STOCHASTIC_RUNS:
        out["stochastic"][name] = stochastic_grads(name, rank)
    out["none"] = grad_none_and_buckets(rank)
    out["mismatch"] = mismatch(rank)
    out["subsampling_example"] = run_example("distributed_subsampling.py", ["--smoke"])
    torch.save(out, f"{out_dir}/results{rank}.pt")
    failing_scenario(rank, world_size)


def failing_scenario(rank: int, world_size: int) -> None:
    """Rank 1 raises at its third step; rank 0 must fail too (not hang) in the all_reduce."""
    pyro.clear_param_store()
    pyro.set_rng_seed(rank)
    x = data()
    batches = shard_batches(rank, world_size)
    guide = AutoDelta(model, create_plates=_plates)
    svi = SVI(
        model, guide, DistributedOptimizer(pyro.optim.Adam({"lr": 0.05})), gr_infer.Trace_ELBO()
    )
    svi.evaluate_loss(x, batches[0])
    broadcast_param_store(src=0)
    for step, idx in enumerate(batches):
        if rank == 1 and step == 2:
            raise ValueError("rank 1 fails on purpose at step 2")
        svi.step(x, idx)
