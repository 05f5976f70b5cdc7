r"""When an adaptive step measures both parts, and when it takes one endpoint directly.

A *measured* step forms :math:`p` and :math:`c` and applies :math:`p + b \odot c`; a *direct*
step applies one endpoint's gradient (:math:`e = 1`: ``Trace_ELBO``, :math:`e = 0`: STL) at
that estimator's cost. Every choice comes from earlier steps only, so every step is unbiased.
Since :math:`S(b) = \mathbb E\lVert g(b)\rVert^2 = \lVert \mathbb E g\rVert^2 + \sum
\operatorname{Var} g(b)` and the mean is every weight's:

* the **gate** (:class:`Gate`): no weights gain more than :math:`B = \mathbb E\lVert
  g_t\rVert^2 / \mathbb E\langle g_t, g_{t-1}\rangle` over the endpoint the steps take; while
  :math:`B \le` ``mix_gain`` no step measures;
* the **fit**: once settled, where the fit takes one endpoint on every parameter tensor (step
  5 of :class:`~pyro_gradroute.infer.control_variate.ControlVariate`, with ``mix_gain``),
  steps take it directly and one in ``measure_every`` measures (the wait doubles after each
  measurement that confirms it, up to ``measure_max``: step 5 keeps an endpoint only where
  the fit would gain less than ``mix_gain``). Where measured steps take one pass (their
  tensors are guide sites' ``loc`` and ``scale``), the endpoint may differ between tensors
  (a *split*, :math:`e` the set of names at 1): a direct step then runs the guide under
  sticking the landing with the score part kept at those tensors, which is :math:`p + e
  \odot c` at STL's cost.

``mix_gain=None`` measures every step; ``math.inf`` never mixes: a switch between the whole
estimators (``Trace_ELBO`` first, STL once its predicted second moment is the lower).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from .._validation import check_float, check_int

__all__ = ["Gate", "Schedule", "ScheduleConfig"]


@dataclass
class ScheduleConfig:
    """The schedule's tuning constants, each with the value the estimators use by default.

    :param measure_every: while the fit keeps choosing one endpoint, one step in this many
        measures (the first wait).
    :param measure_max: the longest wait: waits double after each measurement that confirms
        the choice, up to one step in this many.
    :param gate_every: a direct step's gradient feeds the gate on one direct step in this many
        (draws ``k`` steps apart are as independent as neighbours).
    :param switch_gate: the gate's threshold with ``mix_gain=math.inf`` (the parts are measured
        once the other endpoint could gain this much).
    :param min_samples: effective number of samples the gate needs before its bound is read.
    :param refit: past the first ``fresh`` fits, the fit is recomputed every ``refit`` updates.
    :param fresh: updates past warm-up on which the fit is recomputed every time, and before
        which the schedule does not rely on it (every step measures).
    :param no_score: an element whose score part's variance is below this fraction of its
        second moment has no score part (it keeps ``b = 1``).

    Example::

        >>> from pyro_gradroute.infer import TraceAdaptiveSTL_ELBO
        >>> elbo = TraceAdaptiveSTL_ELBO(schedule=ScheduleConfig(measure_every=2, measure_max=8))
    """

    measure_every: int = 4
    measure_max: int = 32
    gate_every: int = 4
    switch_gate: float = 2.0
    min_samples: float = 3.0
    refit: int = 4
    fresh: int = 5
    no_score: float = 1e-6

    def __post_init__(self):
        where = "ScheduleConfig"
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "int":
                setattr(self, f.name, check_int(v, f.name, where, minimum=1))
            else:
                setattr(self, f.name, check_float(v, f.name, where, low=0.0))
        if self.measure_max < self.measure_every:
            raise ValueError(
                f"{where}: measure_max must be >= measure_every ({self.measure_every}); "
                f"got {self.measure_max}"
            )


class Gate:
    r"""The bound :math:`B = \mathbb E\lVert g_t\rVert^2 / \mathbb E\langle g_t, g_{t-1}\rangle`
    on the gain of any weights over the endpoint ``e`` the steps take, from exponentially
    weighted sums (factor ``decay``) over the applied gradients (a mean that turns within the
    window only makes :math:`B` larger)."""

    def __init__(self, decay: float, min_samples: float = 3.0):
        self.decay, self.min_samples = decay, min_samples
        self.reset(1.0)

    def reset(self, e: float) -> None:
        """Forget the moments; the steps now take endpoint ``e``."""
        self.e, self.prev, self.sums, self.w1, self.w2 = e, None, None, 0.0, 0.0

    def update(self, g: torch.Tensor) -> None:
        """Add one step's applied gradient (its inner products leave the device here, once)."""
        g, prev = g.detach(), self.prev
        self.prev = g
        if prev is None or prev.shape != g.shape or prev.dtype != g.dtype:
            self.sums, self.w1, self.w2 = None, 0.0, 0.0  # another parameter set: start again
            return
        sq, cross = torch.stack([g.dot(g), g.dot(prev.to(g.device))]).tolist()
        d, (s0, s1) = self.decay, (0.0, 0.0) if self.sums is None else self.sums
        self.sums = (d * s0 + sq, d * s1 + cross)
        self.w1, self.w2 = d * self.w1 + 1.0, d**2 * self.w2 + 1.0

    def known(self) -> bool:
        """Whether the bound has ``min_samples`` effective samples."""
        return self.sums is not None and self.w1 * self.w1 >= self.min_samples * self.w2

    def bound(self) -> float:
        """:math:`B` (``inf`` until known, or with no mean left)."""
        if not self.known():
            return math.inf
        sq, cross = self.sums
        return sq / cross if cross > 0 else math.inf


