"""TraceAdaptiveSTL_ELBO / TraceAdaptiveDReG_ELBO against the estimators they mix, side by side.

Run: ``python benchmarks/bench_adaptive.py`` (add ``--quick`` for a short, noisier run).

(a) Gradient variance on the D=10 conjugate Gaussian at guides ``t`` posterior sds away
    (mean shifted by ``t`` sds, scale multiplied by ``exp(t/2)``), parameters held fixed,
    after 300 warm-up calls of ``loss_and_grads``: Var(adaptive) / min(Var STL, Var Trace)
    (the per-element mix on every draw, ``mix_gain=None``; by default a draw where the mix
    would not pay for its cost takes the better endpoint),
    and Var(adaptive DReG) / min(Var IWAE, Var DReG) with K=8 (target <= 0.5 at 0.3-5 sds).
(b) The same ratios along training (Adam, adaptive estimator) of the digits VAE and of a
    hierarchical model with AutoNormal, at early / middle / late steps: guide parameters,
    draws at the frozen parameters, the adaptive estimator continuing with the moments it
    learned in training (target <= 1.0).
(c) Held-out ELBO of the digits VAE after the same number of steps, paired seeds:
    adaptive vs Trace_ELBO and STL; held-out log-likelihood (IWAE bound, K=200) for
    adaptive DReG vs IWAE and DReG (K=8).
(d) Time per SVI step (``--cost``: only this; mean CPU time over the steps after the first
    100 of Adam at lr 1e-3) and memory over Trace_ELBO (targets <= 1.15 and <= 1.1): graph
    memory saved for backward plus the estimator's moment buffers; by default (direct steps
    where the mix does not pay) and with every step measured (``mix_gain=None``).

``--training``: whole training runs from the initialisations users have (Pyro's own
settings), paired seeds: the final ELBO (a 2000-draw estimate at the fitted guide) of
Pyro's ``Trace_ELBO``, ``TraceSTL_ELBO`` and ``TraceAdaptiveSTL_ELBO()`` (plus any
``--variant`` settings of it), and the paired differences with their SEs (target: the
adaptive estimator >= Trace_ELBO - 2 SE on every model, and >= STL - 2 SE). Models:

* eight schools, Pyro's ``examples/eight_schools/svi.py`` model and guide (scales
  initialised at ``0.1 * rand``, Adam lr 0.01, 1000 steps); the guide's ``eta`` has
  shape ``(8,)`` (the example's ``(8, 1)`` no longer matches the model in Pyro 1.9);
* the Bayesian-regression tutorial: ``PyroModule[nn.Linear]`` with ``AutoDiagonalNormal``
  on scikit-learn's diabetes data (features and target standardized), Adam lr 0.03,
  1000 steps;
* a hierarchical normal model (J=50 groups) with ``AutoNormal`` (``init_scale=0.1``),
  Adam lr 0.01, 1000 steps.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import pyro
import pyro.distributions as dist
import torch
from _common import (
    ES_SIGMA,
    ES_Y,
    bayesian_regression,
    es_guide,
    es_model,
    gaussian_problem,
    place_guide,
    print_table,
    saved_tensor_bytes,
    time_interleaved,
)
from pyro.infer import SVI, RenyiELBO
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal

from pyro_gradroute.app.models.digits_vae import VAE, load_binarized_digits
from pyro_gradroute.infer import (
    Trace_ELBO,
    TraceAdaptiveDReG_ELBO,
    TraceAdaptiveSTL_ELBO,
    TraceDReG_ELBO,
    TraceSTL_ELBO,
)


# ----------------------------------------------------------------------------- helpers
def _params(names=None):
    store = pyro.get_param_store()
    keys = sorted(store.keys()) if names is None else names
    return [(k, store._params[k]) for k in keys]


def draws(elbo, model, guide, n, args=(), names=None):
    """``n`` gradient draws (flattened over ``names``) at fixed parameters."""
    ps = _params(names)
    out = []
    for _ in range(n):
        for _, p in ps:
            p.grad = None
        elbo.loss_and_grads(model, guide, *args)
        out.append(
            torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for _, p in ps]
            )
        )
    for _, p in ps:
        p.grad = None
    return torch.stack(out)


def total_var(g):
    return g.var(0).sum().item()


# ----------------------------------------------------------------------------- (a)
def variance_table(distances, n_draws, warmup=300, K=8, raw=None):
    """Variance ratios per distance; ``raw`` (a dict) also receives ``{distance: {estimator: variance}}``."""
    model, guide, post_mean, post_sd = gaussian_problem()
    rows = []
    for t in distances:
        place_guide(guide, post_mean, post_sd, t)
        v = {}
        for name, elbo in (
            ("trace", Trace_ELBO()),
            ("stl", TraceSTL_ELBO()),
            ("adaptive", TraceAdaptiveSTL_ELBO(mix_gain=None)),  # the mix on every step
            (
                "iwae",
                RenyiELBO(alpha=0, num_particles=K, vectorize_particles=True, max_plate_nesting=1),
            ),
            ("dreg", TraceDReG_ELBO(num_particles=K, max_plate_nesting=1)),
            ("adaptive-dreg", TraceAdaptiveDReG_ELBO(num_particles=K, max_plate_nesting=1)),
        ):
            if name.startswith("adaptive"):
                draws(elbo, model, guide, warmup)
            v[name] = total_var(draws(elbo, model, guide, n_draws))
        if raw is not None:
            raw[t] = dict(v)
        rows.append(
            (
                t,
                f"{v['stl'] / v['trace']:.3g}",
                f"{v['adaptive'] / min(v['stl'], v['trace']):.3f}",
                f"{v['dreg'] / v['iwae']:.3g}",
                f"{v['adaptive-dreg'] / min(v['dreg'], v['iwae']):.3f}",
            )
        )
    return rows


# ----------------------------------------------------------------------------- (b)
def hierarchical_model(y, sigma):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("groups", len(y)):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def hierarchical_data(J=50):
    g = torch.Generator().manual_seed(0)
    y = 3 + 2 * torch.randn(J, generator=g)
    sigma = 1 + torch.rand(J, generator=g)
    return y, sigma


def along_training(problem, checkpoints, n_draws, lr):
    """Var ratios at the checkpoints of one Adam run driven by the adaptive estimator."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, guide, args, guide_names = problem()
    elbo = TraceAdaptiveSTL_ELBO()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), elbo)
    rows, step = [], 0
    for c in checkpoints:
        while step < c:
            svi.step(*args)
            step += 1
        names = guide_names()
        frozen = copy.deepcopy(elbo.state_dict())
        frozen["mix_gain"] = None  # the variance of the mix itself, on every draw
        probe = TraceAdaptiveSTL_ELBO()
        probe.load_state_dict(frozen)  # continues from the moments training learned
        v = {
            "trace": total_var(draws(Trace_ELBO(), model, guide, n_draws, args, names)),
            "stl": total_var(draws(TraceSTL_ELBO(), model, guide, n_draws, args, names)),
            "adaptive": total_var(draws(probe, model, guide, n_draws, args, names)),
        }
        rows.append(
            (c, f"{v['stl'] / v['trace']:.3g}", f"{v['adaptive'] / min(v['stl'], v['trace']):.3f}")
        )
    return rows


