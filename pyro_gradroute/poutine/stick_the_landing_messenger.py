"""Sticking the landing inside Pyro's own ELBOs, through the ``score_parts`` hook: the handler,
its guide-site wrapper, and the policy (which sites, from which step, in which estimators)."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import pyro.infer as pi
import torch
from pyro.poutine.messenger import Messenger
from torch.distributions import Distribution, TransformedDistribution, kl_divergence, register_kl

from .._compat import Subsample, calling_elbo
from .._validation import check_int
from ..distributions.detached import delta_base, density_reads_parameters, param_tensors
from ..distributions.split import preimage_rsample
from ..distributions.structured import calling_structured_guide
from .block_grad_messenger import _EMPTY, GatedDistribution, WrappedDistribution
from .pathwise import RunSite, _delta_error, evaluate_run

__all__ = ["STLPolicy", "StickTheLandingMessenger", "check_elbo", "stick_the_landing"]


class PathwiseDistribution(WrappedDistribution):
    """``base_dist``, whose ``log_prob`` and ``score_parts`` at its own draw carry only the pathwise gradient.

    Everything else (sampling, shapes, support, ``log_prob`` at any other value) is
    ``base_dist``'s. The parts of a guide run's sites are computed together when the first
    is asked for (:func:`~pyro_gradroute.poutine.pathwise.evaluate_run`).
    """

    _own = ("base_dist", "_run", "_value", "_pre", "_site", "_path")

    @classmethod
    def _wrap(cls, base_dist, run: _Run, path: bool = True) -> PathwiseDistribution:
        """``cls(base_dist, run)`` without the metaclass's call or ``Distribution.__init__``
        (one wrapper per site and step); ``path``: the policy gives the site its pathwise part."""
        self = object.__new__(cls)
        self.__dict__ = {
            "base_dist": base_dist,
            "_run": run,
            "_value": None,
            "_pre": None,
            "_site": None,
            "_path": path,
            "_batch_shape": base_dist.batch_shape,
            "_event_shape": base_dist.event_shape,
            "_validate_args": False,
        }
        return self

    def __call__(self, sample_shape=_EMPTY):
        base = self.base_dist
        if not base.has_rsample:
            self._value = base.sample(sample_shape)
        elif isinstance(base, TransformedDistribution):  # (a flow keeps its path)
            self._value, self._pre = preimage_rsample(base, sample_shape)
        else:
            self._value = base.rsample(sample_shape)
        return self._value

    def rsample(self, sample_shape=_EMPTY):
        base = self.base_dist
        return self(sample_shape) if base.has_rsample else base.rsample(sample_shape)

    def sample(self, sample_shape=_EMPTY):
        self._value = self.base_dist.sample(sample_shape)
        return self._value

    def expand(self, batch_shape, _instance=None):
        return PathwiseDistribution._wrap(self.base_dist.expand(batch_shape), self._run, self._path)

    def log_prob(self, value, *args, **kwargs):
        site = self._site
        if site is not None and value is site.value:
            return self.score_parts(value).log_prob
        return self.base_dist.log_prob(value, *args, **kwargs)

    def score_parts(self, value, *args, **kwargs):
        site = self._site
        if site is not None and value is site.value:  # at its own draw: the pathwise parts
            if site.parts is _PENDING:
                self._run.evaluate()  # the run's sites, this one included
            if site.parts is not None:
                return site.parts
        return self.base_dist.score_parts(value, *args, **kwargs)


_PENDING = object()  # a site's parts before its run is evaluated


@register_kl(PathwiseDistribution, Distribution)
def _kl_pathwise(p: PathwiseDistribution, q: Distribution) -> torch.Tensor:
    """An analytic KL (``TraceMeanField_ELBO``) is the base distribution's: it has no sampling noise."""
    return kl_divergence(p.base_dist, q)


class _Run:
    """The samples of one guide run in draw order; its sites' parts are evaluated together when
    the first is asked for (every sample is known by then)."""

    def __init__(self, stl: bool, fallback, keep=None) -> None:
        self.earlier: list[torch.Tensor] = []
        self.nodes: dict = {}
        self.changed = False  # a random draw sticks the landing
        self.sites: list[RunSite] = []
        self.pending: list[RunSite] = []
        self.stl = stl  # sticking the landing is on in this run (the policy, at its start)
        self.fallback = fallback
        self.keep = keep  # {site name: parameters whose score part stays}

    def add(self, value) -> None:
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            self.nodes[value.grad_fn] = len(self.earlier)
            self.earlier.append(value)

    def evaluate(self) -> None:
        pending, self.pending = self.pending, []
        for s in pending:
            s.parts = None
        evaluate_run(pending, self.earlier, self.nodes, self.fallback, self.sites, self.keep)


