"""Time per SVI step of AutoMeanField(family=Normal) over AutoNormal on the same model.

Both guides are built on the same hierarchical model (global real and positive
sites, a plate of local sites) and stepped alternately: each repetition times a
block of steps of one guide, then of the other, and the printed ratio is the
median over repetitions of (AutoMeanField time) / (AutoNormal time), measured side
by side in this one process. Target: <= 1.1.

Run: ``python benchmarks/bench_guides.py`` (``--smoke`` for a few-second run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI
from pyro.infer.autoguide import AutoNormal

from pyro_gradroute.guides import AutoMeanField
from pyro_gradroute.infer import TraceSTL_ELBO


def model(y: torch.Tensor) -> None:
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.LogNormal(0.0, 1.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(2.0))
    with pyro.plate("groups", y.shape[0]):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("y", dist.Normal(theta, sigma), obs=y)


def make_svi(guide_class, elbo_class):
    # the two guides' parameters have distinct names: AutoNormal.* and AutoMeanField.*
    return SVI(model, guide_class(model), pyro.optim.Adam({"lr": 0.01}), elbo_class())


def time_block(svi: SVI, y: torch.Tensor, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        svi.step(y)
    return (time.perf_counter() - start) / steps


def measure(elbo_class, y, reps: int, steps: int) -> tuple[float, float, float]:
    """Median seconds per step of AutoNormal and AutoMeanField, and the median ratio."""
    svis = {
        "AutoNormal": make_svi(AutoNormal, elbo_class),
        "AutoMeanField": make_svi(AutoMeanField, elbo_class),
    }
    for svi in svis.values():  # set up and warm up
        time_block(svi, y, steps)
    times: dict[str, list[float]] = {k: [] for k in svis}
    ratios = []
    for rep in range(reps):
        order = list(svis) if rep % 2 == 0 else list(reversed(svis))
        t = {name: time_block(svis[name], y, steps) for name in order}
        for name, v in t.items():
            times[name].append(v)
        ratios.append(t["AutoMeanField"] / t["AutoNormal"])
    return (
        statistics.median(times["AutoNormal"]),
        statistics.median(times["AutoMeanField"]),
        statistics.median(ratios),
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=100)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--smoke", action="store_true", help="a few-second run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.reps, args.steps = 3, 5
    torch.set_num_threads(1)
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    y = torch.randn(args.groups) * 2 + 1
    print(f"model: 3 global sites + {args.groups} local sites; {args.reps} x {args.steps} steps")
    for elbo_class in (pyro.infer.Trace_ELBO, TraceSTL_ELBO):
        t_normal, t_mf, ratio = measure(elbo_class, y, args.reps, args.steps)
        label = f"{elbo_class.__module__.split('.')[0]}.{elbo_class.__name__}"
        print(
            f"{label:30s} "
            f"AutoNormal {t_normal * 1e3:6.2f} ms/step  AutoMeanField(Normal) {t_mf * 1e3:6.2f} "
            f"ms/step  ratio {ratio:.3f} (target <= 1.1)"
        )


if __name__ == "__main__":
    main()
