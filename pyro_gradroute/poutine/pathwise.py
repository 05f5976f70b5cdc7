r"""The pathwise part :math:`\log q(z; \bot(\phi))` of a guide site's log-density, from the site alone.

:func:`site_pathwise` takes the cheapest exact rule per site, :func:`evaluate_run` applies it to
a guide run: a detached copy (:mod:`~pyro_gradroute.distributions.detached`) for a plain family
reading no earlier sample; the forward-carried gradient for an unconditional flow with its path
cached; else one split node for all such sites
(:func:`~pyro_gradroute.distributions.split.split_score_parts`), which sends the partials to the
earlier samples read; under the JIT, full minus detached parts (a conditional site raises). A
``Delta`` keeps its ordinary parts unless its density reads parameters directly (a structured
guide's map, or an error naming the site).
"""

from __future__ import annotations

import torch
from pyro.distributions.score_parts import ScoreParts

from ..distributions import flows
from ..distributions.detached import delta_base, detached_copy, short_walk, verified_params
from ..distributions.split import (
    SplitNotSupported,
    _flow_candidate,
    _sampled_score_parts,
    _stop,
    flatten_transformed,
    split_score_parts,
)
from ..distributions.structured import structured_pathwise
from ..routing import reached, reached_nodes, reaches_leaf_directly

__all__ = ["evaluate_run", "site_pathwise"]


class DeltaDensityError(ValueError):
    """A Delta site whose ``log_density`` depends on the guide's parameters directly."""


class PathwiseParts(ScoreParts):
    """The pathwise parts of a site, as ``score_parts`` (``conditional``: it reads earlier
    samples; the record's unscaled parts keep it, scaled ones are Pyro's ``ScoreParts``)."""

    conditional: bool = True


def _delta_error(name: str) -> DeltaDensityError:
    return DeltaDensityError(
        f"guide site '{name}' is a Delta whose log_density depends on the guide's "
        "parameters directly (as AutoStructured's and AutoGaussian's sites do), so its "
        "pathwise part at a fixed value is not available and dropping the score part would "
        "bias the gradient. Use pyro_gradroute.infer.Trace_ELBO (or pyro.infer.RenyiELBO for "
        "an importance-weighted bound) with this guide, or a guide whose Deltas are "
        "functions of earlier draws only (AutoNormal, AutoMultivariateNormal, ...)."
    )


def site_pathwise(
    name: str, fn, value: torch.Tensor, earlier: list, nodes: dict, preimage=None, tracing=None,
    keep=(),
):  # fmt: skip
    """The pathwise :class:`~pyro.distributions.score_parts.ScoreParts` of one site with a random draw (unscaled).

    ``earlier``: the samples drawn before this one; ``nodes``: the run's samples' autograd
    nodes -> index; ``preimage``: what the handler recorded when it drew the sample (a
    flow's path); ``tracing``: ``torch.jit.is_tracing()`` (computed where not given);
    ``keep``: the family's parameters (``"loc"``, ``"scale"``) whose score part stays (a
    plain family reading no earlier sample only). Returns the parts (detached copy,
    forward-carried flow rule, or the two JIT evaluations), or for a site the split node
    evaluates with the run's others a plain tuple: the indices of the earlier samples it may
    read. Raises ``NotImplementedError`` for a conditional site under the JIT.
    """
    if tracing is None:
        tracing = torch.jit.is_tracing()
    params: list[torch.Tensor] = []
    known = verified_params(fn) if earlier else None  # (a conditional site needs no copy)
    ups = _upstream(known, nodes) if known else ()
    copy = None if ups else detached_copy(fn, value, params, keep)  # None: not a plain family
    if copy is not None and earlier and known is None:
        ups = _upstream(params, nodes)
    if keep and (copy is None or ups):
        raise ValueError(
            f"guide site '{name}': keeping the score part at {sorted(keep)} needs a plain "
            "family whose parameters read no earlier sample"
        )
    if ups:
        if tracing:
            raise _conditional_under_jit(name)
        return tuple(ups)
    if copy is not None:  # (a sample reads none drawn later)
        lp = copy.log_prob(value)
        parts = PathwiseParts(lp, 0, lp)
        parts.conditional = False
        return parts
    if not tracing:
        parts = _flow_pathwise(name, fn, value, earlier, nodes, preimage)
        if parts is not None:
            return parts
    if tracing:
        return _traced(name, fn, value, earlier)
    return tuple(range(len(earlier)))


