"""Diagnostics: ArviZ conversion, PSIS k-hat, gradient statistics.

* :func:`from_pyro_svi` (alias :func:`to_inference_data`) -- a fitted guide as ArviZ data
  (``DataTree`` on ArviZ 1.x, ``InferenceData`` on 0.23: posterior, posterior predictive,
  pointwise log-likelihood, importance log-ratios).
* :func:`psis_khat` / :func:`pareto_khat` -- the Pareto-k diagnostic of a guide.
* :func:`gradient_stats` / :func:`compare_gradients` -- mean, variance and signal-to-noise
  ratio of ELBO gradients, one estimator or several side by side.

Fitting several estimators from one initialisation and tabulating them is
``pyro_gradroute.app.compare.compare_estimators`` (``pyro-gradroute compare``). ArviZ is
imported lazily (only the functions that return ArviZ objects need it).
"""

from .gradients import GradientStats, compare_gradients, gradient_stats
from .inference_data import from_pyro_svi, to_inference_data
from .psis import PSISResult, pareto_khat, psis_khat

__all__ = [
    "GradientStats",
    "PSISResult",
    "compare_gradients",
    "from_pyro_svi",
    "gradient_stats",
    "pareto_khat",
    "psis_khat",
    "to_inference_data",
]