class Step(NamedTuple):
    """A step's kind: ``measure`` (both parts), else a direct step at endpoint ``end`` (1, 0,
    or a split: the names at 1) (``feed``: its gradient goes into the gate)."""

    measure: bool
    end: float | frozenset = 1.0
    feed: bool = False


MEASURE = Step(True)


class Schedule:
    """The choice of each step's kind (module docstring), from the control variate's fit and the
    gate; its state (the last measured step's key and parameters, the gate, the waits) is saved
    with the estimator."""

    def __init__(self, mix_gain: float | None, decay: float, config: ScheduleConfig):
        self.mix_gain, self.config = mix_gain, config
        self.gate = Gate(decay, config.min_samples)
        self.reset()

    def reset(self) -> None:
        """Back to the start (the next step measures at ``b = 1``)."""
        self.key: str | None = None  # the joint state of the last measured step
        self.layout: list | None = None  # its parameters [(param-store name, shape)]
        self.one_pass: bool | None = None  # whether measured steps take one backward
        self.routed = False  # whether the last measured step had block_grad routes
        self.sites = False  # whether its names are guide sites' parameters (one pass)
        self.unmeasured, self.interval, self.last_end = 0, self.config.measure_every, None
        self.gate_count = 0
        self.gate.reset(1.0)

    # -- the choice ----------------------------------------------------------------------
    def endpoint(self, cv) -> float | frozenset | None:
        """The endpoint direct steps take (``None``: none yet, or the fit takes no endpoint on
        some tensor; a ``frozenset``: a split, the names at 1)."""
        ok = self.key is not None and cv.settled(self.key) and cv.fixed_weight is None
        return self.constant(cv, self.key) if ok else None

    def constant(self, cv, key: str) -> float | frozenset | None:
        """The weight every element of ``key`` takes on the next measured step, where they all
        take the same (``fixed_weight``, 1 in warm-up, an endpoint) or a split, else ``None``."""
        if cv.fixed_weight is not None:
            return cv.fixed_weight
        fit = cv.fit(key)
        if fit is None:
            return 1.0
        if self.mix_gain == math.inf:  # a switch: the endpoint predicted better
            s_mix, s0, s1 = fit["moments"]
            return 0.0 if s0 <= s1 else 1.0
        end = fit["constant"]
        if end is None and self.sites and not self.routed:  # a split, where the names are
            end = fit.get("ends")  # sites' parameters (a direct step keeps their score parts)
        return end

    def weights(self, cv, names: list[str], likes: list[torch.Tensor]) -> list[torch.Tensor]:
        """The weights a measured step applies: the fit's, or its endpoint in switch mode."""
        if self.mix_gain != math.inf or cv.fixed_weight is not None:
            return cv.weights(names, likes)
        e = self.constant(cv, cv.key(names, likes))
        return [torch.full_like(t, e) for t in likes]

    def all_weights(self, cv) -> dict[str, torch.Tensor]:
        """``{name: b}`` the next measured step applies, for every parameter with moments."""
        out: dict[str, torch.Tensor] = {}
        for key, st in cv.state.items():
            names = [n for n, _ in cv.layouts[key]]
            out.update(
                zip(names, self.weights(cv, names, list(cv.split(key, st["buf"][0]).values())))
            )
        return out

    def decide(self, cv) -> Step:
        """This step's kind, from earlier steps only."""
        cfg, gate = self.config, self.gate
        end = self.endpoint(cv)
        if end is None or end != self.last_end:
            self.unmeasured, self.interval = 0, cfg.measure_every
        self.last_end = end
        if cv.fixed_weight is not None:
            return MEASURE
        if end is not None and end != gate.e:
            gate.reset(end)
        if self.mix_gain is not None and self.key is not None and self.layout is not None:
            if gate.bound() <= (cfg.switch_gate if self.mix_gain == math.inf else self.mix_gain):
                return self._direct(gate.e)
            if not gate.known() and cv.count(self.key) <= cv.warmup:
                # in warm-up b = 1: Trace_ELBO's own step is that step, and it feeds the gate
                return self._direct(1.0, every=1)
        if end is not None:
            self.unmeasured += 1
            if self.unmeasured < self.interval:
                return self._direct(end)
            self.unmeasured, self.interval = 0, min(2 * self.interval, cfg.measure_max)  # measures
        return MEASURE

    def _direct(self, end: float | frozenset, every: int = 0) -> Step:
        self.gate_count = (self.gate_count + 1) % (every or self.config.gate_every)
        return Step(False, end, self.gate_count == 0)

    def check(self, cv, leaves: dict[str, torch.Tensor]) -> None:
        """Start again where a parameter of the last measured step left the param store or
        changed shape (a new problem reusing the names): its next steps are ``Trace_ELBO``'s."""
        for name, shape in self.layout or ():
            if (p := leaves.get(name)) is None or p.shape != shape:
                cv.forget(self.key)
                self.reset()
                return

    def measured(self, key: str, layout: list | None, routed: bool, sites: bool = False) -> None:
        """Record a measured step's joint state and its parameters (``None``: some parameter
        is outside the param store, so direct steps cannot feed the gate); ``sites``: its
        names are guide sites' parameters (a one-pass step)."""
        self.key, self.layout, self.routed, self.sites = key, layout, routed, sites

    def state_dict(self) -> dict:
        gate = {k: _clone(getattr(self.gate, k)) for k in ("e", "w1", "w2", "prev", "sums")}
        own = {k: v for k, v in vars(self).items() if k not in ("gate", "config", "mix_gain")}
        return {**own, "gate": gate}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        for k, v in state.pop("gate").items():
            setattr(self.gate, k, _clone(v))
        vars(self).update(state)


def _clone(v):
    return v.clone() if torch.is_tensor(v) else v
