"""Sticking the landing inside Pyro's own ELBOs, through the ``score_parts`` hook."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import torch
from pyro.distributions import TorchDistribution
from pyro.poutine.messenger import unwrap
from torch.distributions import Distribution, kl_divergence, register_kl

from .._compat import Subsample, calling_elbo
from ..distributions.detached import delta_base
from .gated_distribution import GatedDistribution
from .measured_switch import check_switch
from .pathwise import (
    Conditional,
    NeedsGeneralSplit,
    conditional_pathwise,
    site_pathwise,
)
from .split_distribution import SplitBatch, SplitDistribution
from .split_messenger import SplitMessenger, _split_of

_EMPTY = torch.Size()


def uses_pathwise(site) -> bool:
    """Whether a guide site (a trace site or a split record) takes only its pathwise gradient.

    Reparameterized sites do, unless marked ``infer={"stl": False}``;
    ``infer={"stl": True}`` on a site without ``rsample`` is an error naming it.
    """
    if isinstance(site, dict):
        fn, infer = site["fn"], site["infer"]
    else:
        fn, infer = site.fn, site.infer
    if type(fn) is SplitDistribution:
        fn = fn.base_dist
    stl = infer.get("stl", None)
    has_rsample = getattr(fn, "has_rsample", False)
    if stl is True and not has_rsample:
        name = site["name"] if isinstance(site, dict) else site.name
        raise ValueError(
            f"Guide site '{name}' is marked infer={{'stl': True}} but its "
            f"distribution {type(fn).__name__} has no rsample, so it has no "
            "pathwise gradient. Use a reparameterizable family or remove the mark "
            "(non-reparameterized sites get the score-function estimator)."
        )
    return not (stl is False or not has_rsample)


class STLPolicy:
    """Which guide sites stick the landing, and how: shared by ``TraceSTL_ELBO`` and the handler.

    * :meth:`uses_pathwise`: reparameterized sites do, unless marked
      ``infer={"stl": False}``;
    * :meth:`fallback`: a site that cannot be split gets the ordinary gradient, with a
      warning naming it (once per site);
    * :meth:`needs_general` / :meth:`mark_general`: the guides seen to need the general
      split (relays, forward-carried flow rules), kept weakly; every other guide runs as
      under Pyro, with the pathwise parts filled from detached copies
      (:mod:`~pyro_gradroute.poutine.pathwise`).

    * ``trace_steps``: the first ``trace_steps`` steps take the ordinary (``Trace_ELBO``)
      gradient everywhere, then sticking the landing starts (:meth:`advance` counts steps).
      Far from the posterior, from a narrow initial scale especially, the score part that
      STL drops is what cancels the noise of the entropy gradient (for a Normal site the
      gradient of the entropy with respect to ``log sigma`` is exactly -1 with it, ``-eps^2``
      without it), so a short ``Trace_ELBO`` phase first avoids STL's worst regime.

    :param owner: the name the warnings use.
    :param trace_steps: number of initial steps with the ordinary gradient (``>= 0``).
    """

    def __init__(self, owner: str, trace_steps: int = 0):
        if isinstance(trace_steps, bool) or not isinstance(trace_steps, int) or trace_steps < 0:
            raise ValueError(
                f"{owner}: trace_steps must be an integer >= 0 (the number of initial steps "
                f"with the ordinary Trace_ELBO gradient), got {trace_steps!r}"
            )
        self.owner = owner
        self.trace_steps = trace_steps
        self.steps = 0
        self._general: weakref.WeakSet = weakref.WeakSet()
        self._plain: weakref.WeakSet = weakref.WeakSet()
        self._warned: set[str] = set()

    switch = None  # a MeasuredSwitch, if sticking the landing waits for its measurements

    @property
    def active(self) -> bool:
        """Whether sticking the landing is on (the ``Trace_ELBO`` phase is over)."""
        return self.steps >= self.trace_steps and (self.switch is None or self.switch.stl)

    def advance(self) -> None:
        """Count one step (a gradient evaluation)."""
        self.steps += 1

    def uses_pathwise(self, site) -> bool:
        return uses_pathwise(site) and self.active

    def fallback(self, rec, error) -> bool:
        if rec.name not in self._warned:
            self._warned.add(rec.name)
            warnings.warn(
                f"{self.owner}: guide site '{rec.name}' cannot be split into score and "
                f"pathwise parts ({error}); it gets the ordinary Trace_ELBO gradient instead "
                "(unbiased, but not sticking the landing). Mark it infer={'stl': False} to "
                "silence this.",
                stacklevel=3,
            )
        return True

    def needs_general(self, guide) -> bool | None:
        """True / False: the guide is known to need / not need the general split; None: unknown.

        Keyed on the guide under Pyro's handlers (``unwrap``): a vectorized ELBO wraps it in a
        fresh particle plate on every call. A cache only: the default path checks every site.
        """
        guide = unwrap(guide)
        try:
            if guide in self._general:
                return True
            return False if guide in self._plain else None
        except TypeError:  # unhashable
            return None

    def mark(self, guide, general: bool) -> None:
        guide = unwrap(guide)
        try:
            (self._general if general else self._plain).add(guide)
        except TypeError:  # unhashable or not weakly referenceable: found again next time
            pass

    def __getstate__(self) -> dict:
        state = {"owner": self.owner, "trace_steps": self.trace_steps, "steps": self.steps}
        return {**state, "switch": self.switch}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["owner"], state["trace_steps"])
        self.steps = state["steps"]
        self.switch = state.get("switch")


def _allowed_elbos() -> tuple:
    """The estimators whose gradient stays unbiased when the score part is dropped (exact types)."""
    import pyro.infer as pi

    from ..infer import Trace_ELBO, TraceSTL_ELBO

    return (
        pi.Trace_ELBO,
        pi.JitTrace_ELBO,
        pi.TraceGraph_ELBO,
        pi.JitTraceGraph_ELBO,
        pi.TraceEnum_ELBO,
        pi.JitTraceEnum_ELBO,
        pi.TraceMeanField_ELBO,
        pi.JitTraceMeanField_ELBO,
        Trace_ELBO,
        TraceSTL_ELBO,
    )


_GRADIENT_METHODS = ("loss_and_grads", "differentiable_loss", "_differentiable_loss_particle")
_VALID: dict[type, bool] = {}  # estimator class -> whether STL is valid in it


def _valid_in(cls) -> bool:
    """An allowed estimator, or a subclass of one that keeps its gradient computation."""
    allowed = _allowed_elbos()
    if cls in allowed:
        return True
    base = next((c for c in cls.__mro__ if c in allowed), None)
    if base is None:
        return False
    for name in _GRADIENT_METHODS:
        own = next((c for c in cls.__mro__ if name in vars(c)), None)
        if own is not None and own not in base.__mro__:
            return False  # a subclass (or mixin) redefines how the gradient is formed
    return True


def check_elbo(elbo) -> None:
    """Raise unless ``elbo`` (the estimator running the guide, or None) is one STL is valid in.

    Allowed: the ELBOs that take ``log q``'s gradient as a plain sum (an allow-list, by
    class), and subclasses of them that do not redefine ``loss_and_grads``,
    ``differentiable_loss`` or ``_differentiable_loss_particle``.
    """
    if elbo is None:
        return
    cls = type(elbo)
    ok = _VALID.get(cls)
    if ok is None:
        ok = _VALID[cls] = _valid_in(cls)
    if ok:
        return
    raise ValueError(
        f"stick_the_landing cannot be used with {type(elbo).__name__}: sticking the landing "
        "drops the score part of log q, which leaves the gradient unbiased only in the "
        "ELBOs that take log q's gradient as a plain sum: pyro.infer.Trace_ELBO, "
        "TraceGraph_ELBO, TraceEnum_ELBO, TraceMeanField_ELBO (and their Jit versions) and "
        "pyro_gradroute.infer.Trace_ELBO. An estimator whose particle weights depend on log q "
        "(RenyiELBO, ReweightedWakeSleep, TraceTailAdaptive_ELBO) would be biased: use "
        "pyro_gradroute.infer.TraceDReG_ELBO (doubly-reparameterized gradients) with the plain "
        "guide, or pyro_gradroute.infer.TraceSTL_ELBO."
    )


class PathwiseDistribution(TorchDistribution):
    """``base_dist``, whose ``log_prob`` and ``score_parts`` at its own draw carry only the pathwise gradient.

    Everything else (sampling, shapes, support, ``log_prob`` at any other value) is
    ``base_dist``'s. The parts of a guide run's sites are computed together when the first
    is asked for (:func:`~pyro_gradroute.poutine.pathwise.site_pathwise`, and one split
    node for the sites whose parameters read earlier samples).
    """

    arg_constraints: dict = {}

    def __init__(self, base_dist, run: _Run, name: str):
        self.__dict__ = self._wrap(base_dist, run, name).__dict__

    @classmethod
    def _wrap(cls, base_dist, run: _Run, name: str) -> PathwiseDistribution:
        """``cls(base_dist, run, name)`` without the metaclass's call (one wrapper per site and step)."""
        self = object.__new__(cls)
        self.__dict__ = {  # what Distribution.__init__ sets, without its checks
            "base_dist": base_dist,
            "_run": run,
            "_name": name,
            "_value": None,
            "_parts": None,
            "_batch_shape": base_dist.batch_shape,
            "_event_shape": base_dist.event_shape,
            "_validate_args": False,
        }
        return self

    def __getattr__(self, name):
        if name in ("base_dist", "_run", "_name", "_value", "_parts"):
            raise AttributeError(name)
        return getattr(self.base_dist, name)

    @property
    def has_rsample(self):  # type: ignore[override]
        return self.base_dist.has_rsample

    @has_rsample.setter
    def has_rsample(self, value):
        self.base_dist.has_rsample = value

    has_enumerate_support = property(lambda self: self.base_dist.has_enumerate_support)  # type: ignore[assignment]
    support = property(lambda self: self.base_dist.support)  # type: ignore[assignment]
    mean = property(lambda self: self.base_dist.mean)
    variance = property(lambda self: self.base_dist.variance)

    def __call__(self, sample_shape=_EMPTY):
        base = self.base_dist
        v = base.rsample(sample_shape) if base.has_rsample else base.sample(sample_shape)
        self._value = v
        return v

    def rsample(self, sample_shape=_EMPTY):
        self._value = self.base_dist.rsample(sample_shape)
        return self._value

    def sample(self, sample_shape=_EMPTY):
        self._value = self.base_dist.sample(sample_shape)
        return self._value

    def expand(self, batch_shape, _instance=None):
        return PathwiseDistribution(self.base_dist.expand(batch_shape), self._run, self._name)

    def enumerate_support(self, expand=True):
        return self.base_dist.enumerate_support(expand=expand)

    def _pathwise(self, value):
        """The pathwise parts at ``value`` (None: at another value, or the ordinary parts)."""
        if value is None or value is not self._value:
            return None
        if self._parts is _PENDING:
            self._run.evaluate()  # the run's sites, this one included
        return self._parts

    def log_prob(self, value, *args, **kwargs):
        parts = self._pathwise(value)
        return self.base_dist.log_prob(value, *args, **kwargs) if parts is None else parts.log_prob

    def score_parts(self, value, *args, **kwargs):
        parts = self._pathwise(value)
        return self.base_dist.score_parts(value, *args, **kwargs) if parts is None else parts


