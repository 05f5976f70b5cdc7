"""Data-parallel SVI on 2 gloo processes spawned here (127.0.0.1 only): pyro_gradroute.distributed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pyro
import pytest
import torch

from pyro_gradroute.distributed import (
    DistributedOptimizer,
    ShardedPlate,
    average_gradients,
    init_distributed,
)

from . import workers
from .launch import RanksFailed, run_ranks


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """One 2-process run of :func:`workers.main_worker`; it ends by a rank raising on purpose."""
    out_dir = tmp_path_factory.mktemp("ranks")
    start = time.monotonic()
    try:
        run_ranks(workers.main_worker, str(out_dir), out_dir=out_dir, pg_timeout_s=20, grace_s=30)
    except RanksFailed as e:
        failure = e
    else:
        failure = None
    elapsed = time.monotonic() - start
    results = [torch.load(out_dir / f"results{r}.pt", weights_only=False) for r in range(2)]
    return {"results": results, "failure": failure, "elapsed": elapsed}


@pytest.fixture(scope="module")
def two_ranks(two_rank_run):
    """The scenario results of the 2-process run, by rank."""
    return two_rank_run["results"]


@pytest.mark.slow
@pytest.mark.parametrize("elbo_name", workers.DELTA_RUNS)
def test_deterministic_guide_two_ranks_equal_one_process_on_union(two_ranks, elbo_name):
    torch.set_default_dtype(torch.float64)
    rank0, rank1 = (r["delta"][elbo_name] for r in two_ranks)
    # the ranks start from different initializations (seeds 0 and 1): broadcast must matter
    assert not torch.allclose(rank0["init"]["AutoDelta.z"], rank1["init"]["AutoDelta.z"])
    # reference: one process from rank 0's initial values (what the broadcast sets), each step
    # on the union of the 2 shards with the plate of global size N (likelihood scale
    # N / (2b) = the mean of the ranks' N / b)
    ref = workers.train_delta(
        elbo_name, workers.union_batches(2), seed=0, distributed=False, start=rank0["init"]
    )
    assert rank0["init"].keys() == ref["final"].keys()
    for name, value in ref["final"].items():
        assert not torch.allclose(value, rank0["init"][name])  # it trained
        torch.testing.assert_close(rank0["final"][name], value, atol=1e-6, rtol=0)
        torch.testing.assert_close(rank1["final"][name], value, atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "elbo_name", ["gradroute.Trace_ELBO", "gradroute.TraceSTL_ELBO", "gradroute.TraceDReG_ELBO"]
)
def test_block_grad_route_changes_the_distributed_fit(two_ranks, elbo_name):
    """Guard: the routed runs compared above really differ from the unrouted ones."""
    plain = two_ranks[0]["delta"][elbo_name]["final"]["AutoDelta.z"]
    routed = two_ranks[0]["delta"][elbo_name + "+block_grad"]["final"]["AutoDelta.z"]
    assert not torch.allclose(plain, routed, atol=1e-3)


@pytest.mark.slow
def test_union_reference_is_not_the_sum_of_gradients(two_ranks):
    """Guard of the test above: summing instead of averaging rank gradients would differ."""
    torch.set_default_dtype(torch.float64)
    start = two_ranks[0]["delta"]["pyro.Trace_ELBO"]["init"]
    ref = workers.train_delta("pyro.Trace_ELBO", workers.union_batches(2), 0, False, start)
    shard = workers.train_delta("pyro.Trace_ELBO", workers.shard_batches(0, 2), 0, False, start)
    assert not torch.allclose(ref["final"]["AutoDelta.mu"], shard["final"]["AutoDelta.mu"])


@pytest.mark.slow
@pytest.mark.parametrize("elbo_name", workers.STOCHASTIC_RUNS)
def test_stochastic_estimator_averaged_gradient_is_mean_of_rank_gradients(two_ranks, elbo_name):
    results = [r["stochastic"][elbo_name] for r in two_ranks]
    grads = [r["grads"] for r in results]
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 4  # AutoNormal locs, scales
    for name in grads[0]:
        assert not torch.allclose(grads[0][name], grads[1][name])  # different noise per rank
        mean = (grads[0][name] + grads[1][name]) / 2
        for r in results:  # SGD(lr=1) step = the averaged gradient, identical on both ranks
            torch.testing.assert_close(r["step"][name], mean, atol=1e-10, rtol=0)


@pytest.mark.slow
def test_grad_none_counts_as_zero_and_collectives_are_bucketed(two_ranks):
    for rank_result in two_ranks:
        runs = rank_result["none"]
        default, tiny, unchecked = runs[25.0, True], runs[1e-6, True], runs[25.0, False]
        for res in (default, tiny, unchecked):
            params = res["params"]
            torch.testing.assert_close(params["a"], torch.full((3,), -1.5, dtype=torch.float64))
            # 'b' had a gradient (5) on rank 1 only: rank 0 contributes zero
            torch.testing.assert_close(params["b"], torch.full((3,), -2.5, dtype=torch.float64))
            for i, n in enumerate("cdefgh"):
                dtype = torch.float32 if n == "c" else torch.float64
                torch.testing.assert_close(params[n], torch.full((3,), -(i + 1.0), dtype=dtype))
            # no gradient on any rank: stays None, the optimizer skips it
            assert res["z_grad_is_none"]
            torch.testing.assert_close(params["z"], torch.zeros(3, dtype=torch.float64))
        # 8 float64 params in one bucket, 1 float32 in another: 1 param check + 2 all_reduce;
        # tiny buckets: 1 + 9; without the check: 2
        assert default["all_reduce_calls"] == 3
        assert tiny["all_reduce_calls"] == 10
        assert unchecked["all_reduce_calls"] == 2


@pytest.mark.slow
def test_params_on_some_ranks_only_is_a_clear_error_on_every_rank(two_ranks):
    for rank_result in two_ranks:
        msg = rank_result["mismatch"]
        assert "ranks do not hold the same parameters" in msg
        assert "rank 0 lacks [('only_on_rank_1', (2,), 'torch.float64')]" in msg
        assert "rank 1 lacks" not in msg


@pytest.mark.slow
def test_a_rank_that_raises_fails_the_run_without_hanging(two_rank_run):
    failure, elapsed = two_rank_run["failure"], two_rank_run["elapsed"]
    assert failure is not None, "the run should have failed"
    errors = failure.errors
    assert "ValueError: rank 1 fails on purpose at step 2" in errors[1]
    # rank 0, waiting in the gradient all_reduce, raised by itself (not killed as hung)
    assert "DistributedOptimizer (gradient all_reduce) failed on rank 0" in errors[0]
    # well below the 20 s process-group timeout plus the 30 s grace after rank 1 failed
    assert elapsed < 45, f"took {elapsed:.1f} s"


def test_without_process_group_the_error_says_what_to_do():
    p = pyro.param("w", torch.ones(2)).unconstrained()
    p.sum().backward()
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedOptimizer(pyro.optim.Adam({"lr": 0.1}))([p])
    with pytest.raises(RuntimeError, match="init_process_group"):
        average_gradients([p])
    with pytest.raises(TypeError, match="pyro.optim"):
        DistributedOptimizer(torch.optim.SGD([p], lr=0.1))


def test_sharded_plate_deals_equal_batches_covering_the_data():
    shards = [ShardedPlate("data", 11, 4, num_replicas=2, rank=r, seed=5) for r in range(2)]
    for epoch in range(2):
        for s in shards:
            s.set_epoch(epoch)
        batches = [list(s) for s in shards]
        assert [len(b) for b in batches[0]] == [len(b) for b in batches[1]] == [4, 2]
        assert len(shards[0]) == 2
        seen = torch.cat([torch.cat(b) for b in batches])
        assert set(seen.tolist()) == set(range(11)) and len(seen) == 12  # one index padded
    trace = pyro.poutine.trace(lambda: pyro.sample("x", pyro.distributions.Normal(0, 1))).get_trace
    with shards[1].plate(batches[1][1]):
        assert trace().nodes["x"]["scale"] == 11 / 2


@pytest.mark.slow
def test_subsampling_example_runs_on_two_ranks_with_identical_fits(two_ranks):
    rank0, rank1 = (r["subsampling_example"] for r in two_ranks)
    assert set(rank0) == {"exact", "plate(N, subsample=idx)", "plate(b)"}
    assert rank0 == rank1  # the guide's params are identical on both ranks
    assert rank0["plate(N, subsample=idx)"] != rank0["plate(b)"]


def test_init_distributed_alone_and_scheduler_passthrough(monkeypatch):
    """Without torchrun: a world of one; the wrapper passes a scheduler's step() through."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    device = init_distributed(timeout_s=30, backend="gloo")
    try:
        assert torch.distributed.get_world_size() == 1 and device == torch.device("cpu")
        p = pyro.param("w", torch.ones(2)).unconstrained()
        sched = pyro.optim.ExponentialLR(
            {"optimizer": torch.optim.SGD, "optim_args": {"lr": 0.1}, "gamma": 0.5}
        )
        optim = DistributedOptimizer(sched)
        p.sum().backward()
        optim([p])
        torch.testing.assert_close(p.detach(), torch.full((2,), 0.9))
        optim.step()  # the scheduler's
        assert [o.get_last_lr() for o in optim.optim_objs.values()] == [[0.05]]
        assert list(optim.get_state()) == ["w"]
    finally:
        torch.distributed.destroy_process_group()


_GROUP_RELEASED = """
import gc, os, torch, torch.distributed as dist
from pyro_gradroute.distributed import init_distributed
init_distributed(timeout_s=30, backend="gloo")
x = torch.ones(2, requires_grad=True)
opt = torch.optim.Adam([x])
x.sum().backward()
opt.step()  # torch.optim's first step imports torch._dynamo
dist.destroy_process_group()
gc.collect()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(sorted(n for n in names if n.startswith(("pt_gloo", "gloo"))))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
def test_destroy_process_group_releases_the_group_after_an_optimizer_step():
    """After ``init_distributed``, an optimizer step and ``destroy_process_group``, no gloo
    thread is left for interpreter exit to tear down (which can abort a finished run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-c", _GROUP_RELEASED], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout
