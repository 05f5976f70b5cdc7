r"""Fit several estimators from one initialisation and measure them side by side.

For each estimator: clear the param store, seed, build the problem afresh (same guide and
network initialisation for all), run ``steps`` SVI steps with Adam, then measure at the fitted
parameters:

* ``train_loss``: the estimator's own loss, averaged over the last 10% of steps, summed over the
  training data as Pyro reports it (IWAE and DReG report the negative IWAE bound, Trace/STL the
  negative ELBO: compare within a family);
* ``elbo`` and ``log_px``: :math:`\frac1S\sum_s \log r_s` and
  :math:`\log \frac1S \sum_s r_s` from ``S`` guide draws, :math:`r_s = p(x, z_s)/q(z_s)`, summed
  over the problem's diagnostic data -- the same yardstick for every estimator;
* ``heldout_ll``: held-out log-likelihood per observation (:mod:`~pyro_gradroute.diagnostics.heldout`);
* ``snr_guide`` / ``snr_model``: norm SNR of the estimator's gradient for guide / model
  parameters (:func:`~pyro_gradroute.diagnostics.gradient_stats`);
* ``ms_per_step``: median wall time of an SVI step (the first, which builds the guide, left
  out); ``khat``: PSIS k-hat of the fitted guide.

Each estimate carries a Monte Carlo standard error (``*_se``). A fit whose loss becomes
non-finite, or rises far above where it started, is stopped: its ``diverged_at`` is the step,
and it is not measured.

Example::

    >>> from pyro_gradroute.app.compare import compare_estimators, format_table
    >>> rows = compare_estimators("gaussian_means", ["trace", "stl"], steps=5,
    ...                           snr_draws=3, num_samples=50, progress=False)
    >>> [r.name for r in rows]
    ['trace', 'stl']
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer import SVI

from ..diagnostics.gradients import GradientStats, gradient_stats
from ..diagnostics.heldout import heldout_log_likelihood
from ..diagnostics.inference_data import to_inference_data
from ..diagnostics.plates import max_plate_nesting as plate_depth
from ..diagnostics.plates import trace_model
from ..diagnostics.psis import PSISResult, pareto_khat
from .estimators import make_elbo
from .models.problem import Problem, as_problem, load_problem

#: a fit is stopped when its recent loss exceeds its starting loss by this many times
#: ``max(|starting loss|, 1)`` (or is not finite)
DIVERGENCE_FACTOR = 10.0
_WINDOW = 10  # steps in the running medians the divergence check compares


@dataclass
class EstimatorResult:
    """One estimator's run (see module docs for the fields' meaning)."""

    name: str
    losses: list[float]
    ms_per_step: float
    train_loss: float
    elbo: float = math.nan
    log_px: float = math.nan
    heldout_ll: float | None = None
    grads: GradientStats | None = None
    khat: PSISResult | None = None
    idata: Any = field(default=None, repr=False)
    train_loss_se: float = math.nan
    elbo_se: float = math.nan
    log_px_se: float = math.nan
    heldout_ll_se: float = math.nan
    diverged_at: int | None = None
    fit_seconds: float = math.nan
    #: adaptive estimators: ``(step, {param: mean control-variate weight b})`` along the fit
    cv_weights: list = field(default_factory=list)
    #: adaptive estimators: guide-gradient variance over the better of the two estimators it
    #: mixes (STL and Trace_ELBO, or DReG and IWAE), all at its fitted parameters
    variance_ratio: float = math.nan

    @property
    def diverged(self) -> bool:
        return self.diverged_at is not None

    @property
    def snr_guide(self) -> float:
        if self.grads is None or not self.grads.guide_params:
            return math.nan
        return self.grads.snr(self.grads.guide_params)

    @property
    def snr_model(self) -> float:
        if self.grads is None or not self.grads.model_params:
            return math.nan
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


def divergence_step(losses: Sequence[float], factor: float = DIVERGENCE_FACTOR) -> int | None:
    """The 1-based step at which ``losses`` diverged, else ``None``: the last loss is not
    finite, or the median of the last few exceeds the median of the first few by more than
    ``factor * max(|start|, 1)``.

    >>> divergence_step([3.0, 2.0, float("nan")])
    3
    >>> divergence_step([1.0] * 10 + [1e6] * 10) is not None
    True
    >>> divergence_step([10.0, 5.0, 2.0]) is None
    True
    """
    if not losses:
        return None
    if not math.isfinite(losses[-1]):
        return len(losses)
    if len(losses) < 2 * _WINDOW:
        return None
    start = statistics.median(losses[:_WINDOW])
    recent = statistics.median(losses[-_WINDOW:])
    if recent > start + factor * max(abs(start), 1.0):
        return len(losses)
    return None


def _invalid_values(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's distribution-argument check failing on values (e.g. a scale
    that underflowed to 0 or became NaN), the form a divergence often takes."""
    return "found invalid values" in str(exc)


