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

import gc
import statistics
import time
from collections.abc import Callable

import torch


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    rounds: int,
    warmup: int = 3,
    mean: bool = False,
    collect: bool = False,
) -> dict[str, float]:
    """CPU seconds per call of each function (``time.thread_time``), calls interleaved round by round.

    CPU time of this thread rather than wall time: on a shared machine other processes' load
    stays out. The median per call, or with ``mean`` the mean: for a function whose calls
    differ by design (an estimator that measures on some steps only), the median would report
    the cheap calls. ``collect``: a full garbage collection before each call, outside the
    timing (for steps that leave large traces behind, whose collection would otherwise fall on
    whichever call happens to trigger it).
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            if collect:
                gc.collect()
            t0 = time.thread_time()
            fn()
            times[k].append(time.thread_time() - t0)
    stat = statistics.mean if mean else statistics.median
    return {k: stat(v) for k, v in times.items()}


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


def print_table(rows: list[tuple], header: tuple, title: str | None = None) -> None:
    """Print an aligned table (and keep it, as Markdown, for :func:`write_results`), under
    ``title`` where given (the results file keeps it as the table's caption)."""
    table = markdown_table(rows, header)
    TABLES.append(table if title is None else f"{title}:\n\n{table}")
    if title is not None:
        print(title)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def gaussian_problem(D: int = 10, n: int = 20):
    """A conjugate Gaussian: ``z ~ N(0, I_D)``, ``n`` points ``x_i ~ N(z, I)``; a mean-field guide.

    Returns ``(model, guide, post_mean, post_sd)``; the guide's family contains the exact
    posterior ``N(post_mean, post_sd^2 I)``.
    """
    import pyro
    import pyro.distributions as dist
    from torch.distributions import constraints

    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, D, generator=g) + 1

    def model():
        z = pyro.sample("z", dist.Normal(torch.zeros(D), 1.0).to_event(1))
        with pyro.plate("data", n):
            pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=x)

    post_sd = (1.0 / (1 + n)) ** 0.5
    post_mean = x.sum(0) / (1 + n)

    def guide():
        loc = pyro.param("loc", post_mean.clone())
        scale = pyro.param("scale", torch.full((D,), post_sd), constraint=constraints.positive)
        pyro.sample("z", dist.Normal(loc, scale).to_event(1))

    return model, guide, post_mean, post_sd


def place_guide(guide, post_mean, post_sd, t: float) -> None:
    """Fresh params with the guide ``t`` posterior sds off in mean and ``exp(t/2)`` in scale."""
    import math

    import pyro

    pyro.clear_param_store()
    guide()
    with torch.no_grad():
        pyro.param("loc").unconstrained().copy_(post_mean + t * post_sd)
        pyro.param("scale").unconstrained().copy_(math.log(post_sd) + t / 2)  # unconstrained = log


# ----------------------------------------------------------------------------- real models
#: Pyro's ``examples/eight_schools``: treatment effects and their standard errors
ES_Y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
ES_SIGMA = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def es_model(data):
    """Pyro's ``examples/eight_schools/svi.py`` model (``data``: columns y, sigma)."""
    import pyro
    import pyro.distributions as dist

    y, sigma = data[:, 0], data[:, 1]
    J = len(y)
    eta = pyro.sample("eta", dist.Normal(torch.zeros(J), torch.ones(J)).to_event(1))
    mu = pyro.sample("mu", dist.Normal(torch.zeros(1), 10 * torch.ones(1)).to_event(1))
    tau = pyro.sample("tau", dist.HalfCauchy(scale=25 * torch.ones(1)).to_event(1))
    theta = mu + tau * eta
    pyro.sample("obs", dist.Normal(theta, sigma).to_event(1), obs=y)