_PENDING = object()  # a wrapper's parts before its run is evaluated


@register_kl(PathwiseDistribution, Distribution)
def _kl_pathwise(p: PathwiseDistribution, q: Distribution) -> torch.Tensor:
    """An analytic KL (``TraceMeanField_ELBO``) is the base distribution's: it has no sampling noise."""
    return kl_divergence(p.base_dist, q)


class _Run:
    """The samples of one guide run, in draw order (what later sites may read).

    The pathwise parts of its sites are evaluated together, when the first is asked for
    (by then every sample is known; a site's parameters cannot read a later one).
    """

    def __init__(self, owner=None, stl: bool = False) -> None:
        self.earlier: list[torch.Tensor] = []
        self.nodes: dict = {}
        self.changed = False
        self.sites: list = []  # wrappers whose parts are pending
        self.owner = owner  # the messenger
        self.stl = stl  # sticking the landing is on in this run (the policy, at its start)

    def add(self, value) -> None:
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            self.nodes[value.grad_fn] = len(self.earlier)
            self.earlier.append(value)

    def evaluate(self) -> None:
        """Set the pending sites' parts: detached copies, and one split node for conditional sites."""
        sites, self.sites = self.sites, []
        conditional = []
        for w in sites:
            try:
                parts = site_pathwise(w._name, w.base_dist, w._value, self.earlier, self.nodes)
            except NeedsGeneralSplit:
                parts = self.owner._not_prepared(w._name)
            if type(parts) is Conditional:
                conditional.append((w, parts))
            else:
                w._parts = parts
        if conditional:
            try:
                out = conditional_pathwise([c for _, c in conditional], self.earlier)
            except NeedsGeneralSplit as e:
                self.owner._not_prepared(str(e))
                out = [None] * len(conditional)
            for (w, _), parts in zip(conditional, out):
                w._parts = parts


