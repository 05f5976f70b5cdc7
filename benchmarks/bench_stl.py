"""TraceSTL_ELBO vs Pyro's Trace_ELBO: time per SVI step, graph memory, gradient variance.

Run: ``python benchmarks/bench_stl.py`` (add ``--quick`` for a short run).

(a) a VAE on binarized 8x8 digits and (b) a hierarchical model with AutoNormal: per-step
time and saved-for-backward memory of STL over Trace_ELBO, measured side by side
(interleaved) in one process, one thread. Targets: time <= 1.03, memory <= 1.02.
(d) AutoNormal over 1 to 800 scalar sites (target at 800: <= 1.06, no per-site term that
grows with the number of sites) and a 20-site conditional chain guide (target <= 1.15).
(b') ``stick_the_landing`` inside Pyro's own ``Trace_ELBO`` (hierarchical model, VAE) and
``TraceEnum_ELBO`` (a Gaussian mixture with enumerated assignments) over the plain
ELBO, and inside ``JitTrace_ELBO`` over plain ``JitTrace_ELBO`` (also printed: the JIT's
step time over the non-JIT ``Trace_ELBO``'s): target <= 1.03.
Times are CPU seconds of this thread (``time.thread_time``), medians over interleaved rounds.
(c) gradient variance of both estimators on a conjugate Gaussian model at several
distances from the exact posterior (mean shifted by ``t`` posterior sds, scale multiplied
by ``exp(t/2)``): STL/Trace variance ratio, which goes to 0 at the posterior.
"""

from __future__ import annotations

import argparse

import pyro
import pyro.distributions as dist
import torch
from _common import (
    add_results_argument,
    gaussian_problem,
    place_guide,
    print_table,
    recording,
    saved_tensor_bytes,
    time_interleaved,
)
from pyro.infer import SVI
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch.distributions import constraints

from pyro_gradroute.app.models.digits_vae import VAE, load_binarized_digits
from pyro_gradroute.infer import TraceSTL_ELBO
from pyro_gradroute.poutine import stick_the_landing


def _svi_steps(model, args, runs):
    """``{name: one SVI step}`` for ``runs = {name: (guide, elbo)}`` (Adam, lr 1e-3)."""
    out = {}
    for name, (guide, elbo) in runs.items():
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), elbo)
        out[name] = lambda svi=svi: svi.step(*args)
    return out


def _measure(steps, rounds, memory=("Trace_ELBO", "TraceSTL_ELBO"), collect=False):
    """Interleaved step times and the graph memory of the ``memory`` candidates."""
    t = time_interleaved(steps, rounds, collect=collect)
    return t, {k: saved_tensor_bytes(steps[k]) for k in memory}


def bench_vae(rounds):
    pyro.clear_param_store()
    train, _ = load_binarized_digits()
    vae = VAE()
    runs = {
        "Trace_ELBO": (vae.guide, PyroTrace_ELBO()),
        "TraceSTL_ELBO": (vae.guide, TraceSTL_ELBO()),
    }
    return _measure(_svi_steps(vae.model, (train[:256],), runs), rounds)


def bench_handler_vae(rounds):
    """``stick_the_landing(vae.guide)`` in Pyro's ``Trace_ELBO`` over the plain guide."""
    pyro.clear_param_store()
    train, _ = load_binarized_digits()
    vae = VAE()
    runs = {
        "Trace_ELBO": (vae.guide, PyroTrace_ELBO()),
        "TraceSTL_ELBO": (stick_the_landing(vae.guide), PyroTrace_ELBO()),
    }
    return _measure(_svi_steps(vae.model, (train[:256],), runs), rounds)


def hierarchical_model(y, sigma):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("groups", len(y)):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def _hierarchical(J):
    """Fresh param store, the data ``(y, sigma)`` and an initialised ``AutoNormal`` guide."""
    pyro.clear_param_store()
    g = torch.Generator().manual_seed(0)
    args = (3 + 2 * torch.randn(J, generator=g), 1 + torch.rand(J, generator=g))
    guide = AutoNormal(hierarchical_model)
    guide(*args)
    return args, guide


def bench_hierarchical(rounds, J=200):
    args, guide = _hierarchical(J)
    runs = {"Trace_ELBO": (guide, PyroTrace_ELBO()), "TraceSTL_ELBO": (guide, TraceSTL_ELBO())}
    return _measure(_svi_steps(hierarchical_model, args, runs), rounds)