def vae_problem(batch=128):
    train, _ = load_binarized_digits()
    vae = VAE()
    x = train[:batch]

    def names():
        return sorted(k for k in pyro.get_param_store().keys() if k.startswith("encoder"))

    return vae.model, vae.guide, (x,), names


def hier_problem(J=50):
    y, sigma = hierarchical_data(J)
    guide = AutoNormal(hierarchical_model)

    def names():
        return sorted(pyro.get_param_store().keys())

    return hierarchical_model, guide, (y, sigma), names


# ----------------------------------------------------------------------------- (c)
def train_vae(make_elbo, steps, seed, batch=128, lr=3e-3):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    train, test = load_binarized_digits()
    vae = VAE()
    svi = SVI(vae.model, vae.guide, pyro.optim.Adam({"lr": lr}), make_elbo())
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(len(train), (batch,), generator=g)
        svi.step(train[idx])
    pyro.set_rng_seed(10_000 + seed)
    with torch.no_grad():
        elbo = -Trace_ELBO(num_particles=20, vectorize_particles=True, max_plate_nesting=1).loss(
            vae.model, vae.guide, test
        ) / len(test)
        ll = -RenyiELBO(
            alpha=0, num_particles=200, vectorize_particles=True, max_plate_nesting=1
        ).loss(vae.model, vae.guide, test) / len(test)
    return elbo, ll


