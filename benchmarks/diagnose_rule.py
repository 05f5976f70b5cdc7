"""Why the adaptive estimator's policy picks STL where it loses: per-parameter gradient moments.

Along a ``Trace_ELBO`` trajectory (``--along stl`` / ``adaptive``: that estimator's; Adam, the
model's lr), at a few
checkpoints, ``--draws`` guide draws at the frozen parameters; on each draw both parts of the
gradient of the same draw, per parameter element: ``c`` the score part
(:math:`\\nabla_\\phi \\log q(\\bot z; \\phi)`) and ``p = g_trace - c`` (STL's gradient). Per group
of elements (each AutoNormal parameter tensor: ``locs``/``scales`` of every site) it prints the
summed second moments of ``Trace_ELBO`` (``S1``), of STL (``S0``), of the per-element better
endpoint (``Se``) and of the per-element optimal mix (``Sb``), the number of elements where STL
is the better endpoint, and the same sums normalized per element by ``Trace_ELBO``'s second
moment (``n0 = mean_e E g0_e^2 / E g1_e^2``: what a per-element normalized optimizer sees),
and each endpoint's variance along the tensor's mean gradient (``A1``: ``Trace_ELBO``, ``A0``:
STL), which a per-element sum cannot see: for a Gaussian posterior with precision ``H`` and a
mean-field guide of variances ``D``, STL's covariance on the locations exceeds
``Trace_ELBO``'s by ``D^-1 - 2H``, positive along the directions of low curvature (a strongly
correlated posterior's slow directions), negative along the rest.

``--trace-on T1,T2``: instead, train with ``Trace_ELBO``'s gradient on the named tensors and
STL's on the rest, and print the final ELBO (which tensor's endpoint decides the result).

``--trend``: instead, train with Pyro's ``Trace_ELBO`` (``TraceEnum_ELBO`` for an enumerated
model) at the model's own budget (every model with
``--model all``) and print, at each tenth of the run, what the run's own numbers could tell a
policy about its progress: the loss's slope per step (exponentially weighted regression over
about 200 steps) in units of the loss's residual standard deviation, that slope's z-score, and
the gate's bound ``B`` (``E|g_t|^2 / E<g_t, g_t-1>`` over that tenth).

Run: ``python benchmarks/diagnose_rule.py --model sv_centered --steps 5000 --draws 300``.
"""

from __future__ import annotations

import argparse
import json
import time

import pyro
import torch
from bench_convergence import MODELS, _trace
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO

from pyro_gradroute.infer import TraceAdaptiveSTL_ELBO, TraceSTL_ELBO
from pyro_gradroute.infer.schedule import Gate

#: the estimators whose trajectory the moments can be read along (``--along``)
ALONG = {"trace": Trace_ELBO, "stl": TraceSTL_ELBO, "adaptive": TraceAdaptiveSTL_ELBO}


def parts(p, params: dict) -> tuple[dict, dict]:
    """One guide draw's ``(g_trace, g_score)`` per parameter (unconstrained leaves)."""
    guide_tr = poutine.trace(p.guide).get_trace(*p.args)
    model_tr = poutine.trace(poutine.replay(p.model, trace=guide_tr)).get_trace(*p.args)
    loss = -(model_tr.log_prob_sum() - guide_tr.log_prob_sum())
    score = 0.0
    for site in guide_tr.nodes.values():
        if site["type"] == "sample" and site["infer"].get("is_auxiliary"):
            score = score + site["fn"].log_prob(site["value"].detach()).sum()
    if not torch.is_tensor(score):
        raise SystemExit(
            "the moments read the score part at the guide's auxiliary sample sites (AutoNormal, "
            "AutoLowRankMultivariateNormal, ...); this model's guide has none: use --trend"
        )
    names = list(params)
    leaves = [params[n] for n in names]
    gt = torch.autograd.grad(loss, leaves, allow_unused=True, retain_graph=True)
    gc = torch.autograd.grad(score, leaves, allow_unused=True)
    z = torch.zeros_like
    return (
        {n: (z(v) if g is None else g) for n, g, v in zip(names, gt, leaves)},
        {n: (z(v) if g is None else g) for n, g, v in zip(names, gc, leaves)},
    )


