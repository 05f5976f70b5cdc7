r"""``Trace_ELBO`` whose score part is added back with a weight learned from earlier steps.

For a reparameterized guide :math:`z = g(\epsilon; \phi)` the loss gradient of ``Trace_ELBO``
is :math:`p + c`: the pathwise part :math:`p` (STL's gradient) and the score part
:math:`c = \nabla_\phi \log q(\bot(z); \phi)`, which has mean zero for every :math:`\phi`.
So for any :math:`b` that does not depend on the current draw,
:math:`g(b) = p + b \odot c` is unbiased: :math:`b = 1` is ``Trace_ELBO``, :math:`b = 0` STL.
:class:`~pyro_gradroute.infer.control_variate.ControlVariate` fits :math:`b` from earlier steps'
parts and :class:`~pyro_gradroute.infer.schedule.Schedule` decides which steps measure.
"""

from __future__ import annotations

import contextlib
import math

import pyro
import torch
import torch.distributed as torch_dist
from pyro.infer import Trace_ELBO as _PyroTrace_ELBO
from pyro.infer import TraceEnum_ELBO as _PyroTraceEnum_ELBO
from pyro.util import warn_if_nan

from .. import routing
from .._compat import param_store_leaves, trace_elbo_particles, trace_enum_elbo_particles
from .._validation import check_float
from ..distributed.gradients import average_gradients
from ..distributions.normal import normal_score, normal_sites
from ..poutine.stick_the_landing_messenger import stick_the_landing
from .control_variate import ControlVariate
from .elbo import (
    EXTRA,
    PATHWISE,
    RoutedELBO,
    Terms,
    collect_blocks,
    refuse_model_enumeration,
    scaled,
)
from .schedule import Schedule, ScheduleConfig
from .trace_elbo import Trace_ELBO, TraceSTL_ELBO

__all__ = ["TraceAdaptiveSTL_ELBO", "TraceEnumAdaptiveSTL_ELBO"]


# ----------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def _own_grads():
    """``own(params)`` gives each parameter a fresh ``.grad`` for this step; on exit what
    ``.grad`` held before is added back."""
    stash: dict = {}

    def own(params):
        for p in params:
            if p not in stash:
                stash[p], p.grad = p.grad, None

    try:
        yield own
    finally:
        for p, old in stash.items():
            if old is not None:
                p.grad = old if p.grad is None else old.add_(p.grad)


def _ranks(distributed: bool | None) -> int:
    """How many ranks average the parts (1: none)."""
    if distributed is False:
        return 1
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        if distributed:
            raise RuntimeError("distributed=True needs an initialized torch.distributed group")
        return 1
    return torch_dist.get_world_size()


def _mean_over_ranks(params: list, *parts: list) -> list[list]:
    """Each list of per-parameter tensors averaged over the ranks (through ``.grad``)."""
    out = []
    saved = [p.grad for p in params]
    for i, gs in enumerate(parts):
        for p, g in zip(params, gs):
            p.grad = g.detach().clone()
        average_gradients(params, check_params=i == 0)
        out.append([p.grad for p in params])
    for p, g in zip(params, saved):
        p.grad = g
    return out


def _param_name(p: torch.Tensor) -> str:
    name = pyro.get_param_store().param_name(p)
    return name if name is not None else f"<unnamed parameter {id(p):x}>"


def _layout(names: list[str], params: list) -> list | None:
    """``[(param-store name, shape)]``, or ``None`` where a parameter is outside the store."""
    if any(n.startswith("<unnamed") for n in names):
        return None
    return [(n, tuple(p.shape)) for n, p in zip(names, params)]


def _trace_params(*traces) -> list[torch.Tensor]:
    """The leaves of the traces' ``param`` sites (unconstrained), in trace order."""
    out, seen = [], set()
    for trace in traces:
        for site in trace.nodes.values():
            if site["type"] != "param":
                continue
            v = site["value"]
            leaf = v.unconstrained() if hasattr(v, "unconstrained") else v
            if torch.is_tensor(leaf) and leaf.requires_grad and id(leaf) not in seen:
                seen.add(id(leaf))
                out.append(leaf)
    return out


