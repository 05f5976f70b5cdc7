"""Gradient routing: routed vs unrouted vs naive two-pass, time and peak memory, side by side.

The seed network ``y = B(A(x))``, ``A`` and ``B`` each 4 layers (Linear + Tanh) of width
1024, batch 256, one CPU thread; ``loss1 = mean(y^2)`` trains ``A`` and ``B``,
``loss2 = mean(sin y)`` trains ``A`` only.

* plain PyTorch: ``unrouted`` = forward + ``(loss1 + loss2).backward()`` (ignores the route),
  ``routed`` = forward + :func:`pyro_gradroute.routing.backward`, ``naive`` = the two-pass
  version (forward + ``loss1.backward()``; forward again + ``loss2`` w.r.t. ``A`` only);
* under SVI (``pyro_gradroute.infer.Trace_ELBO``, Adam): the model has
  ``pyro.factor("loss1")`` / ``pyro.factor("loss2")``; ``routed`` wraps it in
  ``block_grad(sites=["loss2"], modules=["B"])``, ``naive`` recomputes the whole network
  for ``loss2`` with ``B``'s parameters detached. Pyro's own ``Trace_ELBO`` with the
  route (exact through the gated distributions) is listed for comparison.

Time: CPU time of this thread (``time.thread_time``), candidates interleaved round by round;
the median over rounds of each one's time divided by the unrouted step's time in the same
round.
Peak memory: each candidate runs its steps in a fresh ``fork`` of the same parent state;
reported is the child's peak resident set size (``ru_maxrss``) minus its resident size at
the start, i.e. the memory a step adds at its peak (graph, gradients, backward buffers),
all of which torch allocates on the CPU through the system allocator (set to ``mmap`` large
blocks so that freed memory leaves the resident set at once).

Run: ``python benchmarks/bench_route.py`` (``--quick`` for fewer rounds, ``--width`` and
``--batch`` to scale). ``--width 10 --batch 1`` (a step of ~0.5 ms): a routed step costs about
what the naive two passes cost, as its fixed cost (the walk of the autograd graph and the
plan, ~0.4 ms of Python) is as large as the second forward and backward it saves.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import struct
from collections.abc import Callable

import pyro
import torch
from _common import add_results_argument, print_table, recording, time_interleaved
from pyro.infer import SVI
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from torch import nn

from pyro_gradroute import routing
from pyro_gradroute.infer import Trace_ELBO
from pyro_gradroute.poutine import block_grad


def mlp(n: int, w: int) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(n) for m in (nn.Linear(w, w), nn.Tanh())])


def frozen(module: nn.Module):
    params = {n: p.detach() for n, p in module.named_parameters()}
    return lambda inp: torch.func.functional_call(module, params, (inp,))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _mmap_large_allocations() -> None:
    """Serve allocations >= 64 KiB by ``mmap`` (glibc ``mallopt(M_MMAP_THRESHOLD)``).

    Freed tensors then leave the resident set at once instead of staying in malloc's heap
    for reuse, so the peak resident size tracks the peak of live tensor memory.
    """
    try:
        ctypes.CDLL(None).mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: the measure is coarser, still side by side
        pass


def peak_step_memory(fn: Callable[[], object], steps: int = 2) -> int:
    """Peak resident bytes that ``steps`` calls of ``fn`` add, in a forked child."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        base = _rss_bytes()
        for _ in range(steps):
            fn()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        os.write(w, struct.pack("q", peak - base))
        os._exit(0)
    os.close(w)
    data = os.read(r, 8)
    os.waitpid(pid, 0)
    return struct.unpack("q", data)[0]


def step_ratios(fns: dict[str, Callable[[], object]], base: str, rounds: int) -> dict:
    """Per candidate: (median ms/step, median over rounds of its time / ``base``'s same-round time).

    Candidates run one step each per round, alternately, so the (shared, noisy) machine's
    load hits them alike; per-round ratios cancel slow drifts in that load.
    """
    time_interleaved(fns, rounds=1, warmup=0)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, t in time_interleaved(fns, rounds=1, warmup=0).items():
            times[k].append(t)
    return {
        k: (statistics.median(v), statistics.median(a / b for a, b in zip(v, times[base])))
        for k, v in times.items()
    }


