r"""Guide draws with their importance log-ratios, vectorized: the shared input of the diagnostics.

For :math:`S` draws :math:`z_s \sim q(z)` the importance log-ratio is

.. math::

    \log r_s = \log p(x, z_s) - \log q(z_s),

computed by Pyro's :func:`pyro.infer.importance.vectorized_importance_weights` (model and guide
run once, vectorized over an outer ``pyro.plate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pyro.infer.importance import vectorized_importance_weights

from .plates import max_plate_nesting as plate_depth
from .plates import trace_model


@dataclass
class ImportanceDraws:
    r"""``S`` guide draws replayed through the model.

    :ivar log_ratios: ``(S,)`` tensor of :math:`\log p(x, z_s) - \log q(z_s)`.
    :ivar model_trace: the model's trace, vectorized over the draws (leading dimension at
        ``-(max_plate_nesting + 1)``).
    :ivar base_trace: one plain (unvectorized) trace of the model: shapes, plates, observations.
    """

    log_ratios: torch.Tensor
    model_trace: object
    base_trace: object

    @property
    def num_samples(self) -> int:
        return int(self.log_ratios.shape[0])

    def latent_values(self) -> dict[str, torch.Tensor]:
        """Vectorized values of the latent sample sites (``pyro.deterministic`` excluded), in
        the layout :class:`pyro.infer.Predictive` takes as ``posterior_samples``."""
        return {
            name: site["value"]
            for name, site in self.model_trace.nodes.items()
            if site["type"] == "sample"
            and not site["is_observed"]
            and name in self.base_trace.nodes
        }

    def site_draws(self, name: str) -> torch.Tensor:
        """The draws of site ``name``, shaped ``(S,) + its plain value's shape``."""
        site = self.model_trace.nodes[name]
        return self.per_draw(site["value"], self.base_trace.nodes[name]["value"].shape)

    def pointwise_log_prob(self, name: str) -> torch.Tensor:
        """Unscaled ``log p(value | ...)`` of site ``name`` per draw and batch element,
        shaped ``(S,) + the site's plain batch shape`` (event dimensions summed)."""
        site = self.model_trace.nodes[name]
        log_p = site["fn"].log_prob(site["value"])
        return self.per_draw(log_p, self.base_trace.nodes[name]["fn"].batch_shape)

    def per_draw(self, t: torch.Tensor, plain_shape) -> torch.Tensor:
        """Reshape a vectorized ``(S, 1, ..., 1, *plain_shape)`` tensor (possibly broadcast
        within ``plain_shape``) to ``(S,) + plain_shape``."""
        p = len(plain_shape)
        t = t.detach()
        t = t.reshape((self.num_samples,) + tuple(t.shape[t.ndim - p :]) if p else (-1,))
        return t.expand((self.num_samples,) + tuple(plain_shape))


@torch.no_grad()
def importance_draws(
    model, guide, *args, num_samples: int = 1000, max_plate_nesting: int | None = None, **kwargs
) -> ImportanceDraws:
    """Draw ``num_samples`` times from ``guide`` and weigh each draw against ``model``.

    :param max_plate_nesting: the model's plate depth; read from a trace when ``None``.
    :raises ValueError: if ``num_samples < 2``.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro_gradroute.diagnostics.draws import importance_draws
        >>> model = lambda: pyro.sample("z", dist.Normal(0.0, 1.0))
        >>> guide = lambda: pyro.sample("z", dist.Normal(0.0, 1.0))
        >>> d = importance_draws(model, guide, num_samples=10)
        >>> bool((d.log_ratios.abs() < 1e-6).all())  # guide == posterior: log-ratios are log p(x) = 0
        True
    """
    if num_samples < 2:
        raise ValueError(f"num_samples must be at least 2, got {num_samples}")
    base = trace_model(model, args, kwargs)
    nesting = plate_depth(base) if max_plate_nesting is None else max_plate_nesting
    log_w, model_trace, _ = vectorized_importance_weights(
        model, guide, *args, num_samples=num_samples, max_plate_nesting=nesting, **kwargs
    )
    return ImportanceDraws(log_w.detach().reshape(num_samples), model_trace, base)