def _score_part(site):
    r"""The site's score part :math:`\log q(\bot(z); \phi)`, scaled: its density at the live
    sample less the pathwise part the estimator's handler gave it (the difference's gradient
    reaches the parameters directly only, not the sample nor the upstream samples it reads);
    ``None`` where it has none (the handler gave it its ordinary parts: a score-function
    site, a Delta computed from earlier draws, a point of a structured guide).
    """
    rec = site.get(PATHWISE)
    value = site["value"]
    if rec is None or rec.parts is None or not torch.is_grad_enabled():
        return None
    fn = rec.fn
    if not rec.parts.conditional and not _transformed(fn):
        # parameters read no earlier sample: the density at the detached sample is the score part
        score = scaled(site, fn.log_prob(value.detach()))
    else:
        score = scaled(site, fn.log_prob(value)) - site["log_prob"]
    return score if score.requires_grad else None


def _transformed(fn) -> bool:
    while fn is not None:
        if isinstance(fn, torch.distributions.TransformedDistribution):
            return True
        fn = getattr(fn, "base_dist", None)
    return False


def _grads(outputs, params, seeds=None, retain=False) -> dict:
    """``{param: d outputs / d param}`` for the params reached."""
    gs = torch.autograd.grad(outputs, params, seeds, retain_graph=retain, allow_unused=True)
    return {p: g for p, g in zip(params, gs) if g is not None}


