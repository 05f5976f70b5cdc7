"""One model/guide trace pair per particle: Pyro's ``get_importance_trace`` (``"flat"`` graph).

The guide may run inside a messenger (the estimators' own
:class:`~pyro_gradroute.poutine.StickTheLandingMessenger`), whose sites' ``score_parts``
then carry the pathwise gradient; the trace's sites hold their base distributions and,
under :data:`PATHWISE`, the handler's record of each. The model's log-densities are Pyro's
``compute_log_prob``.
"""

from __future__ import annotations

import contextlib

import torch
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.infer.util import is_validation_enabled
from pyro.poutine.util import prune_subsample_sites
from pyro.util import check_if_enumerated, check_model_guide_match, check_site_shape

from ..poutine.gated_distribution import unwrap_gates
from ..poutine.stick_the_landing_messenger import PathwiseDistribution

#: the key of a guide trace site under which the handler's record of it is kept
PATHWISE = "pathwise_site"


def _check_finite(trace: poutine.Trace, role: str) -> None:
    """Raise, naming the site, if a log-density in ``trace`` is NaN (one check when none is)."""
    sites = [s for s in trace.nodes.values() if s["type"] == "sample"]
    if not sites or not torch.isnan(sum(s["log_prob_sum"] for s in sites)):
        return
    site = next(s for s in sites if torch.isnan(s["log_prob_sum"]))
    fn = site["fn"]
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
    context=None,
):
    """Run the guide once (inside ``context``, if given) and the model once against it.

    :param replay_values: optional ``guide_trace -> trace`` giving the trace whose values
        the model replays (for instance with gradient-scaling nodes on the values, as
        :class:`~pyro_gradroute.infer.TraceDReG_ELBO` needs); default the guide trace.
    :param context: a messenger the guide runs inside (the estimator's
        :class:`~pyro_gradroute.poutine.StickTheLandingMessenger`); the guide trace's sites
        then hold their base distributions, with the parts it computed.
    :returns: ``(model_trace, guide_trace)`` with log-probabilities computed.
    """
    # without a context the guide runs as under Pyro's estimators
    splitting = context if context is not None else contextlib.nullcontext()
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
