"""One model/guide trace pair per particle, with the guide's log-densities split once.

:func:`get_split_importance_trace` is :func:`pyro.infer.enum.get_importance_trace`
(``"flat"`` graph), with the guide run under a
:class:`~pyro_gradroute.poutine.split_messenger.SplitMessenger`: each latent guide
site's distribution is a :class:`~pyro_gradroute.poutine.split_distribution.SplitDistribution`,
so Pyro's own ``Trace.compute_score_parts`` computes ``log_prob``, ``log_prob_sum``
and ``score_parts`` (through each distribution's ``score_parts`` hook, so that
``Rejector`` and masked distributions keep Pyro's meaning), every site's density
evaluated once, and the estimators read the pathwise parts with
:func:`site_parts`. The model's log-densities are Pyro's ``compute_log_prob``.
"""

from __future__ import annotations

import contextlib

import torch
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.infer.util import is_validation_enabled
from pyro.poutine.util import prune_subsample_sites
from pyro.util import check_if_enumerated, check_model_guide_match, check_site_shape

from ..poutine._wrapped import WrappedDistribution
from ..poutine.gated_distribution import unwrap_gates
from ..poutine.split_distribution import SplitBatch, SplitDistribution
from ..poutine.split_messenger import SplitMessenger
from ..poutine.stick_the_landing_messenger import PathwiseDistribution

#: the key of a guide trace site under which the handler's record of it is kept
PATHWISE = "pathwise_site"


class _StructuredSite(WrappedDistribution):
    """(The adaptive shim above.)"""

    _own = ("base_dist", "_path")

    def __init__(self, base_dist, path):
        self.base_dist, self._path = base_dist, path
        super().__init__(base_dist.batch_shape, base_dist.event_shape, validate_args=False)

    def log_prob(self, value, *args, **kwargs):
        lp = self.base_dist.log_prob(value, *args, **kwargs)
        path = None if self._path is None else self._path.log_prob
        return lp if not torch.is_tensor(path) else lp + 0.0 * path


def _check_finite(trace: poutine.Trace, role: str) -> None:
    """Raise, naming the site, if a log-density in ``trace`` is NaN (one check when none is)."""
    sites = [s for s in trace.nodes.values() if s["type"] == "sample"]
    if not sites or not torch.isnan(sum(s["log_prob_sum"] for s in sites)):
        return
    site = next(s for s in sites if torch.isnan(s["log_prob_sum"]))
    fn = site["fn"].base_dist if isinstance(site["fn"], SplitDistribution) else site["fn"]
    raise ValueError(
        f"NaN log-density at {role} site '{site['name']}' "
        f"(distribution {type(fn).__name__}). Check the site's parameters "
        "(e.g. a scale that is not positive) and its value; use constrained params "
        "(pyro.param(..., constraint=...)) for parameters with a restricted domain."
    )


def refuse_model_enumeration(elbo, model_trace, guide_trace) -> None:
    """Raise, naming the site, for an enumerated model site the estimator would sample instead."""
    for name, site in model_trace.nodes.items():
        if (
            site["type"] == "sample"
            and site["infer"].get("enumerate")
            and not site["is_observed"]
            and name not in guide_trace.nodes
        ):
            raise ValueError(
                f"model site {name!r} is marked for enumeration, which {type(elbo).__name__} "
                "does not do (it would be sampled from its prior, a different objective): use "
                "pyro.infer.TraceEnum_ELBO with the guide under "
                "pyro_gradroute.poutine.stick_the_landing, or "
                "pyro_gradroute.infer.TraceEnumAdaptiveSTL_ELBO, or remove the enumeration mark"
            )


def site_parts(site):
    """``(full, pathwise)`` :class:`~pyro.distributions.score_parts.ScoreParts` of a guide site, scaled and masked.

    A site the estimator's handler took (its ``score_parts`` are the pathwise ones):
    ``(None, site["score_parts"])``. Any other: ``site["score_parts"]`` and the same parts
    with every gradient stopped.
    """
    full = site["score_parts"]
    if site.get(PATHWISE) is not None:
        return None, full
    if isinstance(site["fn"], SplitDistribution):
        _, path = site["fn"].split_parts(site["value"])
        return full, path.scale_and_mask(site["scale"], site["mask"])
    return full, type(full)(*(t.detach() if torch.is_tensor(t) else t for t in full))


