"""Read ``block_grad`` marks from a model/guide trace pair: term key -> blocked leaves."""

from __future__ import annotations

import torch

from .gated_distribution import site_specs
from .resolve import resolve


def collect_blocks(model_trace, guide_trace) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    """``{("model" | "guide", site): {param name: unconstrained leaf}}`` for every marked site.

    The keys are the term keys of :class:`~pyro_gradroute.infer.RoutedELBO`; the values
    are what :func:`pyro_gradroute.routing.backward` takes as a block entry.

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
            specs = site_specs(site)
            if specs:
                blocks[(role, name)] = resolve(specs)
    return blocks
