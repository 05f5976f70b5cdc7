"""Sticking the landing inside Pyro's own ELBOs, through the ``score_parts`` hook."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import torch
from pyro.poutine.messenger import Messenger
from torch.distributions import Distribution, TransformedDistribution, kl_divergence, register_kl

from .._compat import Subsample, calling_elbo, distribution_fields
from ..distributions.detached import delta_base, density_reads_parameters, param_tensors
from ..distributions.split import preimage_rsample
from ..distributions.structured import calling_structured_guide
from ._wrapped import _EMPTY, WrappedDistribution
from .gated_distribution import GatedDistribution
from .pathwise import RunSite, _delta_error, evaluate_run
from .stl_policy import STLPolicy, check_elbo

__all__ = ["StickTheLandingMessenger", "stick_the_landing"]


class PathwiseDistribution(WrappedDistribution):
    """``base_dist``, whose ``log_prob`` and ``score_parts`` at its own draw carry only the pathwise gradient.

    Everything else (sampling, shapes, support, ``log_prob`` at any other value) is
    ``base_dist``'s. The parts of a guide run's sites are computed together when the first
    is asked for (:func:`~pyro_gradroute.poutine.pathwise.evaluate_run`).
    """

    _own = ("base_dist", "_run", "_value", "_pre", "_site")

    def __init__(self, base_dist, run: _Run):
        self.__dict__ = self._wrap(base_dist, run).__dict__

    @classmethod
    def _wrap(cls, base_dist, run: _Run) -> PathwiseDistribution:
        """``cls(base_dist, run)`` without the metaclass's call (one wrapper per site and step)."""
        self = object.__new__(cls)
        self.__dict__ = {  # what Distribution.__init__ sets, without its checks
            "base_dist": base_dist,
            "_run": run,
            "_value": None,
            "_pre": None,
            "_site": None,
            **distribution_fields(base_dist),
        }
        return self

    def __call__(self, sample_shape=_EMPTY):
        return (
            self.rsample(sample_shape) if self.base_dist.has_rsample else self.sample(sample_shape)
        )

    def rsample(self, sample_shape=_EMPTY):
        base = self.base_dist
        if _transformed(type(base)):  # a flow keeps its path (and a pushforward its pre-image)
            self._value, self._pre = preimage_rsample(base, sample_shape)
        else:
            self._value = base.rsample(sample_shape)
        return self._value

    def sample(self, sample_shape=_EMPTY):
        self._value = self.base_dist.sample(sample_shape)
        return self._value

    def expand(self, batch_shape, _instance=None):
        return PathwiseDistribution._wrap(self.base_dist.expand(batch_shape), self._run)

    def _pathwise(self, value):
        """The pathwise parts at ``value`` (None: at another value, or the ordinary parts)."""
        site = self._site
        if site is None or value is not site.value:
            return None
        if site.parts is _PENDING:
            self._run.evaluate()  # the run's sites, this one included
        return site.parts

    def log_prob(self, value, *args, **kwargs):
        parts = self._pathwise(value)
        return self.base_dist.log_prob(value, *args, **kwargs) if parts is None else parts.log_prob

    def score_parts(self, value, *args, **kwargs):
        parts = self._pathwise(value)
        return self.base_dist.score_parts(value, *args, **kwargs) if parts is None else parts


_PENDING = object()  # a site's parts before its run is evaluated
_TRANSFORMED: dict[type, bool] = {}


def _transformed(cls) -> bool:
    t = _TRANSFORMED.get(cls)
    if t is None:
        t = _TRANSFORMED[cls] = issubclass(cls, TransformedDistribution)
    return t


@register_kl(PathwiseDistribution, Distribution)
def _kl_pathwise(p: PathwiseDistribution, q: Distribution) -> torch.Tensor:
    """An analytic KL (``TraceMeanField_ELBO``) is the base distribution's: it has no sampling noise."""
    return kl_divergence(p.base_dist, q)


