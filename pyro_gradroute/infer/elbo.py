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
from .traces import get_split_importance_trace

Terms = dict[Hashable, torch.Tensor]


def add_term(terms: Terms, key: Hashable, value) -> None:
    """Add ``value`` to ``terms[key]`` (creating it), skipping non-differentiable values."""
    if not (torch.is_tensor(value) and value.requires_grad):
        return
    terms[key] = terms[key] + value if key in terms else value


def collect_blocks(model_trace, guide_trace) -> dict:
    """Term key -> parameters the term must not reach, from ``block_grad`` marks in the traces."""
    from ..poutine.collect import collect_blocks as _collect

    return _collect(model_trace, guide_trace)


class RoutedELBO(ELBO):
    """Base class: subclasses implement :meth:`_particle_terms`.

    ``_particle_terms(model_trace, guide_trace) -> (elbo: float, terms: dict)``
    returns one particle's ELBO estimate and its named surrogate-ELBO terms
    (to be *maximized*). With vectorized particles the trace pair holds all
    particles, summed; the base class divides by :meth:`_particle_divisor`
    (``num_particles``) in both cases. Estimators whose terms already combine the
    particles (importance-weighted bounds) return 1 there.
    """

    def _particle_divisor(self) -> int:
        return self.num_particles

    def _needs_split(self, site) -> bool:
        """Whether the estimator uses the split parts of this guide site (else one plain evaluation)."""
        return True

    def _split_fallback(self, site, error) -> bool:
        """Whether a site that cannot be split may use its ordinary gradient instead."""
        return False

    def _get_trace(self, model, guide, args, kwargs):
        return get_split_importance_trace(
            self.max_plate_nesting,
            model,
            guide,
            args,
            kwargs,
            needs_split=self._needs_split,
            fallback=self._split_fallback,
        )

    def _particle_terms(self, model_trace, guide_trace) -> tuple[float, Terms]:
        raise NotImplementedError

    def _iter_particles(self, model, guide, args, kwargs):
        """Yield ``(elbo, terms, blocks)`` per trace, divided by :meth:`_particle_divisor`.

        (A vectorized trace holds all particles, summed: it is divided likewise.)
        """
        n = self._particle_divisor()
        for model_trace, guide_trace in self._get_traces(model, guide, args, kwargs):
            elbo, terms = self._particle_terms(model_trace, guide_trace)
            if n > 1:
                terms = {k: v / n for k, v in terms.items()}
            yield elbo / n, terms, collect_blocks(model_trace, guide_trace)

    def loss(self, model, guide, *args, **kwargs) -> float:
        """Estimate of the negative ELBO (a float; no gradients)."""
        with torch.no_grad():
            loss = -sum(e for e, _, _ in self._iter_particles(model, guide, args, kwargs))
        warn_if_nan(loss, "loss")
        return loss

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """Negative ELBO whose gradient is the estimator.

        ``block_grad`` routes are honoured by passing each blocked term through
        :func:`pyro_gradroute.routing.gate` (exact; slower than :meth:`loss_and_grads`,
        which SVI calls and which uses the routing engine's pruned passes).
        """
        loss, surrogate = 0.0, 0.0
        for elbo, terms, blocks in self._iter_particles(model, guide, args, kwargs):
            terms = {k: routing.gate(v, blocks[k]) if k in blocks else v for k, v in terms.items()}
            loss = loss - elbo
            surrogate = surrogate - sum(terms.values(), torch.tensor(0.0))
        warn_if_nan(surrogate, "loss")
        if not torch.is_tensor(surrogate):
            return torch.tensor(loss)
        return loss + (surrogate - torch_item(surrogate))

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        """Negative ELBO as a float; accumulates the (routed) estimator into ``.grad``."""
        loss = 0.0
        for elbo, terms, blocks in self._iter_particles(model, guide, args, kwargs):
            loss -= elbo
            if terms and not blocks:  # no routes: one plain backward of the whole surrogate
                (-sum(terms.values())).backward(retain_graph=self.retain_graph)
            elif terms:
                routing.backward(
                    {k: -v for k, v in terms.items()},
                    block=blocks,
                    retain_graph=self.retain_graph,
                    strict=False,  # marked sites without a gradient have no term
                )
        warn_if_nan(loss, "loss")
        return loss