def moments(p, draws: int) -> dict:
    """Per parameter: per-element mean of p, Var p, Var c, Cov(p, c) over ``draws`` draws, and
    the variance of ``Trace_ELBO``'s (``a1``) and STL's (``a0``) gradient along the unit vector
    of the tensor's mean gradient (the direction the parameters are moving)."""
    params = dict(pyro.get_param_store().named_parameters())
    acc: dict = {n: ([], []) for n in params}
    for _ in range(draws):
        gt, gc = parts(p, params)
        for n, (ps, cs) in acc.items():
            cs.append(gc[n].detach().reshape(-1))
            ps.append((gt[n] - gc[n]).detach().reshape(-1))
    out = {}
    for n, (ps, cs) in acc.items():
        pp, c = torch.stack(ps), torch.stack(cs)
        mp, mc = pp.mean(0), c.mean(0)
        dp, dc = pp - mp, c - mc
        u = (mp + mc) / (mp + mc).norm().clamp_min(1e-30)
        out[n] = {
            "mean": mp,
            "vp": dp.square().mean(0),
            "vc": dc.square().mean(0),
            "cov": (dp * dc).mean(0),
            "a1": float(((dp + dc) @ u).square().mean()),
            "a0": float((dp @ u).square().mean()),
        }
    return out


def table(mom: dict) -> list[dict]:
    rows = []
    for n, m in mom.items():
        mean2, vp, vc, cov = m["mean"] ** 2, m["vp"], m["vc"], m["cov"]
        s0 = mean2 + vp  # STL, per element
        s1 = mean2 + vp + 2 * cov + vc  # Trace_ELBO
        se = torch.minimum(s0, s1)  # the better endpoint per element
        bstar = torch.where(vc > 0, -cov / vc.clamp_min(1e-30), torch.ones_like(vc))
        sb = mean2 + vp + bstar * (2 * cov + bstar * vc)
        rows.append(
            {
                "param": n.replace("AutoNormal.", ""),
                "size": s0.numel(),
                "mean2": float(mean2.sum()),
                "S1": float(s1.sum()),
                "S0": float(s0.sum()),
                "Se": float(se.sum()),
                "Sb": float(sb.sum()),
                "stl_better": int((s0 < s1).sum()),
                "n0": float((s0 / s1).mean()),  # per-element normalized: STL over Trace_ELBO
                "ne": float((se / s1).mean()),
                "b_med": float(bstar.median()),
                "A1": m["a1"],  # along the mean gradient: Trace_ELBO
                "A0": m["a0"],  # STL
            }
        )
    return rows


def show(rows: list[dict], head: str) -> None:
    print(head)
    print(f"{'param':>28} {'n':>4} {'|Eg|^2':>9} {'S1 trace':>9} {'S0 stl':>9} {'S elem':>9} "
          f"{'S b*':>9} {'stl<':>5} {'n0':>6} {'ne':>6} {'b* med':>6} {'A1 trace':>9} "
          f"{'A0 stl':>9}")  # fmt: skip
    tot = {k: 0.0 for k in ("mean2", "S1", "S0", "Se", "Sb")}
    for r in rows:
        print(f"{r['param']:>28} {r['size']:>4} {r['mean2']:9.3g} {r['S1']:9.3g} {r['S0']:9.3g} "
              f"{r['Se']:9.3g} {r['Sb']:9.3g} {r['stl_better']:>5} {r['n0']:6.3f} "
              f"{r['ne']:6.3f} {r['b_med']:6.2f} {r['A1']:9.3g} {r['A0']:9.3g}")  # fmt: skip
        for k in tot:
            tot[k] += r[k]
    print(f"{'total':>28} {'':>4} {tot['mean2']:9.3g} {tot['S1']:9.3g} {tot['S0']:9.3g} "
          f"{tot['Se']:9.3g} {tot['Sb']:9.3g}", flush=True)  # fmt: skip


def run_moments(
    model: str, steps: int, draws: int, checkpoints: list[int], seed: int, along: str = "trace"
) -> list:
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    p = MODELS[model](seed)
    svi = SVI(p.model, p.guide, pyro.optim.Adam({"lr": p.lr}), ALONG[along]())
    out = []
    for step in range(1, steps + 1):
        svi.step(*p.args)
        if step in checkpoints:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(7 + step)
                rows = table(moments(p, draws))
            show(rows, f"\n== {model}, {along} trajectory, step {step}, {draws} draws")
            out.append({"step": step, "rows": rows})
    return out


