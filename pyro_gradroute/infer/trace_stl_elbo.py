"""(A private shim: ``TraceSTL_ELBO`` lives in :mod:`~pyro_gradroute.infer.trace_elbo`.)"""

from .trace_elbo import TraceSTL_ELBO

__all__ = ["TraceSTL_ELBO"]
