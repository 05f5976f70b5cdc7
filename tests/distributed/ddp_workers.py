"""DDP over ``ELBOModule`` on every rank, and the single-process references (tests only).

Module-level functions so that ``spawn``-ed processes can import them. Every run is
float64, ``DistributedDataParallel(elbo(model, guide))`` with ``torch.optim.Adam``; the
parameters live in Pyro's param store (the default), so ``block_grad`` names them.
"""

from __future__ import annotations

import pyro
import pyro.infer
import torch
from pyro.infer.autoguide import AutoDelta, AutoNormal
from torch.nn.parallel import DistributedDataParallel

import pyro_gradroute.infer as gr_infer
from pyro_gradroute.poutine import block_grad

from .workers import _plates, data, model, shard_batches

LR = 0.05
STEPS = 6  # stochastic runs: steps per rank
DECAY = 0.5  # the adaptive estimators' moment decay

ESTIMATORS = {
    "Trace_ELBO": lambda: gr_infer.Trace_ELBO(),
    "TraceSTL_ELBO": lambda: gr_infer.TraceSTL_ELBO(),
    "TraceDReG_ELBO": lambda: gr_infer.TraceDReG_ELBO(num_particles=3, max_plate_nesting=1),
    "TraceAdaptiveSTL_ELBO": lambda: gr_infer.TraceAdaptiveSTL_ELBO(warmup=1, decay=DECAY),
    "TraceAdaptiveDReG_ELBO": lambda: gr_infer.TraceAdaptiveDReG_ELBO(
        num_particles=3, max_plate_nesting=1, warmup=1, decay=DECAY
    ),
}
ADAPTIVE = ("TraceAdaptiveSTL_ELBO", "TraceAdaptiveDReG_ELBO")
# the likelihood "x" may not train the local parameters (AutoDelta.z / AutoNormal.locs.z)
ROUTABLE = [n for n in ESTIMATORS if n != "TraceAdaptiveDReG_ELBO"]  # it raises on routes
RUNS = [*ESTIMATORS] + [f"{n}+block_grad" for n in ROUTABLE]


def _setup(run: str, guide_cls, batch0):
    """(estimator, routed model, guide, ELBOModule) with the guide's params created."""
    name, _, route = run.partition("+")
    guide = guide_cls(model, create_plates=_plates)
    elbo = ESTIMATORS[name]()
    local = "AutoDelta.z" if guide_cls is AutoDelta else "AutoNormal.locs.z"
    routed = block_grad(model, sites=["x"], params=[local]) if route else model
    pyro.infer.Trace_ELBO().loss(model, guide, data(), batch0)  # creates the params, no step
    return elbo, routed, guide, elbo(routed, guide)


