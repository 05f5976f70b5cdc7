"""Shared measurement helpers for the benchmarks: interleaved timing and graph memory.

Ratios are measured side by side in one process: the candidates run alternately, one
step each per round, so machine noise hits them alike; the median per-step time of
each is reported.

Memory on the CPU is measured as the bytes of tensors the autograd graph saves for
backward during one forward pass (``torch.autograd.graph.saved_tensors_hooks``,
counting each storage once). That is the memory that a training step holds at its
peak (just before ``backward``) beyond the parameters, and it is deterministic,
unlike the process's resident size.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_interleaved(
    fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 3
) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved round by round."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def saved_tensor_bytes(fn: Callable[[], object]) -> int:
    """Bytes of distinct storages saved for backward while ``fn`` runs (its graph's memory)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        try:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def print_table(rows: list[tuple], header: tuple) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
