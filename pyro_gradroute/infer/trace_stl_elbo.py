"""Sticking-the-landing ELBO (Roeder, Wu & Duvenaud 2017)."""

from __future__ import annotations

from ..poutine.pathwise import fill_score_parts, pathwise_score_parts
from ..poutine.stick_the_landing_messenger import STLPolicy
from .trace_elbo import Trace_ELBO
from .traces import get_split_importance_trace, rng_state, set_rng_state


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

    This is the package's ``Trace_ELBO`` with the guide's sites split as
    :func:`~pyro_gradroute.poutine.stick_the_landing` splits them (one mechanism:
    the sites' ``score_parts`` carry the pathwise gradient), with routing.

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
      ``log_density`` is taken pathwise through the draws it is computed from.
      ``AutoStructured`` and ``AutoGaussian`` (dense), whose Deltas' ``log_density``
      depends on the parameters directly, take the pathwise part of the joint density
      through the guide's affine map; any other ``log_density`` that depends on
      parameters directly is an error naming the site;
    * a site whose distribution cannot be split (a flow with a transform that has neither
      a forward rule nor an inverse) gets the ordinary gradient, with a warning naming it;
    * ``infer={"stl": False}`` on a guide site restores the ordinary gradient there;
      ``infer={"stl": True}`` on a site without ``rsample`` is an error.

    ``trace_steps=N``: the first ``N`` calls of ``loss_and_grads`` (SVI steps) take the
    ordinary ``Trace_ELBO`` gradient, and sticking the landing starts after them. Far from
    the posterior (Pyro's narrow initial scales, e.g. ``AutoNormal(init_scale=0.1)``) STL's
    variance can exceed ``Trace_ELBO``'s; starting with ``Trace_ELBO`` avoids that regime.
    :class:`~pyro_gradroute.infer.TraceAdaptiveSTL_ELBO` makes this choice from measured
    variances, per parameter element; ``TraceAdaptiveSTL_ELBO(mix_gain=math.inf)`` is the
    measured switch between the whole estimators (``Trace_ELBO`` first, this estimator's
    gradient once its measured second moment is the lower; never a mix).

    **Cost.** A site of a plain family (a torch or Pyro distribution, ``Independent``,
    ``expand``, ``mask``, or a parameter-free ``TransformedDistribution`` over one) takes
    its pathwise part from one evaluation of a copy with detached parameters at the live
    sample: the step costs what ``Trace_ELBO``'s does. Conditional sites (parameters
    computed from earlier samples, at any depth: chains, dense DAGs) add one custom node
    that sends the partials to the samples they read, in one product that stops the
    gradient below each sample read while it is taken. A flow site whose parameters read no
    earlier sample takes its pathwise part from its forward-carried gradient at the
    sample's cached path, as a plain expression (no custom node). Guides with conditional
    flows, ``Rejector``-like families, straight-through samples or parameter-dependent
    Deltas take the general split (relays) on every step.

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

    def __init__(self, *args, trace_steps: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        n = self.num_particles
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"{type(self).__name__}: num_particles must be an integer >= 1, got {n!r}"
            )
        self._policy = STLPolicy(type(self).__name__, trace_steps)

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        loss = super().loss_and_grads(model, guide, *args, **kwargs)
        self._policy.advance()
        return loss

    _splits = True

    def _needs_split(self, site) -> bool:
        return self._policy.uses_pathwise(site)

    def _pathwise(self, site) -> bool:  # the same policy as poutine.stick_the_landing
        return self._policy.uses_pathwise(site)

    def _split_fallback(self, site, error) -> bool:
        return self._policy.fallback(site, error)

    def _fill(self, guide_trace) -> bool:
        """Set the STL sites' score parts from detached copies; ``False``: the general split is needed."""
        parts = pathwise_score_parts(guide_trace, self._policy.uses_pathwise)
        if parts is None:
            return False
        fill_score_parts(guide_trace, parts)
        return True

    def _get_trace(self, model, guide, args, kwargs):
        known = self._policy.needs_general(guide)
        if not known:
            # a guide not seen yet may need the general split: the second run then draws
            # the same random numbers as the first
            state = rng_state() if known is None else None
            out = get_split_importance_trace(
                self.max_plate_nesting,
                model,
                guide,
                args,
                kwargs,
                needs_split=False,
                fill=self._fill,
            )
            self._policy.mark(guide, general=out is None)
            if out is not None:
                return out
            if state is not None:
                set_rng_state(state)
        return super()._get_trace(model, guide, args, kwargs)
