"""A guide site's distribution whose parts come from one batched split of the whole guide.

:class:`SplitDistribution` wraps a guide site's distribution. It samples through a
:class:`~pyro_gradroute.distributions.split.Relay` (a cut point for the pathwise
products of later, conditional sites) and answers ``log_prob`` / ``score_parts`` at
its own sample from :class:`SplitBatch`, which evaluates every recorded site of the
guide run once, in one :func:`~pyro_gradroute.distributions.split.split_score_parts`
call, the first time any part is asked for. At any other value it is its base
distribution. Pyro's trace machinery (``Trace.compute_score_parts``) reads the parts
through the documented ``score_parts`` hook; the estimators read the pathwise parts
with :meth:`SplitDistribution.split_parts`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from pyro.distributions import TorchDistribution
from pyro.distributions.score_parts import ScoreParts
from torch.distributions import Distribution, kl_divergence, register_kl

from ..distributions.detached import delta_base
from ..distributions.split import (
    Relay,
    RelayGroup,
    SplitNotSupported,
    _sampled_score_parts,
    preimage_rsample,
    split_score_parts,
)
from ..distributions.structured import (
    StructuredNotSupported,
    calling_structured_guide,
    structured_pathwise,
)
from ..routing import reached, reaches_leaf_directly

_EMPTY = torch.Size()


@dataclass(eq=False)
class SiteRecord:
    """What the batch knows of one guide site."""

    name: str
    fn: object
    value: torch.Tensor | None = None
    raw: torch.Tensor | None = None  # the sample before its relay (transform caches know it)
    preimage: torch.Tensor | None = None
    upstream: list = field(default_factory=list)
    infer: dict = field(default_factory=dict)
    split: bool = False
    stl: bool = False  # score_parts carry the pathwise gradient
    parts: tuple | None = None  # (full ScoreParts, pathwise ScoreParts, score tensor)
    # a site of AutoStructured / AutoGaussian (the guide that sampled it), see .structured
    owner: object = None
    point: bool = False  # an AutoStructured "delta" conditional: no density of its own
    owner_error: str | None = None  # why its pathwise part is not available


class SplitBatch:
    """The split parts of one guide run, evaluated together on first use.

    :param needs_split: ``record -> bool``: whether a site's parts are split (else the
        site is evaluated the ordinary way, with ``fn.score_parts(value)``).
    :param fallback: ``(record, SplitNotSupported) -> bool``: whether a site that
        cannot be split is evaluated the ordinary way instead of raising.
    :param pathwise: ``record -> bool``: the sites whose ``log_prob`` and ``score_parts``
        (``log_prob`` and ``entropy_term``) carry only the pathwise gradient
        (sticking the landing through Pyro's own ELBOs); the value is unchanged.
    """

    def __init__(
        self,
        needs_split: Callable[[SiteRecord], bool] | None = None,
        fallback: Callable[[SiteRecord, Exception], bool] | None = None,
        pathwise: Callable[[SiteRecord], bool] | None = None,
    ):
        self.pathwise = pathwise
        self.group = RelayGroup()
        self.records: dict[str, SiteRecord] = {}
        self.needs_split = needs_split
        self.fallback = fallback
        self._pending: list[SiteRecord] = []
        self._rsampled: dict[int, tuple] = {}  # id(relay out) -> (out, raw sample, pre-image)

    def relay(self, value: torch.Tensor, preimage: torch.Tensor | None) -> torch.Tensor:
        """The relay output the guide continues with (remembering the pre-image)."""
        out = Relay(value, self.group)
        self._rsampled[id(out)] = (out, value, preimage)
        return out

    def drew(self, value) -> bool:
        """Whether ``value`` is a sample a wrapped distribution of this batch drew (through its relay)."""
        pre = self._rsampled.get(id(value))
        return pre is not None and pre[0] is value

    def register(self, name: str, fn, value, infer=None) -> SiteRecord:
        """Record a guide sample site after it was sampled (its upstream: earlier relays)."""
        upstream = [r for r in self.group.outputs if r is not value]
        pre = self._rsampled.get(id(value))
        raw, preimage = (pre[1], pre[2]) if pre is not None and pre[0] is value else (value, None)
        rec = SiteRecord(name, fn, value, raw, preimage, upstream, dict(infer or {}))
        rec.split = bool(torch.is_tensor(value)) and (
            self.needs_split is None or self.needs_split(rec)
        )
        rec.stl = rec.split and self.pathwise is not None and self.pathwise(rec)
        if rec.split and _param_density_delta(fn):
            rec.owner = calling_structured_guide()
        self.records[name] = rec
        if rec.split:
            self._pending.append(rec)
        return rec

    def parts(self, rec: SiteRecord) -> tuple:
        """``(full, pathwise, score)`` of a recorded site, evaluating the pending sites once."""
        if rec.parts is None and rec.split and torch.jit.is_tracing():
            rec.parts = _traced_split(rec)
        if rec.parts is None and rec.split:
            self._evaluate()
        if rec.parts is None:  # an ordinary evaluation
            full = rec.fn.score_parts(rec.raw)
            rec.parts = (full, ScoreParts(*(_stop(t) for t in full)), full.log_prob)
        return rec.parts

    def _evaluate(self) -> None:
        pending, self._pending = self._pending, []
        # A Delta is no random draw: its value has no density gradient, and a log_density
        # computed from earlier draws only is all pathwise (through their relays). It needs
        # no split: the ordinary evaluation serves as both parts. (One that depends on
        # parameters directly is refused by check_delta_density.)
        deltas = [r for r in pending if delta_base(r.fn) is not None]
        pending = [r for r in pending if delta_base(r.fn) is None]
        for rec in deltas:
            full = rec.fn.score_parts(rec.raw)
            rec.parts = (full, full, full.log_prob)

        def on_error(i, err):
            rec = pending[i]
            if self.fallback is None or not self.fallback(rec, err):
                raise SplitNotSupported(f"Guide site '{rec.name}': {err}") from err
            rec.split = False
            full = rec.fn.score_parts(rec.raw)
            return (full, ScoreParts(*(_stop(t) for t in full)), full.log_prob)

        items = [(r.fn, r.value, r.upstream, r.preimage, r.raw) for r in pending]
        try:
            out = split_score_parts(items, group=self.group, on_error=on_error)
        except ValueError as e:
            i = getattr(e, "split_index", None)
            if i is None:
                raise
            raise ValueError(
                f"Error while computing log_prob at site '{pending[i].name}':\n{e}"
            ) from e
        for rec, parts in zip(pending, out):
            rec.parts = parts
            if rec.stl and rec.split:
                check_delta_density(rec)
        owners = {id(r.owner): r.owner for r in deltas if r.owner is not None}
        for owner in owners.values():
            self._structured(owner)
        check_auxiliary_links(self)
        for rec in deltas:
            if rec.stl:
                check_delta_density(rec)

    def _structured(self, owner) -> None:
        """Pathwise parts of a structured guide's sites (its auxiliary draws and Deltas)."""
        mine = [r for r in self.records.values() if r.owner is owner]
        try:
            parts = structured_pathwise(owner, self.records)
        except StructuredNotSupported as e:
            for r in mine:
                r.owner_error = str(e)
            return
        for name, (lp, point) in parts.items():
            rec = self.records[name]
            rec.owner, rec.point = owner, point
            if lp is None:
                continue
            full = rec.parts[0]
            # the per-site score tensor is no part of the joint score here: none is given
            # (an estimator that mixes in the score part keeps the pathwise one for it)
            score = _stop(rec.parts[2])
            rec.parts = (full, ScoreParts(lp, _stop(full.score_function), lp), score)

    def score_parts(self, rec: SiteRecord) -> ScoreParts:
        """What ``score_parts`` answers at the recorded sample (pathwise for ``stl`` sites)."""
        full, path, _ = self.parts(rec)
        if rec.stl and rec.split:
            return ScoreParts(path.log_prob, full.score_function, path.entropy_term)
        return full


def _traced_split(rec: SiteRecord) -> tuple:
    """The split as plain tensor operations, for programs traced by the JIT.

    Under ``torch.jit.trace`` (``JitTrace_ELBO`` and friends) the one-pass node cannot
    be used: its backward reads the evaluated graph of the step it was built in, which a
    traced program does not rebuild. Two evaluations give the same first derivatives:
    ``pathwise = log q(z) - log q(stop(z)) + stop(log q(stop(z)))`` (the full gradient minus
    the score part). That subtraction also removes the path through earlier samples, so a
    conditional site (a density computed from earlier samples) raises instead.
    """
    full = rec.fn.score_parts(rec.raw)
    if delta_base(rec.fn) is not None:  # all pathwise, as in the one-pass split
        if rec.owner is not None:
            raise NotImplementedError(
                f"guide site '{rec.name}': a Delta of {type(rec.owner).__name__} (its "
                "log_density depends on the guide's parameters), whose pathwise part the "
                "split cannot compute inside a program traced by the JIT. Use the non-JIT ELBO "
                "(Trace_ELBO, TraceGraph_ELBO, TraceEnum_ELBO) with stick_the_landing, or "
                "pyro_gradroute.infer.TraceSTL_ELBO."
            )
        check_delta_density(rec)
        return full, full, full.log_prob
    v = rec.raw.detach()
    try:
        score = rec.fn.score_parts(v)
    except AssertionError:
        # a family whose score_parts accept only its sampler's exact tensor (RSVI's
        # ShapeAugmentedGamma): its parts at that tensor, log_prob at the fixed copy
        try:
            score = _sampled_score_parts(rec.fn, v, rec.raw)
        except SplitNotSupported as e:
            raise SplitNotSupported(f"guide site '{rec.name}': {e}") from e
    except (NotImplementedError, KeyError) as e:
        raise SplitNotSupported(
            f"guide site '{rec.name}': {type(rec.fn).__name__}.log_prob cannot be evaluated at "
            f"a fixed sample ({type(e).__name__}: {e}), which a program traced by the JIT needs "
            "for the split (a flow with a transform without an inverse: Planar, Radial, "
            "Sylvester, ...). Use the non-JIT ELBO (Trace_ELBO, TraceGraph_ELBO, "
            "TraceEnum_ELBO) with stick_the_landing, or pyro_gradroute.infer.TraceSTL_ELBO, "
            "which carry the pathwise gradient forward without an inverse."
        ) from e
    if rec.upstream and reached(score.log_prob, rec.upstream):
        raise NotImplementedError(
            f"guide site '{rec.name}': its density depends on earlier guide samples (a "
            "conditional guide), whose pathwise path the split cannot keep inside a program "
            "traced by the JIT. Use the non-JIT ELBO (Trace_ELBO, TraceGraph_ELBO, "
            "TraceEnum_ELBO) with stick_the_landing, or pyro_gradroute.infer.TraceSTL_ELBO."
        )

    def path(f, s):
        if not (torch.is_tensor(f) and f.requires_grad):
            return _stop(f)
        if not (torch.is_tensor(s) and s.requires_grad):
            return f
        return f - s + s.detach()

    pathwise = ScoreParts(*(path(f, g) for f, g in zip(full, score)))
    return full, pathwise, score.log_prob


def _param_density_delta(fn) -> bool:
    """A Delta whose ``log_density`` carries a gradient (a Jacobian term)."""
    d = delta_base(fn)
    return d is not None and torch.is_tensor(d.log_density) and d.log_density.requires_grad


def check_delta_density(rec: SiteRecord) -> None:
    """Raise if a Delta site's ``log_density`` depends on parameters other than through earlier draws.

    A Delta's value is a deterministic function of earlier draws; its ``log_density``
    (a Jacobian correction) is part of ``log q``. When it depends only on earlier
    draws (AutoNormal, AutoDiagonalNormal, AutoMultivariateNormal, ...) its whole
    gradient is pathwise, through those draws. When it depends on the guide's
    parameters directly, the pathwise part at a fixed value needs the guide's map:
    ``AutoStructured`` and ``AutoGaussian`` (dense) sites get it from
    :mod:`~pyro_gradroute.distributions.structured` (their map is affine in the
    auxiliary draw); any other such Delta, or one of those guides in a form that cannot
    be made exact, raises here.
    """
    if rec.owner is not None:
        if rec.owner_error is not None:
            raise ValueError(rec.owner_error)
        return
    d = delta_base(rec.fn)
    if d is None or not torch.is_tensor(d.log_density) or not d.log_density.requires_grad:
        return
    if reaches_leaf_directly(d.log_density, rec.upstream):
        raise ValueError(
            f"guide site '{rec.name}' is a Delta whose log_density depends on the guide's "
            "parameters directly (as AutoStructured's and AutoGaussian's sites do), so its pathwise part at a "
            "fixed value is not available and dropping the score part would bias the "
            "gradient. Use pyro_gradroute.infer.Trace_ELBO (or pyro.infer.RenyiELBO for an "
            "importance-weighted bound) with this guide, or a guide whose Deltas are "
            "functions of earlier draws only (AutoNormal, AutoMultivariateNormal, ...)."
        )


def check_auxiliary_links(batch: SplitBatch) -> None:
    """Raise if a site's density reads an auxiliary Delta whose value depends on parameters directly.

    In ``w = sample("w", Delta(c + d * z0), infer={"is_auxiliary": True})`` read by
    ``z2 ~ q(. | w)``, ``w`` is no latent of the model: ``c`` and ``d`` are parameters
    of the conditional density ``q(z2 | z0)``. Its pathwise part holds them fixed, but
    the split treats ``w`` as a sample (a cut point), and the gradient it sends to
    ``w`` would reach ``c`` and ``d`` through ``w``'s value: part of the score part,
    kept silently. Computing ``c + d * z0`` inside the guide without a sample site gives
    the exact split (``z2``'s parameters then read ``z0`` directly).
    """
    aux = {
        id(r.value): r
        for r in batch.records.values()
        if r.infer.get("is_auxiliary")
        and r.owner is None
        and delta_base(r.fn) is not None
        and torch.is_tensor(r.raw)
        and r.raw.requires_grad
        and reaches_leaf_directly(r.raw, r.upstream)
    }
    if not aux:
        return
    for rec in batch.records.values():
        if not (rec.split and rec.upstream and rec.parts is not None):
            continue
        if delta_base(rec.fn) is not None:
            continue  # a Delta reading it has no score part to drop (AutoLaplaceApproximation)
        score = rec.parts[2]
        if not (torch.is_tensor(score) and score.requires_grad):
            continue
        for i in reached(score, rec.upstream):
            w = aux.get(id(rec.upstream[i]))
            if w is not None:
                raise ValueError(
                    f"guide site '{rec.name}' reads the auxiliary Delta site '{w.name}', whose "
                    "value depends on the guide's parameters directly: those parameters are "
                    f"parameters of '{rec.name}''s conditional density, whose pathwise part "
                    f"holds them fixed, but the path through '{w.name}''s value would keep "
                    "them (part of the score part, so the estimator would not stick the "
                    f"landing). Compute '{w.name}''s value in the guide without a sample site "
                    "(the split then keeps only the path through the draws it reads), or use "
                    "pyro_gradroute.infer.Trace_ELBO with this guide."
                )


def _stop(t):
    return t.detach() if torch.is_tensor(t) else t


class SplitDistribution(TorchDistribution):
    """``base_dist`` whose parts at its own sample come from a :class:`SplitBatch`.

    Sampling, shapes, support and every other attribute are those of ``base_dist``.
    ``rsample`` goes through a relay (identity in value and gradient). ``log_prob`` and
    ``score_parts`` at the recorded sample return the *full* parts (the ordinary
    gradient, exactly as ``base_dist`` would give it); :meth:`split_parts` also gives
    the pathwise parts. At any other value they are ``base_dist``'s.

    Example::

        >>> import torch, pyro.distributions as dist
        >>> batch = SplitBatch()
        >>> loc = torch.tensor(0.3, requires_grad=True)
        >>> d = SplitDistribution(dist.Normal(loc, 1.0), batch, "z")
        >>> z = d.rsample()
        >>> rec = batch.register("z", d.base_dist, z)
        >>> full, pathwise = d.split_parts(z)
        >>> bool(full.log_prob == dist.Normal(loc, 1.0).log_prob(z))
        True
    """

    arg_constraints: dict = {}

    def __init__(self, base_dist, batch: SplitBatch, name: str):
        self.base_dist = base_dist
        self.batch = batch
        self.name = name
        super().__init__(base_dist.batch_shape, base_dist.event_shape, validate_args=False)

    def __getattr__(self, name):
        if name in ("base_dist", "batch", "name"):
            raise AttributeError(name)
        return getattr(self.base_dist, name)

    @property  # type: ignore[override]
    def has_rsample(self) -> bool:  # type: ignore[override]
        return self.base_dist.has_rsample

    @has_rsample.setter
    def has_rsample(self, value: bool) -> None:
        # Pyro's broadcast copies a site's custom ``has_rsample_`` onto the expanded
        # distribution by assignment: it belongs to the base distribution
        self.base_dist.has_rsample = bool(value)

    has_enumerate_support = property(lambda self: self.base_dist.has_enumerate_support)  # type: ignore[assignment]
    support = property(lambda self: self.base_dist.support)  # type: ignore[assignment]
    mean = property(lambda self: self.base_dist.mean)
    variance = property(lambda self: self.base_dist.variance)

    def rsample(self, sample_shape=_EMPTY):
        value, pre = preimage_rsample(self.base_dist, sample_shape)
        return self.batch.relay(value, pre) if value.requires_grad else value

    def sample(self, sample_shape=_EMPTY):
        return self.base_dist.sample(sample_shape)

    def _record(self, value):
        rec = self.batch.records.get(self.name)
        return rec if rec is not None and rec.value is value else None

    def is_split(self, value) -> bool:
        """Whether the parts at ``value`` are split (else ordinary: not recorded, or fallen back)."""
        rec = self._record(value)
        if rec is None or not rec.split:
            return False
        self.batch.parts(rec)
        return rec.split

    def split_parts(self, value) -> tuple[ScoreParts, ScoreParts]:
        """``(full, pathwise)`` score parts at ``value`` (pathwise: parameters stopped)."""
        rec = self._record(value)
        if rec is None:
            full = self.base_dist.score_parts(value)
            return full, ScoreParts(*(_stop(t) for t in full))
        full, path, _ = self.batch.parts(rec)
        return full, path

    def log_prob(self, value, *args, **kwargs):
        rec = self._record(value)
        if rec is None:
            return self.base_dist.log_prob(value, *args, **kwargs)
        return self.batch.score_parts(rec).log_prob

    def score_parts(self, value, *args, **kwargs):
        rec = self._record(value)
        if rec is None:
            return self.base_dist.score_parts(value, *args, **kwargs)
        return self.batch.score_parts(rec)

    def enumerate_support(self, expand=True):
        return self.base_dist.enumerate_support(expand=expand)

    def expand(self, batch_shape, _instance=None):
        base = self.base_dist.expand(batch_shape)
        if base.has_rsample != self.base_dist.has_rsample:  # a custom has_rsample_
            base.has_rsample = self.base_dist.has_rsample
        return SplitDistribution(base, self.batch, self.name)


@register_kl(SplitDistribution, Distribution)
def _kl_split(p: SplitDistribution, q: Distribution) -> torch.Tensor:
    """An analytic KL (``TraceMeanField_ELBO``) is the base distribution's: it needs no split."""
    return kl_divergence(p.base_dist, q)
