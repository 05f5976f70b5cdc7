"""Identical starting parameters on every rank: :func:`broadcast_param_store`."""

from __future__ import annotations

import pyro
import pyro.optim
import torch
import torch.distributed as dist

from .gradients import (
    ParameterMismatchError,
    _buckets,
    _check_same_params,
    _require_initialized,
    _wrap_collective_error,
)
from .setup import DEFAULT_BUCKET_CAP_MB


def broadcast_param_store(
    src: int = 0, *, group=None, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
) -> None:
    r"""Copy every parameter of Pyro's param store from rank ``src`` to all ranks, in place.

    .. math::

        \theta^{(r)} \leftarrow \theta^{(\text{src})} \quad \text{for every rank } r

    (on the unconstrained tensors, so constraints are preserved). Call it on every rank
    after the first model/guide trace created the parameters (``svi.evaluate_loss(batch)``
    creates the guide's and the model's without a step) and before the first step; with :class:`DistributedOptimizer` they then stay identical.
    The ranks must hold the same parameter names, shapes and dtypes (a ``RuntimeError``
    lists the differences). Bucketed like :func:`average_gradients`. Optimizer state is
    not broadcast: call it before the first optimizer step has built state, or load the
    same state on every rank.

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
    try:
        _check_same_params(named, group, "broadcast_param_store")
        buckets = _buckets(named, max(1, int(bucket_cap_mb * 2**20)))
        with torch.no_grad():
            flats = [torch.cat([p.detach().reshape(-1) for _, p in b]) for b in buckets]
            works = [dist.broadcast(f, src=src, group=group, async_op=True) for f in flats]
            for work in works:
                work.wait()
            for bucket, flat in zip(buckets, flats):
                offset = 0
                for _, p in bucket:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
    except ParameterMismatchError:
        raise
    except RuntimeError as e:
        raise _wrap_collective_error("broadcast_param_store", e) from e