def scaled(site, t):
    """``t`` scaled and masked like ``site``'s log-density."""
    return scale_and_mask(t, site["scale"], site["mask"])


def get_split_importance_trace(
    max_plate_nesting,
    model,
    guide,
    args,
    kwargs,
    replay_values=None,
    needs_split=None,
    fallback=None,
    pathwise=None,
    context=None,
):
    """Run the guide once and the model once against it; split the guide's log-densities.

    :param replay_values: optional ``guide_trace -> trace`` giving the trace whose values
        the model replays (for instance with gradient-scaling nodes on the values, as
        :class:`~pyro_gradroute.infer.TraceDReG_ELBO` needs); default the guide trace.
    :param needs_split: optional ``record -> bool``: the guide sites whose split parts the
        estimator uses (``False``: none, and the guide runs exactly as under Pyro's ELBOs), and ``fallback(record, error) -> bool`` for sites that cannot be
        split, and ``pathwise(record) -> bool`` for the sites whose ``score_parts`` carry
        the pathwise gradient (see :class:`~pyro_gradroute.poutine.split_distribution.SplitBatch`).
    :param context: a messenger the guide runs inside instead of the split (the estimator's
        :class:`~pyro_gradroute.poutine.StickTheLandingMessenger`); the guide trace's sites
        then hold their base distributions, with the parts it computed.
    :returns: ``(model_trace, guide_trace)`` with log-probabilities computed.
    """
    # an estimator that splits no site (needs_split is False) runs the guide as Pyro does
    if context is not None:
        splitting = context
    elif needs_split is not False:
        splitting = SplitMessenger(SplitBatch(needs_split, fallback, pathwise))
    else:
        splitting = contextlib.nullcontext()
    unwrapped_guide = poutine.unwrap(guide)
    if isinstance(unwrapped_guide, poutine.messenger.Messenger):
        if replay_values is not None:
            raise NotImplementedError(
                "GuideMessenger guides are not supported by this estimator with more than "
                "one particle; use a callable guide (e.g. AutoNormal instead of "
                "AutoNormalMessenger)"
            )
        with splitting:
            guide(*args, **kwargs)
        model_trace, guide_trace = unwrapped_guide.get_traces()
    else:
        with splitting:
            guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        replayed = guide_trace if replay_values is None else replay_values(guide_trace)
        model_trace = poutine.trace(poutine.replay(model, trace=replayed)).get_trace(
            *args, **kwargs
        )
    validate = is_validation_enabled()
    if validate:
        check_if_enumerated(guide_trace)  # enumerated guide sites need TraceEnum_ELBO
        check_model_guide_match(model_trace, guide_trace, max_plate_nesting)
    guide_trace = prune_subsample_sites(guide_trace)
    model_trace = prune_subsample_sites(model_trace)
    unwrap_gates(model_trace)  # block_grad routes go to the routing engine, not the gates
    unwrap_gates(guide_trace)
    guide_trace.compute_score_parts()  # the guide first: a NaN there is named as such
    if context is not None:  # the parts are computed: the sites hold their base distributions
        for site in guide_trace.nodes.values():
            if site["type"] == "sample":
                fn = site["fn"]
                if type(fn) is not PathwiseDistribution:
                    continue
                site[PATHWISE] = fn._site  # the site as the handler saw it (upstream, owner, ...)
                rec = fn._site
                if rec is not None and rec.owner is not None:
                    # (a private shim for trace_adaptive_elbo._filled_score, which reads a
                    # site's score part as its full density less its pathwise one: a
                    # structured guide's site is no Delta there, and its full density
                    # carries the graph even where its value reads no parameter)
                    site["fn"] = _StructuredSite(fn.base_dist, rec.parts)
                else:
                    site["fn"] = fn.base_dist
    if validate:
        _check_finite(guide_trace, "guide")
    model_trace.compute_log_prob()
    if validate:
        _check_finite(model_trace, "model")
        for trace in (model_trace, guide_trace):
            for site in trace.nodes.values():
                if site["type"] == "sample":
                    check_site_shape(site, max_plate_nesting)
    return model_trace, guide_trace
