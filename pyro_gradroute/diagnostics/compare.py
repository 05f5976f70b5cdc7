r"""Fit several estimators from one initialisation and measure them side by side.

For each estimator: clear the param store, seed, build the problem afresh (same guide and
network initialisation for all), run ``steps`` SVI steps with Adam, then measure at the fitted
parameters:

* ``train_loss``: the estimator's own loss, averaged over the last 10% of steps (IWAE and DReG
  report the negative IWAE bound, Trace/STL the negative ELBO: compare within a family);
* ``elbo`` and ``log_px``: :math:`\frac1S\sum_s \log r_s` and
  :math:`\log \frac1S \sum_s r_s` from ``S`` guide draws, :math:`r_s = p(x, z_s)/q(z_s)`, on the
  problem's diagnostic data -- the same yardstick for every estimator;
* ``heldout_ll``: held-out log-likelihood per observation (:mod:`.heldout`), if any;
* ``snr_guide`` / ``snr_model``: norm SNR of the estimator's gradient for guide / model
  parameters (:func:`~pyro_gradroute.diagnostics.gradient_stats`);
* ``ms_per_step``: median wall time of an SVI step (the first, which builds the guide, left
  out); ``khat``: PSIS k-hat of the fitted guide.

Example::

    >>> from pyro_gradroute.diagnostics.compare import compare_estimators, format_table
    >>> rows = compare_estimators("score_pathwise", ["trace", "stl"], steps=5,
    ...                           snr_draws=3, num_samples=50, progress=False)
    >>> [r.name for r in rows]
    ['trace', 'stl']
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyro
import torch
from pyro.infer import SVI

from ..models.registry import Problem, as_problem, load_problem
from .estimators import make_elbo
from .gradients import GradientStats, gradient_stats
from .heldout import heldout_log_likelihood
from .inference_data import to_inference_data
from .plates import max_plate_nesting as plate_depth
from .plates import trace_model
from .psis import PSISResult, pareto_khat


@dataclass
class EstimatorResult:
    """One estimator's run (see module docs for the fields' meaning)."""

    name: str
    losses: list[float]
    ms_per_step: float
    train_loss: float
    elbo: float
    log_px: float
    heldout_ll: float | None
    grads: GradientStats
    khat: PSISResult
    idata: Any = field(repr=False)

    @property
    def snr_guide(self) -> float:
        return self.grads.snr(self.grads.guide_params)

    @property
    def snr_model(self) -> float:
        return self.grads.snr(self.grads.model_params)


def _builder(problem: str | Callable) -> Callable[[], Problem]:
    if isinstance(problem, str):
        load_problem(problem)  # fail early, with the list of names
        return lambda: load_problem(problem)
    if callable(problem):
        return lambda: as_problem(problem(), where=getattr(problem, "__name__", "problem"))
    raise TypeError(
        "problem must be a model name, 'module:function', or a zero-argument function "
        f"returning a Problem or dict; got {type(problem).__name__}"
    )


def _plate_depth(p: Problem) -> int:
    """Plate depth of model and guide (passed to the ELBO instead of letting Pyro guess)."""
    guide_trace = trace_model(p.guide, p.args, p.kwargs)
    return max(plate_depth(trace_model(p.model, p.args, p.kwargs)), plate_depth(guide_trace))


def _run_one(build, name, seed, steps, lr, num_particles, snr_draws, num_samples, progress):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    p = build()
    steps = p.steps if steps is None else steps
    elbo = make_elbo(name, num_particles or p.num_particles, _plate_depth(p))
    svi = SVI(p.model, p.guide, pyro.optim.Adam({"lr": lr or p.lr}), elbo)
    losses = []
    bar = range(steps)
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(bar, desc=f"{name:>6}", leave=False, dynamic_ncols=True)
    times = []
    for _ in bar:
        t0 = time.perf_counter()
        losses.append(svi.step(*p.args, **p.kwargs))
        times.append(time.perf_counter() - t0)
        if progress and len(losses) % 25 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.4g}")
    ms = 1000 * statistics.median(times[1:] or times) if times else math.nan
    tail = losses[-max(1, steps // 10) :]
    grads = gradient_stats(
        p.model, p.guide, elbo, *p.args, num_draws=snr_draws, seed=seed, **p.kwargs
    )
    diag = p.diag_args if p.diag_args is not None else p.args
    idata = to_inference_data(
        p.model,
        p.guide,
        *diag,
        num_samples=num_samples,
        coords=p.coords,
        dims=p.dims,
        **p.kwargs,
    )
    log_r = torch.as_tensor(idata["sample_stats"]["log_importance_ratio"].values).reshape(-1)
    heldout = None
    if p.heldout_args is not None:
        heldout = heldout_log_likelihood(
            p.model,
            p.guide,
            p.args,
            p.heldout_args,
            p.heldout,
            num_samples=min(num_samples, 200),
            kwargs=p.kwargs,
        )
    return EstimatorResult(
        name=name,
        losses=losses,
        ms_per_step=ms,
        train_loss=sum(tail) / len(tail) if tail else math.nan,
        elbo=float(log_r.mean()),
        log_px=float(log_r.logsumexp(0) - math.log(log_r.numel())),
        heldout_ll=heldout,
        grads=grads,
        khat=pareto_khat(log_r),
        idata=idata,
    )


def compare_estimators(
    problem: str | Callable,
    estimators: Sequence[str],
    *,
    steps: int | None = None,
    lr: float | None = None,
    num_particles: int | None = None,
    seed: int = 0,
    snr_draws: int = 20,
    num_samples: int = 1000,
    progress: bool = True,
) -> list[EstimatorResult]:
    """Fit ``problem`` with each estimator from the same initialisation; measure each.

    :param problem: a bundled model name, ``"module:function"``, or a zero-argument function
        returning a :class:`~pyro_gradroute.models.registry.Problem` or dict.
    :param estimators: names from :data:`~pyro_gradroute.diagnostics.estimators.ESTIMATORS`.
    :param steps, lr, num_particles: override the problem's defaults.
    :param seed: the seed set before building the problem and fitting, for every estimator.
    :param snr_draws: gradient evaluations for the SNR.
    :param num_samples: guide draws for k-hat, ELBO, :math:`\\log p(x)` and the InferenceData.
    :param progress: show a tqdm progress bar per estimator.
    :raises ValueError: for an unknown model or estimator (listing what exists).
    """
    build = _builder(problem)
    for name in estimators:
        make_elbo(name)  # fail before any fitting
    return [
        _run_one(build, name, seed, steps, lr, num_particles, snr_draws, num_samples, progress)
        for name in estimators
    ]


def _fmt(x: float | None, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    return "nan" if math.isnan(x) else format(x, spec)


COLUMNS = ["estimator", "train loss", "ELBO", "log p(x)", "held-out ll", "SNR guide",
           "SNR model", "ms/step", "k-hat"]  # fmt: skip


def format_table(results: Sequence[EstimatorResult]) -> str:
    """The comparison as a fixed-width text table, one row per estimator."""
    rows = [COLUMNS]
    for r in results:
        rows.append([
            r.name, _fmt(r.train_loss, ".5g"), _fmt(r.elbo, ".5g"), _fmt(r.log_px, ".5g"),
            _fmt(r.heldout_ll, ".4f"), _fmt(r.snr_guide) if r.grads.guide_params else "-",
            _fmt(r.snr_model) if r.grads.model_params else "-", _fmt(r.ms_per_step, ".3g"),
            f"{_fmt(r.khat.khat, '.2f')} {r.khat.reading}",
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def suggest(results: Sequence[EstimatorResult]) -> str:
    """One line naming the estimator with the best held-out log-likelihood (else the best
    :math:`\\log p(x)` estimate, among the guides whose k-hat is not unreliable when there
    are any) and its k-hat reading, with a hint when every guide is unreliable."""
    if not results:
        return ""
    have_heldout = all(r.heldout_ll is not None for r in results)
    key = (lambda r: r.heldout_ll) if have_heldout else (lambda r: r.log_px)
    pool = list(results)
    what = "held-out log-likelihood" if have_heldout else "log p(x) estimate"
    if not have_heldout:  # an importance estimate is only trustworthy where k-hat is
        reliable = [r for r in results if r.khat.reading != "unreliable"]
        if reliable and len(reliable) < len(results):
            pool, what = reliable, "log p(x) estimate among guides with k-hat <= 0.7"
    best = max(pool, key=lambda r: (not math.isnan(key(r)), key(r)))
    line = f"best {what}: {best.name} ({_fmt(key(best), '.4f')}); k-hat {best.khat.reading}"
    if all(r.khat.reading == "unreliable" for r in results):
        line += (
            " -- every guide has k-hat > 0.7: the guide family, not the estimator, limits the fit"
            " (try a richer guide, e.g. AutoMultivariateNormal or AutoMeanField families)"
        )
    return line
