"""``DistributedDataParallel`` over ``ELBOModule`` on 2 gloo processes, for every estimator.

The same engine as Lightning's ``strategy="ddp"``; each rank runs ``ddp(x, idx).backward()``
and ``torch.optim.Adam`` on its own shard. References, in this process, without DDP:

* deterministic guide (``AutoDelta``): one process on the union of the shards;
* stochastic guide (``AutoNormal``): each rank's gradient on its shard with its own random
  stream (replayed here), averaged by hand: the same draws as the ranks;
* adaptive estimators: one process from their endpoints (each step's gradient is the ranks'
  mean of ``g_path + b g_cv``, ``g_path`` the base estimator's and ``g_path + g_cv`` Pyro's
  ``Trace_ELBO`` / ``RenyiELBO`` gradient on the same draws; the moments are the hand-summed
  moments of the ranks' mean parts); their other distributed path, ``SVI`` +
  ``DistributedOptimizer`` (``loss_and_grads``), on the same ranks and draws; and their
  moments agree across ranks.
"""

from __future__ import annotations

import pytest
import torch

from . import ddp_workers as w
from .launch import run_ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ddp_ranks")
    return run_ranks(w.main_worker, out_dir=out_dir, timeout_s=120, pg_timeout_s=30)


def _assert_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("run", w.RUNS)
def test_ddp_deterministic_guide_equals_one_process_on_the_union(ranks, run):
    torch.set_default_dtype(torch.float64)
    r0, r1 = (r["delta"][run] for r in ranks)
    # the ranks start from different values: DDP's broadcast of rank 0's must matter
    assert not torch.allclose(
        r0["init"]["guide.z_unconstrained"], r1["init"]["guide.z_unconstrained"]
    )
    ref = w.union_reference(run, r0["init"], 2)
    for k in ref:
        assert not torch.allclose(ref[k], r0["init"][k])  # it trained
    _assert_close(r0["final"], ref)
    _assert_close(r1["final"], ref)


@pytest.mark.slow
@pytest.mark.parametrize("run", w.RUNS)
def test_ddp_stochastic_guide_equals_the_average_of_the_ranks_gradients(ranks, run):
    torch.set_default_dtype(torch.float64)
    r0, r1 = (r["normal"][run] for r in ranks)
    _assert_close(r0["final"], r1["final"])
    if run.partition("+")[0] in w.ADAPTIVE:
        return  # its moments average over real ranks: see the SVI comparison below
    ref = w.simulated_ranks_reference(run, r0["init"], 2)
    _assert_close(r0["final"], ref)


@pytest.mark.slow
@pytest.mark.parametrize("run", [r for r in w.RUNS if r.partition("+")[0] in w.ADAPTIVE])
def test_ddp_adaptive_equals_svi_with_distributed_optimizer_and_state_agrees(ranks, run):
    torch.set_default_dtype(torch.float64)
    ddp = [r["normal"][run] for r in ranks]
    svi = [r["svi"][run] for r in ranks]
    for d, s in zip(ddp, svi):
        # one joint state per set of parameters, keyed by their names joined with \x1f
        assert {n for k in d["state"] for n in k.split("\x1f")} == {
            "AutoNormal.locs.mu",
            "AutoNormal.locs.z",
            "AutoNormal.scales.mu",
            "AutoNormal.scales.z",
        }
        assert all(st["n"] == w.STEPS for st in d["state"].values())
        final = {k.replace("guide.", ""): v for k, v in d["final"].items()}
        _assert_close(final, s["final"])
        for name, st in d["state"].items():
            for key, v in st.items():
                if torch.is_tensor(v):
                    torch.testing.assert_close(v, s["state"][name][key], atol=1e-9, rtol=0)
                    torch.testing.assert_close(
                        v, ddp[1]["state"][name][key], atol=0, rtol=0
                    )  # identical on every rank


@pytest.mark.slow
@pytest.mark.parametrize("run", [r for r in w.RUNS if r.partition("+")[0] in w.ADAPTIVE])
def test_ddp_adaptive_equals_one_process_from_its_endpoints(ranks, run):
    """One process, no DDP and no process group: each step's DDP gradient is the ranks' mean of
    ``g_path + b g_cv``, with ``g_path`` the base estimator's gradient and ``g_path + g_cv``
    Pyro's ``Trace_ELBO`` / ``RenyiELBO(alpha=0)`` gradient on the same draws and shard; the
    moments are the exponentially weighted sums of the ranks' mean parts, by hand."""
    torch.set_default_dtype(torch.float64)
    trails = [r["normal"][run]["trail"] for r in ranks]
    assert len(trails[0]) == len(trails[1]) == w.STEPS
    for a, b in zip(*trails):  # every step starts from the same parameters and weights
        _assert_close(a["params"], b["params"])
        assert a["b"].keys() == b["b"].keys()
        for k in a["b"]:
            torch.testing.assert_close(a["b"][k], b["b"][k], atol=0, rtol=0)
    ref = w.adaptive_parts_reference(run, trails)
    mixed = 0  # steps whose weights are strictly between the endpoints somewhere
    for step, (a, b, r) in enumerate(zip(*trails, ref)):
        for name, trail in (("rank 0", a), ("rank 1", b)):
            for k in r["grad"]:
                torch.testing.assert_close(
                    trail["grad"][k], r["grad"][k], atol=1e-9, rtol=0, msg=f"{name} step {step} {k}"
                )
        mixed += any(((v > 0) & (v < 1)).any() for v in a["b"].values())
    assert mixed >= 2, "the weights never left the endpoints: the mix is not tested"
    for rank in ranks:
        (key,) = rank["normal"][run]["state"]
        state = rank["normal"][run]["state"][key]
        moments = w.ew_moments(ref, key.split("\x1f"), w.DECAY)
        for k, v in moments.items():
            torch.testing.assert_close(state[k], v, atol=1e-9, rtol=0, msg=k)


@pytest.mark.slow
def test_block_grad_changes_the_ddp_fit(ranks):
    """Guard: the routed runs compared above really differ from the unrouted ones."""
    for run in w.ROUTABLE:
        plain = ranks[0]["delta"][run]["final"]["guide.z_unconstrained"]
        routed = ranks[0]["delta"][run + "+block_grad"]["final"]["guide.z_unconstrained"]
        assert not torch.allclose(plain, routed, atol=1e-3), run


@pytest.mark.slow
def test_adaptive_control_variate_acts_under_ddp(ranks):
    """Guard: with b != 0 after warm-up, the adaptive fit differs from its base estimator's."""
    normal = ranks[0]["normal"]
    for adaptive, base in (
        ("TraceAdaptiveSTL_ELBO", "TraceSTL_ELBO"),
        ("TraceAdaptiveDReG_ELBO", "TraceDReG_ELBO"),
    ):
        a, b = normal[adaptive]["final"], normal[base]["final"]
        assert not torch.allclose(
            a["guide.locs.mu_unconstrained"], b["guide.locs.mu_unconstrained"]
        )