def _se(x: torch.Tensor) -> float:
    return float(x.std() / math.sqrt(x.numel())) if x.numel() > 1 else math.nan


def _log_mean_exp_se(log_r: torch.Tensor) -> float:
    """Delta-method standard error of :math:`\\log \\frac1S \\sum_s e^{\\log r_s}`."""
    w = (log_r - log_r.max()).exp()
    return float(w.std() / (w.mean() * math.sqrt(w.numel())))


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _mean_weights(elbo, most: int = 3) -> dict[str, float]:
    """The mean control-variate weight ``b`` of (at most ``most``) parameters."""
    weights = elbo.control_variate_weights()
    return {n: float(b.mean()) for n, b in list(weights.items())[:most]}


def _guide_variance(stats) -> float:
    names = stats.guide_params
    if not names or stats.draws is None:
        return math.nan
    flat = torch.cat([stats.draws[n].reshape(stats.num_draws, -1) for n in names], 1)
    return float(flat.var(0).sum())


def _variance_ratio(name, p, stats, num_draws, seed, alpha) -> float:
    """Guide-gradient variance of an adaptive estimator over the better of the two it mixes."""
    bases = ("dreg", "iwae") if name == "adaptive-dreg" else ("stl", "trace")
    variances = []
    for base in bases:
        elbo = make_elbo(base, p.num_particles, _plate_depth(p), alpha=alpha)
        other = gradient_stats(p.model, p.guide, elbo, *p.args, num_draws=num_draws, seed=seed,
                               keep_draws=True, **p.kwargs)  # fmt: skip
        variances.append(_guide_variance(other))
    best = min(variances)
    return _guide_variance(stats) / best if best > 0 else math.nan


