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
  parameters (:func:`~pyro_gradroute.diagnostics.gradient_stats`), with a 68% bootstrap
  interval (``snr_*_interval``: :meth:`~pyro_gradroute.diagnostics.GradientStats.snr_interval`)
  and the noise floor ``snr_floor``
  :math:`= 1/\sqrt{D}` for ``D`` gradient draws: with a zero mean gradient (the usual state
  at a fit) the norm SNR is about :math:`1/\sqrt{D}`, so an SNR near the floor says the
  mean gradient is not distinguishable from zero, not how noisy the estimator is;
* ``grad_var_guide`` / ``grad_var_model``: the total gradient variance, the trace of the
  covariance of the gradient estimate, :math:`\sum_i \mathrm{Var}(\hat g_i)` over the
  guide / model parameters' unconstrained elements (what compares estimators at a fit);
* ``ms_per_step``: median time of an SVI step at the fitted parameters, measured once every
  estimator is fitted (``nan`` until then), in interleaved rounds: each round runs one step
  of every estimator, in an order that rotates from round to round, after
  :data:`TIMING_WARMUP_ROUNDS` untimed rounds (see :func:`time_interleaved`); so no
  estimator pays for running first, or for what the machine did during its fit. CPU time of
  the thread (``time.thread_time``) with one torch thread, else wall time;
  ``khat``: PSIS k-hat of the fitted guide.

Each estimate carries a Monte Carlo standard error (``*_se``).

With ``warmup_steps = N`` every estimator starts from the same parameters: the problem is
built from the seed and fitted ``N`` steps with Pyro's ``Trace_ELBO`` (repeated for each
estimator; deterministic, so the parameters are identical), then the estimator runs its
``steps`` with a fresh Adam from there. This compares estimators near a fit rather than from
the initialisation.

A fit **diverged at step N** (:data:`~pyro_gradroute.app.catalog.DIVERGED`; a test checks
that its numbers are :data:`DIVERGENCE_FACTOR` and ``_WINDOW``) is stopped there, not measured, and never
called best: its ``diverged_at`` is ``N``, and the other estimators go on.

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

from .._compat import is_deterministic_site
from .._validation import check_float, check_int
from ..diagnostics.gradients import GradientStats, gradient_stats
from ..diagnostics.heldout import heldout_log_likelihood
from ..diagnostics.inference_data import to_inference_data
from ..diagnostics.plates import max_plate_nesting as plate_depth
from ..diagnostics.plates import trace_model
from ..diagnostics.psis import PSISResult, pareto_khat
from .estimators import make_elbo
from .models.problem import Problem, as_problem, load_problem

#: a fit is stopped when the median loss of its last ``_WINDOW`` steps exceeds its first
#: step's loss by this many times ``max(|first loss|, 1)``
DIVERGENCE_FACTOR = 10.0
_WINDOW = 10  # steps in the running median the divergence check compares


#: untimed rounds before the interleaved timing rounds (see :func:`time_interleaved`)
TIMING_WARMUP_ROUNDS = 2


@dataclass
class EstimatorResult:
    """One estimator's run (see module docs for the fields' meaning)."""

    name: str
    losses: list[float]
    train_loss: float
    ms_per_step: float = math.nan
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
    #: total gradient variance (trace of the covariance) over guide / model parameters
    grad_var_guide: float = math.nan
    grad_var_model: float = math.nan
    #: 68% bootstrap intervals of the norm SNRs (``GradientStats.snr_interval``: they contain it)
    snr_guide_interval: tuple = (math.nan, math.nan)
    snr_model_interval: tuple = (math.nan, math.nan)
    #: Trace_ELBO losses of the shared warm-up (``warmup_steps``), before ``losses``
    warmup_losses: list = field(default_factory=list)

    @property
    def snr_floor(self) -> float:
        r"""Norm SNR of a zero-mean gradient estimated from the draws: :math:`1/\sqrt{D}`."""
        if self.grads is None or not self.grads.num_draws:
            return math.nan
        return 1.0 / math.sqrt(self.grads.num_draws)

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
    """The 1-based step at which ``losses`` diverged, judged by the losses alone (the loss
    part of :data:`~pyro_gradroute.app.catalog.DIVERGED`), else ``None``: the last loss is not finite, or the median of
    the last ``_WINDOW`` exceeds the first loss (at the initialisation, before any update)
    by more than ``factor * max(|first|, 1)``.

    >>> divergence_step([3.0, 2.0, float("nan")])
    3
    >>> divergence_step([392.0] + [1e13] * 10)  # exploded at once: the first window too
    11
    >>> divergence_step([1.0] * 10 + [1e6] * 10) is not None
    True
    >>> divergence_step([10.0, 5.0, 2.0] * 5) is None
    True
    """
    if not losses:
        return None
    if not math.isfinite(losses[-1]):
        return len(losses)
    if len(losses) <= _WINDOW:
        return None
    start = losses[0]
    recent = statistics.median(losses[-_WINDOW:])
    if recent > start + factor * max(abs(start), 1.0):
        return len(losses)
    return None