class STLPolicy:
    """Which guide sites stick the landing, and from which step: shared by ``TraceSTL_ELBO`` and the handler.

    * :meth:`uses_pathwise`: reparameterized sites do, unless marked
      ``infer={"stl": False}``; ``infer={"stl": True}`` on a site without ``rsample`` is an
      error naming it;
    * :meth:`fallback`: a site that cannot be split gets the ordinary gradient, with a
      warning naming it (once per site);
    * ``trace_steps``: the first ``trace_steps`` steps take the ordinary (``Trace_ELBO``)
      gradient everywhere, then sticking the landing starts (:meth:`advance` counts steps):
      far from the posterior the score part STL drops cancels the entropy gradient's noise.

    Example::

        >>> import pyro.distributions as dist
        >>> policy = STLPolicy("my estimator", trace_steps=1)
        >>> policy.active
        False
        >>> policy.advance(); policy.active
        True
        >>> policy.uses_pathwise({"name": "z", "fn": dist.Normal(0.0, 1.0), "infer": {"stl": False}})
        False

    :param owner: the name the warnings use.
    :param trace_steps: number of initial steps with the ordinary gradient (``>= 0``).
    :param keep: ``{site name: names of its family's parameters}`` whose score part stays
        (a plain family reading no earlier sample, e.g. ``{"z": {"loc"}}``: the ordinary
        gradient at ``z``'s ``loc``, the pathwise one at its ``scale``).
    """

    def __init__(self, owner: str, trace_steps: int = 0, keep: dict | None = None):
        self.owner = owner
        self.trace_steps = check_int(trace_steps, "trace_steps", owner, minimum=0)
        self.keep = keep
        self.steps = 0
        self._warned: set[str] = set()

    @property
    def active(self) -> bool:
        """Whether sticking the landing is on (the ``Trace_ELBO`` phase is over)."""
        return self.steps >= self.trace_steps

    def advance(self) -> None:
        """Count one step (a gradient evaluation)."""
        self.steps += 1

    def uses_pathwise(self, site) -> bool:
        """Whether a guide site (a message, while sticking the landing is on) takes its pathwise part."""
        fn, stl = site["fn"], site["infer"].get("stl", None)
        has_rsample = getattr(fn, "has_rsample", False)
        if stl is True and not has_rsample:
            raise ValueError(
                f"Guide site '{site['name']}' is marked infer={{'stl': True}} but its "
                f"distribution {type(fn).__name__} has no rsample, so it has no "
                "pathwise gradient. Use a reparameterizable family or remove the mark "
                "(non-reparameterized sites get the score-function estimator)."
            )
        return stl is not False and bool(has_rsample)

    def fallback(self, name: str, error) -> bool:
        """Warn (once per site) that site ``name`` gets the ordinary gradient; True."""
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(
                f"{self.owner}: guide site '{name}' cannot be split into score and "
                f"pathwise parts ({error}); it gets the ordinary Trace_ELBO gradient instead "
                "(unbiased, but not sticking the landing). Mark it infer={'stl': False} to "
                "silence this.",
                stacklevel=4,
            )
        return True


_GRADIENT_METHODS = ("loss_and_grads", "differentiable_loss", "_differentiable_loss_particle")
_VALID: dict[type, bool] = {}  # estimator class -> whether STL is valid in it
#: Pyro's ELBOs that take log q's gradient as a plain sum (the classes, held from import on)
_PYRO_SAFE = (pi.Trace_ELBO, pi.JitTrace_ELBO, pi.TraceGraph_ELBO, pi.JitTraceGraph_ELBO,
              pi.TraceEnum_ELBO, pi.JitTraceEnum_ELBO, pi.TraceMeanField_ELBO,
              pi.JitTraceMeanField_ELBO)  # fmt: skip