def report(title: str, fns: dict[str, Callable[[], object]], base: str, rounds: int) -> dict:
    mem = {k: peak_step_memory(fn) for k, fn in fns.items()}  # before any step in this process
    timing = step_ratios(fns, base, rounds)
    print()
    rows = [
        (
            k,
            f"{timing[k][0] * 1e3:.1f}",
            f"{timing[k][1]:.2f}x",
            f"{mem[k] / 2**20:.0f}",
            f"{mem[k] / mem[base]:.2f}x",
        )
        for k in fns
    ]
    header = ("candidate", "ms/step", f"time / {base}", "peak MiB", f"memory / {base}")
    print_table(rows, header, title)
    return {k: (timing[k][1], mem[k] / mem[base]) for k in fns}


def bench_plain(width: int, batch: int, rounds: int) -> dict:
    torch.manual_seed(0)
    A, B = mlp(4, width), mlp(4, width)
    x = torch.randn(batch, width)
    params = [*A.parameters(), *B.parameters()]

    def losses(y):
        return y.pow(2).mean(), y.sin().mean()

    def zero():
        for p in params:
            p.grad = None

    def unrouted():
        zero()
        l1, l2 = losses(B(A(x)))
        (l1 + l2).backward()

    def routed():
        zero()
        l1, l2 = losses(B(A(x)))
        routing.backward({"loss1": l1, "loss2": l2}, block={"loss2": [B]})

    def naive():
        zero()
        l1, _ = losses(B(A(x)))
        l1.backward()
        _, l2 = losses(frozen(B)(A(x)))
        l2.backward()

    return report(
        f"plain PyTorch, 4+4 layers width {width}, batch {batch}",
        {"unrouted": unrouted, "routed": routed, "naive two-pass": naive},
        "unrouted",
        rounds,
    )


def bench_svi(width: int, batch: int, rounds: int) -> dict:
    torch.manual_seed(0)
    A, B = mlp(4, width), mlp(4, width)
    x = torch.randn(batch, width)

    def model(naive=False):
        pyro.module("A", A)
        pyro.module("B", B)
        y = B(A(x))
        pyro.factor("loss1", -y.pow(2).mean())
        y2 = frozen(B)(A(x)) if naive else y
        pyro.factor("loss2", -y2.sin().mean())

    def guide(naive=False):
        pass

    routed_model = block_grad(model, sites=["loss2"], modules=["B"])
    pyro.clear_param_store()
    optim = pyro.optim.Adam({"lr": 1e-5})
    svis = {
        "unrouted": SVI(model, guide, optim, Trace_ELBO()),
        "routed": SVI(routed_model, guide, optim, Trace_ELBO()),
        "naive two-pass": SVI(model, guide, optim, Trace_ELBO()),
        "routed, pyro.infer.Trace_ELBO (gates)": SVI(routed_model, guide, optim, PyroTrace_ELBO()),
    }
    svis["unrouted"].step()  # register the params and the optimizer state
    fns = {k: (lambda s=s, k=k: s.step(naive=k.startswith("naive"))) for k, s in svis.items()}
    return report(
        f"SVI step (pyro_gradroute.infer.Trace_ELBO, Adam), width {width}, batch {batch}",
        fns,
        "unrouted",
        rounds,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    add_results_argument(parser)
    args = parser.parse_args(argv)
    with recording(args.results, argv):
        torch.set_num_threads(1)
        _mmap_large_allocations()
        rounds = 5 if args.quick else 21
        bench_plain(args.width, args.batch, rounds)
        bench_svi(args.width, args.batch, rounds)


if __name__ == "__main__":
    main()