class StickTheLandingMessenger(SplitMessenger):
    r"""Inside it, each reparameterized guide site's log-density carries only its pathwise gradient.

    For a guide sample :math:`z = g(\epsilon; \phi)`, ``log_prob`` and
    ``score_parts`` (``log_prob`` and ``entropy_term``) at the sample equal
    :math:`\log q(z; \phi)` in value, with gradient that of
    :math:`\log q(z; \bot(\phi))` (sticking the landing, Roeder et al. 2017): the
    score part :math:`\partial_\phi \log q(z;\phi)|_z`, whose expectation is zero, is
    dropped. For a conditional :math:`q(z_2 \mid z_1)` the path through :math:`z_1`
    is kept. Every density is evaluated once (one batched split per guide run).
    Non-reparameterized sites keep Pyro's score-function treatment.

    Pyro's ELBOs read these parts through the documented ``score_parts`` hook, so
    ``SVI(model, stick_the_landing(guide), optim, elbo)`` sticks the landing with
    ``Trace_ELBO``, ``TraceGraph_ELBO``, ``TraceEnum_ELBO`` and ``TraceMeanField_ELBO``
    (sites with an analytic KL keep it: it has no sampling variance). Under
    ``RenyiELBO`` and ``ReweightedWakeSleep`` it raises: an importance-weighted bound
    differentiates ``log q`` inside its weights, where dropping the score part biases
    the gradient (use :class:`~pyro_gradroute.infer.TraceDReG_ELBO`).

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro.infer import SVI, TraceEnum_ELBO
        >>> from pyro_gradroute.poutine import stick_the_landing
        >>> def model(x):
        ...     loc = pyro.sample("loc", dist.Normal(0.0, 5.0))
        ...     with pyro.plate("data", len(x)):
        ...         pyro.sample("x", dist.Normal(loc, 1.0), obs=x)
        >>> def guide(x):
        ...     m = pyro.param("m", torch.tensor(0.0))
        ...     pyro.sample("loc", dist.Normal(m, 0.5))
        >>> pyro.clear_param_store()
        >>> svi = SVI(model, stick_the_landing(guide), pyro.optim.Adam({"lr": 0.1}),
        ...           TraceEnum_ELBO(max_plate_nesting=1))
        >>> loss = svi.step(torch.randn(5))

    :param trace_steps: the first ``trace_steps`` guide runs with gradients keep the ordinary
        gradient (see :class:`STLPolicy`).
    :param switch: ``"measured"``: the ordinary gradient until the gradients at the guide
        sites' ``Normal`` parameters measure sticking the landing better
        (:class:`~pyro_gradroute.poutine.measured_switch.MeasuredSwitch`); ``None``: no switch.
    """

    def __init__(self, trace_steps: int = 0, switch: str | None = None) -> None:
        self._policy = STLPolicy("sticking the landing", trace_steps)
        self._switch = self._policy.switch = check_switch(switch)
        self._measuring = False  # whether this run's Normal sites are measured for the switch
        self._classified = False  # whether a general run sticking the landing classified the sites
        super().__init__(self._new_batch())
        self._fast = False  # the first run takes the general split and finds what the guide needs
        self._flows = False  # whether the default path met a flow site (not under the JIT)
        self._run = _Run()
        self._warned = False
        self._drawn: dict[int, weakref.ref] = {}  # id -> sample this handler drew

    def _new_batch(self) -> SplitBatch:
        p = self._policy
        return SplitBatch(p.uses_pathwise, p.fallback, p.uses_pathwise)

    def __enter__(self):
        check_elbo(calling_elbo())
        if self._fast and self._flows and torch.jit.is_tracing():
            self._fast = False  # a flow's forward-carried rules cannot be traced: the general split
        if self._switch is not None:  # the runs before chose this run's gradient
            self._measuring = self._switch.begin(torch.is_grad_enabled()) and self._fast
            if self._policy.active and not self._classified:
                self._fast = self._measuring = False  # the first STL run classifies the sites
        if self._fast:
            self._run = _Run(self, self._policy.active)
        else:
            self.batch = self._new_batch()
        return super().__enter__()

    # -- the fast path: Pyro's own draws, pathwise parts from detached copies ---------------
    # (per site and step: exact type checks, no isinstance against Pyro's ABCs, few calls)
    def _process_message(self, msg) -> None:
        if msg["type"] == "sample":
            self._pyro_sample(msg)

    def _postprocess_message(self, msg) -> None:
        if msg["type"] == "sample":
            self._pyro_post_sample(msg)

    def _pyro_sample(self, msg) -> None:
        if msg["value"] is not None or msg["is_observed"]:
            return  # observed, or a value another handler supplies (the model, under replay)
        if not self._fast:
            return super()._pyro_sample(msg) if self._latent(msg) else None
        if self._switch is not None and not self._run.stl and not self._measuring:
            return  # the ordinary gradient, not measured: the guide runs exactly as under Pyro
        fn = msg["fn"]
        gated = type(fn) is GatedDistribution
        base = fn.base_dist if gated else fn
        kind = type(base)
        if (
            kind is PathwiseDistribution
            or kind is SplitDistribution
            or kind is Subsample
            or msg["infer"].get("enumerate")
        ):
            return
        wrapped = PathwiseDistribution._wrap(base, self._run, msg["name"])
        msg["fn"] = GatedDistribution(wrapped, fn.specs) if gated else wrapped

    def _pyro_post_sample(self, msg) -> None:
        if not self._fast:
            return self._general_post_sample(msg)
        outer = msg["fn"]
        fn = outer.base_dist if type(outer) is GatedDistribution else outer
        run = self._run
        if type(fn) is not PathwiseDistribution or fn._run is not run:
            return
        value, name, base = msg["value"], msg["name"], fn.base_dist
        if self._switch is not None and uses_pathwise(msg):
            sw, m = self._switch, self._measuring
            sw.measure(name, base, value, msg["scale"], msg["mask"], run.nodes, run.stl, m)
        if not (run.stl and msg["infer"].get("stl") is None and base.has_rsample) and not (
            self._policy.uses_pathwise(msg)
        ):
            if outer is fn:
                msg["fn"] = base
            run.add(value)
            return  # the ordinary parts (score-function sites keep Pyro's treatment)
        if value is fn._value:
            self._remember(value)
        elif self._drew_before(value):  # replayed from an earlier run (sequential enumeration)
            fn._value = value
        else:
            raise _not_drawn(name)
        if delta_base(base) is None:
            fn._parts = _PENDING  # evaluated with the run's other sites, when first asked for
            run.sites.append(fn)
            run.changed = True  # a random draw
        else:  # a Delta: its ordinary parts, unless its density needs the general split
            try:
                site_pathwise(name, base, value, run.earlier, run.nodes)
            except NeedsGeneralSplit:
                self._not_prepared(name)
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:  # (run.add)
            run.nodes[value.grad_fn] = len(run.earlier)
            run.earlier.append(value)

    def _general_post_sample(self, msg) -> None:
        """The learning run: the general split, and a check that each sample is its own draw."""
        split = _split_of(msg["fn"])
        value = msg["value"]
        if (
            isinstance(split, SplitDistribution)
            and split.batch is self.batch
            and torch.is_tensor(value)
            and value.requires_grad
            and self._policy.uses_pathwise(msg)
        ):
            if self.batch.drew(value):
                self._remember(value)
            elif not self._drew_before(value):
                raise _not_drawn(msg["name"])
        return super()._pyro_post_sample(msg)

    def _remember(self, value: torch.Tensor) -> None:
        """Keep (weakly) a sample this handler drew: a later run may replay it.

        Pyro's sequential enumeration (``poutine.queue``) runs the guide several times per
        step, replaying the samples drawn before the enumerated site.
        """
        drawn = self._drawn
        if len(drawn) > 4096:  # forget the samples that are gone
            for k in [k for k, r in drawn.items() if r() is None]:
                del drawn[k]
        drawn[id(value)] = weakref.ref(value)

    def _drew_before(self, value) -> bool:
        ref = self._drawn.get(id(value))
        return ref is not None and ref() is value

    def _not_prepared(self, name: str) -> None:
        self._fast = False  # the guide changed: the next run takes the general split
        warnings.warn(
            f"sticking the landing: guide site '{name}' needs the general split, which this "
            "run did not prepare; it gets the ordinary gradient in this step (unbiased) and "
            "sticks the landing from the next step on.",
            stacklevel=4,
        )

    def __exit__(self, *args):
        if args[0] is None and self._measuring:
            self._switch.arm()  # the backward that follows sends the parts to the hooks
        if args[0] is None and not self._policy.active:
            if torch.is_grad_enabled():
                self._policy.advance()
            if self._switch is not None:
                if self._fast and self._measuring and not self._switch.seen:
                    self._warn_unchanged()
                # the ordinary gradient on the default path (its sites unwrapped), which the
                # switch measures at the sites' Normal parameters
                self._fast, self._flows = True, False
        elif args[0] is None:
            if torch.is_grad_enabled():
                self._policy.advance()
            if self._fast:
                changed = self._run.changed
                self._run = None  # the trace's wrappers keep what they need
            else:
                changed = any(
                    r.stl and delta_base(r.fn) is None for r in self.batch.records.values()
                )
                self._fast, self._flows = _fast_enough(self.batch)
                self._classified = True
            if not changed:
                self._warn_unchanged()
        return super().__exit__(*args)

    def _warn_unchanged(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                "stick_the_landing: the guide has no reparameterized site with a random draw "
                "(only Delta or non-reparameterized sites), so sticking the landing changes "
                "nothing.",
                stacklevel=3,
            )