def bench_handler_hierarchical(rounds, J=200):
    args, guide = _hierarchical(J)
    runs = {
        "Trace_ELBO": (guide, PyroTrace_ELBO()),
        "TraceSTL_ELBO": (stick_the_landing(guide), PyroTrace_ELBO()),
    }
    return _measure(_svi_steps(hierarchical_model, args, runs), rounds)


def bench_jit_hierarchical(rounds, J=200):
    """``stick_the_landing`` in ``JitTrace_ELBO`` over plain ``JitTrace_ELBO``; JIT over non-JIT."""
    import warnings

    from pyro.infer import JitTrace_ELBO

    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
    args, guide = _hierarchical(J)
    runs = {
        "Trace_ELBO": (guide, JitTrace_ELBO()),
        "TraceSTL_ELBO": (stick_the_landing(guide), JitTrace_ELBO()),
        "non-JIT": (guide, PyroTrace_ELBO()),
    }
    t, m = _measure(_svi_steps(hierarchical_model, args, runs), rounds)
    print(
        f"JitTrace_ELBO / Trace_ELBO step time (hierarchical J={J}): {t['Trace_ELBO'] / t['non-JIT']:.3f}"
    )
    return t, m


def mixture_model(data):
    with pyro.plate("components", 3):
        locs = pyro.sample("locs", dist.Normal(0.0, 5.0))
    with pyro.plate("data", len(data)):
        k = pyro.sample("k", dist.Categorical(torch.ones(3) / 3), infer={"enumerate": "parallel"})
        pyro.sample("x", dist.Normal(locs[k], 0.5), obs=data)


def mixture_guide(data):
    m = pyro.param("m", torch.tensor([-2.0, 0.0, 2.0]))
    s = pyro.param("s", torch.full((3,), 0.3), constraint=constraints.positive)
    with pyro.plate("components", 3):
        pyro.sample("locs", dist.Normal(m, s))