def heldout_table(steps, seeds, K=8):
    cands = {
        "Trace_ELBO": lambda: Trace_ELBO(),
        "TraceSTL_ELBO": lambda: TraceSTL_ELBO(),
        "TraceAdaptiveSTL_ELBO": lambda: TraceAdaptiveSTL_ELBO(),
        f"IWAE (K={K})": lambda: RenyiELBO(
            alpha=0, num_particles=K, vectorize_particles=True, max_plate_nesting=1
        ),
        f"TraceDReG_ELBO (K={K})": lambda: TraceDReG_ELBO(num_particles=K, max_plate_nesting=1),
        f"TraceAdaptiveDReG_ELBO (K={K})": lambda: TraceAdaptiveDReG_ELBO(
            num_particles=K, max_plate_nesting=1
        ),
    }
    res = {k: [train_vae(f, steps, s) for s in seeds] for k, f in cands.items()}
    rows = []
    for k, vals in res.items():
        e = [v[0] for v in vals]
        ll = [v[1] for v in vals]
        rows.append(
            (
                k,
                " ".join(f"{x:.3f}" for x in e),
                f"{sum(e) / len(e):.3f}",
                " ".join(f"{x:.3f}" for x in ll),
                f"{sum(ll) / len(ll):.3f}",
            )
        )
    return rows


# ----------------------------------------------------------------------------- (d)
def buffer_bytes(elbo) -> int:
    """Bytes of the estimator's moment buffers (distinct storages)."""
    cv = getattr(elbo, "control_variate", None)
    if cv is None:
        return 0
    seen = {}
    for st in cv.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                storage = v.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def cost_table(rounds, settle=100):
    rows = []
    for label, problem, K in (
        ("digits VAE (batch 128)", vae_problem, 1),
        ("hierarchical, AutoNormal (J=200)", lambda: hier_problem(200), 1),
        ("digits VAE (batch 128), K=8", vae_problem, 8),
    ):
        pyro.clear_param_store()
        model, guide, args, _ = problem()
        if K == 1:
            elbos = {
                "base": Trace_ELBO(),
                "adaptive": TraceAdaptiveSTL_ELBO(),
                "measured": TraceAdaptiveSTL_ELBO(mix_gain=None),
            }
        else:
            elbos = {
                "base": RenyiELBO(
                    alpha=0, num_particles=K, vectorize_particles=True, max_plate_nesting=1
                ),
                "dreg": TraceDReG_ELBO(num_particles=K, max_plate_nesting=1),
                "adaptive": TraceAdaptiveDReG_ELBO(num_particles=K, max_plate_nesting=1),
            }
        steps = {}
        for name, elbo in elbos.items():
            svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), elbo)
            steps[name] = lambda svi=svi, args=args: svi.step(*args)
        for _ in range(settle):  # past the first steps, which always measure
            for f in steps.values():
                f()
        t = time_interleaved(steps, rounds, mean=True)
        mem = {k: saved_tensor_bytes(f) + buffer_bytes(elbos[k]) for k, f in steps.items()}
        base = "Trace_ELBO" if K == 1 else f"IWAE (K={K})"
        rows.append(
            (
                label,
                base,
                f"{1e3 * t['base']:.2f}",
                f"{1e3 * t['adaptive']:.2f}",
                f"{t['adaptive'] / t['base']:.3f}",
                f"{mem['adaptive'] / mem['base']:.3f}",
            )
        )
        if "measured" in t:
            rows.append(
                (
                    label + ", every step measured (mix_gain=None)",
                    base,
                    f"{1e3 * t['base']:.2f}",
                    f"{1e3 * t['measured']:.2f}",
                    f"{t['measured'] / t['base']:.3f}",
                    f"{mem['measured'] / mem['base']:.3f}",
                )
            )
        if "dreg" in t:
            rows.append(
                (
                    label,
                    "TraceDReG_ELBO",
                    f"{1e3 * t['dreg']:.2f}",
                    f"{1e3 * t['adaptive']:.2f}",
                    f"{t['adaptive'] / t['dreg']:.3f}",
                    f"{mem['adaptive'] / mem['dreg']:.3f}",
                )
            )
    return rows


