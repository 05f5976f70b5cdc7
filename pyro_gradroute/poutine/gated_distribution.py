"""A distribution wrapper whose log-density's gradient skips blocked parameters.

Used by :class:`~pyro_gradroute.poutine.block_grad_messenger.BlockGradMessenger` so that
*any* ELBO that differentiates ``site["fn"].log_prob`` / ``score_parts`` honours the routes
exactly, through :func:`pyro_gradroute.routing.gate`. This package's ELBOs unwrap it and
route with the faster engine, reading the marks with :func:`collect_blocks`.
"""

from __future__ import annotations

import torch
from pyro.distributions.score_parts import ScoreParts
from pyro.ops.provenance import detach_provenance, get_provenance, track_provenance

from .. import routing
from ._wrapped import WrappedDistribution
from .resolve import BlockSpec, resolve

SPECS_KEY = "block_grad_specs"


class GatedDistribution(WrappedDistribution):
    r"""``base_dist`` with :math:`\nabla_\theta \log p = 0` for the blocked parameters :math:`\theta`.

    Sampling, shapes, support and every other attribute are those of ``base_dist``;
    ``log_prob`` and the three ``score_parts`` are passed through
    :func:`~pyro_gradroute.routing.gate`. ``kl_divergence`` is deliberately not
    registered, so ``TraceMeanField_ELBO`` uses its Monte Carlo fallback at a gated site
    (an analytic KL mixes the model's and the guide's terms, which routes cannot split).

    Example::

        >>> import torch, pyro.distributions as dist
        >>> from pyro_gradroute.poutine.resolve import BlockSpec
        >>> loc = torch.tensor(0.0, requires_grad=True)
        >>> spec = BlockSpec(frozenset({"x"}), (), (loc,))
        >>> d = GatedDistribution(dist.Normal(loc, 1.0), [spec])
        >>> d.log_prob(torch.tensor(1.0)).backward()
        >>> loc.grad is None  # the only parameter is blocked: no gradient at all
        True
    """

    def __init__(self, base_dist=None, specs=(), site=None, score_sites=None, **params):
        if base_dist is None or params:
            # a reparameterizer rebuilding the site's distribution (type(fn)(**params))
            raise TypeError(
                f"block_grad: a gated distribution (site {site!r}) was rebuilt from "
                f"{sorted(params)}, as a reparameterizer does; the rebuilt one cannot carry "
                "the route. Put block_grad outside poutine.reparam and block the sample "
                "site(s) the reparameterizer creates."
            )
        self.base_dist = base_dist
        self.specs = tuple(specs)
        self.site = site
        self.score_sites = score_sites if score_sites is not None else []
        super().__init__(base_dist.batch_shape, base_dist.event_shape, validate_args=False)

    @classmethod
    def wrap(cls, fn, spec: BlockSpec, site=None, score_sites=None) -> GatedDistribution:
        """``fn`` gated by ``spec`` (merging with an existing gate: nested handlers compose)."""
        if isinstance(fn, cls):
            merged = list(fn.score_sites) + [
                s for s in score_sites or () if s not in fn.score_sites
            ]
            return cls(fn.base_dist, fn.specs + (spec,), fn.site or site, merged)
        return cls(fn, (spec,), site, score_sites)

    def _gate(self, t):
        if torch.jit.is_tracing():
            raise NotImplementedError(
                "block_grad routes cannot be traced by the JIT (JitTrace_ELBO and friends). "
                "Use pyro.infer.Trace_ELBO / TraceGraph_ELBO / TraceMeanField_ELBO / RenyiELBO, "
                "or pyro_gradroute.infer.Trace_ELBO / TraceSTL_ELBO (fastest with routes)."
            )
        if not (torch.is_tensor(t) and t.requires_grad):
            return t
        # TraceGraph_ELBO tracks which sites a log-density depends on with ProvenanceTensor
        # (a __torch_function__ subclass): gate the plain tensor, then restore the provenance.
        provenance = get_provenance(t)
        plain, blocked = detach_provenance(t), resolve(self.specs)
        self._check_score_function_paths(plain, blocked)
        gated = routing.gate(plain, blocked)
        return track_provenance(gated, provenance) if provenance else gated

    def _check_score_function_paths(self, t, blocked) -> None:
        """Raise where a blocked parameter can only be reached through a REINFORCE term.

        Pyro's ELBOs call this gated ``log_prob`` (this package's ELBOs unwrap the gate).
        They build each non-reparameterized guide site's score-function term from the
        *detached* model log-densities, so a gate here cannot keep this site's cost from
        the guide parameters of that term. Such a site shows in the run as a latent
        site whose value has no gradient; a blocked parameter that this log-density does
        not reach pathwise may then be reached only that way.
        """
        others = [n for n in self.score_sites if n != self.site]
        if not others:
            return
        reached = set(routing.reachable_leaves(t))
        unreached = sorted(n for n, p in blocked.items() if p not in reached)
        if unreached:
            raise NotImplementedError(
                f"block_grad: site {self.site!r} is blocked from {unreached}, which its "
                "log-density does not reach pathwise, and latent site(s) "
                f"{others} have no reparameterized gradient: their score-function "
                "(REINFORCE) terms carry this site's cost, and Pyro's ELBOs build those "
                "terms from detached log-densities, so this route cannot be applied there. "
                "Use pyro_gradroute.infer.Trace_ELBO or TraceSTL_ELBO, which route "
                "REINFORCE terms per site."
            )

    def log_prob(self, value, *args, **kwargs):
        return self._gate(self.base_dist.log_prob(value, *args, **kwargs))

    def score_parts(self, value, *args, **kwargs):
        parts = self.base_dist.score_parts(value, *args, **kwargs)
        return ScoreParts(*(self._gate(t) for t in parts))

    def expand(self, batch_shape, _instance=None):
        return GatedDistribution(
            self.base_dist.expand(batch_shape), self.specs, self.site, self.score_sites
        )


def collect_blocks(model_trace, guide_trace) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    """``{("model" | "guide", site): {param name: unconstrained leaf}}`` for every marked site.

    A site is marked by its gate, or by the specs an estimator unwrapped it to (under
    ``site["block_grad_specs"]``). The keys are :class:`~pyro_gradroute.infer.RoutedELBO`'s
    term keys; the values what :func:`pyro_gradroute.routing.backward` takes as a block entry.

    Example::

        >>> import pyro, torch, pyro.distributions as dist
        >>> from pyro import poutine
        >>> from pyro_gradroute.poutine import block_grad
        >>> def model():
        ...     w = pyro.param("w", torch.tensor(1.0))
        ...     pyro.sample("x", dist.Normal(w, 1.0), obs=torch.tensor(0.5))
        >>> tr = poutine.trace(block_grad(model, sites="x", params="w")).get_trace()
        >>> list(collect_blocks(tr, poutine.Trace()))
        [('model', 'x')]
    """
    blocks: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for role, trace in (("model", model_trace), ("guide", guide_trace)):
        for name, site in trace.nodes.items():
            if site["type"] != "sample":
                continue
            fn = site["fn"]
            specs = fn.specs if isinstance(fn, GatedDistribution) else site.get(SPECS_KEY, ())
            if specs:
                blocks[(role, name)] = resolve(specs)
    return blocks
