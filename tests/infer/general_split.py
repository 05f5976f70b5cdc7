"""The general split (relays on every sample, one batch per guide run) as an estimator: an
independent sticking-the-landing reference for the handler's per-site mechanisms."""

from pyro_gradroute.infer import Trace_ELBO
from pyro_gradroute.poutine.stl_policy import uses_pathwise


class GeneralSplitSTL(Trace_ELBO):
    """``TraceSTL_ELBO``'s estimator, every site's parts from the general split."""

    _splits = True

    def _needs_split(self, site) -> bool:
        return uses_pathwise({"name": site.name, "fn": site.fn, "infer": site.infer})

    _pathwise = _needs_split

    def _split_fallback(self, site, error) -> bool:
        return True
