"""Sticking-the-landing ELBO (Roeder, Wu & Duvenaud 2017)."""

from __future__ import annotations

import warnings

from ..distributions.split import is_delta
from .trace_elbo import Trace_ELBO


class TraceSTL_ELBO(Trace_ELBO):
    r"""Trace ELBO whose reparameterized guide sites use only the *pathwise* gradient.

    For a reparameterized guide sample :math:`z = g(\epsilon; \phi)` the ordinary
    estimator differentiates :math:`\log q(z; \phi)` fully, which contains the score
    part :math:`\partial_\phi \log q(z;\phi)|_z` whose expectation is zero. STL drops it:

    .. math::

        \hat\nabla_\phi = \nabla_\phi\big[\log p(x, g(\epsilon;\phi))
            - \log q(g(\epsilon;\phi); \bot(\phi))\big]

    Same expectation (unbiased), and the estimator is exactly zero when
    :math:`q` equals the posterior (then :math:`\log p(x,z) - \log q(z)` is constant in
    :math:`z`). Far from the posterior its variance can exceed ``Trace_ELBO``'s
    (see the README's Performance section for where the crossover lies).

    Drop-in for :class:`pyro.infer.Trace_ELBO`: same constructor arguments
    (``num_particles``, ``vectorize_particles``, ``max_plate_nesting``, ...), and the
    loss values are identical for the same random seed. The guide's log-density is
    evaluated once per site (:func:`~pyro_gradroute.distributions.split_log_prob`);
    the model and guide run once per particle.

    * non-reparameterized guide sites keep the score-function treatment of ``Trace_ELBO``;
    * ``Delta`` sites (AutoDelta, and the Jacobian-carrying site of AutoContinuous
      guides) keep their full gradient: their log-density depends on the sample only;
    * a site whose distribution cannot be split (a flow without an inverse, e.g.
      Planar) gets the ordinary gradient, with a warning naming it;
    * ``infer={"stl": False}`` on a guide site restores the ordinary gradient there;
      ``infer={"stl": True}`` on a site without ``rsample`` is an error.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro.infer import SVI
        >>> from pyro.infer.autoguide import AutoNormal
        >>> from pyro_gradroute.infer import TraceSTL_ELBO
        >>> def model(x):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", len(x)):
        ...         pyro.sample("x", dist.Normal(mu, 1.0), obs=x)
        >>> pyro.clear_param_store()
        >>> svi = SVI(model, AutoNormal(model), pyro.optim.Adam({"lr": 0.05}),
        ...           TraceSTL_ELBO(num_particles=4, vectorize_particles=True))
        >>> loss = svi.step(torch.randn(10))
    """

    def _needs_split(self, site) -> bool:
        return self._uses_pathwise(site)

    def _split_fallback(self, site, error) -> bool:
        warnings.warn(
            f"TraceSTL_ELBO: guide site '{site['name']}' cannot be split into score and "
            f"pathwise parts ({error}); it gets the ordinary Trace_ELBO gradient instead "
            "(unbiased, but not sticking the landing). Mark it infer={'stl': False} to "
            "silence this.",
            stacklevel=2,
        )
        return True

    @staticmethod
    def _uses_pathwise(site) -> bool:
        stl = site["infer"].get("stl", None)
        has_rsample = getattr(site["fn"], "has_rsample", False)
        if stl is True and not has_rsample:
            raise ValueError(
                f"Guide site '{site['name']}' is marked infer={{'stl': True}} but its "
                f"distribution {type(site['fn']).__name__} has no rsample, so it has no "
                "pathwise gradient. Use a reparameterizable family or remove the mark "
                "(non-reparameterized sites get the score-function estimator)."
            )
        return not (stl is False or not has_rsample or is_delta(site["fn"]))

    def _entropy_term(self, site):
        if self._uses_pathwise(site):
            return site["split"].pathwise
        return site["score_parts"].entropy_term