def _params_finite() -> bool:
    """Whether every param-store parameter is finite, unconstrained and constrained."""
    store = pyro.get_param_store()
    return all(
        bool(torch.isfinite(u).all()) and bool(torch.isfinite(store[name]).all())
        for name, u in store.named_parameters()
    )


#: words of the ``ValueError`` torch's and Pyro's value checks raise on an invalid value
_INVALID_VALUE = ("found invalid values", "nan", "infinite", "non-finite", "not finite")


def _step_diverged(exc: BaseException) -> bool:
    """Whether a failed step (after a first step that did not fail) is the divergence of
    :data:`~pyro_gradroute.app.catalog.DIVERGED`: parameters that are no longer finite, an
    invalid value (torch's check of a distribution's parameters, a NaN log-density), or a
    failed factorisation. Any other error is the model's, and is raised."""
    if not _params_finite() or isinstance(exc, torch.linalg.LinAlgError):
        return True
    text = str(exc).lower()
    return isinstance(exc, ValueError) and any(w in text for w in _INVALID_VALUE)


def check_data(p: Problem) -> None:
    """Raise ``ValueError`` naming the observed site whose data hold NaN or infinite values
    (in the training, diagnostic or held-out arguments), before any fitting."""
    for label, args in (("training", p.args), ("diagnostic", p.diag_args),
                        ("held-out", p.heldout_args)):  # fmt: skip
        if args is None:
            continue
        try:
            trace = trace_model(p.model, args, p.kwargs)
        except Exception:  # noqa: BLE001 - the model's own error is reported where it runs
            continue
        for name, site in trace.nodes.items():
            value = site.get("value")
            if not (site["type"] == "sample" and site["is_observed"] and torch.is_tensor(value)):
                continue
            if not value.is_floating_point() or is_deterministic_site(site):
                continue
            bad = ~torch.isfinite(value)
            event_dim = site["fn"].event_dim
            if event_dim:  # a batch element is bad if any of its event's values is
                bad = bad.reshape(bad.shape[: bad.dim() - event_dim] + (-1,)).any(-1)
            mask = site["mask"]  # masked-out entries (obs_mask, poutine.mask) are not read
            if mask is False:
                continue
            if torch.is_tensor(mask):
                bad = bad & mask
            if bool(bad.any()):
                kind = "NaN" if bool(value.isnan().any()) else "infinite"
                raise ValueError(
                    f"the {label} data of observed site {name!r} hold {kind} values (in "
                    f"{int(bad.sum())} of {bad.numel()} entries): drop or impute them, or mask "
                    "them (pyro.sample(..., obs_mask=...)), before fitting"
                )


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