def check_elbo(elbo) -> None:
    """Raise unless ``elbo`` (the estimator running the guide, or None) is one STL is valid in.

    Allowed: the ELBOs that take ``log q``'s gradient as a plain sum (Pyro's by class, this
    package's by the ``_stl_safe`` flag), and subclasses of them that do not redefine
    ``loss_and_grads``, ``differentiable_loss`` or ``_differentiable_loss_particle``.

    Example::

        >>> import pyro.infer
        >>> check_elbo(pyro.infer.Trace_ELBO())
        >>> check_elbo(pyro.infer.RenyiELBO())
        Traceback (most recent call last):
        ...
        ValueError: stick_the_landing cannot be used with RenyiELBO: ...
    """
    if elbo is None:
        return
    cls = type(elbo)
    if cls not in _VALID:
        base = next((c for c in cls.__mro__ if c in _PYRO_SAFE or vars(c).get("_stl_safe")), None)
        owners = (next((c for c in cls.__mro__ if m in vars(c)), None) for m in _GRADIENT_METHODS)
        _VALID[cls] = base is not None and all(c is None or c in base.__mro__ for c in owners)
    if _VALID[cls]:
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


class StickTheLandingMessenger(Messenger):
    r"""Inside it, each reparameterized guide site's log-density carries only its pathwise gradient.

    For a guide sample :math:`z = g(\epsilon; \phi)`, ``log_prob`` and
    ``score_parts`` (``log_prob`` and ``entropy_term``) at the sample equal
    :math:`\log q(z; \phi)` in value, with gradient that of
    :math:`\log q(z; \bot(\phi))` (sticking the landing, Roeder et al. 2017): the
    score part :math:`\partial_\phi \log q(z;\phi)|_z`, whose expectation is zero, is
    dropped. For a conditional :math:`q(z_2 \mid z_1)` the path through :math:`z_1`
    is kept. Every density is evaluated once
    (:func:`~pyro_gradroute.poutine.pathwise.site_pathwise` decides how, per site).
    Non-reparameterized sites keep Pyro's score-function treatment; a site the handler
    does not wrap (observed, enumerated, with a value another handler supplies) keeps
    Pyro's.

    Pyro's ELBOs read these parts through the documented ``score_parts`` hook, so
    ``SVI(model, stick_the_landing(guide), optim, elbo)`` sticks the landing with
    ``Trace_ELBO``, ``TraceGraph_ELBO``, ``TraceEnum_ELBO``, ``TraceMeanField_ELBO`` (and
    their Jit versions) and this package's ``Trace_ELBO``; an estimator in which dropping
    the score part biases the gradient (``RenyiELBO``, ...) is refused. Wrap the guide
    only. The measured switch between ``Trace_ELBO`` and sticking the landing is
    :class:`~pyro_gradroute.infer.TraceAdaptiveSTL_ELBO` ``(mix_gain=math.inf)``.

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
    """

    def __init__(self, trace_steps: int = 0, switch=None, *, _policy: STLPolicy | None = None):
        if switch is not None:
            raise ValueError(
                f"stick_the_landing: switch={switch!r}: the handler has no switch: it sticks "
                "the landing after trace_steps=N steps (0 by default). The measured switch "
                "between Trace_ELBO and sticking the landing is "
                "pyro_gradroute.infer.TraceAdaptiveSTL_ELBO(mix_gain=math.inf) (or "
                "TraceEnumAdaptiveSTL_ELBO for enumerated models)."
            )
        super().__init__()
        self._owned = _policy is not None  # an estimator's own handler: it counts the steps
        self._policy = (
            _policy if _policy is not None else STLPolicy("sticking the landing", trace_steps)
        )
        self._run: _Run | None = None
        self._warned = False
        self._drawn: dict[int, weakref.ref] = {}  # id -> sample this handler drew

    def __enter__(self):
        if not self._owned:
            check_elbo(calling_elbo())
        policy = self._policy
        self._run = _Run(policy.active, policy.fallback, policy.keep)
        return super().__enter__()

    # per site and step: exact type checks, no isinstance against Pyro's ABCs, few calls
    def _process_message(self, msg) -> None:
        run = self._run
        if msg["type"] != "sample" or msg["value"] is not None or msg["is_observed"]:
            return  # observed, or a value another handler supplies
        if run is None or not run.stl:
            return  # the ordinary gradient
        fn = msg["fn"]
        gated = type(fn) is GatedDistribution
        base = fn.base_dist if gated else fn
        kind = type(base)
        if kind is PathwiseDistribution or kind is Subsample or msg["infer"].get("enumerate"):
            return
        wrapped = PathwiseDistribution._wrap(base, run, self._policy.uses_pathwise(msg))
        msg["fn"] = GatedDistribution(wrapped, fn.specs) if gated else wrapped

    def _postprocess_message(self, msg) -> None:
        if msg["type"] != "sample":
            return
        outer = msg["fn"]
        fn = outer.base_dist if type(outer) is GatedDistribution else outer
        run = self._run
        if type(fn) is not PathwiseDistribution or fn._run is not run:
            return
        value, name, base = msg["value"], msg["name"], fn.base_dist
        if not fn._path:  # the ordinary parts (Pyro's treatment)
            if outer is fn:
                msg["fn"] = base
            run.add(value)
            return
        if value is fn._value:  # keep (weakly) a sample this handler drew: Pyro's sequential
            drawn = self._drawn  # enumeration (poutine.queue) replays it in a later run
            if len(drawn) > 4096:  # forget the samples that are gone
                for k in [k for k, r in drawn.items() if r() is None]:
                    del drawn[k]
            drawn[id(value)] = weakref.ref(value)
        elif (ref := self._drawn.get(id(value))) is None or ref() is not value:
            if torch.is_tensor(value) and not value.requires_grad and not param_tensors(base):
                run.add(value)  # nothing to stop: another handler's value passes through
                return
            raise ValueError(
                f"stick_the_landing: the value of site '{name}' is not the sample its "
                "distribution drew: another handler outside the handler replaced it (e.g. "
                "poutine.replay), or the handler wraps the model instead of the guide. Wrap "
                "the guide only: SVI(model, stick_the_landing(guide), ...)."
            )
        d = delta_base(base)
        owner = None
        if d is not None:  # no random draw: its ordinary parts, unless its density reads
            # parameters directly (a structured guide's map, or an error)
            if density_reads_parameters(d, run.nodes):
                owner = calling_structured_guide()
                if owner is None:
                    raise _delta_error(name)
        else:
            run.changed = True  # a random draw
        aux = bool(msg["infer"].get("is_auxiliary"))
        site = RunSite(name, base, value, len(run.earlier), owner, aux, fn._pre, run.earlier)
        fn._site = site
        run.sites.append(site)
        if d is None or owner is not None:
            site.parts = _PENDING
            run.pending.append(site)
        run.add(value)

    def __exit__(self, *args):
        run, self._run = self._run, None  # (the trace's wrappers keep what they need)
        if args[0] is None and run is not None:
            if torch.is_grad_enabled() and not self._owned:
                self._policy.advance()
            if run.stl and not run.changed and not self._warned and not self._owned:
                self._warned = True
                warnings.warn(
                    "stick_the_landing: the guide has no reparameterized site with a random draw "
                    "(only Delta or non-reparameterized sites), so sticking the landing changes "
                    "nothing.",
                    stacklevel=2,
                )
        return super().__exit__(*args)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_run"], state["_drawn"] = None, {}  # (a run's samples carry graphs)
        return state


def stick_the_landing(
    fn: Callable | None = None, *, trace_steps: int = 0, switch=None
) -> StickTheLandingMessenger | Callable:
    """Handler form of :class:`StickTheLandingMessenger` (like ``pyro.poutine.scale``).

    ``trace_steps``: the first ``trace_steps`` runs of the guide with gradients enabled
    (one per SVI step and particle) keep the ordinary gradient; sticking the landing
    starts after them (see :class:`STLPolicy`).
    ``switch`` is refused: the measured switch is
    :class:`~pyro_gradroute.infer.TraceAdaptiveSTL_ELBO` ``(mix_gain=math.inf)``.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> def guide():
        ...     pyro.sample("z", dist.Normal(pyro.param("m", torch.tensor(0.0)), 1.0))
        >>> stl_guide = stick_the_landing(guide)
        >>> with stick_the_landing():
        ...     guide()

    :returns: the wrapped ``fn``, or the messenger (a context manager) if ``fn`` is None.
    """
    msngr = StickTheLandingMessenger(trace_steps, switch)
    return msngr if fn is None else msngr(fn)