def _upstream(params: list, nodes: dict) -> list:
    """Indices (sorted) of the earlier samples (``nodes``: node -> index) the parameters read:
    one bounded walk, routing's walker past its limit."""
    hits, roots = set(), []
    for p in params:
        node = p.grad_fn
        if node is not None:
            i = nodes.get(node)
            if i is not None:
                hits.add(i)
            else:
                roots.append(node)
    walk = short_walk(roots, nodes)
    return reached_nodes(params, nodes) if walk is None else sorted(hits | walk[0])


def _conditional_under_jit(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"guide site '{name}': its density depends on earlier guide samples (a "
        "conditional guide), whose pathwise path cannot be kept inside a program traced "
        "by the JIT. Use the non-JIT ELBO (Trace_ELBO, TraceGraph_ELBO, TraceEnum_ELBO) "
        "with stick_the_landing, or pyro_gradroute.infer.TraceSTL_ELBO."
    )


def _flow_pathwise(
    name: str, fn, value: torch.Tensor, earlier: list, nodes: dict, path=None
) -> ScoreParts | None:
    r"""The pathwise parts of an unconditional flow site whose transforms have forward rules
    (:mod:`~pyro_gradroute.distributions.flows`), from its drawn ``path``
    (:class:`~pyro_gradroute.distributions.flows.FlowPath`) or the path in the transforms'
    caches (no node); ``None`` for any other flow (the split node evaluates it)."""
    drawn = isinstance(path, flows.FlowPath) and path.value is value
    if not (drawn and flows.caches_hold(path)):  # (else: the path in the caches, if any)
        flat = flatten_transformed(fn)
        if not _flow_candidate(flat):
            return None
        path = flows.cached_path(flat, value)
        if path is None:
            return None
    if earlier and torch.is_grad_enabled():  # a conditional flow: what its density reads
        stops = {n: i for n, i in nodes.items() if i < len(earlier)}  # (drawn before it)
        if reached_nodes([path.log_prob(), value], stops):
            return None
    try:
        lp = flows.pathwise_log_prob(path)
    except ValueError as e:  # a triangular solve that did not converge, ...: name the site
        raise ValueError(f"Error while computing log_prob at site '{name}':\n{e}") from e
    parts = PathwiseParts(lp, 0, lp)
    parts.conditional = False
    return parts


def _traced(name: str, fn, value: torch.Tensor, earlier: list) -> ScoreParts:
    """For programs traced by the JIT: ``log q(z) - log q(stop(z)) + stop(log q(stop(z)))``, the
    split node's first derivatives; it drops the path through earlier samples (a conditional
    site raises)."""
    full = fn.score_parts(value)
    v = value.detach()
    try:
        score = fn.score_parts(v)
    except AssertionError:  # score_parts that accept only the sampler's own tensor (RSVI)
        try:
            score = _sampled_score_parts(fn, v, value)
        except SplitNotSupported as e:
            raise SplitNotSupported(f"guide site '{name}': {e}") from e
    except (NotImplementedError, KeyError) as e:
        raise SplitNotSupported(
            f"guide site '{name}': {type(fn).__name__}.log_prob cannot be evaluated at a fixed "
            f"sample ({type(e).__name__}: {e}), which a program traced by the JIT needs for the "
            "split (a flow with a transform without an inverse: Planar, Radial, Sylvester, ...). "
            "Use the non-JIT ELBO (Trace_ELBO, TraceGraph_ELBO, TraceEnum_ELBO) with "
            "stick_the_landing, or pyro_gradroute.infer.TraceSTL_ELBO, which carry the "
            "pathwise gradient forward without an inverse."
        ) from e
    if earlier and reached(score.log_prob, earlier):
        raise _conditional_under_jit(name)

    def path(f, s):
        if not (torch.is_tensor(f) and f.requires_grad):
            return _stop(f)
        if not (torch.is_tensor(s) and s.requires_grad):
            return f
        return f - s + s.detach()

    return PathwiseParts(
        path(full.log_prob, score.log_prob),
        full.score_function,
        path(full.entropy_term, score.entropy_term),
    )


class RunSite:
    """One guide site of a run, as :func:`evaluate_run` reads it."""

    __slots__ = (
        "name", "fn", "value", "index", "earlier", "owner", "auxiliary", "preimage", "parts",
        "score", "point",
    )  # fmt: skip

    def __init__(
        self, name, fn, value, index, owner=None, auxiliary=False, preimage=None, earlier=()
    ):
        self.name, self.fn, self.value, self.index = name, fn, value, index
        self.owner, self.auxiliary, self.preimage = owner, auxiliary, preimage
        self.earlier = earlier  # the run's samples (those before this one: ``upstream``)
        self.parts = None  # the pathwise parts (None: the ordinary ones)
        self.score = None  # the split node's evaluated density (what it reads)
        self.point = False  # an AutoStructured "delta" conditional: no density of its own

    @property
    def upstream(self) -> list:
        """The samples drawn before this one (with an autograd node), in draw order."""
        return self.earlier[: self.index]


