"""Flow guides: STL / Trace_ELBO and DReG / IWAE step time, and the triangular-solve iteration counts.

Run: ``python benchmarks/bench_flows.py`` (add ``--quick`` for a short run, a few minutes;
``--only NAME`` for the guides whose name contains NAME, ``--no-solves`` to skip (b),
``--floor`` to replace the forward-carried gradient by zeros: the general split's own cost).

(a) Per-step time of ``TraceSTL_ELBO`` over Pyro's ``Trace_ELBO`` (8 vectorized particles)
and of ``TraceDReG_ELBO`` over Pyro's ``RenyiELBO(alpha=0)`` (IWAE, K=16), side by side
(interleaved) in one process, one thread, CPU time, on a D-dimensional Gaussian-means model
(``z ~ N(0, I_D)``, 20 observations ``x_i ~ N(z, I)``), for ``AutoIAFNormal``,
``AutoNormalizingFlow`` with ``affine_coupling``, two ``planar`` layers and one
``sylvester`` layer. The pathwise part of every flow is carried forward
(``pyro_gradroute.distributions.flows``): no inverse runs. Targets (STL/Trace):
AutoIAFNormal D=64 <= 2.0, D=16 <= 1.5; affine coupling D=64 <= 1.15; Planar,
Sylvester <= 1.2.

(b) Iterations (VJPs) of the triangular solves of an ``AutoIAFNormal`` guide on the
bundled eight-schools model (D=10), at initialisation and after 2000 ``TraceSTL_ELBO``
steps (500 with ``--quick``): min / median / max over 50 draws of 8 particles.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import pyro
import pyro.distributions as dist
import pyro.distributions.transforms as T
import torch
from _common import add_results_argument, print_table, recording, time_interleaved
from pyro.infer import SVI, RenyiELBO
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoIAFNormal, AutoNormalizingFlow

from pyro_gradroute.distributions import flows
from pyro_gradroute.infer import TraceDReG_ELBO, TraceSTL_ELBO


def means_model(x):
    D = x.size(-1)
    z = pyro.sample("z", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    with pyro.plate("data", x.size(0)):
        pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=x)


GUIDES = {
    "AutoDiagonalNormal (no flow: the split's own cost)": lambda m: AutoDiagonalNormal(m),
    "AutoIAFNormal": lambda m: AutoIAFNormal(m),
    "affine_coupling": lambda m: AutoNormalizingFlow(m, T.affine_coupling),
    "planar (2 layers)": lambda m: AutoNormalizingFlow(
        m, functools.partial(T.iterated, 2, T.planar)
    ),
    "sylvester": lambda m: AutoNormalizingFlow(
        m, functools.partial(T.sylvester, count_transforms=2)
    ),
}


def _steps(model, guide, args, elbos):
    out = {}
    for name, elbo in elbos.items():
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), elbo)
        out[name] = lambda svi=svi: svi.step(*args)
    return out


def bench_step_time(name, D, rounds):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x = torch.randn(20, D) + 0.5
    guide = GUIDES[name](means_model)
    guide(x)
    steps = _steps(
        means_model,
        guide,
        (x,),
        {
            "Trace": PyroTrace_ELBO(num_particles=8, vectorize_particles=True),
            "STL": TraceSTL_ELBO(num_particles=8, vectorize_particles=True),
            "IWAE": RenyiELBO(alpha=0, num_particles=16, vectorize_particles=True),
            "DReG": TraceDReG_ELBO(num_particles=16),
        },
    )
    t = time_interleaved(steps, rounds)
    return t["STL"] / t["Trace"], t["DReG"] / t["IWAE"], t["Trace"]


def iteration_counts(steps, draws=50):
    from pyro_gradroute.app.models.eight_schools import SIGMA, Y, model

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoIAFNormal(model)
    elbo = TraceSTL_ELBO(num_particles=8, vectorize_particles=True)

    def counts():
        with flows.record_solves() as recs:
            for _ in range(draws):
                elbo.loss_and_grads(model, guide, SIGMA, Y)
        for p in guide.parameters():
            p.grad = None
        its = [r.iterations for r in recs]
        return min(its), statistics.median(its), max(its), max(r.residual for r in recs)

    guide(SIGMA, Y)
    at_init = counts()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 5e-3}), elbo)
    for _ in range(steps):
        svi.step(SIGMA, Y)
    return at_init, counts(), guide.latent_dim


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer rounds and training steps")
    ap.add_argument("--only", action="append", help="guides whose name contains this")
    ap.add_argument("--dims", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--no-solves", action="store_true", help="skip (b)")
    ap.add_argument("--floor", action="store_true", help="(a) with the rules' gradient set to 0")
    add_results_argument(ap)
    args = ap.parse_args(argv)
    with recording(args.results, argv):
        if args.floor:  # not an estimator: the cost of everything but the rules
            flows.FlowPath.target_grad = lambda self: torch.zeros_like(self.target)
        torch.set_num_threads(1)
        rounds = 20 if args.quick else 100
        rows = []
        names = [n for n in GUIDES if not args.only or any(o in n for o in args.only)]
        for name in names:
            for D in args.dims:
                stl, dreg, base = bench_step_time(name, D, rounds)
                rows.append((name, D, f"{stl:.2f}", f"{dreg:.2f}", f"{1e3 * base:.1f}"))
                print(*rows[-1], flush=True)
        print()
        print("(a) step time, one thread, median CPU time of interleaved rounds")
        print_table(
            rows, ("guide", "D", "STL/Trace (8 particles)", "DReG/IWAE (K=16)", "Trace ms/step")
        )
        if args.no_solves:
            return
        steps = 500 if args.quick else 2000
        init, trained, D = iteration_counts(steps)
        print()
        print(f"(b) triangular-solve iterations, AutoIAFNormal on eight schools (D={D}), float32")
        print_table(
            [
                ("initialisation", *init[:3], f"{init[3]:.2g}"),
                (f"after {steps} STL steps", *trained[:3], f"{trained[3]:.2g}"),
            ],
            ("", "min", "median", "max", "max residual"),
        )


if __name__ == "__main__":
    main()