def _values(module) -> dict:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def ddp_run(run: str, guide_cls, rank: int, world_size: int, steps: int | None = None) -> dict:
    """DDP(ELBOModule) + Adam on this rank's shards; init from seed ``rank`` (DDP broadcasts)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(rank)  # different initial values on every rank
    batches = shard_batches(rank, world_size)[:steps]
    elbo, _, guide, module = _setup(run, guide_cls, batches[0])
    init = _values(module)
    ddp = DistributedDataParallel(module)  # broadcasts rank 0's parameters
    optim = torch.optim.Adam(module.parameters(), lr=LR)
    pyro.set_rng_seed(100 + rank)  # the draws of the steps: a known stream per rank
    x = data()
    trail = []  # adaptive runs: what each step started from, the weights it used, its gradient
    for idx in batches:
        optim.zero_grad()
        if hasattr(elbo, "state_dict"):
            trail.append(
                {
                    "rng": torch.get_rng_state(),
                    "params": _values(module),
                    "b": {k: v.clone() for k, v in elbo.control_variate_weights().items()},
                }
            )
        ddp(x, idx).backward()
        if trail:
            trail[-1]["grad"] = {k: v.grad.clone() for k, v in module.named_parameters()}
        optim.step()
    out = {"init": init, "final": _values(module)}
    if hasattr(elbo, "state_dict"):
        out["state"] = elbo.state_dict()["moments"]
        out["trail"] = trail
    return out


# the adaptive estimators' two endpoints, as independent estimators on the same draws:
# (the base, b = 0; b = 1), the latter Pyro's own
ENDPOINTS = {
    "TraceAdaptiveSTL_ELBO": (
        lambda: gr_infer.TraceSTL_ELBO(),
        lambda: pyro.infer.Trace_ELBO(),
    ),
    "TraceAdaptiveDReG_ELBO": (
        lambda: gr_infer.TraceDReG_ELBO(num_particles=3, max_plate_nesting=1),
        lambda: pyro.infer.RenyiELBO(
            alpha=0.0, num_particles=3, max_plate_nesting=1, vectorize_particles=True
        ),
    ),
}


def adaptive_parts_reference(run: str, trails: list[list[dict]]) -> list[dict]:
    """One process, no DDP, no process group: each step's parts from the endpoints.

    For every step ``t`` and rank ``r``, at the step's parameters and on rank ``r``'s shard and
    draws (its random state, replayed): ``g_path`` = the base estimator's gradient (b = 0:
    ``TraceSTL_ELBO`` / ``TraceDReG_ELBO``) and ``g_cv = g_1 - g_path`` with ``g_1`` Pyro's
    ``Trace_ELBO`` / ``RenyiELBO(alpha=0)`` (IWAE) gradient (b = 1). Returns, per step, the
    ranks' means ``{"path", "cv"}`` and the DDP gradient they imply, ``mean_r(g_path + b g_cv)``
    with the step's weights ``b``: ``{"path", "cv", "grad"}``, keyed by module name.
    """
    name, _, route = run.partition("+")
    base_fn, one_fn = ENDPOINTS[name]
    world = len(trails)
    shards = [shard_batches(r, world)[:STEPS] for r in range(world)]
    pyro.clear_param_store()
    guide = AutoNormal(model, create_plates=_plates)
    local = "AutoNormal.locs.z"
    routed = block_grad(model, sites=["x"], params=[local]) if route else model
    pyro.infer.Trace_ELBO().loss(model, guide, data(), shards[0][0])  # creates the params
    named = dict(guide.named_parameters())
    x = data()
    out = []
    for step in range(len(trails[0])):
        path: dict = {}
        cv: dict = {}
        grad: dict = {}
        for r in range(world):
            rec = trails[r][step]
            with torch.no_grad():
                for k, v in named.items():
                    v.copy_(rec["params"]["guide." + k])
            parts = []
            for fn in (base_fn, one_fn):
                torch.set_rng_state(rec["rng"])
                for v in named.values():
                    v.grad = None
                fn().loss_and_grads(routed, guide, x, shards[r][step])  # RenyiELBO has no other
                parts.append(
                    {
                        k: torch.zeros_like(v) if v.grad is None else v.grad.clone()
                        for k, v in named.items()
                    }
                )
            g0, g1 = parts
            for k in named:
                key = "guide." + k
                c = g1[k] - g0[k]
                # before any moments (the first step) the weights are 1: Trace_ELBO's / IWAE's
                b = rec["b"].get("AutoNormal." + k.removesuffix("_unconstrained"), 1.0)
                mixed = g0[k] + b * c
                path[key] = path.get(key, 0) + g0[k] / world
                cv[key] = cv.get(key, 0) + c / world
                grad[key] = grad.get(key, 0) + mixed / world
        out.append({"path": path, "cv": cv, "grad": grad})
    return out


def ew_moments(parts: list[dict], names: list[str], decay: float) -> dict:
    """The exponentially weighted moments of the parts, by hand: ``sum_t decay^(T-1-t) f_t``
    for ``f = p, c, p^2, p c, c^2`` (``p``, ``c``: the step's mean parts, flattened in the
    order of ``names``)."""
    out = {k: 0 for k in ("sp", "sc", "spp", "spc", "scc")}
    for part in parts:
        keys = ["guide." + n.removeprefix("AutoNormal.") + "_unconstrained" for n in names]
        p = torch.cat([part["path"][k].reshape(-1) for k in keys])
        c = torch.cat([part["cv"][k].reshape(-1) for k in keys])
        for k, f in (("sp", p), ("sc", c), ("spp", p * p), ("spc", p * c), ("scc", c * c)):
            out[k] = decay * out[k] + f
    return out


def svi_adaptive_run(run: str, rank: int, world_size: int) -> dict:
    """The adaptive estimator's other path: SVI + DistributedOptimizer (loss_and_grads)."""
    from pyro.infer import SVI

    from pyro_gradroute.distributed import DistributedOptimizer, broadcast_param_store

    pyro.clear_param_store()
    pyro.set_rng_seed(rank)
    batches = shard_batches(rank, world_size)[:STEPS]
    elbo, routed, guide, _ = _setup(run, AutoNormal, batches[0])
    broadcast_param_store(src=0)
    svi = SVI(routed, guide, DistributedOptimizer(pyro.optim.Adam({"lr": LR})), elbo)
    pyro.set_rng_seed(100 + rank)
    x = data()
    for idx in batches:
        svi.step(x, idx)
    return {"final": _values(guide), "state": elbo.state_dict()["moments"]}


