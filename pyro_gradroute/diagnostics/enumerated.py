r"""Discrete latents enumerated in the model, summed out for the diagnostics.

A site marked ``infer={"enumerate": "parallel"}`` (or ``"sequential"``) in the model and absent
from the guide is summed out, as ``TraceEnum_ELBO`` does, instead of being drawn from its prior.
For an enumerated site :math:`k` with children :math:`c` (the sites whose density reads it) the
importance log-ratio takes its marginal

.. math::

    \log \sum_k p(k \mid \cdot) \prod_{c} p(c \mid k, \cdot),

the children's plates that :math:`k` is not in summed inside the sum (a global :math:`k` with
local observations), and the pointwise log-likelihood of an observed child :math:`x` in the same
plates as :math:`k` is :math:`\log p(x_i \mid z) = \operatorname{logsumexp}_k [\log p(k_i) +
\log p(x_i \mid k_i, z)]`.

Supported: any number of enumerated sites, each with its own children. Refused with
:class:`EnumerationError` naming the sites: an enumerated site whose distribution reads another
enumerated site (nested enumeration), a site that reads two enumerated sites, children with
different scales, and a child outside one of its enumerated parent's plates. The pointwise
log-likelihood is refused (only ``log_likelihood``; the ratio and PSIS still work) where it does
not factor per point: a child in plates the enumerated site is not in, or an enumerated site
with several children (the points' joint density is then not one site's).

Example (a two-component mixture with fixed means; the marginal written by hand)::

    >>> import torch, pyro, pyro.distributions as dist
    >>> from pyro_gradroute.diagnostics.draws import importance_draws
    >>> w = torch.tensor([0.3, 0.7])
    >>> def model(x):
    ...     with pyro.plate("data", len(x)):
    ...         k = pyro.sample("k", dist.Categorical(w), infer={"enumerate": "parallel"})
    ...         pyro.sample("x", dist.Normal(2.0 * k - 1.0, 1.0), obs=x)
    >>> x = torch.tensor([-1.0, 0.5, 2.0])
    >>> d = importance_draws(model, lambda x: None, x, num_samples=2)
    >>> per_k = w.log() + dist.Normal(torch.tensor([-1.0, 1.0]), 1.0).log_prob(x[:, None])
    >>> exact = per_k.logsumexp(-1)  # log p(x_i), k summed out
    >>> torch.allclose(d.pointwise_log_prob("x")[0], exact)
    True
    >>> torch.allclose(d.log_ratios, exact.sum()), d.enumerated
    (True, {'k'})
"""

from __future__ import annotations

import pyro.poutine as poutine
import torch
from pyro.distributions.util import scale_and_mask
from pyro.poutine.messenger import Messenger


class EnumerationError(ValueError):
    """An enumerated model the diagnostics cannot sum out exactly."""


class ParallelEnumeration(Messenger):
    """Reads ``infer={"enumerate": "sequential"}`` as ``"parallel"`` (the diagnostics sum every
    enumerated site in one pass)."""

    def _pyro_sample(self, msg) -> None:
        if msg["infer"].get("enumerate") == "sequential":
            msg["infer"] = dict(msg["infer"], enumerate="parallel")


def enumerate_model(model, first_available_dim: int):
    """``model`` with its enumerated sites enumerated in parallel from ``first_available_dim``."""
    return poutine.enum(ParallelEnumeration()(model), first_available_dim=first_available_dim)


def _depends(t: torch.Tensor, dim: int) -> bool:
    return t.dim() >= -dim and t.shape[dim] > 1


def _frames(site, skip: str | None) -> dict[str, int]:
    return {
        f.name: f.dim
        for f in site["cond_indep_stack"]
        if f.vectorized and f.dim is not None and f.name != skip
    }


def _same_scale(a, b) -> bool:
    return bool(torch.as_tensor(a).eq(torch.as_tensor(b)).all())


def marginal_terms(sites: dict, log_probs: dict, particle_plate: str | None):
    r"""Sum the enumerated sites out of a model trace.

    :param sites: ``{name: site}`` of the model trace's sample sites (subsample sites pruned).
    :param log_probs: ``{name: unscaled log_prob tensor}`` of the same sites.
    :param particle_plate: the name of the plate over draws (``None`` when drawing one at a time).
    :returns: ``(terms, pointwise, enumerated)``: the scaled and masked log-density terms whose
        sum over all but the draw dimension is :math:`\log p(x, z)` with the enumerated sites
        summed out; ``{observed child: unscaled marginal log_prob, or the reason it has none}``;
        the names of the enumerated sites.
    """
    enum = {
        n: s["infer"]["_enumerate_dim"]
        for n, s in sites.items()
        if s["infer"].get("_enumerate_dim") is not None
    }
    for e in enum:
        others = [o for o, d2 in enum.items() if o != e and _depends(log_probs[e], d2)]
        if others:
            raise EnumerationError(
                f"enumerated site {e!r} reads enumerated site(s) {others} (nested enumeration): "
                "the diagnostics sum out only enumerated sites whose distributions read no other "
                "enumerated site. Sum them with TraceEnum_ELBO, or put the discrete sites in "
                "the guide."
            )
    children: dict[str, list[str]] = {e: [] for e in enum}
    terms = []
    for n, s in sites.items():
        if n in enum:
            continue
        parents = [e for e, d in enum.items() if _depends(log_probs[n], d)]
        if len(parents) > 1:
            raise EnumerationError(
                f"site {n!r} reads several enumerated sites {parents}: the diagnostics sum out "
                "enumerated sites one at a time; sum them with TraceEnum_ELBO, or put the "
                "discrete sites in the guide."
            )
        if parents:
            children[parents[0]].append(n)
        else:
            terms.append(scale_and_mask(log_probs[n], s["scale"], s["mask"]))
    pointwise: dict[str, torch.Tensor | str] = {}
    for e, d in enum.items():
        frames_e = _frames(sites[e], particle_plate)
        total = scale_and_mask(log_probs[e], mask=sites[e]["mask"])
        for c in children[e]:
            frames_c = _frames(sites[c], particle_plate)
            missing = sorted(set(frames_e) - set(frames_c))
            if missing:
                raise EnumerationError(
                    f"site {c!r} reads enumerated site {e!r} but is outside its plate(s) "
                    f"{missing}; the diagnostics cannot sum {e!r} out."
                )
            if not _same_scale(sites[c]["scale"], sites[e]["scale"]):
                raise EnumerationError(
                    f"site {c!r} reads enumerated site {e!r} with a different scale "
                    "(poutine.scale or a subsampled plate); the diagnostics cannot sum it out."
                )
            t = scale_and_mask(log_probs[c], mask=sites[c]["mask"])
            extra = sorted(set(frames_c) - set(frames_e))
            dims = [frames_c[name] for name in extra if t.dim() >= -frames_c[name]]
            total = total + (t.sum(dims, keepdim=True) if dims else t)
            if not sites[c]["is_observed"]:
                continue
            if len(children[e]) > 1:
                pointwise[c] = (
                    f"enumerated site {e!r} is read by several sites {children[e]}, so the "
                    f"pointwise log-likelihood of {c!r} with {e!r} summed out is not one site's"
                )
            elif extra:
                pointwise[c] = (
                    f"enumerated site {e!r} is outside plate(s) {extra} of {c!r}, so "
                    f"log p({c}_i | z) with {e!r} summed out does not factor over points"
                )
            else:
                pointwise[c] = (log_probs[e] + log_probs[c]).logsumexp(d)
        terms.append(total.logsumexp(d) * sites[e]["scale"])
    return terms, pointwise, set(enum)
