"""Routing-aware :class:`Trace_ELBO`: Pyro's estimator, built from named per-site terms."""

from __future__ import annotations

import torch
from pyro.distributions.util import is_identically_zero
from pyro.infer.util import MultiFrameTensor, get_plate_stacks, torch_item

from ..poutine.stick_the_landing_messenger import StickTheLandingMessenger, STLPolicy
from .elbo import RoutedELBO, Terms, add_term, get_split_importance_trace, refuse_model_enumeration


class Trace_ELBO(RoutedELBO):
    r"""Pyro's :class:`pyro.infer.Trace_ELBO` estimator, honouring ``block_grad`` routes.

    Same constructor, same loss values and (without routes) the same gradients as
    Pyro's class. The surrogate ELBO is the sum of per-site terms

    .. math::

        \sum_{x \in \text{model}} \log p(x \mid \ldots)
        - \sum_{z \in \text{guide}} \Big[ \underbrace{\log q(z)}_{\text{reparam: entropy term}}
        - \underbrace{\bot(\log r)\,\log q(z)}_{\text{non-reparam: score term}} \Big]

    each keyed ``("model", name)`` / ``("guide", name)``, so that
    :class:`~pyro_gradroute.poutine.block_grad` can keep chosen terms from chosen
    parameters in :meth:`loss_and_grads`.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro.infer import SVI
        >>> from pyro.infer.autoguide import AutoNormal
        >>> from pyro_gradroute.infer import Trace_ELBO
        >>> def model(x):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", len(x)):
        ...         pyro.sample("x", dist.Normal(mu, 1.0), obs=x)
        >>> pyro.clear_param_store()
        >>> guide = AutoNormal(model)
        >>> svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
        >>> loss = svi.step(torch.randn(10))
    """

    _stl_safe = True  # stick_the_landing is valid in it (a plain sum of log q's gradient)

    def _particle_terms(self, model_trace, guide_trace, blocks=None) -> tuple[float, Terms]:
        elbo = 0.0
        terms: Terms = {}
        for name, site in model_trace.nodes.items():
            if site["type"] == "sample":
                lp = site["log_prob_sum"]
                elbo += torch_item(lp)
                if torch.is_tensor(lp) and lp.requires_grad:  # (site names are unique)
                    terms[("model", name)] = lp
        costs = None  # (term key, plate stack, detached log-density): the pieces of log r
        log_r = None
        entropies = []  # (key, entropy term summed)
        for name, site in guide_trace.nodes.items():
            if site["type"] != "sample":
                continue
            elbo -= torch_item(site["log_prob_sum"])
            parts = site["score_parts"]
            entropy_term = parts.entropy_term
            if torch.is_tensor(entropy_term) and entropy_term.requires_grad:
                entropies.append((("guide", name), entropy_term.sum()))
            score_function = parts.score_function
            if is_identically_zero(score_function):
                continue
            stack = site["cond_indep_stack"]
            if costs is None:
                costs = _costs(model_trace, guide_trace)
            if blocks:  # each cost's REINFORCE piece is a term of the cost site and of this one
                for key, frames, cost in costs:
                    r = MultiFrameTensor((frames, cost)).sum_to(stack)
                    add_term(terms, ("reinforce", key, ("guide", name)), (r * score_function).sum())
                continue
            if log_r is None:
                log_r = MultiFrameTensor(*((f, c) for _, f, c in costs))
            add_term(terms, ("guide", name), (log_r.sum_to(stack) * score_function).sum())
        if blocks:  # a term per site (REINFORCE terms are keyed apart)
            return elbo, {**terms, **{k: -t for k, t in entropies}}
        total = sum(terms.values()) - sum(t for _, t in entropies)  # else one term (as Pyro)
        return elbo, {("surrogate",): total} if torch.is_tensor(total) else {}


class TraceSTL_ELBO(Trace_ELBO):
    r"""Trace ELBO whose reparameterized guide sites use only the *pathwise* gradient.

    For a reparameterized guide sample :math:`z = g(\epsilon; \phi)` the ordinary
    estimator differentiates :math:`\log q(z; \phi)` fully, which contains the score
    part :math:`\partial_\phi \log q(z;\phi)|_z` whose expectation is zero. STL drops it:

    .. math::

        \hat\nabla_\phi = \nabla_\phi\big[\log p(x, g(\epsilon;\phi))
            - \log q(g(\epsilon;\phi); \bot(\phi))\big]

    Same expectation (unbiased), and exactly zero when :math:`q` equals the posterior (then
    :math:`\log p(x,z) - \log q(z)` is constant in :math:`z`). For a conditional guide
    :math:`q(z_1) q(z_2 \mid z_1)` the score part holds *both* samples fixed, so
    :math:`\log q(z_2 \mid z_1; \bot(\phi))` keeps its path through :math:`z_1`.

    This is the package's ``Trace_ELBO`` with the guide under
    :func:`~pyro_gradroute.poutine.stick_the_landing`, a drop-in for
    :class:`pyro.infer.Trace_ELBO`: same arguments, the same draws and loss for the same seed,
    the model and guide run once per particle. Non-reparameterized sites keep the score
    function. How ``Delta``, flow, structured and straight-through sites are treated,
    ``infer={"stl": False}`` and the cost are on the "Sticking the landing" page
    (``docs/stl.md``).

    ``trace_steps=N``: the first ``N`` SVI steps take ``Trace_ELBO``'s gradient (far from the
    posterior STL's variance can exceed it);
    :class:`~pyro_gradroute.infer.TraceAdaptiveSTL_ELBO` makes that choice from measured
    variances.

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
        self._policy = STLPolicy(type(self).__name__, trace_steps)
        self._handler = StickTheLandingMessenger(_policy=self._policy)

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        loss = super().loss_and_grads(model, guide, *args, **kwargs)
        self._policy.advance()
        return loss

    def _get_trace(self, model, guide, args, kwargs):
        model_trace, guide_trace = get_split_importance_trace(
            self.max_plate_nesting, model, guide, args, kwargs, context=self._handler
        )
        refuse_model_enumeration(self, model_trace, guide_trace)
        return model_trace, guide_trace


def _costs(model_trace, guide_trace) -> list:
    """The pieces of Pyro's ``log r`` (model minus guide log-densities, detached), keyed by site."""
    costs = []
    stacks = get_plate_stacks(model_trace)
    for name, site in model_trace.nodes.items():
        if site["type"] == "sample":
            costs.append((("model", name), stacks[name], site["log_prob"].detach()))
            if not site["is_observed"]:
                costs.append(
                    (("guide", name), stacks[name], -guide_trace.nodes[name]["log_prob"].detach())
                )
    return costs
