"""The process group, and bucketed collectives on the param store's tensors that check every
rank holds the same parameters."""

from __future__ import annotations

import datetime
import hashlib
import importlib
import os
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pyro
import pyro.optim
import torch
import torch.distributed as dist

DEFAULT_BUCKET_CAP_MB = 25.0


def init_distributed(timeout_s: float = 120.0, backend: str | None = None) -> torch.device:
    r"""Join the process group ``torchrun`` describes, or make a group of one process.

    Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set)
    this is ``torch.distributed.init_process_group(backend, timeout=...)``; without them
    it creates a world of one process on 127.0.0.1 (a free port), so the same script runs
    alone with ``python script.py``. ``backend`` defaults to ``"nccl"`` when CUDA is
    available (one GPU per process: ``cuda:LOCAL_RANK``) and ``"gloo"`` otherwise. The
    timeout bounds every collective: a rank that crashed makes the others fail after at
    most ``timeout_s`` seconds instead of hanging.

    :returns: the device this process should compute on.

    Example::

        >>> import torch.distributed as dist
        >>> from pyro_gradroute.distributed import init_distributed
        >>> device = init_distributed(timeout_s=60)
        >>> dist.get_world_size(), device
        (1, device(type='cpu'))
        >>> dist.destroy_process_group()
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if "RANK" not in os.environ:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        kwargs.update(init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    # torch.optim's first step imports torch._dynamo; imported while a group exists, it keeps
    # a reference to that group past destroy_process_group, and the group's gloo threads are
    # then torn down at interpreter exit, which can abort the process ("terminate called
    # without an active exception"). Imported before the group exists, it holds none.
    importlib.import_module("torch._dynamo")
    dist.init_process_group(backend, **kwargs)
    return device


class ParameterMismatchError(RuntimeError):
    """The ranks hold different parameters (names, shapes or dtypes); raised on every rank."""


def _require_initialized(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs a torch.distributed process group, and none is initialized. "
            "Call torch.distributed.init_process_group(backend, timeout=...) first "
            "(under torchrun: init_process_group('gloo') on CPU or 'nccl' on GPUs; the "
            "launcher sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)."
        )


def _param_names(params: Iterable[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``(name, param)`` sorted by param-store name (the same order on every rank)."""
    store = pyro.get_param_store()
    named = []
    for p in params:
        name = store.param_name(p)
        if name is None:
            raise ValueError(
                "DistributedOptimizer / average_gradients got a tensor that is not in Pyro's "
                f"param store (shape {tuple(p.shape)}). Only param-store parameters can be "
                "matched across ranks: create it with pyro.param or pyro.module."
            )
        named.append((name, p))
    return sorted(named, key=lambda item: item[0])


def _signature(named: list[tuple[str, torch.Tensor]]) -> int:
    """A 62-bit digest of the names, shapes and dtypes (the same on all ranks iff they agree)."""
    h = hashlib.blake2b(digest_size=8)
    for name, p in named:
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}\n".encode())
    return int.from_bytes(h.digest(), "little") >> 2


def _check_same_params(named: list[tuple[str, torch.Tensor]], group, what: str) -> None:
    """Raise on every rank, with the differing names, unless all ranks hold the same params."""
    sig = _signature(named)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    t = torch.tensor([sig, -sig], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if int(t[0]) == -int(t[1]):
        return
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in named]
    dist.all_gather_object(gathered, mine, group=group)
    union = set().union(*map(set, gathered))
    lines = []
    for r, entries in enumerate(gathered):
        missing = sorted(union - set(entries))
        if missing:
            lines.append(f"  rank {r} lacks {missing}")
    raise ParameterMismatchError(
        f"{what}: the ranks do not hold the same parameters (name, shape, dtype), so their "
        "gradients cannot be averaged:\n" + "\n".join(lines) + "\nEvery rank must create "
        "the same parameters in the same shapes: avoid data-dependent pyro.param calls, and "
        "give plates with local parameters the global size (see ShardedPlate)."
    )


