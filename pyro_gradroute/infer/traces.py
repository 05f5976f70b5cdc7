"""One model/guide trace pair per particle, with the guide's log-densities split once.

This is :func:`pyro.infer.enum.get_importance_trace` (``"flat"`` graph) except that
each guide sample site's log-density is computed by
:func:`~pyro_gradroute.distributions.split_log_prob`, so the site carries
``site["split"]`` (scaled and masked ``log_prob``, ``score``, ``pathwise``) in
addition to Pyro's usual ``log_prob``, ``log_prob_sum`` and ``score_parts``. The
guide's log-density is evaluated once per site; the model's with Pyro's own
``compute_log_prob``.
"""

from __future__ import annotations

import torch
from pyro import poutine
from pyro.distributions.score_parts import ScoreParts
from pyro.infer.util import is_validation_enabled
from pyro.poutine.util import prune_subsample_sites
from pyro.util import check_if_enumerated, check_model_guide_match, check_site_shape

from ..distributions.split import SplitLogProb, SplitNotSupported, is_delta, split_log_probs
from ..poutine.gated_distribution import unwrap_gates


def _check_finite(trace: poutine.Trace, role: str) -> None:
    """Raise, naming the site, if a log-density in ``trace`` is NaN (one check when none is)."""
    sites = [s for s in trace.nodes.values() if s["type"] == "sample"]
    if not sites or not torch.isnan(sum(s["log_prob_sum"] for s in sites)):
        return
    site = next(s for s in sites if torch.isnan(s["log_prob_sum"]))
    raise ValueError(
        f"NaN log-density at {role} site '{site['name']}' "
        f"(distribution {type(site['fn']).__name__}). Check the site's parameters "
        "(e.g. a scale that is not positive) and its value; use constrained params "
        "(pyro.param(..., constraint=...)) for parameters with a restricted domain."
    )


def trace_log_prob(trace: poutine.Trace, site) -> torch.Tensor:
    """``site["fn"].log_prob(site["value"])``, with Pyro's error message naming the site."""
    try:
        return site["fn"].log_prob(site["value"], *site["args"], **site["kwargs"])
    except ValueError as e:
        raise ValueError(
            f"Error while computing log_prob at site '{site['name']}':\n{e}\n"
            f"{trace.format_shapes(last_site=site['name'])}"
        ) from e


def compute_split_log_prob(trace: poutine.Trace, needs_split=None, fallback=None) -> None:
    """Fill ``split``, ``log_prob``, ``log_prob_sum`` and ``score_parts`` of every sample site.

    ``split.pathwise`` keeps the path through earlier reparameterized samples that the
    site's distribution depends on (``log q(z_2 | z_1; stop(phi))`` for a conditional
    guide), so pathwise-only estimators stay unbiased for structured guides.
    ``needs_split(site) -> bool`` (default: every site) picks the sites whose parts the
    estimator uses; the others get one ordinary evaluation (``site["split"]`` then holds
    ``log_prob`` three times). ``fallback(site, error) -> bool`` decides what happens
    when a site's distribution cannot be split (:class:`SplitNotSupported`, e.g. a flow
    without an inverse): ``True`` evaluates it the ordinary way instead, otherwise the
    error is raised, naming the site.
    ``score_parts`` follows Pyro's convention: reparameterized sites get
    ``(log_prob, 0, log_prob)``, others ``(log_prob, score, 0)`` (the score-function
    part is neither scaled nor masked, as in Pyro).
    """
    sites = [s for s in trace.nodes.values() if s["type"] == "sample" and "split" not in s]
    upstream, random_values = {}, []  # earlier reparameterized, non-Delta samples
    for site in sites:
        upstream[site["name"]] = list(random_values)
        if site["value"].requires_grad and not is_delta(site["fn"]):
            random_values.append(site["value"])
    split_sites = [s for s in sites if needs_split is None or needs_split(s)]
    while True:
        try:
            all_parts = split_log_probs([(s["fn"], s["value"], upstream[s["name"]]) for s in split_sites])
            break
        except ValueError as e:
            name = split_sites[getattr(e, "split_index", 0)]["name"]
            raise ValueError(
                f"Error while computing log_prob at site '{name}':\n{e}\n"
                f"{trace.format_shapes(last_site=name)}"
            ) from e
        except SplitNotSupported as e:
            site = split_sites[e.split_index]  # type: ignore[attr-defined]
            if fallback is None or not fallback(site, e):
                raise SplitNotSupported(f"Guide site '{site['name']}': {e}") from e
            split_sites.remove(site)
    split_parts = {s["name"]: p for s, p in zip(split_sites, all_parts)}
    for site in sites:
        if site["name"] in split_parts:
            parts = split_parts[site["name"]]
        else:  # an ordinary evaluation, as Pyro's: the estimator uses no split part here
            lp = trace_log_prob(trace, site)
            parts = SplitLogProb(lp, lp, lp)
        site["unscaled_log_prob"] = parts.log_prob
        scaled = parts.scale_and_mask(site["scale"], site["mask"])
        site["split"] = scaled
        site["log_prob"] = scaled.log_prob
        site["log_prob_sum"] = scaled.log_prob.sum()
        if getattr(site["fn"], "has_rsample", False):
            site["score_parts"] = ScoreParts(scaled.log_prob, 0, scaled.log_prob)
        else:
            site["score_parts"] = ScoreParts(scaled.log_prob, parts.score, 0)


def get_split_importance_trace(
    max_plate_nesting, model, guide, args, kwargs, replay_values=None, needs_split=None, fallback=None
):
    """Run the guide once and the model once against it; split the guide's log-densities.

    :param replay_values: optional ``guide_trace -> trace`` giving the trace whose values
        the model replays (for instance with gradient-scaling gates on the values, as
        :class:`~pyro_gradroute.infer.TraceDReG_ELBO` needs); default the guide trace.
    :param needs_split: optional ``site -> bool``: the guide sites whose split parts the
        estimator uses, and ``fallback(site, error) -> bool`` for sites that cannot be
        split (see :func:`compute_split_log_prob`).
    :returns: ``(model_trace, guide_trace)`` with log-probabilities computed.
    """
    unwrapped_guide = poutine.unwrap(guide)
    if isinstance(unwrapped_guide, poutine.messenger.Messenger):
        if replay_values is not None:
            raise NotImplementedError(
                "GuideMessenger guides are not supported by this estimator; use a callable guide"
            )
        guide(*args, **kwargs)
        model_trace, guide_trace = unwrapped_guide.get_traces()
    else:
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
    compute_split_log_prob(guide_trace, needs_split, fallback)  # the guide first: a NaN there is named as such
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
