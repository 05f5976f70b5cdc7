"""Routing-aware :class:`Trace_ELBO`: Pyro's estimator, built from named per-site terms."""

from __future__ import annotations

from pyro.distributions.util import is_identically_zero
from pyro.infer.util import MultiFrameTensor, get_plate_stacks, torch_item

from .elbo import RoutedELBO, Terms, add_term


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

    _splits = False  # only the ordinary log-densities: the guide runs exactly as under Pyro

    def _needs_split(self, site) -> bool:
        return False

    def _entropy_term(self, site):
        """The guide site's term whose gradient is taken pathwise (reparameterized sites)."""
        return site["score_parts"].entropy_term

    def _particle_terms(self, model_trace, guide_trace, blocks=None) -> tuple[float, Terms]:
        elbo = 0.0
        terms: Terms = {}
        for name, site in model_trace.nodes.items():
            if site["type"] == "sample":
                elbo += torch_item(site["log_prob_sum"])
                add_term(terms, ("model", name), site["log_prob_sum"])
        costs = None  # (term key, plate stack, detached log-density): the pieces of log r
        log_r = None
        for name, site in guide_trace.nodes.items():
            if site["type"] != "sample":
                continue
            elbo -= torch_item(site["log_prob_sum"])
            entropy_term = self._entropy_term(site)
            if not is_identically_zero(entropy_term):
                add_term(terms, ("guide", name), -entropy_term.sum())
            score_function = site["score_parts"].score_function
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
        return elbo, terms


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
