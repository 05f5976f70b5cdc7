"""The trace-pair machinery of this package's ELBOs (:class:`RoutedELBO`): one model/guide trace
pair per particle, named surrogate terms, ``block_grad`` routes."""

from __future__ import annotations

import contextlib
from collections.abc import Hashable

import torch
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.infer.elbo import ELBO
from pyro.infer.util import is_validation_enabled, torch_item
from pyro.poutine.util import prune_subsample_sites
from pyro.util import check_if_enumerated, check_model_guide_match, check_site_shape, warn_if_nan

from .. import routing
from .._validation import check_int
from ..poutine.block_grad_messenger import SPECS_KEY, GatedDistribution, collect_blocks
from ..poutine.stick_the_landing_messenger import PathwiseDistribution

__all__ = ["RoutedELBO", "collect_blocks", "get_split_importance_trace", "name_nan"]

Terms = dict[Hashable, torch.Tensor]

#: the key under which ``_particle_terms`` may return a per-particle record that is not a term
EXTRA = ("__extra__",)

#: the key of a guide trace site under which the handler's record of it is kept
PATHWISE = "pathwise_site"


def add_term(terms: Terms, key: Hashable, value) -> None:
    """Add ``value`` to ``terms[key]`` (creating it), skipping non-differentiable values."""
    if not (torch.is_tensor(value) and value.requires_grad):
        return
    terms[key] = terms[key] + value if key in terms else value


def _joint_blocks(terms: Terms, blocks: dict) -> dict:
    """Blocks of the terms keyed ``("reinforce", cost key, score key)``: the union of both sites'."""
    joint = {}
    for key in terms:
        if isinstance(key, tuple) and len(key) == 3 and key[0] == "reinforce":
            merged = {**blocks.get(key[1], {}), **blocks.get(key[2], {})}
            if merged:
                joint[key] = merged
    return {**blocks, **joint} if joint else blocks


