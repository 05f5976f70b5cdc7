r"""Gradient statistics of an ELBO estimator at the current parameters.

For an estimator :math:`\hat g` of :math:`\nabla_\theta \mathcal L` (the gradient of the loss
with respect to each *unconstrained* parameter, what the optimizer sees), ``num_draws``
independent evaluations :math:`\hat g_1..\hat g_D` give per element

.. math::

    \bar g = \frac1D \sum_d \hat g_d, \qquad
    s^2 = \frac1{D-1} \sum_d (\hat g_d - \bar g)^2, \qquad
    \mathrm{SNR} = |\bar g| / s,

and per parameter (or group of parameters) the norm SNR
:math:`\lVert \bar g \rVert_2 / \sqrt{\sum s^2}` (Rainforth et al. 2018 use the per-element
ratio; the norm version has no 0/0 for elements that never move). An estimator that is exactly
zero at every draw (STL at the exact posterior) has SNR NaN: it has no noise and no signal.
"""

from __future__ import annotations

import copy
import math
import statistics
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import pyro
import pyro.poutine as poutine
import torch

from .._compat import handler_stack, wrapping_messengers
from .._validation import check_elbo, check_int, check_mapping
from ..poutine.stick_the_landing_messenger import StickTheLandingMessenger, STLPolicy


@dataclass
class ParamGradStats:
    """Mean, variance (unbiased) and per-element SNR of one parameter's gradient."""

    mean: torch.Tensor
    variance: torch.Tensor

    @property
    def snr(self) -> torch.Tensor:
        return self.mean.abs() / self.variance.sqrt()

    @property
    def norm_snr(self) -> float:
        return _norm_snr([self])


def _norm_snr(stats) -> float:
    signal = math.sqrt(sum(float((s.mean**2).sum()) for s in stats))
    noise = math.sqrt(sum(float(s.variance.sum()) for s in stats))
    if noise == 0.0:
        return math.nan if signal == 0.0 else math.inf
    return signal / noise


class GradientStats(dict):
    """``{param name: ParamGradStats}`` plus the names of guide and model parameters.

    :ivar guide_params: names of parameters read by the guide.
    :ivar model_params: names of parameters read by the model only.
    :ivar num_draws: number of gradient evaluations.
    """

    def __init__(self, stats, guide_params, model_params, num_draws: int, draws=None):
        super().__init__(stats)
        self.guide_params = list(guide_params)
        self.model_params = list(model_params)
        self.num_draws = num_draws
        #: ``{name: (num_draws, *shape) tensor}`` of the gradient draws, with ``keep_draws``
        self.draws = draws

    def __missing__(self, name):
        raise KeyError(f"{name!r}: not a parameter of these statistics, which hold {sorted(self)}")

    def snr(self, names=None) -> float:
        """Norm SNR over the parameters ``names`` (a name, a list of names; default: all)."""
        names = list(self) if names is None else [names] if isinstance(names, str) else list(names)
        return _norm_snr([self[n] for n in names]) if names else math.nan

    def snr_interval(
        self, names=None, level: float = 0.68, num_resamples: int = 200, seed: int = 0
    ) -> tuple[float, float]:
        r"""A bootstrap interval of the norm SNR over ``names`` (default: all) that contains
        the estimate: :math:`\hat\rho \exp(\pm z\,\mathrm{sd}^*(\log\hat\rho^*))`, ``z``
        the normal quantile of ``level``, over ``num_resamples`` resamples of the draws.
        (:math:`\hat\rho = \lVert\bar g\rVert / \sqrt{\sum_i s_i^2}` is biased upwards and a
        resample adds the bias again: near the noise floor :math:`1/\sqrt D` the bootstrap's
        percentiles miss the estimate.) Needs ``keep_draws=True``; ``(nan, nan)`` without draws.

        >>> d = torch.randn(20, 3, generator=torch.Generator().manual_seed(0))
        >>> s = GradientStats({"a": ParamGradStats(d.mean(0), d.var(0))}, ["a"], [], 20,
        ...                   draws={"a": d})
        >>> lo, hi = s.snr_interval(["a"])
        >>> lo <= s.snr(["a"]) <= hi
        True
        """
        names = list(self) if names is None else [names] if isinstance(names, str) else list(names)
        if not names or self.draws is None:
            return math.nan, math.nan
        est, D = self.snr(names), self.num_draws
        if not (math.isfinite(est) and est > 0):
            return est, est
        flat = torch.cat([self.draws[n].reshape(D, -1) for n in names], 1).double()
        g = torch.Generator(device=flat.device).manual_seed(seed)
        boot = flat[torch.randint(D, (num_resamples, D), generator=g, device=flat.device)]
        signal, noise = boot.mean(1).pow(2).sum(-1).sqrt(), boot.var(1).sum(-1).sqrt()
        ok = (signal > 0) & (noise > 0)
        if int(ok.sum()) < 2:
            return est, est
        spread = float((signal[ok] / noise[ok]).log().std())
        z = statistics.NormalDist().inv_cdf((1 + level) / 2)
        return est * math.exp(-z * spread), est * math.exp(z * spread)

    def to_dataframe(self):
        """A ``pandas.DataFrame``, one row per parameter: role, size, mean ``|g|``, variance, SNR."""
        import pandas as pd

        rows = {
            name: {
                "role": "guide" if name in self.guide_params else "model",
                "size": s.mean.numel(),
                "mean_abs": float(s.mean.abs().mean()),
                "variance": float(s.variance.mean()),
                "snr": s.norm_snr,
            }
            for name, s in self.items()
        }
        return pd.DataFrame.from_dict(rows, orient="index")