def evaluate_run(
    sites: list[RunSite], earlier: list, nodes: dict, fallback=None, run=None, keep=None
) -> None:
    """Set each site's ``parts`` (unscaled pathwise :class:`ScoreParts`; None: ordinary).

    ``earlier``: every sample of the run with an autograd node, in draw order; ``nodes``:
    node -> index; a site's ``index`` is how many of them were drawn before it.
    ``fallback(name, error) -> bool``: whether a site that cannot be split takes its
    ordinary parts (else the error is raised, naming the site). ``run``: every site of the
    run (``sites`` are those not evaluated yet), which a structured guide's map reads.
    ``keep``: ``{site name: parameters whose score part stays}`` (:func:`site_pathwise`).
    """
    items: list[tuple[RunSite, tuple]] = []  # (site, upstream indices)
    owners: dict[int, object] = {}
    tracing = torch.jit.is_tracing()
    for s in sites:
        if s.owner is not None:  # a structured guide's Delta: evaluated through its map
            owners[id(s.owner)] = s.owner
            continue
        out = site_pathwise(
            s.name, s.fn, s.value, earlier[: s.index], nodes, s.preimage, tracing,
            keep.get(s.name, ()) if keep else (),
        )  # fmt: skip
        if type(out) is tuple:
            items.append((s, out))
        else:
            s.parts = out
    if items:
        _split(items, earlier, fallback)
    for owner in owners.values():
        _structured(owner, run or sites)
    if items:  # (only a split node's density reads an auxiliary Delta)
        _check_auxiliary_links(run or sites, items, earlier, nodes)


def _split(items, earlier, fallback) -> None:
    """One split node for the sites that need it (conditional, straight-through, own parts, flows)."""

    def on_error(i, err):
        s = items[i][0]
        if fallback is None or not fallback(s.name, err):
            raise SplitNotSupported(f"Guide site '{s.name}': {err}") from err
        full = s.fn.score_parts(s.value)
        return full, ScoreParts(*(_stop(t) for t in full)), None

    args = [(s.fn, s.value, [earlier[i] for i in up], s.preimage) for s, up in items]
    out = split_score_parts(args, on_error=on_error, cut=True, names=[s.name for s, _ in items])
    for (s, _), (full, path, score) in zip(items, out):
        if score is None:  # fallen back: the ordinary parts
            s.parts = None
            continue
        s.parts = PathwiseParts(path.log_prob, full.score_function, path.entropy_term)
        s.score = score


def _structured(owner, sites: list[RunSite]) -> None:
    """Pathwise parts of a structured guide's sites (its auxiliary draws and Deltas)."""
    by_name = {s.name: s for s in sites}
    for name, (lp, point) in structured_pathwise(owner, by_name).items():
        site = by_name[name]
        site.owner, site.point = owner, point
        if lp is not None:
            site.parts = PathwiseParts(lp, 0, lp)


def _check_auxiliary_links(sites: list[RunSite], items, earlier, nodes) -> None:
    """Raise if a site's density reads an auxiliary Delta whose value depends on parameters
    directly: the split would send gradient through that value to parameters of the conditional
    density (part of the score part)."""
    aux = {
        nodes[s.value.grad_fn]: s
        for s in sites
        if s.auxiliary
        and s.owner is None
        and delta_base(s.fn) is not None
        and torch.is_tensor(s.value)
        and s.value.grad_fn in nodes
        and reaches_leaf_directly(
            s.value, stop_nodes={n: i for n, i in nodes.items() if i < s.index}
        )
    }
    if not aux:
        return
    for s, up in items:
        if s.score is None or not s.score.requires_grad:
            continue
        ups = [earlier[i] for i in up]
        for j in reached(s.score, ups):
            w = aux.get(up[j])
            if w is not None:
                raise ValueError(
                    f"guide site '{s.name}' reads the auxiliary Delta site '{w.name}', whose "
                    "value depends on the guide's parameters directly: those parameters are "
                    f"parameters of '{s.name}''s conditional density, whose pathwise part "
                    f"holds them fixed, but the path through '{w.name}''s value would keep "
                    "them (part of the score part, so the estimator would not stick the "
                    f"landing). Compute '{w.name}''s value in the guide without a sample site "
                    "(the split then keeps only the path through the draws it reads), or use "
                    "pyro_gradroute.infer.Trace_ELBO with this guide."
                )
