r"""The measured switch of :func:`~pyro_gradroute.poutine.stick_the_landing`: ``Trace_ELBO``'s
gradient first, STL's once it measures better.

At a guide site's ``Normal`` parameters :math:`\theta = (\mu, \sigma)` the ``Trace_ELBO``
gradient is :math:`p + c`, with :math:`p` STL's (pathwise) part and :math:`c` the score part,
closed-form (:func:`~pyro_gradroute.distributions.normal.normal_score`). A hook at
:math:`\theta` reads the gradient the backward sends there (:math:`p + c` while the handler
gives the ordinary gradient, :math:`p` while it sticks the landing), so every measured run
gives, with no extra backward,

.. math::

    d = \lVert p + c \rVert^2 - \lVert p \rVert^2 = 2 \langle p, c \rangle + \lVert c \rVert^2,

the difference of the two estimators' squared gradients on one draw (their means are equal,
so :math:`\mathbb E d` is the difference of their total variances at :math:`\theta`). The
switch keeps an exponentially weighted mean and variance of :math:`d` (factor ``decay``) and
sticks the landing while the mean is above ``confidence`` standard errors (after
``warmup`` measured runs), back to the ordinary gradient once it is below minus that. The
choice for a run comes from earlier runs only, so every run's gradient is one of the two
unbiased estimators.
"""

from __future__ import annotations

import math

import torch

from ..distributions.detached import delta_base
from ..distributions.normal import normal_pushforward, normal_score
from ..routing import reached_nodes, taps
from .pathwise import NeedsGeneralSplit, site_pathwise

__all__ = ["MeasuredSwitch"]