def variance_figure(path, distances=(0.1, 0.3, 1.0, 2.0, 3.0, 5.0, 8.0), n_draws=200, warmup=100):
    """A log-log figure of total guide-gradient variance against distance, six estimators."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    raw: dict = {}
    variance_table(list(distances), n_draws, warmup=warmup, raw=raw)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("trace", "stl", "adaptive", "iwae", "dreg", "adaptive-dreg"):
        ax.plot(list(raw), [raw[t][name] for t in raw], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("distance of the guide from the posterior (posterior sds)")
    ax.set_ylabel("total guide-gradient variance")
    ax.set_title(f"D=10 conjugate Gaussian, fixed parameters ({n_draws} draws)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- --training
def _diabetes():
    from sklearn.datasets import load_diabetes

    d = load_diabetes()
    x = torch.tensor(d.data, dtype=torch.get_default_dtype())
    y = torch.tensor(d.target, dtype=torch.get_default_dtype())
    return (x - x.mean(0)) / x.std(0), (y - y.mean()) / y.std()


def training_problems():
    """``{name: () -> (model, guide, args, lr, steps, max_plate_nesting)}``, Pyro's settings."""

    def eight_schools():
        return es_model, es_guide, (torch.stack([ES_Y, ES_SIGMA], 1),), 0.01, 1000, 0

    def regression():
        x, y = _diabetes()
        model = bayesian_regression(x.shape[1])
        return model, AutoDiagonalNormal(model), (x, y), 0.03, 1000, 1

    def hierarchical():
        return (
            hierarchical_model,
            AutoNormal(hierarchical_model),
            hierarchical_data(50),
            0.01,
            1000,
            1,
        )

    return {"eight schools": eight_schools, "regression": regression, "hierarchical": hierarchical}


def final_elbo(model, guide, args, mpn, draws=2000, chunk=100) -> float:
    """A ``draws``-draw estimate of the ELBO at the current guide (Pyro's ``Trace_ELBO``)."""
    est = PyroTrace_ELBO(num_particles=chunk, max_plate_nesting=mpn)
    with torch.no_grad():
        return -sum(est.loss(model, guide, *args) for _ in range(draws // chunk)) / (draws // chunk)


def train_final_elbo(problem, make_elbo, seed: int) -> float:
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    model, guide, args, lr, steps, mpn = problem()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), make_elbo(mpn))
    for _ in range(steps):
        svi.step(*args)
    pyro.set_rng_seed(10_000 + seed)
    return final_elbo(model, guide, args, mpn)


def _paired(a, b) -> str:
    d = [x - y for x, y in zip(a, b)]
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.nan
    return f"{statistics.mean(d):+.2f} +/- {se:.2f}"


def _parse_variant(spec: str) -> dict:
    out = {}
    for item in spec.split(","):
        k, v = item.split("=")
        out[k.strip()] = float(v) if k.strip() != "warmup" else int(v)
    return out