def total_variance(stats: GradientStats, names: Sequence[str]) -> float:
    r"""Trace of the covariance of the gradient estimate over the parameters ``names``.

    :math:`\operatorname{tr}\operatorname{Cov}(\hat g) = \sum_i s_i^2`, the unbiased
    per-element variances of :func:`~pyro_gradroute.diagnostics.gradient_stats` summed over
    every unconstrained element; NaN without names.

    >>> from pyro_gradroute.diagnostics.gradients import GradientStats, ParamGradStats
    >>> s = GradientStats({"a": ParamGradStats(torch.zeros(2), torch.tensor([1.0, 2.0]))},
    ...                   ["a"], [], num_draws=5)
    >>> total_variance(s, ["a"])
    3.0
    """
    names = list(names)
    if not names:
        return math.nan
    return float(sum(float(stats[n].variance.sum()) for n in names))


def _guide_variance(stats) -> float:
    return total_variance(stats, stats.guide_params)


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


def warm_start(build: Callable[[], Problem], seed: int, warmup_steps: int, lr: float | None):
    """Build the problem from ``seed`` and fit it ``warmup_steps`` steps with Pyro's ``Trace_ELBO``.

    Returns ``(problem, losses)``. Deterministic: every call with the same arguments leaves
    the same parameters in the param store (a fresh store each time). The random state is
    then reset to ``seed + 1``, so that what follows draws the same numbers for every
    estimator.
    """
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    p = build()
    check_data(p)
    losses: list[float] = []
    if warmup_steps:
        elbo = pyro.infer.Trace_ELBO(max_plate_nesting=_plate_depth(p))
        svi = SVI(p.model, p.guide, pyro.optim.Adam({"lr": lr or p.lr}), elbo)
        for _ in range(warmup_steps):
            losses.append(svi.step(*p.args, **p.kwargs))
        if not math.isfinite(losses[-1]):
            raise ValueError(
                f"the Trace_ELBO warm-up (warmup_steps={warmup_steps}) diverged (loss "
                f"{losses[-1]}): use fewer warm-up steps or a smaller learning rate"
            )
        pyro.set_rng_seed(seed + 1)
    return p, losses