class MeasuredSwitch:
    """State of the measured switch (see the module docs).

    :param every: measure one guide run in ``every`` (hooks and the closed-form score part
        cost a few vector operations a site).
    :param decay: weight of the earlier runs' moments.
    :param warmup: measured runs before the switch may move.
    :param confidence: standard errors of the mean of :math:`d` needed to move.

    Example (what ``stick_the_landing(guide, switch="measured")`` keeps)::

        >>> sw = MeasuredSwitch(warmup=2)
        >>> for d in (3.0, 2.5, 3.5, 2.9):  # STL's squared gradient keeps measuring smaller
        ...     sw._add(d)
        >>> sw.stl
        True
    """

    def __init__(
        self, every: int = 4, decay: float = 0.9, warmup: int = 10, confidence: float = 3.0
    ):
        self.every, self.decay, self.warmup, self.confidence = every, decay, warmup, confidence
        self.stl = False
        self.runs = 0
        self.w1 = self.w2 = self.s1 = self.s2 = 0.0
        self.n = self.seen = 0
        self._pending: list = []  # [(tensor, c)] of the measured run whose backward is awaited
        self._stl = False  # the measured run's state
        self._taps: taps | None = None

    # -- between runs -------------------------------------------------------------------
    def begin(self, grad: bool) -> bool:
        """Start a guide run: take in the last measured run's parts (if its backward ran) and
        choose this run's gradient. Returns whether this run is measured."""
        self._collect()
        self.seen = 0  # this run's sites with a random draw (checked)
        if not grad:
            return False
        self.runs += 1
        return (self.runs - 1) % self.every == 0

    def arm(self) -> None:
        """End of a measured run: read the gradients its backward sends to the sites'
        ``Normal`` parameters (:class:`~pyro_gradroute.routing.taps`, until the next run)."""
        if self._pending:
            self._taps = taps([(t, None) for t, _ in self._pending])
            self._taps.__enter__()

    def _collect(self) -> None:
        armed, self._taps = self._taps, None
        pending, self._pending = self._pending, []
        if armed is None:
            return
        armed.__exit__()
        seen = armed.seen
        if any(g is None for g in seen):
            return  # no backward reached every site (loss(), Predictive, ...): nothing learnt
        d = 0.0
        for (_, c), g in zip(pending, seen):
            p = g if self._stl else g - c
            d += float(2 * (p * c).sum() + (c * c).sum())
        if math.isfinite(d):  # (a saturated pushforward's draw has no finite pre-image)
            self._add(d)

    def _add(self, d: float) -> None:
        b = self.decay
        self.w1, self.w2 = b * self.w1 + 1.0, b * b * self.w2 + 1.0
        self.s1, self.s2 = b * self.s1 + d, b * self.s2 + d * d
        self.n += 1
        if self.n <= self.warmup:
            return
        mean = self.s1 / self.w1
        var = max(self.s2 / self.w1 - mean * mean, 0.0)
        n_eff = self.w1 * self.w1 / self.w2
        se = math.sqrt(var / max(n_eff - 1.0, 1.0))
        if mean > self.confidence * se:
            self.stl = True
        elif mean < -self.confidence * se:
            self.stl = False

    # -- during a measured run ----------------------------------------------------------
    def measure(
        self, name: str, site_fn, value, scale, mask, earlier_nodes: dict, stl: bool, hook: bool
    ) -> None:
        """Check the site and, where ``hook``, keep its ``Normal`` parameters and score part for
        this run's backward (:meth:`arm` hooks them at the run's end).

        Raises ``ValueError`` (naming the site) for a reparameterized site that is not a
        ``Normal`` (or a ``Normal`` pushed forward by parameter-free bijections) whose
        parameters read no earlier sample.
        """
        if delta_base(site_fn) is not None:  # no draw of its own: a score part only where
            try:  # its density reads parameters directly (a structured guide's site)
                site_pathwise(name, site_fn, value, [], earlier_nodes)
            except NeedsGeneralSplit:
                raise ValueError(
                    f"stick_the_landing(switch='measured'): guide site '{name}' is a Delta "
                    "whose density reads parameters; the measured switch reads the score "
                    "part of Normal sites only. Use trace_steps=N (a fixed number of "
                    "Trace_ELBO steps), or pyro_gradroute.infer.TraceAdaptiveSTL_ELBO("
                    "mix_gain=math.inf)"
                ) from None
            return
        base, nd, transforms = normal_pushforward(site_fn)
        if base is None:
            raise ValueError(
                f"stick_the_landing(switch='measured'): guide site '{name}' is a "
                f"{type(site_fn).__name__}; the measured switch reads the score part of Normal "
                "sites (and of Normals pushed forward by parameter-free bijections) only. Use "
                "trace_steps=N (a fixed number of Trace_ELBO steps), or "
                "pyro_gradroute.infer.TraceAdaptiveSTL_ELBO(mix_gain=math.inf)"
            )
        self.seen += 1
        ps = [t for t in (base.loc, base.scale) if t.requires_grad]
        if not ps:
            return
        if reached_nodes(ps, earlier_nodes):
            raise ValueError(
                f"stick_the_landing(switch='measured'): guide site '{name}' reads an earlier "
                "sample (a conditional guide); the measured switch reads the score part of "
                "Normal sites whose parameters read no sample. Use trace_steps=N, or "
                "pyro_gradroute.infer.TraceAdaptiveSTL_ELBO(mix_gain=math.inf)"
            )
        if not hook:
            return
        with torch.no_grad():
            for t in reversed(transforms):  # the Normal's own draw
                value = t.inv(value)
        self._stl = stl
        self._pending.extend((t, c) for _, t, c in normal_score(base, nd, value, scale, mask))

    # -- state ----------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        keys = (
            "every",
            "decay",
            "warmup",
            "confidence",
            "stl",
            "runs",
            "w1",
            "w2",
            "s1",
            "s2",
            "n",
        )
        return {k: getattr(self, k) for k in keys}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._pending, self._stl, self._taps = [], False, None


def check_switch(switch) -> MeasuredSwitch | None:
    """The switch a handler's ``switch`` argument asks for (``None``: none)."""
    if switch is None:
        return None
    if switch == "measured":
        return MeasuredSwitch()
    raise ValueError(
        f"stick_the_landing: switch must be None or 'measured' (Trace_ELBO's gradient first, "
        f"sticking the landing once it measures better), got {switch!r}"
    )