def training_table(seeds, models=None, variants=(), on_model=None):
    """Rows per model and estimator: final ELBOs by seed, mean, paired differences.

    ``on_model(rows)`` (optional) receives each model's rows as soon as they are measured.
    """
    cands = {
        "Trace_ELBO (Pyro)": lambda mpn: PyroTrace_ELBO(max_plate_nesting=mpn),
        "TraceSTL_ELBO": lambda mpn: TraceSTL_ELBO(max_plate_nesting=mpn),
        "TraceAdaptiveSTL_ELBO()": lambda mpn: TraceAdaptiveSTL_ELBO(max_plate_nesting=mpn),
    }
    for spec in variants:
        kw = _parse_variant(spec)
        cands[f"adaptive({spec})"] = lambda mpn, kw=kw: TraceAdaptiveSTL_ELBO(
            max_plate_nesting=mpn, **kw
        )
    rows = []
    for name, problem in training_problems().items():
        if models and name not in models:
            continue
        res = {k: [train_final_elbo(problem, f, s) for s in seeds] for k, f in cands.items()}
        trace, stl = res["Trace_ELBO (Pyro)"], res["TraceSTL_ELBO"]
        mine = [
            (
                name,
                k,
                f"{statistics.mean(v):.2f}",
                _paired(v, trace),
                _paired(v, stl),
                " ".join(f"{x:.2f}" for x in v),
            )
            for k, v in res.items()
        ]
        if on_model is not None:
            on_model(mine)
        rows += mine
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer draws, steps and rounds (noisier)"
    )
    parser.add_argument(
        "--figure",
        metavar="PNG",
        help="only draw the variance-vs-distance figure of the six estimators into PNG",
    )
    parser.add_argument(
        "--training",
        action="store_true",
        help="only the training runs from Pyro's initialisations (final ELBO, paired seeds)",
    )
    parser.add_argument("--seeds", type=int, default=5, help="paired seeds of --training")
    parser.add_argument("--cost", action="store_true", help="only (d), the cost per step")
    parser.add_argument(
        "--models", nargs="*", help="--training models (default: all): eight schools, ..."
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="K=V,...",
        help="--training: also TraceAdaptiveSTL_ELBO(K=V, ...), e.g. decay=0.99,confidence=1",
    )
    args = parser.parse_args(argv)
    if args.training:
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        seeds = tuple(range(args.seeds))
        print(
            f"Training from Pyro's initialisations, {len(seeds)} paired seeds: final ELBO "
            "(2000 draws); paired differences +/- SE"
        )
        header = ("model", "estimator", "mean ELBO", "vs Trace_ELBO", "vs STL", "by seed")

        def show(rows):
            print_table(rows, header)
            print(flush=True)

        training_table(seeds, args.models, args.variant, on_model=show)
        print(f"\n(total {time.perf_counter() - t0:.0f} s)")
        return
    if args.figure:
        torch.set_num_threads(1)
        pyro.set_rng_seed(0)
        print(variance_figure(args.figure))
        return
    torch.set_num_threads(1)
    pyro.set_rng_seed(0)
    q = args.quick
    t0 = time.perf_counter()

    print(
        "(d) Cost per SVI step over the base estimator, mean CPU time over the steps after "
        "the first 100 (targets: time <= 1.15, memory <= 1.1)"
    )
    print_table(
        cost_table(20 if q else 150, settle=20 if q else 100),
        ("model", "base", "base ms", "adaptive ms", "time ratio", "memory ratio"),
    )
    print()
    if args.cost:
        return
    print(
        "(a) Gradient variance vs distance from the posterior (D=10 conjugate Gaussian, fixed params, 300 warm-up calls)"
    )
    dist_list = [0.3, 1.0, 3.0] if q else [0.1, 0.3, 1.0, 2.0, 3.0, 5.0, 8.0]
    print_table(
        variance_table(dist_list, 100 if q else 1000),
        (
            "distance (sds)",
            "STL/Trace",
            "adaptive/min(STL,Trace)",
            "DReG/IWAE (K=8)",
            "adaptive-DReG/min(IWAE,DReG)",
        ),
    )
    print()
    n_draws = 50 if q else 400
    for label, problem, cps, lr in (
        (
            "digits VAE (batch 128, lr 3e-3)",
            vae_problem,
            (10, 50, 150) if q else (20, 300, 1500),
            3e-3,
        ),
        (
            "hierarchical, AutoNormal (J=50, lr 0.02)",
            hier_problem,
            (10, 50, 150) if q else (20, 300, 1500),
            0.02,
        ),
    ):
        print(f"(b) Along training: {label}; guide parameters; target adaptive/min <= 1")
        print_table(
            along_training(problem, cps, n_draws, lr),
            ("step", "STL/Trace", "adaptive/min(STL,Trace)"),
        )
        print()
    steps, seeds = (100, (0, 1)) if q else (1000, (0, 1, 2))
    print(
        f"(c) Digits VAE after {steps} steps (batch 128, Adam 3e-3), paired seeds {seeds}: held-out ELBO and log-likelihood (IWAE K=200) per image"
    )
    print_table(
        heldout_table(steps, seeds),
        ("estimator", "held-out ELBO by seed", "mean", "held-out log p(x) by seed", "mean"),
    )
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
