"""pyro_gradroute: control where gradients flow in Pyro variational inference.

* :mod:`pyro_gradroute.distributions` -- ``split_log_prob``: ordinary, score and
  pathwise parts of a log-density from one evaluation.
* :mod:`pyro_gradroute.routing` -- a plain-PyTorch engine that keeps named loss
  terms from chosen parameters in as few pruned backward passes as possible.
* :mod:`pyro_gradroute.infer` -- ELBOs (``Trace_ELBO``, ``TraceSTL_ELBO``, ...).
* :mod:`pyro_gradroute.poutine` -- ``block_grad``.
* :mod:`pyro_gradroute.guides` -- param-store guides with swappable families.
* :mod:`pyro_gradroute.diagnostics` -- ArviZ conversion, PSIS k-hat, gradient statistics.
"""

__version__ = "0.1.0"
