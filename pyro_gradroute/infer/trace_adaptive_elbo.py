"""The adaptive estimators' measured and direct steps, around :class:`.control_variate.ControlVariate`
and :class:`.schedule.Schedule`."""

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
from .._compat import param_store_leaves, trace_elbo_particles, trace_enum_elbo_particles, vjp
from .._validation import check_float
from ..distributed.gradients import average_gradients
from ..distributions.normal import normal_score, normal_sites
from ..poutine.stick_the_landing_messenger import StickTheLandingMessenger, STLPolicy
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
    """``own(params)`` gives each parameter a fresh ``.grad``; on exit the old one is added back."""
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


def _flat_grad(params: list) -> torch.Tensor:
    return torch.cat(
        [(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in params]
    )


def _add(acc: dict, pairs) -> None:
    for k, g in pairs:
        acc[k] = g if k not in acc else acc[k] + g


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
    r"""The site's scaled score part :math:`\log q(\bot(z); \phi)` (reaching the parameters
    directly only), or ``None`` where the estimator's handler left it its ordinary parts."""
    rec, value = site.get(PATHWISE), site["value"]
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
    gs = vjp(
        outputs, params, [torch.ones_like(o) for o in outputs] if seeds is None else seeds, retain
    )
    return {p: g for p, g in zip(params, gs) if g is not None}


def _normal_parts(blocks: dict, guide_trace, n: int) -> list | str:
    """``[("<site>.loc", loc, c), ...]`` sorted by name: each plain-Normal site's parameter and its
    closed-form score part, or why the traces do not qualify
    (:func:`~pyro_gradroute.distributions.normal.normal_sites`)."""
    sites = "block_grad routes" if blocks else normal_sites(guide_trace)
    if isinstance(sites, str):
        return sites
    parts = []
    for name, base, nd, transforms in sites:
        site = guide_trace.nodes[name]
        value = site["value"].detach()
        for t in reversed(transforms):  # the Normal's own draw
            value = t.inv(value)
        for part, t, c in normal_score(base, nd, value, site["scale"], site["mask"]):
            parts.append((f"{name}.{part}", t, c / n if n > 1 else c))
    return sorted(parts, key=lambda x: x[0])


# ----------------------------------------------------------------------------- the step
class _Adaptive:
    """The state (``control_variate``, ``schedule``) and the measured step of the adaptive estimators."""

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
            gain=mix_gain if mix_gain is not None and math.isfinite(mix_gain) else None,
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

    def _at(self, end, guide):
        r"""The guide a direct step at endpoint ``end`` runs: ``guide`` at 1, else ``guide``
        under sticking the landing, with the score part kept at the tensors of a split
        (``"<site>.loc"``, ``"<site>.scale"``: :math:`p + e \odot c`); kept per guide."""
        if end == 1.0:
            return guide
        cached = self.__dict__.get("_stl_guide")
        if cached is None or cached[0] is not guide or cached[1] != end:
            keep: dict[str, set] = {}
            for name in end if isinstance(end, frozenset) else ():
                site, part = name.rsplit(".", 1)
                keep.setdefault(site, set()).add(part)
            handler = StickTheLandingMessenger(_policy=STLPolicy(type(self).__name__, keep=keep))
            cached = self._stl_guide = (guide, end, handler(guide))
        return cached[2]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_stl_guide", None)  # a cache (and the user's guide is not the estimator's)
        return state

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        r"""The loss whose gradient is :math:`p + b \odot c`; every call measures and is a
        step of the moments (call it once per step)."""
        return self._measured_step(model, guide, args, kwargs, differentiable=True)

    def _measured_step(self, model, guide, args, kwargs, differentiable: bool = False):
        r"""A step that forms both parts and applies :math:`p + b \odot c` (into ``.grad``, or
        as the returned loss's gradient where ``differentiable``)."""
        loss, surrogate, one_pass, routed = 0.0, None, True, False
        g_path: dict = {}
        g_cv: dict = {}
        with _own_grads() as own:
            for elbo, terms, blocks, trainable, item in self._iter_particles(
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
                        _add(g_path, zip(params, gs))
                    else:
                        own(params)
                        routing.backward(raw, block=blocks, retain_graph=True, strict=False)
                retain = differentiable or bool(self.retain_graph)
                _add(g_cv, self._cv_grads(item, params, blocks, seen, retain).items())
                del item, terms, raw
            names = {p: _param_name(p) for p in g_cv}
            order = sorted(g_cv, key=names.__getitem__)  # the same order on every rank
            keys = [names[p] for p in order]
            if not differentiable:
                g_path = {p: p.grad for p in order if p.grad is not None}
            paths = [g_path.get(p, torch.zeros_like(p)) for p in order]
            cvs = [g_cv[p] for p in order]
            linear = None
            if order:  # this step's weights come from earlier steps only
                cv, sch = self.control_variate, self.schedule
                for p, path, b, c in zip(order, paths, sch.weights(cv, keys, order), cvs):
                    if differentiable:
                        term = (b * c).detach().mul(p).sum()
                        linear = term if linear is None else linear + term
                    else:
                        p.grad = torch.addcmul(path, b, c)
                if _ranks(self._distributed) > 1:
                    paths, cvs = _mean_over_ranks(order, paths, cvs)
                p, c = cv.update(keys, paths, cvs)
                e = sch.gate.e  # what a direct step at the gate's endpoint applies (a split's
                if sch.mix_gain is not None and not isinstance(e, frozenset):  # names: sites')
                    sch.gate.update(p if e == 0.0 else p + e * c)
                sch.measured(cv.key(keys, order), _layout(keys, order), routed)
                if sch.one_pass is None:
                    sch.one_pass = one_pass
        if not differentiable:
            warn_if_nan(loss, "loss")
            return loss
        if surrogate is None:
            return torch.tensor(loss)
        if linear is not None:
            surrogate = surrogate + (linear - linear.detach())
        warn_if_nan(surrogate, "loss")
        return loss + (surrogate - surrogate.detach())


# ----------------------------------------------------------------------------- STL
class TraceAdaptiveSTL_ELBO(_Adaptive, TraceSTL_ELBO):
    r"""Trace ELBO whose score part is added back with a per-element weight chosen from past steps.

    The recommended default. Each step's gradient is

    .. math::

        g(b) = p + b \odot c, \qquad
        p = -\nabla_\phi\big[\log p(x, z) - \log q(z; \bot(\phi))\big], \quad
        c = -\nabla_\phi \log q(\bot(z); \phi),

    with :math:`z = g(\epsilon; \phi)` and :math:`\bot` stop-gradient (for a conditional
    guide every sample is held fixed in :math:`c`). :math:`\mathbb E[c] = 0`, so with :math:`b`
    from earlier steps only **every step is unbiased**, whatever :math:`b` is. :math:`b = 1` is
    ``Trace_ELBO``, :math:`b = 0` STL, and :math:`b^\star = -\operatorname{Cov}(p,
    c)/\operatorname{Var}(c)` has the smallest variance. :math:`b` starts at 1 (the first step is
    ``Trace_ELBO``'s) and moves towards the fitted :math:`\hat b` per element only as far as
    ``confidence`` standard errors allow
    (:class:`~pyro_gradroute.infer.control_variate.ControlVariate`): with :math:`|b - b^\star|
    \le |e^\star - b^\star|` the step's variance is at most the better endpoint's (a statistical
    statement, lagging when :math:`b^\star` moves faster than the window ``decay``). With a
    finite ``mix_gain`` :math:`G`, step 5 of the fit gives up at most a factor :math:`G` in a
    tensor's predicted second moment: for a direct step at an endpoint, or for
    ``Trace_ELBO``'s gradient on a tensor whose mean gradient dominates.

    **Steps** (:class:`~pyro_gradroute.infer.schedule.Schedule`, from earlier steps). A *direct*
    step is Pyro's ``Trace_ELBO`` on ``guide`` or on ``stick_the_landing(guide)``; where the
    tensors take different endpoints, the guide under sticking the landing with the score part
    kept at the ``"<site>.loc"`` / ``"<site>.scale"`` at 1 (at STL's cost). A *measured*
    step forms both parts: in one backward where every guide site with a score part is a plain
    ``Normal`` (:func:`~pyro_gradroute.distributions.normal.normal_sites`; moments per element
    of its parameters, named ``"<site>.loc"``, ``"<site>.scale"``), else with a second backward.
    ``differentiable_loss`` and distributed runs measure every step. ``block_grad`` routes apply
    to both parts. A parameter of the last measured step that changes shape or leaves the param
    store starts again at ``Trace_ELBO``. Only param sites (``pyro.param``, ``pyro.module``) are
    weighed: a tensor the guide reads without one gets STL's gradient from a measured step. The state survives ``pickle``, ``deepcopy``,
    ``torch.save`` and ``state_dict`` (each copy takes the same next steps).

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
    :param mix_gain: ``None``: every step measures and applies the fit; a number
        :math:`\ge 1`: per parameter tensor, ``Trace_ELBO``'s gradient while no weights can
        gain more than ``mix_gain`` there, else the better endpoint unless the fit gains more
        than ``mix_gain`` over it (step 5 of
        :class:`~pyro_gradroute.infer.control_variate.ControlVariate`); steps take the
        endpoints directly where every tensor takes one (different ones only where measured
        steps take one pass), and while the gate bounds any weights' gain below
        ``mix_gain``; ``math.inf``: a measured switch between the whole estimators (never a
        mix).
    :param schedule: a :class:`~pyro_gradroute.infer.schedule.ScheduleConfig`.

    Other arguments are :class:`pyro.infer.Trace_ELBO`'s.
    """

    _PYRO = _PyroTrace_ELBO  # Pyro's estimator whose steps the direct and one-pass steps are
    _PYRO_PARTICLES = staticmethod(trace_elbo_particles)

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
            return self._measured_step(model, guide, args, kwargs)
        leaves = param_store_leaves()
        sch.check(cv, leaves)
        step = sch.decide(cv)
        if not step.measure:
            return self._direct_step(step, model, guide, args, kwargs, leaves)
        if sch.one_pass and not self.vectorize_particles:
            return self._one_pass_step(model, guide, args, kwargs)
        return self._measured_step(model, guide, args, kwargs)

    def _direct_step(self, step, model, guide, args, kwargs, leaves) -> float:
        """Endpoint ``step.end``'s own step; where ``step.feed``, its gradient on the last
        measured step's parameters (``leaves``: the param store's) goes into the gate."""
        sch = self.schedule
        if not (step.feed and sch.layout):
            return self._endpoint(step.end, model, guide, args, kwargs)
        params = [leaves[n] for n, _ in sch.layout]
        with _own_grads() as own:
            own(params)
            loss = self._endpoint(step.end, model, guide, args, kwargs)
            sch.gate.update(_flat_grad(params))
        return loss

    def _endpoint(self, end, model, guide, args, kwargs) -> float:
        """Pyro's estimator on ``guide`` (``end = 1``) or on it under sticking the landing
        (``end = 0``, or a split: :meth:`_at`); where
        the last measured step had ``block_grad`` routes, this package's routed ones (which
        route REINFORCE terms per site)."""
        if self.schedule.routed:
            if end == 1.0:
                return self._routed_trace.loss_and_grads(model, guide, *args, **kwargs)
            return RoutedELBO.loss_and_grads(self, model, guide, *args, **kwargs)
        self._sync()
        return self._pyro.loss_and_grads(model, self._at(end, guide), *args, **kwargs)

    def _sync(self) -> None:
        self._pyro.max_plate_nesting = self.max_plate_nesting

    def _not_one_pass(self, why: str) -> None:
        """A trace the one-pass step cannot take; here the step stays ``Trace_ELBO``'s."""

    def _one_pass_step(self, model, guide, args, kwargs) -> float:
        r"""A measured step in one backward: Pyro's step, with a tap at each guide site's
        :math:`\theta = (\mu, \sigma)` that reads :math:`t = p + c` there (:math:`c` closed-form)
        and sends on :math:`t + (b - 1) c`. Where a trace does not qualify the step is
        ``Trace_ELBO``'s (nothing measured) and later measured steps take two backwards."""
        sch, cv, n = self.schedule, self.control_variate, self.num_particles
        loss, ok, keys, routed = 0.0, True, None, False
        acc: dict[tuple, torch.Tensor] = {}  # (name, 0): p, (name, 1): c
        params: dict[str, torch.Tensor] = {}
        self._sync()
        with _own_grads() as own:
            for model_trace, guide_trace, loss_p, surrogate in self._PYRO_PARTICLES(
                self._pyro, model, guide, args, kwargs
            ):
                self._refuse_enumeration(model_trace, guide_trace)
                loss += loss_p / n
                blocks = collect_blocks(model_trace, guide_trace)
                routed = routed or bool(blocks)
                parts = _normal_parts(blocks, guide_trace, n) if ok else None
                if isinstance(parts, str):
                    self._not_one_pass(parts)
                    parts = None
                if parts is not None and keys is None:  # the first trace fixes the weights
                    keys, cs = [k for k, _, _ in parts], [c for _, _, c in parts]
                    key = cv.key(keys, cs) if keys else ""
                    const = sch.constant(cv, key)
                    feed = sch.mix_gain is not None and const == sch.gate.e
                    bs = sch.weights(cv, keys, cs) if const != 1.0 and keys else [None] * len(keys)
                ok = parts is not None and [k for k, _, _ in parts] == keys
                if ok:
                    ps = _trace_params(guide_trace)
                    params.update((_param_name(p), p) for p in ps)
                    own(ps)  # the step's own gradient, for the gate
                if not getattr(surrogate, "requires_grad", False) or not _trace_params(
                    model_trace, guide_trace
                ):
                    continue
                if blocks:  # this package's routed Trace_ELBO on these traces
                    _, terms = self._routed_trace._particle_terms(model_trace, guide_trace, blocks)
                    terms = {k: -v / n for k, v in terms.items()}  # (non-differentiable: skipped)
                    routing.backward(
                        terms, block=blocks, retain_graph=self._pyro.retain_graph, strict=False
                    )
                    continue
                entries = (
                    [(t, None if b is None else (b - 1) * c) for (_, t, c), b in zip(parts, bs)]
                    if ok
                    else []
                )
                with routing.taps(entries) as seen:
                    (surrogate / n).backward(retain_graph=self._pyro.retain_graph)
                if ok and entries:
                    if any(g is None for g in seen):
                        ok = False
                        continue
                    _add(acc, (((k, 0), g - c) for (k, _, c), g in zip(parts, seen)))
                    _add(acc, (((k, 1), c) for k, _, c in parts))
            sch.routed = routed
            if ok and keys and len(acc) == 2 * len(keys):
                if sch.key is not None and sch.key != key:
                    cv.forget(sch.key)  # the two-backward path's state (a first step)
                cv.update(keys, [acc[k, 0] for k in keys], [acc[k, 1] for k in keys])
                names = sorted(params)
                ps = [params[k] for k in names]
                sch.measured(key, _layout(names, ps), routed, sites=True)
                if feed and ps:  # the step's own gradient, in the layout's order
                    sch.gate.update(_flat_grad(ps))
                sch.one_pass = True
            elif not ok:
                sch.one_pass = False  # later measured steps: the two-backward path
        return loss

    def _refuse_enumeration(self, model_trace, guide_trace) -> None:
        refuse_model_enumeration(self, model_trace, guide_trace)

    def _particle_terms(self, model_trace, guide_trace, blocks=None) -> tuple[float, Terms]:
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

    Direct steps are ``TraceEnum_ELBO``'s on ``guide`` or ``stick_the_landing(guide)`` (or a
    split, as :class:`TraceAdaptiveSTL_ELBO`'s);
    measured steps take one backward, so every guide site with a score part must be a plain
    ``Normal`` (``AutoNormal``, ``AutoDiagonalNormal``, mean-field guides; another raises a
    ``ValueError`` naming the site). Every method's value equals ``TraceEnum_ELBO``'s on the
    same seed; ``differentiable_loss`` is the current endpoint's (it does not measure).
    ``block_grad`` routes, vectorized particles and distributed runs raise, naming what to use.

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
    _PYRO_PARTICLES = staticmethod(trace_enum_elbo_particles)

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

    def _measured_step(self, model, guide, args, kwargs, differentiable: bool = False):
        if _ranks(self._distributed) > 1:
            raise NotImplementedError(
                f"{type(self).__name__} does not average its parts over ranks; use "
                "pyro.infer.TraceEnum_ELBO with the guide under stick_the_landing, or one process"
            )
        return self._one_pass_step(model, guide, args, kwargs)  # every measured step takes one pass

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        end = self.schedule.endpoint(self.control_variate)
        self._sync()
        guide = guide if end is None else self._at(end, guide)
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

    def _endpoint(self, end, model, guide, args, kwargs) -> float:
        self._sync()
        return self._pyro.loss_and_grads(model, self._at(end, guide), *args, **kwargs)
