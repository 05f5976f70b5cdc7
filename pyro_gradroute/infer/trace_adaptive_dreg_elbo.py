r"""The IWAE bound whose guide gradient mixes IWAE's and DReG's with a weight learned from earlier steps."""

from __future__ import annotations

import torch

from .elbo import EXTRA, Terms, pathwise_log_prob
from .trace_adaptive_elbo import _Adaptive, _add, _grads, _score_part, _trace_params
from .trace_dreg_elbo import TraceDReG_ELBO

__all__ = ["TraceAdaptiveDReG_ELBO"]


class TraceAdaptiveDReG_ELBO(_Adaptive, TraceDReG_ELBO):
    r"""The IWAE bound whose guide gradient is :math:`g_\text{DReG} + b \odot (g_\text{IWAE} - g_\text{DReG})`.

    With normalized weights :math:`\tilde w_k` and :math:`a_k = \partial_{z_k} \log w_k \cdot
    \partial z_k / \partial\phi` (the path through the sample), the guide gradients of the IWAE
    bound are

    .. math::

        g_\text{IWAE} = \sum_k \tilde w_k \big(a_k - \nabla_\phi \log q(\bot(z_k);\phi)\big),
        \qquad
        g_\text{DReG} = \sum_k \tilde w_k^2\, a_k,

    with the same expectation (Tucker et al. 2019, eq. 5), so
    :math:`c = g_\text{IWAE} - g_\text{DReG}` has mean zero and, with :math:`b` from earlier
    steps only, **every step is unbiased**: :math:`b = 1` is IWAE, :math:`b = 0` DReG. The
    fit and its guarantee are :class:`~pyro_gradroute.infer.TraceAdaptiveSTL_ELBO`'s (every
    step measures). Model parameters get the IWAE gradient. :math:`c` costs one backward of
    the guide graph only (the model's gradient at each sample is read during the base
    backward). ``block_grad`` routes raise.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro_gradroute.infer import TraceAdaptiveDReG_ELBO
        >>> def model(x):
        ...     with pyro.plate("data", len(x)):
        ...         z = pyro.sample("z", dist.Normal(0.0, 1.0))
        ...         pyro.sample("x", dist.Normal(z, 0.5), obs=x)
        >>> def guide(x):
        ...     w = pyro.param("w", torch.tensor(0.5))
        ...     with pyro.plate("data", len(x)):
        ...         pyro.sample("z", dist.Normal(w * x, 0.6))
        >>> pyro.clear_param_store()
        >>> elbo = TraceAdaptiveDReG_ELBO(num_particles=8, warmup=2)
        >>> x = torch.randn(10)
        >>> for _ in range(3):
        ...     loss = elbo.loss_and_grads(model, guide, x)
        >>> list(elbo.control_variate_weights())
        ['w']

    Arguments are :class:`TraceDReG_ELBO`'s plus ``decay``, ``clip`` (default 2: far from the
    posterior the weights are nearly one-hot and :math:`\hat b` heavy-tailed), ``warmup``,
    ``confidence``, ``fixed_weight``, ``center``, ``distributed`` and ``schedule`` (see
    :class:`~pyro_gradroute.infer.TraceAdaptiveSTL_ELBO`).
    """

    def __init__(
        self,
        num_particles: int = 2,
        vectorize_particles: bool = True,
        *,
        decay: float = 0.9,
        clip: float | None = 2.0,
        warmup: int = 10,
        confidence: float = 2.0,
        fixed_weight: float | None = None,
        center: bool = True,
        distributed: bool | None = None,
        schedule=None,
        **kwargs,
    ):
        super().__init__(
            num_particles=num_particles, vectorize_particles=vectorize_particles, **kwargs
        )
        self._init_adaptive(
            decay, clip, warmup, center, confidence, fixed_weight, None, distributed, schedule
        )

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        return self._measured_step(model, guide, args, kwargs)

    def _particle_terms(self, model_trace, guide_trace, blocks=None) -> tuple[float, Terms]:
        elbo, terms = super()._particle_terms(model_trace, guide_trace, blocks)
        record = terms.pop(EXTRA)  # the base estimator's weights and per-site factors
        if not torch.is_grad_enabled():
            return elbo, terms
        w, factors = record["weights"].detach(), record["factors"]
        taps, seeds, paths, scores = [], [], [], []
        for name, site in guide_trace.nodes.items():
            if site["type"] != "sample" or site["is_observed"]:
                continue
            one_minus_f = 1 - factors.get(name, 1.0)
            if torch.is_tensor(one_minus_f) or one_minus_f != 0:
                z, msite = site["value"], model_trace.nodes.get(name)
                v = msite["value"] if msite is not None else None
                if torch.is_tensor(v) and v is not z and v.requires_grad:
                    taps.append((v, None))  # the model's gradient at the sample
                    seeds.append((z, one_minus_f, getattr(site["fn"], "event_dim", 0)))
                path = pathwise_log_prob(site)
                if torch.is_tensor(path) and path.requires_grad:
                    paths.append((w * one_minus_f * path).sum())
            s = _score_part(site)
            if s is not None:
                scores.append((w * s).sum())
        if blocks and (seeds or paths or scores):
            raise NotImplementedError(
                "TraceAdaptiveDReG_ELBO does not support block_grad routes (its control variate "
                "re-seeds the model's gradient at each sample, which mixes the routes). Use "
                "TraceDReG_ELBO (routes supported) or remove the marks."
            )
        params = _trace_params(model_trace, guide_trace)
        terms[EXTRA] = dict(params=params, taps=taps, seeds=seeds, paths=paths, scores=scores)
        return elbo, terms

    def _cv_grads(self, item, params, blocks, seen, retain: bool) -> dict:
        outs, grads = [], []
        for (z, f, event_dim), g in zip(item["seeds"], seen):
            if g is not None:
                if torch.is_tensor(f):
                    f = f.reshape(f.shape + (1,) * event_dim)
                outs.append(z)
                grads.append(g * f)
        outs += item["paths"]
        grads += [torch.ones_like(p) for p in item["paths"]]
        out = _grads(outs, params, grads, retain=True) if outs else {}
        if item["scores"]:
            _add(out, _grads(item["scores"], params, retain=retain).items())
        return out