def _buckets(
    named: list[tuple[str, torch.Tensor]], cap_mb: float
) -> list[list[tuple[str, torch.Tensor]]]:
    """Groups of at most ``cap_mb`` megabytes (at least one param each) of one dtype and device,
    in name order within a (dtype, device): the same on all ranks."""
    cap_bytes = max(1, int(cap_mb * 2**20))
    ordered = sorted(named, key=lambda item: (str(item[1].dtype), str(item[1].device)))
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    size, key = 0, None
    for name, p in ordered:
        nbytes = p.numel() * p.element_size()
        k = (p.dtype, p.device)
        if not buckets or k != key or size + nbytes > cap_bytes:
            buckets.append([])
            size, key = 0, k
        buckets[-1].append((name, p))
        size += nbytes
    return buckets


def _views(buckets: list, flats: list) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(param, its slice of its bucket's flat tensor)``, bucket by bucket."""
    for bucket, flat in zip(buckets, flats):
        offset = 0
        for _, p in bucket:
            yield p, flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()


@contextmanager
def _collective_errors(what: str):
    """A collective's ``RuntimeError`` (not a :class:`ParameterMismatchError`) re-raised saying
    that another rank probably failed first."""
    try:
        yield
    except ParameterMismatchError:
        raise
    except RuntimeError as e:
        if not dist.is_initialized():
            raise
        raise RuntimeError(
            f"{what} failed on rank {dist.get_rank()}: a collective did not complete "
            f"({type(e).__name__}: {e}). Usually another rank raised or was killed first (look "
            "for its traceback) or the process group timed out; pass "
            "init_process_group(..., timeout=datetime.timedelta(seconds=...)) to fail faster."
        ) from e


def average_gradients(
    params: Iterable[torch.Tensor],
    *,
    group=None,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    check_params: bool = True,
) -> float:
    r"""Replace each parameter's ``.grad`` by its average over the ranks of ``group``.

    .. math::

        \text{grad}_p \leftarrow \frac{1}{R} \sum_{r=1}^{R} \text{grad}_{p,r},
        \qquad \text{grad}_{p,r} := 0 \text{ where rank } r \text{ has no gradient}

    A parameter whose gradient is ``None`` on *every* rank keeps ``None`` (so the optimizer
    skips it, as in one process). One asynchronous ``all_reduce`` per bucket of at most
    ``bucket_cap_mb`` megabytes (by dtype and device, in param-store-name order), and one small
    collective that checks all ranks hold the same parameters (a
    :class:`ParameterMismatchError` naming the differing ones otherwise). With one rank nothing
    is communicated.

    :param params: param-store parameters (unconstrained tensors, as SVI passes them).
    :param group: process group (default: the world).
    :param bucket_cap_mb: bucket size in megabytes.
    :param check_params: run the parameter check. ``False`` saves that collective once the
        parameters are known to agree; ranks whose parameters then differ fail in the
        ``all_reduce`` or at the process group's timeout, without the diagnosis.
    :returns: seconds spent in collectives (for profiling).

    Example (one process; a real run has several ranks)::

        >>> import torch, pyro, torch.distributed as dist
        >>> from pyro_gradroute.distributed import average_gradients, init_distributed
        >>> device = init_distributed()  # under torchrun: its group; here: one process
        >>> p = pyro.param("w", torch.ones(3)).unconstrained()
        >>> (2 * p).sum().backward()
        >>> _ = average_gradients([p])
        >>> p.grad
        tensor([2., 2., 2.])
        >>> dist.destroy_process_group()
    """
    _require_initialized("average_gradients")
    named = _param_names(params)
    world = dist.get_world_size(group)
    if world == 1:
        return 0.0
    for name, p in named:
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError(
                f"average_gradients: the gradient of '{name}' is sparse, which is not "
                "supported; use dense gradients (e.g. nn.Embedding(..., sparse=False))."
            )
    start = time.perf_counter()
    if check_params:
        _check_same_params(named, group, "average_gradients")
    buckets = _buckets(named, bucket_cap_mb)
    flats, works = [], []
    for i, bucket in enumerate(buckets):
        dtype, device = bucket[0][1].dtype, bucket[0][1].device
        pieces = [
            p.grad.detach().reshape(-1) if p.grad is not None else p.new_zeros(p.numel())
            for _, p in bucket
        ]
        if i == 0:  # which params have a gradient on some rank: counts, exact in any float type
            present = [float(p.grad is not None) for b in buckets for _, p in b]
            pieces.append(torch.tensor(present, dtype=dtype, device=device))
        flat = torch.cat(pieces)
        flats.append(flat)
        works.append(dist.all_reduce(flat, group=group, async_op=True))
    for work in works:
        work.wait()
    elapsed = time.perf_counter() - start
    present = flats[0][-len(named) :].tolist() if named else []
    for (p, total), there in zip(_views(buckets, flats), present):
        if there > 0:
            avg = total.div_(world)
            if p.grad is None:
                p.grad = avg.clone()
            else:
                p.grad.copy_(avg)
    return elapsed


def broadcast_param_store(
    src: int = 0, *, group=None, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
) -> None:
    r"""Copy every parameter of Pyro's param store from rank ``src`` to all ranks, in place.

    .. math::

        \theta^{(r)} \leftarrow \theta^{(\text{src})} \quad \text{for every rank } r

    (on the unconstrained tensors, so constraints are preserved). Call it on every rank after
    the first trace created the parameters (``svi.evaluate_loss(batch)`` does, without a step)
    and before the first step; with :class:`DistributedOptimizer` they then stay identical.
    The ranks must hold the same parameter names, shapes and dtypes (a
    :class:`ParameterMismatchError` lists the differences). Optimizer state is not broadcast:
    call it before the first step has built state, or load the same state on every rank.

    Example (one process; a real run has several ranks)::

        >>> import torch, pyro, torch.distributed as dist
        >>> from pyro_gradroute.distributed import broadcast_param_store, init_distributed
        >>> device = init_distributed()
        >>> w = pyro.param("w", torch.randn(3))
        >>> broadcast_param_store(src=0)
        >>> dist.destroy_process_group()
    """
    _require_initialized("broadcast_param_store")
    store = pyro.get_param_store()
    named = sorted(store.named_parameters(), key=lambda item: item[0])
    if dist.get_world_size(group) == 1:
        return
    with _collective_errors("broadcast_param_store"), torch.no_grad():
        _check_same_params(named, group, "broadcast_param_store")
        buckets = _buckets(named, bucket_cap_mb)
        flats = [torch.cat([p.detach().reshape(-1) for _, p in b]) for b in buckets]
        works = [dist.broadcast(f, src=src, group=group, async_op=True) for f in flats]
        for work in works:
            work.wait()
        for p, value in _views(buckets, flats):
            p.copy_(value)


class DistributedOptimizer(pyro.optim.PyroOptim):
    r"""Average gradients across ``torch.distributed`` ranks, then step a Pyro optimizer.

    The counterpart of :class:`pyro.optim.HorovodOptimizer` on ``torch.distributed``.
    Each call (SVI makes one per step, with the parameters the trace touched) replaces every
    gradient by the rank average :math:`\bar g = \frac1R \sum_r g_r` (:func:`average_gradients`,
    in param-store-name order on every rank; ``None`` counts as zero unless it is ``None`` on
    every rank; a clear error if the ranks' parameters differ), then calls the wrapped
    optimizer, whose gradient clipping therefore acts on :math:`\bar g`, identically on every rank.

    Starting from identical parameters (:func:`broadcast_param_store`), the ranks stay
    identical. Only ``.grad`` is read and written, so any ELBO works. The wrapped
    optimizer keeps its own state: :meth:`get_state`, :meth:`set_state`, :meth:`save`,
    :meth:`load`, and e.g. ``step()`` of a :class:`pyro.optim.PyroLRScheduler`, are
    passed through.

    :param pyro_optim: any :class:`pyro.optim.PyroOptim` (``Adam``, ``ClippedAdam``,
        a ``PyroLRScheduler``, ...).
    :param group: process group (default: the world).
    :param bucket_cap_mb: size of the ``all_reduce`` buckets in megabytes.
    :param check_params: check every step that the ranks' parameters agree (one small
        extra collective; see :func:`average_gradients`).

    Attributes ``comm_seconds`` (time spent in collectives) and ``num_steps`` accumulate
    over calls, for profiling.

    Example (one process here; under ``torchrun`` every rank runs the same code)::

        >>> import torch, pyro, pyro.distributions as dist, torch.distributed as tdist
        >>> from pyro.infer import SVI
        >>> from pyro.infer.autoguide import AutoNormal
        >>> from pyro_gradroute.infer import TraceSTL_ELBO
        >>> from pyro_gradroute.distributed import (
        ...     DistributedOptimizer, broadcast_param_store, init_distributed)
        >>> device = init_distributed()
        >>> def model(x):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", len(x)):
        ...         pyro.sample("x", dist.Normal(mu, 1.0), obs=x)
        >>> pyro.clear_param_store()
        >>> guide = AutoNormal(model)
        >>> optim = DistributedOptimizer(pyro.optim.Adam({"lr": 0.01}))
        >>> svi = SVI(model, guide, optim, TraceSTL_ELBO())
        >>> x = torch.randn(10)
        >>> loss = svi.evaluate_loss(x)  # creates the params, no step ...
        >>> broadcast_param_store(src=0)  # ... then make all ranks identical
        >>> loss = svi.step(x)
        >>> tdist.destroy_process_group()
    """

    def __init__(
        self,
        pyro_optim: pyro.optim.PyroOptim,
        *,
        group=None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        check_params: bool = True,
    ):
        if not isinstance(pyro_optim, pyro.optim.PyroOptim):
            raise TypeError(
                f"DistributedOptimizer wraps a pyro.optim optimizer (e.g. pyro.optim.Adam"
                f"({{'lr': 1e-3}})), got {type(pyro_optim).__name__}. For a torch.optim "
                "optimizer, call average_gradients(params) before its step()."
            )
        if isinstance(pyro_optim, DistributedOptimizer):
            raise TypeError("DistributedOptimizer is already distributed; do not wrap it twice.")
        # No PyroOptim.__init__: the wrapped optimizer holds all optimizer state.
        self.optim = pyro_optim
        self.group = group
        self.bucket_cap_mb = bucket_cap_mb
        self.check_params = check_params
        self.comm_seconds = 0.0
        self.num_steps = 0

    def __call__(self, params, *args, **kwargs) -> None:
        params = [p for _, p in _param_names(params)]
        with _collective_errors("DistributedOptimizer (gradient all_reduce)"):
            self.comm_seconds += average_gradients(
                params,
                group=self.group,
                bucket_cap_mb=self.bucket_cap_mb,
                check_params=self.check_params,
            )
        self.num_steps += 1
        self.optim(params, *args, **kwargs)

    def get_state(self) -> dict:
        """The wrapped optimizer's state (identical on every rank)."""
        return self.optim.get_state()

    def set_state(self, state_dict: dict) -> None:
        """Set the wrapped optimizer's state (load the same state on every rank)."""
        self.optim.set_state(state_dict)

    def __getattr__(self, name: str):
        # Only called for attributes not found normally: pass through to the wrapped optimizer
        # (optim_objs, pt_optim_args, step() of schedulers, ...).
        if name == "optim":
            raise AttributeError(name)
        return getattr(self.optim, name)
