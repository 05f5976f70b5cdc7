"""Diagnostics: ArviZ conversion, PSIS k-hat, gradient statistics, estimator comparison.

* :func:`to_inference_data` -- a fitted guide as ``arviz.InferenceData`` (posterior,
  posterior predictive, pointwise log-likelihood, importance log-ratios).
* :func:`psis_khat` / :func:`pareto_khat` -- the Pareto-k diagnostic of a guide.
* :func:`gradient_stats` / :func:`compare_gradients` -- mean, variance and signal-to-noise
  ratio of ELBO gradients, one estimator or several side by side.
* :func:`compare_estimators` -- fit several estimators from one initialisation and tabulate
  them (what ``pyro-gradroute compare`` runs).

ArviZ is imported lazily (only the functions that return ArviZ objects need it).
"""

from .gradients import GradientStats, compare_gradients, gradient_stats
from .inference_data import to_inference_data
from .psis import PSISResult, pareto_khat, psis_khat

__all__ = [
    "GradientStats",
    "PSISResult",
    "compare_gradients",
    "gradient_stats",
    "pareto_khat",
    "psis_khat",
    "to_inference_data",
]