def es_guide(data):
    """Pyro's ``examples/eight_schools/svi.py`` guide (narrow ``0.1 * rand`` initial scales).

    The script's ``(J, 1)`` shapes broadcast against the model's ``(J,)`` eta and sit in no
    plate, which Pyro's validation refuses: ``(J,)`` here and ``.to_event(1)`` on every site
    (the same density).
    """
    import pyro
    import pyro.distributions as dist
    from torch.distributions import constraints, transforms

    J = len(data)
    m_eta = pyro.param("loc_eta", lambda: torch.randn(J))
    s_eta = pyro.param("scale_eta", lambda: 0.1 * torch.rand(J), constraint=constraints.positive)
    m_mu = pyro.param("loc_mu", lambda: torch.randn(1))
    s_mu = pyro.param("scale_mu", lambda: 0.1 * torch.rand(1), constraint=constraints.positive)
    m_lt = pyro.param("loc_logtau", lambda: torch.randn(1))
    s_lt = pyro.param("scale_logtau", lambda: 0.1 * torch.rand(1), constraint=constraints.positive)
    pyro.sample("eta", dist.Normal(m_eta, s_eta).to_event(1))
    pyro.sample("mu", dist.Normal(m_mu, s_mu).to_event(1))
    log_tau = dist.Normal(m_lt, s_lt)
    pyro.sample("tau", dist.TransformedDistribution(log_tau, transforms.ExpTransform()).to_event(1))


def bayesian_regression(d: int):
    """The Bayesian-regression tutorial's model: ``PyroModule[nn.Linear]`` with ``PyroSample`` priors."""
    import pyro
    import pyro.distributions as dist
    from pyro.nn import PyroModule, PyroSample

    class BayesianRegression(PyroModule):
        def __init__(self):
            super().__init__()
            self.linear = PyroModule[torch.nn.Linear](d, 1)
            self.linear.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, d]).to_event(2))
            self.linear.bias = PyroSample(dist.Normal(0.0, 10.0).expand([1]).to_event(1))

        def forward(self, x, y=None):
            sigma = pyro.sample("sigma", dist.Uniform(0.0, 10.0))
            mean = self.linear(x).squeeze(-1)
            with pyro.plate("data", x.shape[0]):
                pyro.sample("obs", dist.Normal(mean, sigma), obs=y)
            return mean

    return BayesianRegression()


# ----------------------------------------------------------------------------- results files
#: every table print_table has shown, as Markdown (write_results puts them in a file)
TABLES: list[str] = []


def markdown_table(rows: list[tuple], header: tuple) -> str:
    """A plain Markdown table (``|``-separated, one header line)."""
    lines = ["| " + " | ".join(str(c) for c in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def results_header(argv: list[str] | None = None) -> str:
    """The line a results file opens with: the command, the date (UTC), the git commit (with
    ``+dirty`` where the work tree differs from it) and the machine's load average."""
    import datetime
    import os
    import subprocess
    import sys
    from pathlib import Path

    argv = sys.argv if argv is None else argv
    root = Path(__file__).resolve().parent.parent

    def git(*a):
        try:
            out = subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=20)
            return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    script = Path(argv[0]).name if argv else "?"
    command = " ".join(["python", f"benchmarks/{script}", *argv[1:]])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    cores = os.cpu_count()
    return (f"Command: `{command}`; date: {date}; commit: `{commit}`; "
            f"machine load (1, 5, 15 min): {load} on {cores} cores.")  # fmt: skip


def write_results(path: str | None, tables: list[str] | None = None, header: str = "") -> None:
    """Write ``tables`` (default: every table :func:`print_table` has shown) to ``path`` as
    Markdown, under the line :func:`results_header` gives (``header`` passed in: the one taken
    when the run started, so its load is the run's). ``None``: nothing is written."""
    if not path:
        return
    from pathlib import Path

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    body = "\n\n".join(TABLES if tables is None else tables)
    out.write_text(f"{header or results_header()}\n\n{body}\n")
    print(f"results in {out}")


def add_results_argument(parser) -> None:
    """``--results PATH``: the run's tables, as Markdown, into ``PATH`` (see :func:`recording`)."""
    parser.add_argument(
        "--results",
        default=None,
        help="write the tables as Markdown to this file (e.g. docs/results/NAME.md), under a "
        "line with the command, date, git commit and machine load",
    )


class recording:
    """``with recording(path, argv): ...``: the tables :func:`print_table` shows inside go to
    ``path`` at the end (nothing without a path; the header's load is the start's)."""

    def __init__(self, path: str | None, argv: list[str] | None = None):
        import sys

        self.path = path
        self.header = results_header(None if argv is None else [sys.argv[0], *argv])

    def __enter__(self):
        self.start = len(TABLES)
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            write_results(self.path, TABLES[self.start :], self.header)