def bench_enum_mixture(rounds, n=500):
    from pyro.infer import TraceEnum_ELBO

    pyro.clear_param_store()
    g = torch.Generator().manual_seed(0)
    data = torch.cat(
        [torch.randn(n // 2, generator=g) - 2, torch.randn(n - n // 2, generator=g) + 2]
    )
    runs = {
        "Trace_ELBO": (mixture_guide, TraceEnum_ELBO(max_plate_nesting=1)),
        "TraceSTL_ELBO": (stick_the_landing(mixture_guide), TraceEnum_ELBO(max_plate_nesting=1)),
    }
    return _measure(_svi_steps(mixture_model, (data,), runs), rounds)


def many_sites_model(n):
    for i in range(n):
        pyro.sample(f"z{i}", dist.Normal(0.0, 1.0))
    pyro.sample("x", dist.Normal(0.0, 1.0), obs=torch.tensor(0.3))


def bench_many_sites(rounds, n):
    """AutoNormal over ``n`` scalar latent sites: per-site cost (loss_and_grads, no optimizer)."""
    pyro.clear_param_store()
    model = lambda: many_sites_model(n)  # noqa: E731
    guide = AutoNormal(model)
    guide()
    steps = {}
    for name, elbo in (("Trace_ELBO", PyroTrace_ELBO()), ("TraceSTL_ELBO", TraceSTL_ELBO())):
        steps[name] = lambda elbo=elbo: elbo.loss_and_grads(model, guide)
    # ~0.5 s steps at n = 800; from 100 sites on a full collection before each (large traces)
    return _measure(steps, min(rounds, max(9, 4000 // n)), collect=n >= 100)


def chain_model(T=20):
    prev = torch.tensor(0.0)
    for t in range(T):
        prev = pyro.sample(f"z{t}", dist.Normal(0.9 * prev, 1.0))
        pyro.sample(f"x{t}", dist.Normal(prev, 0.5), obs=torch.tensor(0.1 * t))


def chain_guide(T=20):
    a = pyro.param("ch_a", torch.full((T,), 0.5))
    b = pyro.param("ch_b", torch.zeros(T))
    s = pyro.param("ch_s", torch.full((T,), 0.5), constraint=constraints.positive)
    prev = torch.tensor(0.0)
    for t in range(T):
        prev = pyro.sample(f"z{t}", dist.Normal(a[t] * prev + b[t], s[t]))


def bench_chain(rounds):
    """A 20-site conditional chain guide q(z_t | z_{t-1})."""
    pyro.clear_param_store()
    runs = {
        "Trace_ELBO": (chain_guide, PyroTrace_ELBO()),
        "TraceSTL_ELBO": (chain_guide, TraceSTL_ELBO()),
    }
    return _measure(_svi_steps(chain_model, (), runs), rounds)


def variance_vs_distance(distances, draws):
    """Total gradient variance of STL and Trace_ELBO at guides ``t`` posterior-sds away."""
    model, guide, post_mean, post_sd = gaussian_problem()

    rows = []
    for t in distances:
        place_guide(guide, post_mean, post_sd, t)
        store = pyro.get_param_store()
        var = {}
        for name, elbo in (("Trace_ELBO", PyroTrace_ELBO()), ("TraceSTL_ELBO", TraceSTL_ELBO())):
            gs = []
            for _ in range(draws):
                for p in store._params.values():
                    p.grad = None
                elbo.loss_and_grads(model, guide)
                gs.append(torch.cat([p.grad.reshape(-1) for p in store._params.values()]))
            var[name] = torch.stack(gs).var(0).sum().item()
        rows.append(
            (
                t,
                f"{var['Trace_ELBO']:.3g}",
                f"{var['TraceSTL_ELBO']:.3g}",
                f"{var['TraceSTL_ELBO'] / var['Trace_ELBO']:.3g}",
            )
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    parser.add_argument("--only", default=None, help="run the cases whose name contains this")
    parser.add_argument("--no-variance", action="store_true", help="skip the variance table")
    add_results_argument(parser)
    args = parser.parse_args(argv)
    with recording(args.results, argv):
        torch.set_num_threads(1)
        pyro.set_rng_seed(0)
        rounds = 20 if args.quick else 600  # (medians of 200 moved by about 0.01 between runs)
        rows = []
        cases = (
            ("digits VAE (batch 256)", bench_vae),
            ("hierarchical, AutoNormal (J=200)", lambda r: bench_hierarchical(r, J=200)),
            ("hierarchical, AutoNormal (J=5000)", lambda r: bench_hierarchical(r, J=5000)),
            ("stick_the_landing in Pyro's Trace_ELBO (J=200)", bench_handler_hierarchical),
            ("stick_the_landing in Pyro's Trace_ELBO (digits VAE)", bench_handler_vae),
            ("stick_the_landing in TraceEnum_ELBO (mixture)", bench_enum_mixture),
            ("stick_the_landing in JitTrace_ELBO (J=200)", bench_jit_hierarchical),
            *(
                (
                    f"AutoNormal, {n} latent sites (loss_and_grads)",
                    lambda r, n=n: bench_many_sites(r, n),
                )
                for n in (1, 100, 400, 800)
            ),
            ("conditional chain guide, 20 sites", bench_chain),
        )
        for name, fn in cases:
            if args.only and args.only not in name:
                continue
            t, m = fn(rounds)
            rows.append(
                (
                    name,
                    f"{1e3 * t['Trace_ELBO']:.2f}",
                    f"{1e3 * t['TraceSTL_ELBO']:.2f}",
                    f"{t['TraceSTL_ELBO'] / t['Trace_ELBO']:.3f}",
                    f"{m['TraceSTL_ELBO'] / m['Trace_ELBO']:.3f}",
                )
            )
        print(
            "STL over Trace (targets: TraceSTL_ELBO time <= 1.03, memory <= 1.02; handler <= 1.03; "
            "800 sites <= 1.06; chain <= 1.15)"
        )
        print_table(rows, ("model", "Trace ms/step", "STL ms/step", "time ratio", "memory ratio"))
        if args.no_variance:
            return
        print()
        print("Gradient variance vs distance from the posterior (D=10 conjugate Gaussian)")
        distances = [0.0, 0.1, 0.3, 1.0, 2.0, 3.0, 5.0]
        print_table(
            variance_vs_distance(distances, 50 if args.quick else 300),
            ("distance (post. sds)", "Var Trace", "Var STL", "STL/Trace"),
        )


if __name__ == "__main__":
    main()