def _run_one(build, name, seed, steps, lr, num_particles, snr_draws, num_samples, progress,
             quiet, alpha=0.5, warmup_steps=0):  # fmt: skip
    p, warmup_losses = warm_start(build, seed, warmup_steps, lr)
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
        p, warmup_losses = warm_start(build, seed, warmup_steps, lr)
    svi = SVI(p.model, p.guide, pyro.optim.Adam({"lr": lr}), elbo)
    losses: list[float] = []
    bar = range(steps)
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(bar, desc=f"{name:>6}", leave=True, dynamic_ncols=True, file=sys.stderr)
    cv_weights: list = []
    diverged = None
    t_fit = time.perf_counter()
    for _ in bar:
        try:
            losses.append(svi.step(*p.args, **p.kwargs))
        except Exception as e:
            if not losses or not _step_diverged(e):
                raise  # a first step that fails is the model's error, not a divergence
            losses.append(math.nan)  # a parameter left its support: the fit has diverged
        if progress and len(losses) % 25 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.4g}")
        diverged = divergence_step(losses)
        if diverged is None and not _params_finite():
            diverged = len(losses)
        if diverged is not None:
            break
        if hasattr(elbo, "control_variate_weights") and len(losses) % max(1, steps // 50) == 0:
            cv_weights.append((len(losses), _mean_weights(elbo)))
    if progress:
        bar.close()
    fit_seconds = time.perf_counter() - t_fit
    tail = torch.tensor(losses[-max(1, len(losses) // 10) :], dtype=torch.float64)
    result = EstimatorResult(
        name=name,
        losses=losses,
        train_loss=float(tail.mean()) if tail.numel() else math.nan,
        train_loss_se=_se(tail),
        diverged_at=diverged,
        fit_seconds=fit_seconds,
        cv_weights=cv_weights,
        warmup_losses=warmup_losses,
    )
    last = f"{losses[-1]:.5g}" if losses else "-"
    if diverged is not None:
        _say(f"{name}: diverged at step {diverged} (loss {last}); try a smaller --lr "
             f"(was {lr:g}). Not measured.", quiet)  # fmt: skip
        return result, None
    _say(f"{name}: {len(losses)} steps in {fit_seconds:.1f} s, final loss {last}; "
         f"measuring ({snr_draws} gradient draws, {num_samples} guide draws)", quiet)  # fmt: skip
    result.grads = gradient_stats(
        p.model, p.guide, elbo, *p.args, num_draws=snr_draws, seed=seed, keep_draws=True,
        **p.kwargs,
    )  # fmt: skip
    g = result.grads
    result.grad_var_guide = total_variance(g, g.guide_params)
    result.grad_var_model = total_variance(g, g.model_params)
    result.snr_guide_interval = g.snr_interval(g.guide_params, seed=seed)
    result.snr_model_interval = g.snr_interval(g.model_params, seed=seed)
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
    return result, _Stepper(svi, p, pyro.get_param_store().get_state())


class _Stepper:
    """One more SVI step of a fitted estimator, with its own param store put in place."""

    def __init__(self, svi, p: Problem, state: dict):
        self.svi, self.p, self.state = svi, p, state

    def prepare(self) -> None:
        pyro.clear_param_store()
        pyro.get_param_store().set_state(self.state)

    def __call__(self) -> None:
        self.svi.step(*self.p.args, **self.p.kwargs)


def time_interleaved(
    steps: Sequence[Callable[[], Any]],
    rounds: int = 20,
    warmup_rounds: int = TIMING_WARMUP_ROUNDS,
    prepare: Sequence[Callable[[], Any]] | None = None,
    clock: Callable[[], float] | None = None,
) -> list[float]:
    r"""Median milliseconds per call of each of ``steps``, timed in interleaved rounds.

    Each round calls every step once (after its ``prepare``, untimed), in an order that
    rotates by one from round to round, so each step runs in every position equally often;
    the first ``warmup_rounds`` rounds are not timed (caches, allocator, lazy set-up). With
    one torch thread the clock is ``time.thread_time`` (CPU time of this thread: work of
    other processes is not counted), else ``time.perf_counter``. A step that raises gets
    ``nan`` and is not called again.

    Example::

        >>> ms = time_interleaved([lambda: sum(range(10_000)), lambda: None], rounds=5)
        >>> ms[0] > ms[1]
        True
    """
    check_int(rounds, "rounds", "time_interleaved", minimum=1)
    check_int(warmup_rounds, "warmup_rounds", "time_interleaved", minimum=0)
    if clock is None:
        clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    n = len(steps)
    times: list[list[float]] = [[] for _ in range(n)]
    failed: set[int] = set()
    for r in range(warmup_rounds + rounds):
        for i in [(r + j) % n for j in range(n)]:
            if i in failed:
                continue
            if prepare is not None:
                prepare[i]()
            t0 = clock()
            try:
                steps[i]()
            except Exception:  # noqa: BLE001 - measured already; only its time is lost
                failed.add(i)
                continue
            if r >= warmup_rounds:
                times[i].append(clock() - t0)
    return [
        math.nan if i in failed or not t else 1000 * statistics.median(t)
        for i, t in enumerate(times)
    ]


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
    warmup_steps: int = 0,
    timing_rounds: int = 20,
) -> Iterator[EstimatorResult]:
    """:func:`compare_estimators`, yielding each estimator's result as soon as it is fitted
    and measured; ``ms_per_step`` is filled in (on the results already yielded) once every
    estimator is, by :func:`time_interleaved` over ``timing_rounds`` rounds."""
    where = "iter_compare"
    check_int(steps, "steps", where, minimum=1, allow_none=True)
    check_float(lr, "lr", where, low=0.0, low_open=True, allow_none=True)
    check_int(num_particles, "num_particles", where, minimum=1, allow_none=True)
    check_int(seed, "seed", where, minimum=0)
    check_int(snr_draws, "snr_draws", where, minimum=2)
    check_int(num_samples, "num_samples", where, minimum=2)
    check_int(warmup_steps, "warmup_steps", where, minimum=0)
    check_int(timing_rounds, "timing_rounds", where, minimum=1)
    build = _builder(problem)
    for name in estimators:
        make_elbo(name)  # fail before any fitting
    fitted: list[tuple[EstimatorResult, _Stepper]] = []
    for name in estimators:
        result, stepper = _run_one(build, name, seed, steps, lr, num_particles, snr_draws,
                                   num_samples, progress, quiet, alpha, warmup_steps)  # fmt: skip
        if stepper is not None:
            fitted.append((result, stepper))
        yield result
    if fitted:
        _say(f"timing: {timing_rounds} interleaved rounds of one step per estimator", quiet)
        with torch.random.fork_rng(devices=[]):
            ms = time_interleaved([s for _, s in fitted], timing_rounds,
                                  prepare=[s.prepare for _, s in fitted])  # fmt: skip
        for (result, _), t in zip(fitted, ms):
            result.ms_per_step = t


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
    :param warmup_steps: ``N > 0``: every estimator starts after the same ``N`` steps of
        Pyro's ``Trace_ELBO`` from the seed (see :func:`warm_start`); 0 (default): from the
        initialisation.
    :param timing_rounds: rounds of :func:`time_interleaved` for ``ms_per_step``.
    :raises ValueError: for an unknown model or estimator (listing what exists).
    :returns: a list of :class:`EstimatorResult`, in the order of ``estimators``.
    """
    return list(iter_compare(problem, estimators, **kwargs))


def _fmt(x: float | None, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    return "nan" if math.isnan(x) else format(x, spec)


def _snr(x: float, interval: tuple, spec: str = ".3g") -> str:
    lo, hi = interval
    if math.isnan(x) or not (math.isfinite(lo) and math.isfinite(hi)):
        return _fmt(x, spec)
    return f"{format(x, spec)} [{lo:.2g}, {hi:.2g}]"


def _pm(x: float, se: float, spec: str) -> str:
    if math.isnan(x):
        return "nan"
    return f"{format(x, spec)}" + ("" if math.isnan(se) else f" ±{se:.2g}")


COLUMNS = ["estimator", "train loss (sum)", "ELBO (sum)", "log p(x) (sum)",
           "held-out ll (per obs)", "SNR guide", "SNR model", "tr Var guide", "tr Var model",
           "ms/step", "k-hat"]  # fmt: skip

#: printed under the table: what each column is, on which scale
TABLE_NOTE = """\
scales (nats): train loss = the estimator's own loss (iwae/dreg: negative IWAE bound; trace/stl:
  negative ELBO), mean of the last 10% of steps, summed over the training data; ELBO and
  log p(x) = from guide draws, summed over the diagnostic data; held-out ll = per held-out
  observation. SNR = |mean| / sd of the gradient (norm), [68% bootstrap interval]; with D
  gradient draws a zero mean gradient reads SNR ~ 1/sqrt(D) (the noise floor, printed below):
  near it, compare estimators by tr Var = total gradient variance (trace of the covariance,
  summed over unconstrained elements), lower is better. ± = one Monte Carlo standard error.
  ms/step = median time of a step at the fitted parameters, from interleaved rounds (one step
  of each estimator per round, the order rotating; 2 untimed rounds first)."""


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
            _snr(r.snr_guide, r.snr_guide_interval) if r.grads is not None and r.grads.guide_params else "-",
            _snr(r.snr_model, r.snr_model_interval) if r.grads is not None and r.grads.model_params else "-",
            _fmt(r.grad_var_guide, ".3g") if r.grads is not None and r.grads.guide_params else "-",
            _fmt(r.grad_var_model, ".3g") if r.grads is not None and r.grads.model_params else "-",
            _fmt(r.ms_per_step, ".3g") if math.isfinite(r.ms_per_step) else "-",
            f"{_fmt(r.khat.khat, '.2f')} {r.khat.reading}" if r.khat is not None else "-",
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    floors = sorted({r.snr_floor for r in results if not r.diverged and r.grads is not None})
    for f in floors:
        draws = round(1 / f**2)
        notes.append(f"SNR noise floor 1/sqrt(draws) = {f:.3g} ({draws} gradient draws)")
    warm = sorted({len(r.warmup_losses) for r in results if r.warmup_losses})
    for n in warm:
        notes.append(f"every estimator started after the same {n} Trace_ELBO warm-up steps")
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