# ----------------------------------------------------------------------------- the step
class _Adaptive:
    """State and the measured step shared by the adaptive estimators.

    ``control_variate`` (:class:`~pyro_gradroute.infer.control_variate.ControlVariate`) holds
    the moments and the fit; ``schedule`` (:class:`~pyro_gradroute.infer.schedule.Schedule`,
    its constants in ``schedule.config``) the choice of each step's kind.
    """

    control_variate: ControlVariate
    schedule: Schedule

    def _init_adaptive(
        self, decay, clip, warmup, center, confidence, fixed_weight, mix_gain, distributed, schedule
    ):
        where = type(self).__name__
        config = ScheduleConfig() if schedule is None else schedule
        if not isinstance(config, ScheduleConfig):
            raise TypeError(f"{where}: schedule must be a ScheduleConfig or None; got {schedule!r}")
        if distributed is not None and not isinstance(distributed, bool):
            raise TypeError(
                f"{where}: distributed must be True, False or None; got {distributed!r}"
            )
        mix_gain = check_float(
            mix_gain, "mix_gain", where, low=1.0, allow_inf=True, allow_none=True
        )
        self.control_variate = ControlVariate(
            decay, clip, warmup, center, confidence, fixed_weight,
            refit=config.refit, fresh=config.fresh, no_score=config.no_score, where=where,
        )  # fmt: skip
        self.schedule = Schedule(mix_gain, self.control_variate.decay, config)
        self._distributed = distributed

    @property
    def decay(self) -> float:
        return self.control_variate.decay

    @property
    def clip(self) -> float | None:
        return self.control_variate.clip

    def control_variate_weights(self) -> dict[str, torch.Tensor]:
        """``{name: b}`` the next step applies: by param-store name, or by guide site
        (``"<site>.loc"``, ``"<site>.scale"``) where measured steps take one pass."""
        return self.schedule.all_weights(self.control_variate)

    def state_dict(self) -> dict:
        """The moments, settings and schedule, to resume the same estimator."""
        return {**self.control_variate.state_dict(), "schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.control_variate.load_state_dict(state)
        self.schedule.load_state_dict(state["schedule"])

    def reset(self) -> None:
        """Forget the moments (the next step is ``Trace_ELBO``'s / IWAE's, ``b = 1``)."""
        self.control_variate.state.clear()
        self.control_variate.layouts.clear()
        self.schedule.reset()

    def _stl(self, guide):
        """``stick_the_landing(guide)``, one wrapper per guide (kept: a new handler's first run
        costs more than its later ones)."""
        cached = self.__dict__.get("_stl_guide")
        if cached is None or cached[0] is not guide:
            cached = self._stl_guide = (guide, stick_the_landing(guide))
        return cached[1]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_stl_guide", None)  # a cache (and the user's guide is not the estimator's)
        return state

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        r"""The loss whose gradient is :math:`p + b \odot c`; every call measures and is a
        step of the moments (call it once per step)."""
        return self._measure(model, guide, args, kwargs, differentiable=True)

    def _cv_grads(self, item, params, blocks, seen, retain: bool) -> dict:
        """``{param: c}`` of one trace pair (loss space)."""
        raise NotImplementedError

    def _measure(self, model, guide, args, kwargs, differentiable: bool = False):
        r"""A step that forms both parts and applies :math:`p + b \odot c` (into ``.grad``, or
        as the returned loss's gradient where ``differentiable``)."""
        loss, surrogate, one_pass, routed = 0.0, None, True, False
        g_path: dict = {}
        g_cv: dict = {}
        with _own_grads() as own:
            for elbo, terms, blocks, trainable, item in self._iter_particle_items(
                model, guide, args, kwargs
            ):
                loss -= elbo
                routed = routed or bool(blocks)
                if differentiable and terms:
                    part = -sum(
                        routing.gate(v, blocks[k]) if k in blocks else v for k, v in terms.items()
                    )
                    surrogate = part if surrogate is None else surrogate + part
                if not (terms and trainable) or item is None:
                    continue
                one_pass = one_pass and item.get("one_pass", False) and not blocks
                params = item["params"]
                raw = {k: -v for k, v in terms.items()}
                with routing.taps(item.get("taps", ())) as seen:
                    if differentiable:
                        gs = routing.grad(
                            raw, params, block=blocks, retain_graph=True, strict=False
                        )
                        for p, g in zip(params, gs):
                            g_path[p] = g if p not in g_path else g_path[p] + g
                    else:
                        own(params)
                        if blocks:
                            routing.backward(raw, block=blocks, retain_graph=True, strict=False)
                        else:
                            sum(raw.values()).backward(retain_graph=True)
                retain = differentiable or bool(self.retain_graph)
                for p, g in self._cv_grads(item, params, blocks, seen, retain).items():
                    g_cv[p] = g if p not in g_cv else g_cv[p] + g
                del item, terms, raw
            names = {p: _param_name(p) for p in g_cv}
            order = sorted(g_cv, key=names.__getitem__)  # the same order on every rank
            keys = [names[p] for p in order]
            if differentiable:
                paths = [g_path.get(p, torch.zeros_like(p)) for p in order]
            else:
                paths = [torch.zeros_like(p) if p.grad is None else p.grad for p in order]
            cvs = [g_cv[p] for p in order]
            linear = None
            if order:  # this step's weights come from earlier steps only
                for p, path, b, c in zip(
                    order, paths, self.schedule.weights(self.control_variate, keys, order), cvs
                ):
                    if differentiable:
                        term = (b * c).detach().mul(p).sum()
                        linear = term if linear is None else linear + term
                    else:
                        p.grad = torch.addcmul(path, b, c)
                if _ranks(self._distributed) > 1:
                    paths, cvs = _mean_over_ranks(order, paths, cvs)
                self._update(keys, order, paths, cvs, routed, one_pass)
        if not differentiable:
            warn_if_nan(loss, "loss")
            return loss
        if surrogate is None:
            return torch.tensor(loss)
        if linear is not None:
            surrogate = surrogate + (linear - linear.detach())
        warn_if_nan(surrogate, "loss")
        return loss + (surrogate - surrogate.detach())

    def _update(self, keys, order, paths, cvs, routed, one_pass) -> None:
        sch = self.schedule
        p, c = self.control_variate.update(keys, paths, cvs)
        if sch.mix_gain is not None:  # what a direct step at the gate's endpoint applies
            sch.gate.update(p if sch.gate.e == 0.0 else p + sch.gate.e * c)
        sch.measured(self.control_variate.key(keys, order), _layout(keys, order), routed)
        if sch.one_pass is None:
            sch.one_pass = one_pass


# ----------------------------------------------------------------------------- STL
class TraceAdaptiveSTL_ELBO(_Adaptive, TraceSTL_ELBO):
    r"""Trace ELBO whose score part is added back with a per-element weight chosen from past steps.

    The recommended default. Each step's gradient is

    .. math::

        g(b) = p + b \odot c, \qquad
        p = -\nabla_\phi\big[\log p(x, z) - \log q(z; \bot(\phi))\big], \quad
        c = -\nabla_\phi \log q(\bot(z); \phi),

    with :math:`z = g(\epsilon; \phi)` and :math:`\bot` stop-gradient (for a conditional
    guide every sample is held fixed in :math:`c`). :math:`\mathbb E[c] = 0` for every
    :math:`\phi`, so with :math:`b` computed from earlier steps only,
    :math:`\mathbb E[g(b) \mid \text{past}] = \nabla_\phi(-\text{ELBO})`: **every step is
    unbiased**, whatever :math:`b` is. :math:`b = 1` is ``Trace_ELBO``, :math:`b = 0` STL, and
    :math:`b^\star = -\operatorname{Cov}(p, c)/\operatorname{Var}(c)` has the smallest variance
    of all. :math:`b` starts at 1 (the first step is ``Trace_ELBO``'s) and moves towards the
    fitted :math:`\hat b` per element only as far as ``confidence`` standard errors allow
    (:class:`~pyro_gradroute.infer.control_variate.ControlVariate`). With
    :math:`|b - b^\star| \le |e^\star - b^\star|` the step's variance is at most the better
    endpoint's :math:`e^\star`; this is a statistical statement (error :math:`s`, lagging when
    :math:`b^\star` moves faster than the window ``decay``).

    **Steps.** A *direct* step is one endpoint's estimator, at its cost: Pyro's
    ``Trace_ELBO`` on ``guide``, or on ``stick_the_landing(guide)``. A *measured* step forms
    both parts: in one backward where every guide site with a score part is a plain ``Normal``
    (:func:`~pyro_gradroute.distributions.normal.normal_sites`; its score part is then
    closed-form at the ``Normal``'s parameters, and the moments are kept per element of them,
    named ``"<site>.loc"``, ``"<site>.scale"``), else with a second backward of the score parts.
    :class:`~pyro_gradroute.infer.schedule.Schedule` picks the kind from earlier steps
    (``mix_gain``, ``schedule``). ``differentiable_loss`` and distributed runs measure every
    step. ``block_grad`` routes apply to both parts. A parameter of the last measured step that
    changes shape or leaves the param store starts the estimator again at ``Trace_ELBO``. The
    state survives ``pickle``, ``deepcopy``, ``torch.save`` and ``state_dict`` (each copy takes
    the same next steps).

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro.infer import SVI
        >>> from pyro.infer.autoguide import AutoNormal
        >>> from pyro_gradroute.infer import TraceAdaptiveSTL_ELBO
        >>> def model(x):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", len(x)):
        ...         pyro.sample("x", dist.Normal(mu, 1.0), obs=x)
        >>> pyro.clear_param_store()
        >>> elbo = TraceAdaptiveSTL_ELBO(num_particles=4, vectorize_particles=True)
        >>> svi = SVI(model, AutoNormal(model), pyro.optim.Adam({"lr": 0.05}), elbo)
        >>> x = torch.randn(10)
        >>> for _ in range(20):
        ...     loss = svi.step(x)
        >>> sorted(elbo.control_variate_weights())
        ['AutoNormal.locs.mu', 'AutoNormal.scales.mu']
        >>> state = elbo.state_dict()  # resume later with elbo.load_state_dict(state)

    :param decay: weight of earlier steps' moments (effective window
        :math:`(1 + \text{decay})/(1 - \text{decay})` steps).
    :param clip: optional bound on :math:`|\hat b|`.
    :param warmup: measured steps at :math:`b = 1` before the fit is used.
    :param confidence: :math:`z`, in standard errors of :math:`\hat b`.
    :param fixed_weight: a fixed :math:`b` for every element instead of the fit (every step
        measures).
    :param center: fit with an intercept (default); ``False`` fits through 0.
    :param distributed: average the parts over ``torch.distributed`` ranks (``None``:
        when a group is initialized; ``True``: required; ``False``: never), so :math:`b` is
        identical on every rank; every rank must then step together.
    :param mix_gain: ``None``: every step measures; a number :math:`\ge 1`: steps take the
        better endpoint directly while its predicted second moment is within ``mix_gain`` of
        the fitted mix's, and while the gate bounds any weights' gain below it; ``math.inf``:
        never mix, a measured switch between the whole estimators (every step is
        ``Trace_ELBO``'s or STL's on the same draws).
    :param schedule: a :class:`~pyro_gradroute.infer.schedule.ScheduleConfig` (the schedule's
        constants).

    Other arguments are :class:`pyro.infer.Trace_ELBO`'s.
    """

    _PYRO = _PyroTrace_ELBO  # Pyro's estimator whose steps the direct and one-pass steps are

    def __init__(
        self,
        num_particles: int = 1,
        max_plate_nesting: float = math.inf,
        *args,
        decay: float = 0.9,
        clip: float | None = None,
        warmup: int = 5,
        confidence: float = 2.0,
        fixed_weight: float | None = None,
        center: bool = True,
        distributed: bool | None = None,
        mix_gain: float | None = 2.0,
        schedule: ScheduleConfig | None = None,
        **kwargs,
    ):
        super().__init__(num_particles, max_plate_nesting, *args, **kwargs)
        self._init_adaptive(
            decay, clip, warmup, center, confidence, fixed_weight, mix_gain, distributed, schedule
        )
        kwargs.pop("trace_steps", None)
        self._pyro = self._PYRO(num_particles, max_plate_nesting, *args, **kwargs)
        self._routed_trace = Trace_ELBO(num_particles, max_plate_nesting, *args, **kwargs)

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        """Negative ELBO as a float; accumulates :math:`p + b \\odot c` (or a direct step's gradient)."""
        sch, cv = self.schedule, self.control_variate
        if _ranks(self._distributed) > 1:
            return self._measure(model, guide, args, kwargs)
        sch.check(cv, param_store_leaves())
        step = sch.decide(cv)
        if not step.measure:
            return self._direct(step, model, guide, args, kwargs)
        if sch.one_pass and not self.vectorize_particles:
            return self._one_pass(model, guide, args, kwargs)
        return self._measure(model, guide, args, kwargs)

    def _direct(self, step, model, guide, args, kwargs) -> float:
        """Endpoint ``step.end``'s own step; where ``step.feed``, its gradient on the last
        measured step's parameters goes into the gate."""
        sch = self.schedule
        leaves = param_store_leaves() if step.feed and sch.layout else {}
        params = [leaves[n] for n, _ in sch.layout] if leaves else []
        with _own_grads() as own:
            own(params)
            loss = self._endpoint(step.end, model, guide, args, kwargs)
            if params:
                zero = torch.zeros_like
                sch.gate.update(
                    torch.cat([(zero(p) if p.grad is None else p.grad).reshape(-1) for p in params])
                )
        return loss

    def _endpoint(self, end: float, model, guide, args, kwargs) -> float:
        """Pyro's estimator on ``guide`` (``end = 1``) or on ``stick_the_landing(guide)``; where
        the last measured step had ``block_grad`` routes, this package's routed ones."""
        if self.schedule.routed:
            if end == 1.0:
                return self._routed_trace.loss_and_grads(model, guide, *args, **kwargs)
            return RoutedELBO.loss_and_grads(self, model, guide, *args, **kwargs)
        self._sync()
        return self._pyro.loss_and_grads(
            model, guide if end == 1.0 else self._stl(guide), *args, **kwargs
        )

    def _sync(self) -> None:
        self._pyro.max_plate_nesting = self.max_plate_nesting

    def _particles(self, model, guide, args, kwargs):
        """``(model_trace, guide_trace, loss, surrogate)`` per particle of Pyro's estimator."""
        self._sync()
        return trace_elbo_particles(self._pyro, model, guide, args, kwargs)

    def _not_one_pass(self, why: str) -> None:
        """A trace the one-pass step cannot take; here the step stays ``Trace_ELBO``'s."""

    def _one_pass(self, model, guide, args, kwargs) -> float:
        r"""A measured step in one backward: Pyro's step, with a tap at each guide site's
        :math:`\theta = (\mu, \sigma)` that reads :math:`t = p + c` there (:math:`c` closed-form,
        :func:`~pyro_gradroute.distributions.normal.normal_score`) and sends on
        :math:`t + (b - 1) c`. Where a trace does not qualify the step is ``Trace_ELBO``'s
        (nothing measured) and later measured steps take the two-backward path."""
        sch, cv, n = self.schedule, self.control_variate, self.num_particles
        loss, ok, keys, bs, feed, routed, const, key = 0.0, True, None, None, False, False, 1.0, ""
        acc: dict[str, list] = {}
        params: dict[str, torch.Tensor] = {}
        with _own_grads() as own:
            for model_trace, guide_trace, loss_p, surrogate in self._particles(
                model, guide, args, kwargs
            ):
                self._refuse_enumeration(model_trace, guide_trace)
                loss += loss_p / n
                blocks = collect_blocks(model_trace, guide_trace)
                routed = routed or bool(blocks)
                sites = (
                    ("block_grad routes" if blocks else normal_sites(guide_trace)) if ok else None
                )
                if ok and isinstance(sites, str):
                    self._not_one_pass(sites)
                ok = isinstance(sites, list)
                parts = []
                if ok:
                    for name, base, nd, transforms in sites:
                        site = guide_trace.nodes[name]
                        value = site["value"].detach()
                        for t in reversed(transforms):  # the Normal's own draw
                            value = t.inv(value)
                        for part, t, c in normal_score(
                            base, nd, value, site["scale"], site["mask"]
                        ):
                            parts.append((f"{name}.{part}", t, c / n if n > 1 else c))
                    parts.sort(key=lambda x: x[0])
                    names = [k for k, _, _ in parts]
                    if keys is None:
                        keys = names
                        key = cv.key(keys, [c for _, _, c in parts]) if keys else ""
                        const = sch.constant(cv, key)
                        feed = sch.mix_gain is not None and const == sch.gate.e
                        if const != 1.0 and keys:
                            bs = sch.weights(cv, keys, [c for _, _, c in parts])
                    ok = names == keys
                if ok:
                    for p in _trace_params(guide_trace):
                        params[_param_name(p)] = p
                        own([p])  # the step's own gradient, for the gate
                if not getattr(surrogate, "requires_grad", False) or not _trace_params(
                    model_trace, guide_trace
                ):
                    continue
                if blocks:  # this package's routed Trace_ELBO on these traces
                    _, terms = self._routed_trace._particle_terms(model_trace, guide_trace, blocks)
                    terms = {
                        k: -v / n
                        for k, v in terms.items()
                        if torch.is_tensor(v) and v.requires_grad
                    }
                    routing.backward(
                        terms, block=blocks, retain_graph=self._pyro.retain_graph, strict=False
                    )
                    continue
                entries = []
                if ok:
                    entries = [
                        (t, None if const == 1.0 else (b - 1) * c)
                        for (_, t, c), b in zip(parts, bs or [None] * len(parts))
                    ]
                with routing.taps(entries) as seen:
                    (surrogate / n).backward(retain_graph=self._pyro.retain_graph)
                if ok and entries:
                    if any(g is None for g in seen):
                        ok = False
                        continue
                    for (k, _, c), g in zip(parts, seen):
                        a = acc.setdefault(k, [0.0, 0.0])
                        a[0], a[1] = a[0] + (g - c), a[1] + c
            sch.routed = routed
            if ok and keys and len(acc) == len(keys):
                if sch.key is not None and sch.key != key:
                    cv.forget(sch.key)  # the two-backward path's state (a first step)
                cv.update(keys, [acc[k][0] for k in keys], [acc[k][1] for k in keys])
                ps = [params[k] for k in sorted(params)]
                sch.measured(key, _layout(sorted(params), ps), routed)
                if feed and ps:  # the step's own gradient, in the layout's order
                    gs = [
                        (torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in ps
                    ]
                    sch.gate.update(torch.cat(gs))
                sch.one_pass = True
            elif not ok:
                sch.one_pass = False  # later measured steps: the two-backward path
        return loss

    def _refuse_enumeration(self, model_trace, guide_trace) -> None:
        refuse_model_enumeration(self, model_trace, guide_trace)

    def _particle_terms(self, model_trace, guide_trace, blocks=None) -> tuple[float, Terms]:
        self._refuse_enumeration(model_trace, guide_trace)
        elbo, terms = super()._particle_terms(model_trace, guide_trace, blocks)
        if torch.is_grad_enabled():
            scores = []
            for name, site in guide_trace.nodes.items():
                if site["type"] == "sample" and not site["is_observed"]:
                    s = _score_part(site)
                    if s is not None:
                        scores.append((("guide", name), s.sum()))
            one_pass = not blocks and isinstance(normal_sites(guide_trace), list)
            terms[EXTRA] = {
                "params": _trace_params(model_trace, guide_trace),
                "scores": scores,
                "one_pass": one_pass,
            }
        return elbo, terms

    def _cv_grads(self, item, params, blocks, seen, retain: bool) -> dict:
        n = self._particle_divisor()
        terms = {k: (s / n if n > 1 else s) for k, s in item["scores"]}
        if not terms:
            return {}
        if blocks:
            gs = routing.grad(terms, params, block=blocks, retain_graph=retain, strict=False)
            return {p: g for p, g in zip(params, gs) if g is not None}
        return _grads(list(terms.values()), params, retain=retain)


class TraceEnumAdaptiveSTL_ELBO(TraceAdaptiveSTL_ELBO):
    r""":class:`TraceAdaptiveSTL_ELBO` over Pyro's :class:`pyro.infer.TraceEnum_ELBO`: the
    enumerated sites are summed out exactly, and the continuous guide's gradient is
    :math:`p + b \odot c` (unbiased for any :math:`b` from earlier steps).

    Direct steps are ``TraceEnum_ELBO``'s on ``guide`` (:math:`b = 1`) or on
    ``stick_the_landing(guide)`` (:math:`b = 0`); measured steps take one backward, so every
    guide site with a score part must be a plain ``Normal``
    (:func:`~pyro_gradroute.distributions.normal.normal_sites`: ``AutoNormal``,
    ``AutoDiagonalNormal``, mean-field guides); another raises a ``ValueError`` naming the
    site. ``loss`` is ``TraceEnum_ELBO``'s, and every method's value equals
    ``TraceEnum_ELBO``'s on the same seed. ``differentiable_loss`` is the current endpoint's
    ``TraceEnum_ELBO.differentiable_loss`` (it does not measure). ``block_grad`` routes,
    vectorized particles and distributed runs raise, naming what to use.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro import poutine
        >>> from pyro.infer import SVI, config_enumerate
        >>> from pyro.infer.autoguide import AutoNormal
        >>> from pyro_gradroute.infer import TraceEnumAdaptiveSTL_ELBO
        >>> @config_enumerate
        ... def model(x):
        ...     locs = pyro.sample("locs", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
        ...     with pyro.plate("data", len(x)):
        ...         k = pyro.sample("k", dist.Categorical(torch.ones(2) / 2))
        ...         pyro.sample("x", dist.Normal(locs[k], 1.0), obs=x)
        >>> pyro.clear_param_store()
        >>> guide = AutoNormal(poutine.block(model, hide=["k"]))
        >>> elbo = TraceEnumAdaptiveSTL_ELBO(max_plate_nesting=1)
        >>> svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), elbo)
        >>> x = torch.cat([torch.randn(10) - 2, torch.randn(10) + 2])
        >>> for _ in range(10):
        ...     loss = svi.step(x)
        >>> sorted(elbo.control_variate_weights())
        ['locs_unconstrained.loc', 'locs_unconstrained.scale']
    """

    _PYRO = _PyroTraceEnum_ELBO

    def __init__(
        self, num_particles: int = 1, max_plate_nesting: float = math.inf, *args, **kwargs
    ):
        super().__init__(num_particles, max_plate_nesting, *args, **kwargs)
        if self.vectorize_particles:
            raise NotImplementedError(
                f"{type(self).__name__}: vectorize_particles is not supported; use "
                "num_particles without vectorize_particles (a loop over particles)"
            )
        self._pyro.retain_graph = True  # as TraceEnum_ELBO's own backward

    def _refuse_enumeration(self, model_trace, guide_trace) -> None:
        pass  # enumeration is what this estimator is for

    def loss(self, model, guide, *args, **kwargs) -> float:
        """``TraceEnum_ELBO``'s loss (the enumerated sites summed out)."""
        self._sync()
        return self._pyro.loss(model, guide, *args, **kwargs)

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        if _ranks(self._distributed) > 1:
            raise NotImplementedError(
                f"{type(self).__name__} does not average its parts over ranks; use "
                "pyro.infer.TraceEnum_ELBO with the guide under stick_the_landing, or one process"
            )
        sch, cv = self.schedule, self.control_variate
        sch.check(cv, param_store_leaves())
        step = sch.decide(cv)
        if not step.measure:
            return self._direct(step, model, guide, args, kwargs)
        return self._one_pass(model, guide, args, kwargs)

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        end = self.schedule.endpoint(self.control_variate)[0]
        self._sync()
        guide = guide if end in (None, 1.0) else self._stl(guide)
        return self._pyro.differentiable_loss(model, guide, *args, **kwargs)

    def _not_one_pass(self, why: str) -> None:
        raise ValueError(
            f"{type(self).__name__}: {why}; it needs every guide site with a score part to be "
            "a plain Normal whose loc and scale read no earlier sample (AutoNormal, "
            "AutoDiagonalNormal, mean-field guides). Use pyro.infer.TraceEnum_ELBO with the "
            "guide under pyro_gradroute.poutine.stick_the_landing (trace_steps=N to start at "
            "TraceEnum_ELBO)"
        )

    def _sync(self) -> None:
        if self.max_plate_nesting != math.inf:  # (else TraceEnum_ELBO keeps the one it guessed)
            self._pyro.max_plate_nesting = self.max_plate_nesting

    def _particles(self, model, guide, args, kwargs):
        self._sync()
        return trace_enum_elbo_particles(self._pyro, model, guide, args, kwargs)

    def _endpoint(self, end: float, model, guide, args, kwargs) -> float:
        self._sync()
        return self._pyro.loss_and_grads(
            model, guide if end == 1.0 else self._stl(guide), *args, **kwargs
        )