def _not_drawn(name: str) -> ValueError:
    return ValueError(
        f"stick_the_landing: the value of site '{name}' is not the sample its distribution "
        "drew: another handler outside the handler replaced it (e.g. poutine.replay), or the "
        "handler wraps the model instead of the guide. Wrap the guide only: "
        "SVI(model, stick_the_landing(guide), ...)."
    )


def _fast_enough(batch: SplitBatch) -> tuple[bool, bool]:
    """Whether every STL site of a general run can take the default path next time, and
    whether one of them is a flow (which the default path does not take under the JIT).

    The same classification as the default path's (:func:`site_pathwise`), on the samples
    the general run drew through its relays.
    """
    outputs = batch.group.outputs
    nodes = {r.grad_fn: i for i, r in enumerate(outputs)}
    flow = False
    try:
        for rec in batch.records.values():
            if rec.stl:
                parts = site_pathwise(rec.name, rec.fn, rec.raw, outputs, nodes, check_only=True)
                flow = flow or getattr(parts, "flow", False)
    except (NeedsGeneralSplit, ValueError, NotImplementedError):
        return False, flow
    return True, flow


def stick_the_landing(
    fn: Callable | None = None, *, trace_steps: int = 0, switch: str | None = None
) -> StickTheLandingMessenger | Callable:
    """Handler form of :class:`StickTheLandingMessenger` (like ``pyro.poutine.scale``).

    ``trace_steps``: the first ``trace_steps`` runs of the guide with gradients enabled
    (one per SVI step and particle) keep the ordinary gradient; sticking the landing
    starts after them (see :class:`STLPolicy`).

    ``switch="measured"``: the ordinary gradient first, and sticking the landing once the
    gradients measure it better, back if they stop doing so
    (:class:`~pyro_gradroute.poutine.measured_switch.MeasuredSwitch`: from the gradient the
    backward sends to each site's ``Normal`` parameters, one run in 4, no extra backward). Each
    run's choice comes from earlier runs only, so every step is one of the two unbiased
    estimators. It reads ``Normal`` sites (also pushed forward by parameter-free bijections,
    as ``LogNormal``; amortized ones too) whose parameters read no earlier sample; another
    reparameterized site raises a ``ValueError`` naming it.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> def guide():
        ...     pyro.sample("z", dist.Normal(pyro.param("m", torch.tensor(0.0)), 1.0))
        >>> stl_guide = stick_the_landing(guide)
        >>> switched = stick_the_landing(guide, switch="measured")
        >>> with stick_the_landing():
        ...     guide()

    :returns: the wrapped ``fn``, or the messenger (a context manager) if ``fn`` is None.
    """
    msngr = StickTheLandingMessenger(trace_steps, switch)
    return msngr if fn is None else msngr(fn)
