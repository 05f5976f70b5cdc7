"""Run a function on several local processes joined by a gloo process group (tests only).

Every rank is a fresh ``spawn``-ed process talking to the others over 127.0.0.1 on a
free port; nothing leaves the machine. Each rank saves its return value (``torch.save``)
or its traceback in ``out_dir``; :func:`run_ranks` returns the values in rank order or
raises :class:`RanksFailed` with every failed rank's traceback. Deadlines bound both the
process group (``init_process_group(timeout=...)``) and the join, so a hang fails.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import socket
import time
import traceback
from pathlib import Path

import torch


class RanksFailed(RuntimeError):
    """One or more ranks raised, exited abnormally or hung; the message has their tracebacks."""

    def __init__(self, message: str, errors: dict[int, str]):
        super().__init__(message)
        self.errors = errors


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, out_dir, pg_timeout_s, args):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    torch.set_num_threads(1)
    out = Path(out_dir)
    importlib.import_module("torch._dynamo")  # before the group: see init_distributed
    try:
        torch.distributed.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args)
        torch.save(result, out / f"rank{rank}.pt")
        torch.distributed.barrier()  # all ranks done before any tears the group down
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_ranks(
    fn,
    *args,
    out_dir: Path,
    world_size: int = 2,
    timeout_s: float = 60.0,
    pg_timeout_s: float = 20.0,
    grace_s: float = 20.0,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; their results by rank.

    After the first rank fails, the others get ``grace_s`` seconds to exit on their own
    (they should: a broken collective raises); any still running then is killed and
    reported as hung. ``timeout_s`` bounds the whole run.
    """
    ctx = mp.get_context("spawn")
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, rank, world_size, port, str(out_dir), pg_timeout_s, args),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    start = time.monotonic()
    deadline = start + timeout_s
    first_failure = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
            first_failure = now
            deadline = min(deadline, now + grace_s)
        if now > deadline:
            break
        time.sleep(0.05)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join(5)
    errors = {}
    for r, p in enumerate(procs):
        err = out_dir / f"rank{r}.err"
        if r in hung:
            errors[r] = f"still running after {time.monotonic() - start:.0f} s: killed (hang)"
        elif err.exists():
            errors[r] = err.read_text()
        elif p.exitcode != 0:
            errors[r] = f"exited with code {p.exitcode} without a traceback"
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items()))
        raise RanksFailed(f"{len(errors)} of {world_size} ranks failed:\n{text}", errors)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