def _param_names(model, guide, args, kwargs) -> tuple[list[str], list[str]]:
    """Names of the param-store parameters read by guide and model (creating missing ones)."""
    guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
    model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs)
    guide_names = [n for n, s in guide_trace.nodes.items() if s["type"] == "param"]
    model_names = [
        n for n, s in model_trace.nodes.items() if s["type"] == "param" and n not in guide_names
    ]
    return guide_names, model_names


def _step_counters(elbo, guide) -> list[STLPolicy]:
    """The STL policies whose step counts (``trace_steps``) a draw advances: the estimator's,
    and those of ``stick_the_landing`` handlers wrapping the guide or active around the call."""
    found = {id(v): v for v in vars(elbo).values() if isinstance(v, STLPolicy)}
    for m in (*wrapping_messengers(guide), *handler_stack()):
        if isinstance(m, StickTheLandingMessenger):
            found[id(m._policy)] = m._policy
    return list(found.values())


#: weakly keyed caches (e.g. keyed on guides): shared with the estimator, never copied
_WEAK = (weakref.WeakSet, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)


def _copy_value(v):
    """A copy of an attribute's value that later draws cannot change (caches are shared)."""
    if isinstance(v, _WEAK):
        return v
    try:
        return copy.deepcopy(v)
    except Exception:  # not copyable (a compiled JIT function, a graph tensor): shared
        return v


def _own_objects(elbo) -> list:
    """The estimator's attributes that are objects of this package (a control variate, a
    schedule, an STL policy): restored in place, so other references see the restored state."""
    return [
        v
        for v in vars(elbo).values()
        if type(v).__module__.startswith("pyro_gradroute.") and hasattr(v, "__dict__")
    ]


def _snapshot(store, elbo, counters):
    """The param store (leaves, values, ``.grad``, constraints) and the estimator's state: its
    ``state_dict``, its attributes, those of its objects of this package, and ``counters``."""
    leaves = {n: (p, p.detach().clone(), p.grad) for n, p in store.named_parameters()}
    state = getattr(elbo, "state_dict", None)
    elbo_state = copy.deepcopy(state()) if callable(state) else None
    attrs = {k: _copy_value(v) for k, v in vars(elbo).items()}
    inner = [(obj, {k: _copy_value(v) for k, v in vars(obj).items()}) for obj in _own_objects(elbo)]
    return leaves, store.get_state(), elbo_state, (dict(vars(elbo)), attrs, inner), counters


