r"""The pathwise parts of a guide's sites, from Pyro's plain guide trace.

Sticking the landing replaces each reparameterized guide site's ``score_parts`` by
its pathwise part :math:`\log q(z; \bot(\phi))`, the ordinary value with the direct
dependence on the parameters stopped. The cheapest exact mechanism is chosen per site:

* a plain family whose parameters are not computed from earlier samples: one
  evaluation of a detached copy at the live sample
  (:func:`~pyro_gradroute.distributions.detached.detached_copy`); no custom node;
* plain families whose parameters read earlier samples :math:`u` (conditional sites
  :math:`q(z_2 \mid z_1)`): one split node for all of them
  (:func:`~pyro_gradroute.distributions.split.split_score_parts`), which also sends the
  partials :math:`\partial \log q / \partial u` to the samples read. The samples read
  are found by walking the parameters' graph, stopping at earlier samples. Where they
  are computed from each other (chains :math:`q(z_t \mid z_{t-1})`, dense DAGs) the
  product stops the gradient below each sample while it is taken, as relays would
  (:func:`conditional_pathwise`);
* a flow (a ``TransformedDistribution`` with parametrized transforms, each with a forward
  rule) whose density and sample read no earlier sample: its gradient
  :math:`\nabla_{x_k} \log q` carried forward through the path in the transforms'
  caches, sent to the sample's path as :math:`\langle \bot(g), x_k \rangle` in a plain
  expression (:func:`flow_pathwise`); no custom node;
* anything else (conditional flows, flows without a cached path or a rule, families with
  their own ``score_parts``, straight-through samples, Delta sites whose density depends
  on parameters directly): the general split with relays
  (:class:`~pyro_gradroute.poutine.split_messenger.SplitMessenger`).
  :func:`pathwise_score_parts` then answers ``None`` and the caller runs the guide that
  way instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from pyro.distributions.score_parts import ScoreParts
from pyro.poutine.util import site_is_subsample

from ..distributions import flows
from ..distributions.detached import delta_base, detached_copy
from ..distributions.split import (
    SplitNotSupported,
    _flow_candidate,
    flatten_transformed,
    split_score_parts,
)
from ..routing import reached_nodes, reaches_leaf_directly

__all__ = ["frontier", "latent_site", "pathwise_score_parts", "site_pathwise"]


def latent_site(site: dict) -> bool:
    """A guide sample site with a random draw of its own (not observed, subsample or enumerated)."""
    return (
        site["type"] == "sample"
        and not site["is_observed"]
        and not site_is_subsample(site)
        and not site["infer"].get("enumerate")
    )


def frontier(tensors: list[torch.Tensor], earlier: dict) -> list[int]:
    """Indices (in ``earlier``: autograd node -> index) of the earlier samples ``tensors`` read.

    The walk stops at those samples' nodes: a sample read only through another one is not
    listed.

    Example::

        >>> import torch
        >>> phi = torch.tensor(0.5, requires_grad=True)
        >>> z0 = phi * 2.0
        >>> z1 = z0 + 1.0  # computed from z0
        >>> loc = 3.0 * z1 + phi
        >>> frontier([loc], {z0.grad_fn: 0, z1.grad_fn: 1})  # loc reads z1 (and z0 only through it)
        [1]
    """
    return reached_nodes(tensors, earlier)


class NeedsGeneralSplit(Exception):
    """A site whose pathwise part needs the general split (relays and forward-carried rules)."""


class Conditional(NamedTuple):
    """A site whose parameters read earlier samples: evaluated with the others, in one node."""

    name: str
    fn: object
    value: torch.Tensor
    upstream: tuple[int, ...]  # indices of the earlier samples it reads


def site_pathwise(
    name: str,
    fn,
    value: torch.Tensor,
    earlier: list[torch.Tensor],
    nodes: dict,
    check_only: bool = False,
):
    """The pathwise :class:`~pyro.distributions.score_parts.ScoreParts` of one site (unscaled).

    ``None``: the site needs no split (a Delta computed from earlier draws: its ordinary
    parts are all pathwise). A :class:`Conditional`: the site reads earlier samples, and
    :func:`conditional_pathwise` evaluates it. Raises :class:`NeedsGeneralSplit` where the
    general split is needed. ``check_only``: the classification only (a flow's parts then
    carry no gradient: its rules are not run, so the sample's graph may have been freed).
    """
    d = delta_base(fn)
    if d is not None:
        ld = d.log_density
        if torch.is_tensor(ld) and ld.requires_grad and reaches_leaf_directly(ld, stop_nodes=nodes):
            raise NeedsGeneralSplit(name)
        return None
    if hasattr(value, "_unquantize"):  # straight-through: the density is at the relaxed value
        raise NeedsGeneralSplit(name)
    params: list[torch.Tensor] = []
    copy = detached_copy(fn, value, params)  # None where fn is not a plain family
    if copy is None:
        return flow_pathwise(name, fn, value, nodes, check_only)
    if params and not value.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"guide site '{name}': its value does not depend on its distribution's parameters, "
            "so it was not drawn by that distribution (another handler, e.g. poutine.replay "
            "or poutine.condition around the guide, replaced it). Sticking the landing needs "
            "the sample the guide drew; remove that handler, or mark the site "
            "infer={'stl': False} to give it the ordinary gradient."
        )
    ups = frontier(params, nodes)
    if not ups:
        lp = copy.log_prob(value)
        parts = PathwiseParts(lp, 0, lp)
        parts.conditional = False
        return parts
    if torch.jit.is_tracing():
        raise NotImplementedError(
            f"guide site '{name}': its density depends on earlier guide samples (a "
            "conditional guide), whose pathwise path cannot be kept inside a program traced "
            "by the JIT. Use the non-JIT ELBO (Trace_ELBO, TraceGraph_ELBO, TraceEnum_ELBO) "
            "with stick_the_landing, or pyro_gradroute.infer.TraceSTL_ELBO."
        )
    return Conditional(name, fn, value, tuple(ups))


def flow_pathwise(
    name: str, fn, value: torch.Tensor, nodes: dict, check_only: bool = False
) -> ScoreParts:
    r"""The pathwise parts of an unconditional flow site, from its transforms' caches (no custom node).

    ``fn`` is a ``TransformedDistribution`` with parametrized transforms, each up to the
    last parametrized one with a forward rule (:mod:`~pyro_gradroute.distributions.flows`),
    and ``value`` its sample with the path in the caches. Its parts are
    :func:`~pyro_gradroute.distributions.flows.pathwise_log_prob`: the ordinary value,
    the forward-carried gradient :math:`g = \nabla_{x_k} \log q` sent to the sample's
    path only. Raises :class:`NeedsGeneralSplit` for any other flow: without a cached
    path (a value another handler supplied, an uncached transform, a transform called
    again since), a transform without a rule, one whose density or sample reads an
    earlier sample (a conditional flow: the general split keeps that path), or under the
    JIT.
    """
    if torch.jit.is_tracing():
        raise NeedsGeneralSplit(name)
    flat = flatten_transformed(fn)
    if not _flow_candidate(flat):
        raise NeedsGeneralSplit(name)
    path = flows.cached_path(flat, value)
    if path is None:
        raise NeedsGeneralSplit(name)
    if nodes and torch.is_grad_enabled():  # a conditional flow: what its density reads
        if value.grad_fn in nodes:  # the site's own sample (the handler lists its run's samples)
            nodes = {n: i for n, i in nodes.items() if n is not value.grad_fn}
        if frontier([path.log_prob(), value], nodes):
            raise NeedsGeneralSplit(name)
    if check_only:  # (the value only: no rule runs)
        with torch.no_grad():
            lp = path.log_prob()
    else:
        try:
            lp = flows.pathwise_log_prob(path)
        except ValueError as e:  # a triangular solve that did not converge, ...: name the site
            raise ValueError(f"Error while computing log_prob at site '{name}':\n{e}") from e
    parts = PathwiseParts(lp, 0, lp)
    parts.conditional, parts.flow = False, True
    return parts


def conditional_pathwise(items: list[Conditional], earlier: list[torch.Tensor]) -> list[ScoreParts]:
    r"""The pathwise parts of conditional sites, from one split node (no relays).

    The node sends each site's partials :math:`\partial \log q / \partial u` to the
    samples :math:`u` it reads, in one product for all of them. Where the samples read
    are computed from each other (chains :math:`q(z_t \mid z_{t-1})`, dense DAGs) the
    product stops the gradient below each one while it is taken (a backward pre-hook on
    its autograd node), so that each gets its partial derivative, exactly as the general
    split's relays do.
    """
    try:
        out = split_score_parts(
            [(it.fn, it.value, [earlier[i] for i in it.upstream], None) for it in items], cut=True
        )
    except SplitNotSupported as e:
        raise NeedsGeneralSplit(items[0].name) from e
    return [path for _, path, _ in out]


def pathwise_score_parts(
    guide_trace, uses_pathwise: Callable[[dict], bool]
) -> dict[str, ScoreParts] | None:
    """``{site: pathwise ScoreParts, unscaled}`` for the guide sites that take only their pathwise gradient.

    ``None`` if some site needs the general split (see the module docstring).

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro import poutine
        >>> def guide():
        ...     m = pyro.param("m", torch.tensor(0.2))
        ...     z = pyro.sample("z", dist.Normal(m, 1.0))
        ...     pyro.sample("w", dist.Normal(z, 0.5))  # conditional: reads z
        >>> pyro.clear_param_store()
        >>> tr = poutine.trace(guide).get_trace()
        >>> parts = pathwise_score_parts(tr, lambda site: True)
        >>> lp = parts["z"].log_prob
        >>> bool(torch.allclose(lp, tr.nodes["z"]["fn"].log_prob(tr.nodes["z"]["value"])))
        True
        >>> (g,) = torch.autograd.grad(lp, pyro.param("m").unconstrained())
        >>> z = tr.nodes["z"]["value"].detach()
        >>> bool(torch.allclose(g, -(z - 0.2)))  # pathwise: d/dm log q(m + eps; stop(m)) = -eps
        True
    """
    out: dict[str, ScoreParts] = {}
    conditional: list[Conditional] = []
    earlier: list[torch.Tensor] = []
    nodes: dict = {}
    try:
        for name, site in guide_trace.nodes.items():
            if not latent_site(site):
                continue
            value = site["value"]
            if uses_pathwise(site) and torch.is_tensor(value):
                if (
                    site["infer"].get("is_auxiliary")
                    and delta_base(site["fn"]) is not None
                    and value.requires_grad
                    and reaches_leaf_directly(value, stop_nodes=nodes)
                ):
                    # an auxiliary Delta computed from parameters: the general split checks it
                    return None
                parts = site_pathwise(name, site["fn"], value, earlier, nodes)
                if isinstance(parts, Conditional):
                    conditional.append(parts)
                elif parts is not None:
                    out[name] = parts
            if torch.is_tensor(value) and value.grad_fn is not None:
                nodes[value.grad_fn] = len(earlier)
                earlier.append(value)
        if conditional:
            for it, parts in zip(conditional, conditional_pathwise(conditional, earlier)):
                out[it.name] = parts
    except NeedsGeneralSplit:
        return None
    return out


class PathwiseParts(ScoreParts):
    """The pathwise parts of a site, as ``score_parts`` (``conditional``: the site reads earlier
    samples; ``flow``: a flow's, from its forward-carried gradient)."""

    conditional: bool = True
    flow: bool = False


def fill_score_parts(guide_trace, parts: dict[str, ScoreParts]) -> None:
    """Set the sites' ``score_parts`` (and ``log_prob``...) as ``Trace.compute_score_parts`` would."""
    for name, p in parts.items():
        site = guide_trace.nodes[name]
        site["unscaled_log_prob"] = p.log_prob
        conditional = getattr(p, "conditional", True)
        p = PathwiseParts(*p.scale_and_mask(site["scale"], site["mask"]))
        p.conditional = conditional
        site["score_parts"] = p
        site["log_prob"] = p.log_prob
        site["log_prob_sum"] = p.log_prob.sum()