class _Run:
    """The samples of one guide run, in draw order (what later sites may read).

    The pathwise parts of its sites are evaluated together, when the first is asked for
    (by then every sample is known; a site's parameters cannot read a later one).
    """

    def __init__(self, stl: bool, fallback) -> None:
        self.earlier: list[torch.Tensor] = []
        self.nodes: dict = {}
        self.changed = False  # a random draw sticks the landing
        self.sites: list[RunSite] = []
        self.pending: list[RunSite] = []
        self.stl = stl  # sticking the landing is on in this run (the policy, at its start)
        self.fallback = fallback

    def add(self, value) -> None:
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            self.nodes[value.grad_fn] = len(self.earlier)
            self.earlier.append(value)

    def evaluate(self) -> None:
        pending, self.pending = self.pending, []
        for s in pending:
            s.parts = None
        evaluate_run(pending, self.earlier, self.nodes, self.fallback, self.sites)


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
        gradient (see :class:`~pyro_gradroute.poutine.stl_policy.STLPolicy`).
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
        self._run = _Run(self._policy.active, self._policy.fallback)
        return super().__enter__()

    # per site and step: exact type checks, no isinstance against Pyro's ABCs, few calls
    def _process_message(self, msg) -> None:
        if msg["type"] == "sample":
            self._pyro_sample(msg)

    def _postprocess_message(self, msg) -> None:
        if msg["type"] == "sample":
            self._pyro_post_sample(msg)

    def _pyro_sample(self, msg) -> None:
        run = self._run
        if msg["value"] is not None or msg["is_observed"] or run is None or not run.stl:
            return  # observed, a value another handler supplies, or the ordinary gradient
        fn = msg["fn"]
        gated = type(fn) is GatedDistribution
        base = fn.base_dist if gated else fn
        kind = type(base)
        if kind is PathwiseDistribution or kind is Subsample or msg["infer"].get("enumerate"):
            return
        wrapped = PathwiseDistribution._wrap(base, run)
        msg["fn"] = GatedDistribution(wrapped, fn.specs) if gated else wrapped

    def _pyro_post_sample(self, msg) -> None:
        outer = msg["fn"]
        fn = outer.base_dist if type(outer) is GatedDistribution else outer
        run = self._run
        if type(fn) is not PathwiseDistribution or fn._run is not run:
            return
        value, name, base = msg["value"], msg["name"], fn.base_dist
        if not self._policy.uses_pathwise(
            msg
        ):  # the ordinary parts (score-function sites: Pyro's treatment)
            if outer is fn:
                msg["fn"] = base
            run.add(value)
            return
        if value is fn._value:
            self._remember(value)
        elif not self._drew_before(
            value
        ):  # (a replay of an earlier run's draw: sequential enumeration)
            if torch.is_tensor(value) and not value.requires_grad and not param_tensors(base):
                run.add(value)  # nothing to stop: another handler's value passes through
                return
            raise _not_drawn(name)
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


def _not_drawn(name: str) -> ValueError:
    return ValueError(
        f"stick_the_landing: the value of site '{name}' is not the sample its distribution "
        "drew: another handler outside the handler replaced it (e.g. poutine.replay), or the "
        "handler wraps the model instead of the guide. Wrap the guide only: "
        "SVI(model, stick_the_landing(guide), ...)."
    )


def stick_the_landing(
    fn: Callable | None = None, *, trace_steps: int = 0, switch=None
) -> StickTheLandingMessenger | Callable:
    """Handler form of :class:`StickTheLandingMessenger` (like ``pyro.poutine.scale``).

    ``trace_steps``: the first ``trace_steps`` runs of the guide with gradients enabled
    (one per SVI step and particle) keep the ordinary gradient; sticking the landing
    starts after them (see :class:`~pyro_gradroute.poutine.stl_policy.STLPolicy`).
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