def _restore(store, elbo, snapshot) -> None:
    """Put back what :func:`_snapshot` saw, in place (an optimizer keeps referring to the same
    leaves); parameters the draws created are removed; attributes a draw created (a JIT ELBO's
    compiled loss) are caches and are kept."""
    leaves, state, elbo_state, (objects, attrs, inner), counters = snapshot
    for name in [n for n in store.keys() if n not in leaves]:
        del store[name]
    store.set_state(state)
    with torch.no_grad():
        for leaf, value, grad in leaves.values():
            leaf.copy_(value)
            leaf.grad = grad
    if elbo_state is not None:
        elbo.load_state_dict(elbo_state)
    in_place = {id(obj) for obj, _ in inner}
    vars(elbo).update(
        {k: objects[k] if id(objects[k]) in in_place else _copy_value(v) for k, v in attrs.items()}
    )
    for obj, values in inner:
        vars(obj).update({k: _copy_value(v) for k, v in values.items()})
    for policy, steps in counters:
        policy.steps = steps


def gradient_stats(
    model,
    guide,
    elbo,
    *args,
    num_draws: int = 100,
    seed: int | None = None,
    keep_draws: bool = False,
    **kwargs,
) -> GradientStats:
    r"""Mean, variance and SNR of ``elbo``'s gradient estimate at the current parameters.

    Each draw calls ``elbo.loss_and_grads(model, guide, *args, **kwargs)``, the code path
    :class:`pyro.infer.SVI` uses (block_grad routes and surrogate losses are honoured), and
    reads the ``.grad`` of every param-store parameter the model or guide reads. Every draw is
    the estimator's next step from the same state, and that state is left as it was: the param
    store (the same leaf tensors with the same values; ``TraceGraph_ELBO``'s baselines put back,
    parameters the draws created removed), the estimator's attributes and ``state_dict`` (the
    adaptive estimators' moments and schedule), the ``trace_steps`` counts (``TraceSTL_ELBO``,
    ``stick_the_landing`` wrapping the guide or active around the call), every ``.grad`` (the
    same tensor, or ``None``) and torch's random state (pass ``seed`` for reproducible draws).
    Parameters that do not exist yet are created, as SVI's first step would.

    :param elbo: any ELBO with ``loss_and_grads`` (Pyro's or this package's).
    :param num_draws: number of independent gradient evaluations (at least 2).
    :param keep_draws: keep every draw (``stats.draws``) for
        :meth:`GradientStats.snr_interval`.
    :raises ValueError: if ``num_draws`` is not an integer >= 2; ``TypeError`` (also a
        ``ValueError``) if ``elbo`` is not an ELBO instance (e.g. the class itself).

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro.infer.autoguide import AutoNormal
        >>> pyro.clear_param_store()
        >>> from pyro_gradroute.infer import Trace_ELBO
        >>> from pyro_gradroute.diagnostics import gradient_stats
        >>> def model(x):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", len(x)):
        ...         pyro.sample("x", dist.Normal(mu, 1.0), obs=x)
        >>> x = torch.randn(10)
        >>> stats = gradient_stats(model, AutoNormal(model), Trace_ELBO(), x, num_draws=20)
        >>> sorted(stats)
        ['AutoNormal.locs.mu', 'AutoNormal.scales.mu']
        >>> stats["AutoNormal.locs.mu"].variance.shape
        torch.Size([])
    """
    check_elbo(elbo, "elbo", "gradient_stats")
    check_int(num_draws, "num_draws", "gradient_stats", minimum=2)  # 2: for a variance
    check_int(seed, "seed", "gradient_stats", allow_none=True)
    store = pyro.get_param_store()
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        # before the trace that finds the parameters: a handler counts the guide's runs
        counters = [(policy, policy.steps) for policy in _step_counters(elbo, guide)]
        guide_names, model_names = _param_names(model, guide, args, kwargs)
        params = {n: p for n, p in store.named_parameters() if n in guide_names + model_names}
        snapshot = _snapshot(store, elbo, counters)
        count = 0
        mean = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
        m2 = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
        kept: dict[str, list] = {n: [] for n in params}

        try:
            for d in range(num_draws):
                if d:  # every draw is the estimator's next step from the same state
                    _restore(store, elbo, snapshot)
                for _, p in store.named_parameters():
                    p.grad = None
                elbo.loss_and_grads(model, guide, *args, **kwargs)
                count += 1
                for n, p in params.items():  # Welford's update
                    g = torch.zeros_like(mean[n]) if p.grad is None else p.grad.double()
                    delta = g - mean[n]
                    mean[n] += delta / count
                    m2[n] += delta * (g - mean[n])
                    if keep_draws:
                        kept[n].append(g)
        except BaseException:
            try:
                _restore(store, elbo, snapshot)
            except Exception:  # noqa: BLE001 - the draw's error is the one to report
                pass
            raise
        _restore(store, elbo, snapshot)
    stats = {n: ParamGradStats(mean[n], m2[n] / (count - 1)) for n in params}
    return GradientStats(
        stats,
        [n for n in guide_names if n in params],
        [n for n in model_names if n in params],
        num_draws,
        {n: torch.stack(v) for n, v in kept.items()} if keep_draws else None,
    )