def _run_one(build, name, seed, steps, lr, num_particles, snr_draws, num_samples, progress,
             quiet, alpha=0.5):  # fmt: skip
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    p = build()
    steps = p.steps if steps is None else steps
    elbo = make_elbo(name, num_particles or p.num_particles, _plate_depth(p), alpha=alpha)
    lr = lr or p.lr
    try:  # vectorized particles need a model that vectorizes; else one particle at a time
        with poutine.block(), torch.random.fork_rng(devices=[]):
            elbo.loss(p.model, p.guide, *p.args, **p.kwargs)
    except (RuntimeError, ValueError, IndexError) as e:
        _say(f"{name}: the model does not run vectorized over particles "
             f"({type(e).__name__}); fitting with vectorize_particles=False", quiet)  # fmt: skip
        elbo = make_elbo(name, num_particles or p.num_particles, _plate_depth(p),
                         vectorize_particles=False, alpha=alpha)  # fmt: skip
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        p = build()
    svi = SVI(p.model, p.guide, pyro.optim.Adam({"lr": lr}), elbo)
    losses: list[float] = []
    bar = range(steps)
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(bar, desc=f"{name:>6}", leave=True, dynamic_ncols=True, file=sys.stderr)
    times = []
    cv_weights: list = []
    diverged = None
    t_fit = time.perf_counter()
    for _ in bar:
        t0 = time.perf_counter()
        try:
            losses.append(svi.step(*p.args, **p.kwargs))
        except ValueError as e:
            if not losses or not _invalid_values(e):
                raise  # a first step that fails is the model's error, not a divergence
            losses.append(math.nan)  # a parameter left its support: the fit has diverged
        times.append(time.perf_counter() - t0)
        if progress and len(losses) % 25 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.4g}")
        diverged = divergence_step(losses)
        if diverged is not None:
            break
        if hasattr(elbo, "control_variate_weights") and len(losses) % max(1, steps // 50) == 0:
            cv_weights.append((len(losses), _mean_weights(elbo)))
    if progress:
        bar.close()
    fit_seconds = time.perf_counter() - t_fit
    ms = 1000 * statistics.median(times[1:] or times) if times else math.nan
    tail = torch.tensor(losses[-max(1, len(losses) // 10) :], dtype=torch.float64)
    result = EstimatorResult(
        name=name,
        losses=losses,
        ms_per_step=ms,
        train_loss=float(tail.mean()) if tail.numel() else math.nan,
        train_loss_se=_se(tail),
        diverged_at=diverged,
        fit_seconds=fit_seconds,
        cv_weights=cv_weights,
    )
    last = f"{losses[-1]:.5g}" if losses else "-"
    if diverged is not None:
        _say(f"{name}: diverged at step {diverged} (loss {last}); try a smaller --lr "
             f"(was {lr:g}). Not measured.", quiet)  # fmt: skip
        return result
    _say(f"{name}: {len(losses)} steps in {fit_seconds:.1f} s, final loss {last}; "
         f"measuring ({snr_draws} gradient draws, {num_samples} guide draws)", quiet)  # fmt: skip
    result.grads = gradient_stats(
        p.model, p.guide, elbo, *p.args, num_draws=snr_draws, seed=seed, keep_draws=True,
        **p.kwargs,
    )  # fmt: skip
    if hasattr(elbo, "control_variate_weights"):
        result.variance_ratio = _variance_ratio(name, p, result.grads, snr_draws, seed, alpha)
    diag = p.diag_args if p.diag_args is not None else p.args
    result.idata = to_inference_data(
        p.model, p.guide, *diag, num_samples=num_samples, coords=p.coords, dims=p.dims,
        **p.kwargs,
    )  # fmt: skip
    log_r = torch.as_tensor(
        result.idata["sample_stats"]["log_importance_ratio"].values, dtype=torch.float64
    ).reshape(-1)
    result.elbo, result.elbo_se = float(log_r.mean()), _se(log_r)
    result.log_px = float(log_r.logsumexp(0) - math.log(log_r.numel()))
    result.log_px_se = _log_mean_exp_se(log_r)
    result.khat = pareto_khat(log_r)
    if p.heldout_args is not None:
        result.heldout_ll, result.heldout_ll_se = heldout_log_likelihood(
            p.model, p.guide, p.args, p.heldout_args, p.heldout,
            num_samples=min(num_samples, 200), kwargs=p.kwargs, with_se=True,
        )  # fmt: skip
    return result


def iter_compare(
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
    quiet: bool = True,
    alpha: float = 0.5,
) -> Iterator[EstimatorResult]:
    """:func:`compare_estimators`, yielding each estimator's result as soon as it is done."""
    build = _builder(problem)
    for name in estimators:
        make_elbo(name)  # fail before any fitting
    for name in estimators:
        yield _run_one(build, name, seed, steps, lr, num_particles, snr_draws, num_samples,
                       progress, quiet, alpha)  # fmt: skip


def compare_estimators(problem: str | Callable, estimators: Sequence[str], **kwargs):
    """Fit ``problem`` with each estimator from the same initialisation; measure each.

    :param problem: a bundled model name, ``"module:function"``, or a zero-argument function
        returning a :class:`~pyro_gradroute.app.models.Problem` or dict.
    :param estimators: names from :data:`~pyro_gradroute.app.estimators.ESTIMATORS`.
    :param steps, lr, num_particles: override the problem's defaults.
    :param seed: the seed set before building the problem and fitting, for every estimator.
    :param snr_draws: gradient evaluations for the SNR.
    :param num_samples: guide draws for k-hat, ELBO, :math:`\\log p(x)` and the InferenceData.
    :param progress: show a tqdm progress bar per estimator (they stay on screen).
    :param quiet: when false, print a line per phase of each estimator to stderr.
    :raises ValueError: for an unknown model or estimator (listing what exists).
    :returns: a list of :class:`EstimatorResult`, in the order of ``estimators``.
    """
    return list(iter_compare(problem, estimators, **kwargs))


def _fmt(x: float | None, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    return "nan" if math.isnan(x) else format(x, spec)


def _pm(x: float, se: float, spec: str) -> str:
    if math.isnan(x):
        return "nan"
    return f"{format(x, spec)}" + ("" if math.isnan(se) else f" ±{se:.2g}")


COLUMNS = ["estimator", "train loss (sum)", "ELBO (sum)", "log p(x) (sum)",
           "held-out ll (per obs)", "SNR guide", "SNR model", "ms/step", "k-hat"]  # fmt: skip

#: printed under the table: what each column is, on which scale
TABLE_NOTE = """\
scales (nats): train loss = the estimator's own loss (iwae/dreg: negative IWAE bound; trace/stl:
  negative ELBO), mean of the last 10% of steps, summed over the training data; ELBO and
  log p(x) = from guide draws, summed over the diagnostic data; held-out ll = per held-out
  observation. SNR = |mean| / sd of the gradient (norm). ± = one Monte Carlo standard error."""


def format_table(results: Sequence[EstimatorResult]) -> str:
    """The comparison as a fixed-width text table, one row per estimator; a diverged
    estimator's row says at which step, and what to try."""
    rows = [COLUMNS]
    notes = []
    for r in results:
        if r.diverged:
            rows.append([r.name, _fmt(r.train_loss, ".5g")] + ["-"] * (len(COLUMNS) - 2))
            notes.append(f"{r.name}: diverged at step {r.diverged_at}; try a smaller --lr")
            continue
        rows.append([
            r.name, _pm(r.train_loss, r.train_loss_se, ".5g"), _pm(r.elbo, r.elbo_se, ".5g"),
            _pm(r.log_px, r.log_px_se, ".5g"), _pm(r.heldout_ll, r.heldout_ll_se, ".4f") if r.heldout_ll is not None else "-",
            _fmt(r.snr_guide) if r.grads is not None and r.grads.guide_params else "-",
            _fmt(r.snr_model) if r.grads is not None and r.grads.model_params else "-",
            _fmt(r.ms_per_step, ".3g"),
            f"{_fmt(r.khat.khat, '.2f')} {r.khat.reading}" if r.khat is not None else "-",
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + notes)


def suggest(results: Sequence[EstimatorResult]) -> str:
    """One line naming the estimator with the best held-out log-likelihood (else the best
    :math:`\\log p(x)` estimate, among the guides whose k-hat is not unreliable when there
    are any) and its k-hat reading; "within noise" when the runner-up is less than two
    standard errors of the difference behind; a hint when every guide is unreliable."""
    results = [r for r in results if not r.diverged]
    if not results:
        return "no estimator finished without diverging: try a smaller --lr"
    have_heldout = all(r.heldout_ll is not None for r in results)
    if have_heldout:
        key, se = (lambda r: r.heldout_ll), (lambda r: r.heldout_ll_se)
    else:
        key, se = (lambda r: r.log_px), (lambda r: r.log_px_se)
    pool = list(results)
    what = "held-out log-likelihood" if have_heldout else "log p(x) estimate"
    if not have_heldout:  # an importance estimate is only trustworthy where k-hat is
        reliable = [r for r in results if r.khat.reading != "unreliable"]
        if reliable and len(reliable) < len(results):
            pool, what = reliable, "log p(x) estimate among guides with k-hat <= 0.7"
    ranked = sorted(pool, key=lambda r: (not math.isnan(key(r)), key(r)), reverse=True)
    best = ranked[0]
    line = f"best {what}: {best.name} ({_fmt(key(best), '.4f')}); k-hat {best.khat.reading}"
    if len(ranked) > 1:
        second = ranked[1]
        gap = key(best) - key(second)
        noise = math.hypot(se(best), se(second))
        if not math.isnan(noise) and gap < 2 * noise:
            line += (f" -- within noise of {second.name} (difference {gap:.2g}, "
                     f"2 standard errors {2 * noise:.2g})")  # fmt: skip
    if all(r.khat.reading == "unreliable" for r in results):
        line += (
            " -- every guide has k-hat > 0.7: the guide family, not the estimator, limits the fit"
            " (try a guide with correlations, e.g. AutoLowRankMultivariateNormal or"
            " AutoMultivariateNormal, or a normalizing flow such as AutoIAFNormal)"
        )
    return line