def name_nan(guide_trace: poutine.Trace, model_trace: poutine.Trace | None = None) -> None:
    """Raise, naming the site (a guide site first), if a log-density in the traces is NaN.

    Called where a particle's float ELBO is NaN (which a NaN log-density makes it), or where
    the model's log-densities failed (a NaN guide sample is outside a model site's support),
    so that a step without a NaN checks nothing; with Pyro's validation only, as its other
    checks.
    """
    if not is_validation_enabled():
        return
    for role, trace in (("guide", guide_trace), ("model", model_trace)):
        for site in trace.nodes.values() if trace is not None else ():
            if site["type"] == "sample" and torch.isnan(site["log_prob_sum"]):
                raise ValueError(
                    f"NaN log-density at {role} site '{site['name']}' "
                    f"(distribution {type(site['fn']).__name__}). Check the site's parameters "
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


def pathwise_log_prob(site):
    """A guide site's scaled and masked pathwise ``log_prob``: its ``score_parts``' where the
    estimator's handler took the site, else that with its gradient stopped."""
    lp = site["score_parts"].log_prob
    return lp.detach() if site.get(PATHWISE) is None and torch.is_tensor(lp) else lp


def scaled(site, t):
    """``t`` scaled and masked like ``site``'s log-density."""
    return scale_and_mask(t, site["scale"], site["mask"])


def get_split_importance_trace(
    max_plate_nesting, model, guide, args, kwargs, replay_values=None, context=None
):
    """Pyro's ``get_importance_trace``: the guide once (inside ``context``), the model once against it.

    :param replay_values: optional ``guide_trace -> trace`` whose values the model replays
        (:class:`~pyro_gradroute.infer.TraceDReG_ELBO`'s gradient-scaling nodes); default
        the guide trace.
    :param context: a messenger the guide runs inside (the estimator's
        :class:`~pyro_gradroute.poutine.StickTheLandingMessenger`); its sites then hold their
        base distributions, and under :data:`PATHWISE` the handler's record of each.
    :returns: ``(model_trace, guide_trace)`` with log-probabilities computed; ``block_grad``
        gates unwrapped (their specs under the sites' ``block_grad_specs`` key).
    """
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
    for trace in (model_trace, guide_trace):  # routes go to the routing engine, not the gates
        for site in trace.nodes.values():
            if site["type"] == "sample" and type(site["fn"]) is GatedDistribution:
                site[SPECS_KEY], site["fn"] = site["fn"].specs, site["fn"].base_dist
    guide_trace.compute_score_parts()
    if context is not None:  # the parts are computed: the sites hold their base distributions
        for site in guide_trace.nodes.values():
            if site["type"] == "sample" and type(site["fn"]) is PathwiseDistribution:
                site[PATHWISE] = site["fn"]._site  # the site as the handler saw it
                site["fn"] = site["fn"].base_dist
    try:
        model_trace.compute_log_prob()
    except ValueError:  # (a NaN guide sample is outside the model site's support)
        name_nan(guide_trace)
        raise
    if validate:
        for trace in (model_trace, guide_trace):
            for site in trace.nodes.values():
                if site["type"] == "sample":
                    check_site_shape(site, max_plate_nesting)
    return model_trace, guide_trace


class RoutedELBO(ELBO):
    """Base class: subclasses implement :meth:`_particle_terms`.

    ``_particle_terms(model_trace, guide_trace, blocks) -> (elbo: float, terms: dict)``
    returns one particle's ELBO estimate and its named surrogate-ELBO terms
    (to be *maximized*); ``blocks`` are the trace pair's ``block_grad`` routes (term
    key -> blocked parameters), which an estimator may use to split a term further.
    With vectorized particles the trace pair holds all particles, summed; the base
    class divides by :meth:`_particle_divisor` (``num_particles``) in both cases.
    Estimators whose terms already combine the particles (importance-weighted
    bounds) return 1 there.

    Pyro's extension hook is honoured: a subclass that overrides
    ``_differentiable_loss_particle(model_trace, guide_trace) -> (loss, surrogate_loss)``
    (as ``pyro.contrib.cevae.TraceCausalEffect_ELBO`` does) is used as such; its
    default here is built from the terms. Routes cannot be applied to such an opaque
    surrogate: with ``block_grad`` marks present that combination raises.

    Takes :class:`pyro.infer.ELBO`'s arguments; ``num_particles`` must be an integer >= 1
    (else an error naming it, before any work: 0 particles would give a loss of 0.0 and
    no gradient).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_particles = check_int(
            self.num_particles, "num_particles", type(self).__name__, minimum=1
        )

    def _particle_divisor(self) -> int:
        return self.num_particles

    def _get_trace(self, model, guide, args, kwargs):
        return get_split_importance_trace(self.max_plate_nesting, model, guide, args, kwargs)

    def _particle_terms(self, model_trace, guide_trace, blocks=None) -> tuple[float, Terms]:
        raise NotImplementedError

    def _differentiable_loss_particle(self, model_trace, guide_trace):
        """Pyro's hook: ``(loss, surrogate_loss)`` of one trace pair (no routes)."""
        elbo, terms = self._particle_terms(model_trace, guide_trace, {})
        terms.pop(EXTRA, None)
        return -elbo, -sum(terms.values())

    def _iter_particles(self, model, guide, args, kwargs):
        """Yield ``(elbo, terms, blocks, trainable, extra)`` per trace, divided by
        :meth:`_particle_divisor` (``trainable``: the traces hold a ``param`` site; Pyro skips
        the backward otherwise; ``extra``: what ``_particle_terms`` returned under the key
        :data:`EXTRA`, an estimator's per-particle record passed as a value)."""
        n = self._particle_divisor()
        hook = (
            type(self)._differentiable_loss_particle is not RoutedELBO._differentiable_loss_particle
        )
        for model_trace, guide_trace in self._get_traces(model, guide, args, kwargs):
            trainable = marked = False
            for trace in (model_trace, guide_trace):
                for site in trace.nodes.values():
                    if site["type"] == "param":
                        trainable = True
                    elif site["type"] == "sample" and (
                        SPECS_KEY in site or type(site["fn"]) is GatedDistribution
                    ):
                        marked = True
            blocks = collect_blocks(model_trace, guide_trace) if marked else {}
            if hook:
                if blocks:
                    raise NotImplementedError(
                        f"{type(self).__name__} overrides _differentiable_loss_particle, whose "
                        "surrogate is a single tensor: block_grad routes cannot be applied to it. "
                        "Remove the block_grad marks, or express the estimator as terms "
                        "(override _particle_terms)."
                    )
                loss, surrogate = self._differentiable_loss_particle(model_trace, guide_trace)
                elbo, terms = -torch_item(loss), {("surrogate",): -surrogate}
            else:
                elbo, terms = self._particle_terms(model_trace, guide_trace, blocks)
                if blocks:
                    blocks = _joint_blocks(terms, blocks)
            if elbo != elbo:  # NaN: a NaN log-density is named
                name_nan(guide_trace, model_trace)
            extra = terms.pop(EXTRA, None)
            terms = {k: v for k, v in terms.items() if torch.is_tensor(v) and v.requires_grad}
            if n > 1:
                terms = {k: v / n for k, v in terms.items()}
            yield elbo / n, terms, blocks, trainable, extra

    def loss(self, model, guide, *args, **kwargs) -> float:
        """Estimate of the negative ELBO (a float; no gradients)."""
        with torch.no_grad():
            loss = -sum(e for e, *_ in self._iter_particles(model, guide, args, kwargs))
        warn_if_nan(loss, "loss")
        return loss

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """Negative ELBO whose gradient is the estimator.

        ``block_grad`` routes are honoured by passing each blocked term through
        :func:`pyro_gradroute.routing.gate` (exact; slower than :meth:`loss_and_grads`,
        which SVI calls and which uses the routing engine's pruned passes).
        """
        loss, surrogate = 0.0, None
        for elbo, terms, blocks, *_ in self._iter_particles(model, guide, args, kwargs):
            terms = {k: routing.gate(v, blocks[k]) if k in blocks else v for k, v in terms.items()}
            loss = loss - elbo
            for v in terms.values():
                surrogate = -v if surrogate is None else surrogate - v
        if surrogate is None:
            return torch.tensor(loss)
        warn_if_nan(surrogate, "loss")
        return loss + (surrogate - surrogate.detach())

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        """Negative ELBO as a float; accumulates the (routed) estimator into ``.grad``."""
        loss = 0.0
        for elbo, terms, blocks, trainable, _ in self._iter_particles(model, guide, args, kwargs):
            loss -= elbo
            if not (terms and trainable):  # as Pyro: no param site, no backward
                continue
            if not blocks:  # no routes: one plain backward of the whole surrogate
                (-sum(terms.values())).backward(retain_graph=self.retain_graph)
                continue
            neg = {k: -v for k, v in terms.items()}  # strict=False: a marked site may lack a term
            routing.backward(neg, block=blocks, retain_graph=self.retain_graph, strict=False)
        warn_if_nan(loss, "loss")
        return loss