def run_endpoints(model: str, steps: int, seed: int, trace_on: list[str]) -> dict:
    """Adam on the gradient ``g_trace - (1 - b) c`` with ``b = 1`` (``Trace_ELBO``'s) on the
    tensors named in ``trace_on`` (``"all"``: every one) and ``b = 0`` (STL's) on the rest;
    the final ELBO from 1000 draws (the benchmark's common random numbers of the seed)."""
    from bench_convergence import elbo_estimate

    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    p = MODELS[model](seed)
    p.guide(*p.args)  # the guide's parameters
    params = dict(pyro.get_param_store().named_parameters())
    short = {n: n.split(".", 1)[-1] for n in params}
    unknown = set(trace_on) - set(short.values()) - {"all"}
    if unknown:
        raise SystemExit(f"--trace-on: no parameter {sorted(unknown)}; {sorted(short.values())}")
    opt = torch.optim.Adam(list(params.values()), lr=p.lr)  # pyro.optim.Adam's per-leaf math
    for _ in range(steps):
        gt, gc = parts(p, params)
        for n, v in params.items():
            b = 1.0 if "all" in trace_on or short[n] in trace_on else 0.0
            v.grad = gt[n] - (1 - b) * gc[n]
        opt.step()
    elbo = elbo_estimate(p, 1000, seed)
    print(f"{model} seed {seed}, Trace_ELBO's gradient on {trace_on or 'none'}, STL's elsewhere: "
          f"ELBO {elbo:.2f} after {steps} steps", flush=True)  # fmt: skip
    return {"seed": seed, "trace_on": trace_on, "elbo": elbo}


def run_trend(model: str, seed: int, decay: float = 0.99) -> dict:
    """Pyro's estimator at the model's budget (the benchmark's: ``TraceEnum_ELBO`` for an
    enumerated model); per tenth: slope / sd, its z, and the gate's bound ``B`` over the tenth."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    p = MODELS[model](seed)
    elbo, guide = _trace(p)
    optim = pyro.optim.Adam({"lr": p.lr})
    gate = Gate(1.0, min_samples=1.0)  # plain sums over the tenth
    s = [0.0] * 7  # weights' sums of 1, age, age^2, loss, age * loss, loss^2, weight^2
    rows = []
    for t in range(1, p.steps + 1):
        with poutine.trace(param_only=True) as tr:
            loss = elbo.loss_and_grads(p.model, guide, *p.args)
        leaves = [site["value"].unconstrained() for site in tr.trace.nodes.values()]
        gate.update(torch.cat([v.grad.reshape(-1) for v in leaves if v.grad is not None]))
        optim(leaves)
        pyro.infer.util.zero_grads(leaves)
        w, a, aa, y, ay, yy, w2 = s  # every earlier loss one step older, then this one
        d = decay
        s = [d * w + 1, d * (a + w), d * (aa + 2 * a + w), d * y + loss, d * (ay + y),
             d * yy + loss * loss, d * d * w2 + 1]  # fmt: skip
        if t % max(p.steps // 10, 1) == 0:
            w, a, aa, y, ay, yy, w2 = s
            va, cov, vy = aa / w - (a / w) ** 2, ay / w - a * y / w**2, yy / w - (y / w) ** 2
            slope = cov / va  # loss per step of age: its fall per step
            sd = max(vy - slope * cov, 1e-300) ** 0.5
            z = slope / (sd / (w * w / w2 * va) ** 0.5)
            rows.append({"step": t, "slope_sd": slope / sd, "z": z, "B": gate.bound()})
            gate.reset(1.0)
    line = " ".join(f"{r['slope_sd']:7.4f} {r['z']:5.1f} {r['B']:6.2f} |" for r in rows)
    print(f"{model:>22} {line}", flush=True)
    return {"model": model, "seed": seed, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="sv_centered")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--draws", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--along", default="trace", choices=sorted(ALONG),
                    help="the estimator whose training trajectory the moments are read along")  # fmt: skip
    ap.add_argument("--trace-on", default=None,
                    help="instead of the moments: train with Trace_ELBO's gradient on these "
                    "comma-separated tensors (e.g. locs.log_vol; 'all'; '' none) and STL's on the "
                    "rest, and print the final ELBO")  # fmt: skip
    ap.add_argument("--trend", action="store_true",
                    help="instead of the moments: the loss's trend and the gate's bound along a "
                    "Trace_ELBO run at the model's budget (--model all: every model)")  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    res = {}
    if args.trend:
        names = list(MODELS) if args.model == "all" else [args.model]
        print("per tenth of the run: loss slope per step / residual sd, its z, gate bound B")
        res["trend"] = [run_trend(m, args.seed) for m in names]
    elif args.trace_on is not None:
        on = [t for t in args.trace_on.split(",") if t]
        res["endpoints"] = run_endpoints(args.model, args.steps, args.seed, on)
    else:
        cps = sorted({s for s in (50, 200, 500, 1000, 2000, 3500, 5000) if s <= args.steps}
                 | {args.steps})  # fmt: skip
        res["moments"] = run_moments(args.model, args.steps, args.draws, cps, args.seed, args.along)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
