"""Run a guide with every sample site's log-density split once, in one batch."""

from __future__ import annotations

from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample

from .gated_distribution import GatedDistribution
from .split_distribution import SplitBatch, SplitDistribution


class SplitMessenger(Messenger):
    """Wraps each latent sample site's distribution in a :class:`SplitDistribution`.

    Enter it *outside* the guide (and outside any ``poutine.trace`` of the guide), so
    that it sees each site's final distribution. Samples are drawn through relays
    (cut points for the pathwise part of later conditional sites); the parts are
    evaluated once for the whole guide run by ``batch`` when first asked for.
    A ``block_grad`` gate on a guide site stays outermost
    (``GatedDistribution(SplitDistribution(fn))``), so Pyro's ELBOs still honour it.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro import poutine
        >>> from pyro_gradroute.poutine.split_distribution import SplitBatch
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
        fn = msg["fn"]
        if not self._latent(msg) or isinstance(_split_of(fn), SplitDistribution):
            return
        if isinstance(fn, GatedDistribution):
            msg["fn"] = GatedDistribution(
                SplitDistribution(fn.base_dist, self.batch, msg["name"]), fn.specs
            )
        else:
            msg["fn"] = SplitDistribution(fn, self.batch, msg["name"])

    def _pyro_post_sample(self, msg) -> None:
        split = _split_of(msg["fn"])
        if (
            not self._latent(msg)
            or not isinstance(split, SplitDistribution)
            or split.batch is not self.batch
        ):
            return
        self.batch.register(msg["name"], split.base_dist, msg["value"], msg["infer"])


def _split_of(fn):
    return fn.base_dist if isinstance(fn, GatedDistribution) else fn