def compare_gradients(
    model,
    guide,
    elbos: Mapping[str, object],
    *args,
    num_draws: int = 100,
    seed: int | None = 0,
    **kwargs,
):
    r"""Gradient statistics of several ELBOs at the same parameters, side by side.

    Every estimator gets the same ``seed`` (so the same random stream where they draw alike).

    :returns: a ``pandas.DataFrame`` indexed by parameter name (plus ``"(guide)"``,
        ``"(model)"`` and ``"(all)"`` rows with the norm SNR of those groups), with columns
        ``(statistic, estimator)`` for statistic in ``mean_abs``, ``variance``, ``snr``:
        ``df["snr"]`` is the SNR table.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro.infer.autoguide import AutoNormal
        >>> pyro.clear_param_store()
        >>> from pyro_gradroute.infer import Trace_ELBO, TraceSTL_ELBO
        >>> from pyro_gradroute.diagnostics import compare_gradients
        >>> model = lambda: pyro.sample("z", dist.Normal(0.0, 1.0))
        >>> df = compare_gradients(model, AutoNormal(model),
        ...                        {"trace": Trace_ELBO(), "stl": TraceSTL_ELBO()}, num_draws=10)
        >>> list(df["snr"].columns)
        ['trace', 'stl']
    """
    import pandas as pd

    check_mapping(elbos, "elbos ({label: ELBO instance})", "compare_gradients")
    for label, elbo in elbos.items():
        check_elbo(elbo, f"elbos[{label!r}]", "compare_gradients")
    check_int(num_draws, "num_draws", "compare_gradients", minimum=2)
    columns = {}
    for label, elbo in elbos.items():
        st = gradient_stats(model, guide, elbo, *args, num_draws=num_draws, seed=seed, **kwargs)
        df = st.to_dataframe()
        for stat in ("mean_abs", "variance"):
            columns[(stat, label)] = df[stat].to_dict()
        groups = {"(guide)": st.guide_params, "(model)": st.model_params, "(all)": None}
        columns[("snr", label)] = df["snr"].to_dict() | {k: st.snr(v) for k, v in groups.items()}
    return pd.DataFrame(columns)
