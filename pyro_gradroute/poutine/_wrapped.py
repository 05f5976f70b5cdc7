"""One delegating-distribution base for the handlers' wrappers."""

from __future__ import annotations

import torch
from pyro.distributions import TorchDistribution

_EMPTY = torch.Size()


class WrappedDistribution(TorchDistribution):
    """``base_dist`` in every respect (sampling, shapes, support, attributes) except what a
    subclass overrides; ``_own`` names the subclass's own attributes."""

    arg_constraints: dict = {}
    _own: tuple = ("base_dist",)

    def __getattr__(self, name):
        if name in type(self)._own:
            raise AttributeError(name)
        return getattr(self.base_dist, name)

    @property
    def has_rsample(self):  # type: ignore[override]
        return self.base_dist.has_rsample

    @has_rsample.setter
    def has_rsample(self, value):
        # Pyro's broadcast copies a site's custom ``has_rsample_`` onto the expanded
        # distribution by assignment: it belongs to the base distribution
        self.base_dist.has_rsample = bool(value)

    has_enumerate_support = property(lambda self: self.base_dist.has_enumerate_support)  # type: ignore[assignment]
    support = property(lambda self: self.base_dist.support)  # type: ignore[assignment]
    mean = property(lambda self: self.base_dist.mean)
    variance = property(lambda self: self.base_dist.variance)

    def sample(self, sample_shape=_EMPTY):
        return self.base_dist.sample(sample_shape)

    def rsample(self, sample_shape=_EMPTY):
        return self.base_dist.rsample(sample_shape)

    def enumerate_support(self, expand=True):
        return self.base_dist.enumerate_support(expand=expand)
