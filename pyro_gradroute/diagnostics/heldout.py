r"""Held-out log-likelihood of a fitted guide, per observation.

* ``"predictive"`` (models whose latents are global): the log pointwise predictive density

  .. math::

      \frac1n \sum_{i=1}^n \log \frac1S \sum_{s=1}^S p(\tilde x_i \mid z_s),
      \qquad z_s \sim q(z) \text{ fitted on the training data};

* ``"marginal"`` (amortized guides of local latents, e.g. a VAE): the importance-weighted
  estimate :math:`\frac1n \log \frac1S \sum_s p(\tilde x, z_s) / q(z_s \mid \tilde x)` with the
  guide run on the held-out data (Pyro's ``RenyiELBO(alpha=0)`` with ``S`` particles).

``n`` counts the batch elements of the observed sites (event dimensions summed).
"""

from __future__ import annotations

import math

import pyro.poutine as poutine
import torch
from pyro.infer import Predictive, RenyiELBO

from .._validation import check_choice, check_int
from .draws import importance_draws
from .inference_data import latent_and_observed
from .plates import trace_model


def _heldout_log_probs(model, draws, heldout_args, kwargs, observed, base) -> list:
    """``(S,) + batch shape`` log p(x~ | z_s) of each observed site: one vectorized ``Predictive``
    pass, or one conditioned run per draw when the draws were made one by one."""

    def log_p(trace, name):
        site = trace.nodes[name]
        return site["fn"].log_prob(site["value"]).detach()

    if draws.vectorized:
        predictive = Predictive(model, posterior_samples=draws.latent_values(),
                                num_samples=draws.num_samples, parallel=True)  # fmt: skip
        trace = predictive.get_vectorized_trace(*heldout_args, **kwargs)
        return [draws.per_draw(log_p(trace, k), base.nodes[k]["fn"].batch_shape) for k in observed]
    latent = draws.latent_values()
    per_draw = []
    for s in range(draws.num_samples):
        conditioned = poutine.condition(model, {k: v[s] for k, v in latent.items()})
        trace = poutine.trace(conditioned).get_trace(*heldout_args, **kwargs)
        per_draw.append([log_p(trace, k) for k in observed])
    return [torch.stack(site) for site in zip(*per_draw)]


@torch.no_grad()
def heldout_log_likelihood(
    model,
    guide,
    train_args: tuple,
    heldout_args: tuple,
    method: str = "predictive",
    num_samples: int = 200,
    kwargs: dict | None = None,
    with_se: bool = False,
) -> float | tuple[float, float]:
    """Held-out log-likelihood per observation (see module docs).

    :param with_se: also return a standard error: for ``"predictive"`` the standard deviation
        of the pointwise values over the held-out observations divided by :math:`\\sqrt n` (as
        ArviZ's ``loo`` reports it); for ``"marginal"`` ``nan`` (one joint estimate).
    :returns: the value, or ``(value, standard error)`` with ``with_se``.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro_gradroute.diagnostics.heldout import heldout_log_likelihood
        >>> def model(x):
        ...     with pyro.plate("data", len(x)):
        ...         pyro.sample("x", dist.Normal(0.0, 1.0), obs=x)
        >>> ll = heldout_log_likelihood(model, lambda x: None, (torch.zeros(3),), (torch.zeros(2),))
        >>> round(ll, 4)  # log N(0; 0, 1)
        -0.9189
    """
    where = "heldout_log_likelihood"
    check_choice(method, "method", where, ("predictive", "marginal"))
    check_int(num_samples, "num_samples", where, minimum=2)
    kwargs = kwargs or {}
    base = trace_model(model, heldout_args, kwargs)
    _, observed = latent_and_observed(base)
    n = sum(base.nodes[k]["fn"].batch_shape.numel() for k in observed)
    if not n:
        raise ValueError("heldout_log_likelihood: the model has no observed sites on held-out data")
    if method == "marginal":
        elbo = RenyiELBO(alpha=0.0, num_particles=num_samples, vectorize_particles=True)
        value = -elbo.loss(model, guide, *heldout_args, **kwargs) / n
        return (value, math.nan) if with_se else value
    draws = importance_draws(
        model, guide, *train_args, num_samples=num_samples, progress=False, **kwargs
    )
    log_ps = _heldout_log_probs(model, draws, heldout_args, kwargs, observed, base)
    values = torch.cat([(lp.logsumexp(0) - math.log(num_samples)).reshape(-1) for lp in log_ps])
    values = values.double()
    value = float(values.sum()) / n
    if not with_se:
        return value
    return value, float(values.std() / math.sqrt(n)) if n > 1 else math.nan