def union_reference(run: str, start: dict, world_size: int) -> dict:
    """One process, no DDP: ELBOModule + Adam, each step on the union of the ranks' shards.

    For the deterministic guide (AutoDelta) this is what the ranks compute: the plate's
    global size makes the union's likelihood scale ``N / (R b)`` the mean of the ranks'.
    """
    from .workers import union_batches

    pyro.clear_param_store()
    batches = union_batches(world_size)
    _, _, _, module = _setup(run, AutoDelta, batches[0])
    _load(module, start)
    optim = torch.optim.Adam(module.parameters(), lr=LR)
    x = data()
    for idx in batches:
        optim.zero_grad()
        module(x, idx).backward()
        optim.step()
    return _values(module)


def simulated_ranks_reference(run: str, start: dict, world_size: int) -> dict:
    """One process, no DDP: each step, every rank's gradient on its shard with its own draws
    (its seed's random stream, replayed), averaged by hand, then one Adam step."""
    pyro.clear_param_store()
    shards = [shard_batches(r, world_size)[:STEPS] for r in range(world_size)]
    _, _, _, module = _setup(run, AutoNormal, shards[0][0])
    _load(module, start)
    params = list(module.parameters())
    optim = torch.optim.Adam(params, lr=LR)
    states = []
    for r in range(world_size):
        pyro.set_rng_seed(100 + r)
        states.append(torch.get_rng_state())
    x = data()
    for step in range(STEPS):
        total = [torch.zeros_like(p) for p in params]
        for r in range(world_size):
            torch.set_rng_state(states[r])
            grads = torch.autograd.grad(module(x, shards[r][step]), params, allow_unused=True)
            states[r] = torch.get_rng_state()
            total = [t if g is None else t + g for t, g in zip(total, grads)]
        for p, t in zip(params, total):
            p.grad = t / world_size
        optim.step()
    return _values(module)


def _load(module, start: dict) -> None:
    with torch.no_grad():
        for k, v in module.named_parameters():
            v.copy_(start[k])


def main_worker(rank: int, world_size: int) -> dict:
    """Every DDP scenario the tests need, in one 2-process run."""
    torch.set_default_dtype(torch.float64)
    pyro.enable_validation(True)
    out: dict = {"delta": {}, "normal": {}, "svi": {}}
    for run in RUNS:
        out["delta"][run] = ddp_run(run, AutoDelta, rank, world_size)
        out["normal"][run] = ddp_run(run, AutoNormal, rank, world_size, steps=STEPS)
    for run in RUNS:
        if run.partition("+")[0] in ADAPTIVE:
            out["svi"][run] = svi_adaptive_run(run, rank, world_size)
    return out
