"""Shared machinery of this package's ELBOs: named surrogate terms, one trace pass per particle.

Every ELBO here builds, from one model/guide trace pair per particle, a dict of
named scalar *surrogate terms* whose sum is the surrogate ELBO (the quantity whose
gradient is the estimator) and a float ELBO estimate. Terms are keyed
``("model", site)``, ``("guide", site)`` or ``(kind, ...)`` for estimator-specific
terms. Keeping the terms separate lets :func:`pyro_gradroute.routing.backward`
honour :class:`~pyro_gradroute.poutine.block_grad` routes (a blocked site's terms
must not reach the blocked parameters) at the cost of pruned extra backward
passes only where routes exist.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from pyro.infer.elbo import ELBO
from pyro.infer.util import torch_item
from pyro.util import warn_if_nan

from .. import routing
from .._validation import check_int
from ..poutine.collect import collect_blocks as _collect
from .traces import get_split_importance_trace

Terms = dict[Hashable, torch.Tensor]

#: the key under which ``_particle_terms`` may return a per-particle record that is not a term
EXTRA = ("__extra__",)


def add_term(terms: Terms, key: Hashable, value) -> None:
    """Add ``value`` to ``terms[key]`` (creating it), skipping non-differentiable values."""
    if not (torch.is_tensor(value) and value.requires_grad):
        return
    terms[key] = terms[key] + value if key in terms else value


def collect_blocks(model_trace, guide_trace) -> dict:
    """Term key -> parameters the term must not reach, from ``block_grad`` marks in the traces."""
    return _collect(model_trace, guide_trace)


def _joint_blocks(terms: Terms, blocks: dict) -> dict:
    """Blocks of the terms keyed ``("reinforce", cost key, score key)``: the union of both sites'."""
    joint = {}
    for key in terms:
        if isinstance(key, tuple) and len(key) == 3 and key[0] == "reinforce":
            merged = {**blocks.get(key[1], {}), **blocks.get(key[2], {})}
            if merged:
                joint[key] = merged
    return {**blocks, **joint} if joint else blocks


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
        surrogate = sum(terms.values()) if terms else 0.0
        return -elbo, -surrogate

    def _hook_overridden(self) -> bool:
        return (
            type(self)._differentiable_loss_particle is not RoutedELBO._differentiable_loss_particle
        )

    def _iter_particles(self, model, guide, args, kwargs):
        """Yield ``(elbo, terms, blocks, trainable)`` per trace, divided by :meth:`_particle_divisor`.

        (A vectorized trace holds all particles, summed: it is divided likewise.)
        ``trainable``: whether the traces hold a ``param`` site (Pyro skips the
        backward pass otherwise).
        """
        for elbo, terms, blocks, trainable, _ in self._iter_particle_items(
            model, guide, args, kwargs
        ):
            yield elbo, terms, blocks, trainable

    def _iter_particle_items(self, model, guide, args, kwargs):
        """:meth:`_iter_particles` with a fifth element: what ``_particle_terms`` returned
        under the key :data:`EXTRA` (an estimator's per-particle record, passed as a value)."""
        n = self._particle_divisor()
        hook = self._hook_overridden()
        for model_trace, guide_trace in self._get_traces(model, guide, args, kwargs):
            blocks = collect_blocks(model_trace, guide_trace)
            trainable = any(
                site["type"] == "param"
                for t in (model_trace, guide_trace)
                for site in t.nodes.values()
            )
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
                blocks = _joint_blocks(terms, blocks)
            extra = terms.pop(EXTRA, None)
            terms = {k: v for k, v in terms.items() if torch.is_tensor(v) and v.requires_grad}
            if n > 1:
                terms = {k: v / n for k, v in terms.items()}
            yield elbo / n, terms, blocks, trainable, extra

    def loss(self, model, guide, *args, **kwargs) -> float:
        """Estimate of the negative ELBO (a float; no gradients)."""
        with torch.no_grad():
            loss = -sum(e for e, _, _, _ in self._iter_particles(model, guide, args, kwargs))
        warn_if_nan(loss, "loss")
        return loss

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """Negative ELBO whose gradient is the estimator.

        ``block_grad`` routes are honoured by passing each blocked term through
        :func:`pyro_gradroute.routing.gate` (exact; slower than :meth:`loss_and_grads`,
        which SVI calls and which uses the routing engine's pruned passes).
        """
        loss, surrogate = 0.0, None
        for elbo, terms, blocks, _ in self._iter_particles(model, guide, args, kwargs):
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
        for elbo, terms, blocks, trainable in self._iter_particles(model, guide, args, kwargs):
            loss -= elbo
            if not (terms and trainable):  # as Pyro: no param site, no backward
                continue
            if not blocks:  # no routes: one plain backward of the whole surrogate
                (-sum(terms.values())).backward(retain_graph=self.retain_graph)
            else:
                routing.backward(
                    {k: -v for k, v in terms.items()},
                    block=blocks,
                    retain_graph=self.retain_graph,
                    strict=False,  # marked sites without a gradient have no term
                )
        warn_if_nan(loss, "loss")
        return loss
