"""Sticking-the-landing ELBO (Roeder, Wu & Duvenaud 2017)."""

from __future__ import annotations

import warnings

import torch

from ..distributions.split import delta_base, reaches_leaf_directly
from ..distributions.split_distribution import SplitDistribution
from .trace_elbo import Trace_ELBO
from .traces import site_parts, site_upstream


def check_delta_density(site, estimator: str) -> None:
    """Raise if a Delta guide site's ``log_density`` depends on guide parameters directly.

    A Delta's value is a deterministic function of earlier draws; its ``log_density``
    (a Jacobian correction) is part of ``log q``. When that correction depends only on
    earlier draws (AutoNormal, AutoDiagonalNormal, AutoMultivariateNormal, ...) its
    whole gradient is pathwise, through those draws. When it depends on the guide's
    parameters directly (``AutoStructured``: ``-log|scale|``), the pathwise part at a
    fixed value needs the inverse of the guide's map, which is not available: raise.
    """
    fn = site["fn"]
    d = delta_base(fn.base_dist if isinstance(fn, SplitDistribution) else fn)
    if d is None or not torch.is_tensor(d.log_density) or not d.log_density.requires_grad:
        return
    if reaches_leaf_directly(d.log_density, site_upstream(site)):
        raise ValueError(
            f"{estimator}: guide site '{site['name']}' is a Delta whose log_density depends on "
            "the guide's parameters directly (as AutoStructured's sites do), so its pathwise "
            "part at a fixed value is not available and dropping the score part would bias "
            "the gradient. Use pyro_gradroute.infer.Trace_ELBO (or pyro.infer.RenyiELBO for "
            "an importance-weighted bound) with this guide, or a guide whose Deltas are "
            "functions of earlier draws only (AutoNormal, AutoMultivariateNormal, ...)."
        )


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

    For a conditional guide :math:`q(z_1) q(z_2 \mid z_1)` the score part of the joint
    density holds *both* samples fixed, so :math:`\log q(z_2 \mid z_1; \bot(\phi))` keeps
    its path through :math:`z_1` (at any depth: each sample is a cut point).

    Drop-in for :class:`pyro.infer.Trace_ELBO`: same constructor arguments
    (``num_particles``, ``vectorize_particles``, ``max_plate_nesting``, ...), and the
    loss values are identical for the same random seed. The guide's log-density is
    evaluated once per site (:func:`~pyro_gradroute.distributions.split_log_prob`);
    the model and guide run once per particle.

    * non-reparameterized guide sites keep the score-function treatment of ``Trace_ELBO``
      (through their distribution's own ``score_parts``, masks included);
    * distributions with their own ``score_parts`` (``Rejector``) keep their score
      function term; only their entropy term is taken pathwise;
    * ``Delta`` sites (AutoDelta, and the sites AutoContinuous guides unpack) have no
      random draw of their own: their value's gradient is the model's, and their
      ``log_density`` is taken pathwise through the draws it is computed from. A
      ``log_density`` that depends on parameters directly (``AutoStructured``) is an
      error naming the site;
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
            f"TraceSTL_ELBO: guide site '{site.name}' cannot be split into score and "
            f"pathwise parts ({error}); it gets the ordinary Trace_ELBO gradient instead "
            "(unbiased, but not sticking the landing). Mark it infer={'stl': False} to "
            "silence this.",
            stacklevel=2,
        )
        return True

    @staticmethod
    def _uses_pathwise(site) -> bool:
        get = site.get if isinstance(site, dict) else lambda k: getattr(site, k)
        fn = get("fn")
        fn = fn.base_dist if isinstance(fn, SplitDistribution) else fn
        stl = get("infer").get("stl", None)
        has_rsample = getattr(fn, "has_rsample", False)
        if stl is True and not has_rsample:
            raise ValueError(
                f"Guide site '{get('name')}' is marked infer={{'stl': True}} but its "
                f"distribution {type(fn).__name__} has no rsample, so it has no "
                "pathwise gradient. Use a reparameterizable family or remove the mark "
                "(non-reparameterized sites get the score-function estimator)."
            )
        return not (stl is False or not has_rsample)

    def _entropy_term(self, site):
        fn = site["fn"]
        if not (self._uses_pathwise(site) and isinstance(fn, SplitDistribution)):
            return site["score_parts"].entropy_term
        if not fn.is_split(site["value"]):  # fell back to the ordinary gradient
            return site["score_parts"].entropy_term
        check_delta_density(site, type(self).__name__)
        return site_parts(site)[1].entropy_term
