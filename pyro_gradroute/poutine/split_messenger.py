"""Run a guide with every sample site's log-density split once, in one batch."""

from __future__ import annotations

from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample

from ..distributions.split_distribution import SplitBatch, SplitDistribution
from .gated_distribution import SPECS_KEY, GatedDistribution


class SplitMessenger(Messenger):
    """Wraps each latent sample site's distribution in a :class:`SplitDistribution`.

    Enter it *outside* the guide (and outside any ``poutine.trace`` of the guide), so
    that it sees each site's final distribution. Samples are drawn through relays
    (cut points for the pathwise part of later conditional sites); the parts are
    evaluated once for the whole guide run by ``batch`` when first asked for.
    ``block_grad`` gates on guide sites are taken off the distribution and kept in
    the site's ``block_grad_specs`` for the routing engine.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro import poutine
        >>> from pyro_gradroute.distributions.split_distribution import SplitBatch
        >>> def guide():
        ...     loc = pyro.param("loc", torch.tensor(0.0))
        ...     pyro.sample("z", dist.Normal(loc, 1.0))
        >>> batch = SplitBatch()
        >>> with SplitMessenger(batch):
        ...     tr = poutine.trace(guide).get_trace()
        >>> tr.compute_score_parts()
        >>> full, pathwise = tr.nodes["z"]["fn"].split_parts(tr.nodes["z"]["value"])
    """

    def __init__(self, batch: SplitBatch):
        super().__init__()
        self.batch = batch

    @staticmethod
    def _latent(msg) -> bool:
        return not (msg["is_observed"] or site_is_subsample(msg) or msg["infer"].get("enumerate"))

    def _pyro_sample(self, msg) -> None:
        if not self._latent(msg) or isinstance(msg["fn"], SplitDistribution):
            return
        fn = msg["fn"]
        if isinstance(fn, GatedDistribution):
            msg[SPECS_KEY] = fn.specs  # type: ignore[literal-required]
            fn = fn.base_dist
        msg["fn"] = SplitDistribution(fn, self.batch, msg["name"])

    def _pyro_post_sample(self, msg) -> None:
        if not self._latent(msg) or not isinstance(msg["fn"], SplitDistribution):
            return
        self.batch.register(msg["name"], msg["fn"].base_dist, msg["value"], msg["infer"])
