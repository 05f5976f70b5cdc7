r"""Guide draws with their importance log-ratios: the shared input of the diagnostics.

For :math:`S` draws :math:`z_s \sim q(z)` the importance log-ratio is

.. math::

    \log r_s = \log p(x, z_s) - \log q(z_s).

By default model and guide run once, vectorized over an outer ``pyro.plate`` (Pyro's
:func:`pyro.infer.importance.vectorized_importance_weights`). A model that does not vectorize
(e.g. ``PyroModule[nn.Linear]`` with ``PyroSample`` priors, whose weight gains a batch
dimension that ``F.linear`` refuses) is drawn one sample at a time instead, with a progress
bar: ``vectorize=None`` (the default) tries the vectorized pass and falls back with a warning,
``vectorize=False`` skips the attempt, ``vectorize=True`` raises, saying so.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import pyro.poutine as poutine
import torch
from pyro.infer.importance import vectorized_importance_weights
from pyro.poutine.util import prune_subsample_sites

from .._compat import is_deterministic_site
from .plates import max_plate_nesting as plate_depth
from .plates import trace_model


class VectorizationError(RuntimeError):
    """The model or guide failed when run vectorized over the draws."""


@dataclass
class ImportanceDraws:
    r"""``S`` guide draws replayed through the model.

    :ivar log_ratios: ``(S,)`` tensor of :math:`\log p(x, z_s) - \log q(z_s)`.
    :ivar values: ``{site: (S,) + plain value shape}`` for every latent (and deterministic)
        sample site of the model.
    :ivar log_probs: ``{site: (S,) + plain batch shape}``: unscaled ``log p(value | ...)`` of
        every observed site (event dimensions summed).
    :ivar base_trace: one plain (unvectorized) trace of the model: shapes, plates, observations.
    :ivar vectorized: whether the draws were made in one vectorized pass.
    """

    log_ratios: torch.Tensor
    values: dict = field(repr=False)
    log_probs: dict = field(repr=False)
    base_trace: object = field(repr=False)
    vectorized: bool = True
    #: latent draws in the layout ``Predictive`` takes: vectorized (``(S, 1, ..., *shape)``,
    #: the draw dimension left of the plates) or stacked (``(S, *shape)``) when drawn one by one
    predictive_values: dict = field(default_factory=dict, repr=False)

    @property
    def num_samples(self) -> int:
        return int(self.log_ratios.shape[0])

    def latent_values(self) -> dict[str, torch.Tensor]:
        """Draws of the latent sample sites (``pyro.deterministic`` excluded), in the layout
        :class:`pyro.infer.Predictive` takes as ``posterior_samples`` (``parallel`` as
        :attr:`vectorized`)."""
        source = self.predictive_values or self.values
        return {
            name: source[name]
            for name, site in self.base_trace.nodes.items()
            if site["type"] == "sample" and not site["is_observed"] and name in source
        }

    def site_draws(self, name: str) -> torch.Tensor:
        """The draws of site ``name``, shaped ``(S,) + its plain value's shape``."""
        return self.values[name]

    def pointwise_log_prob(self, name: str) -> torch.Tensor:
        """Unscaled ``log p(value | ...)`` of observed site ``name`` per draw and batch element,
        shaped ``(S,) + the site's plain batch shape`` (event dimensions summed)."""
        return self.log_probs[name]

    def per_draw(self, t: torch.Tensor, plain_shape) -> torch.Tensor:
        """Reshape a vectorized ``(S, 1, ..., 1, *plain_shape)`` tensor (possibly broadcast
        within ``plain_shape``) to ``(S,) + plain_shape``."""
        return _per_draw(t, self.num_samples, plain_shape)


def _per_draw(t: torch.Tensor, num_samples: int, plain_shape) -> torch.Tensor:
    p = len(plain_shape)
    t = t.detach()
    t = t.reshape((num_samples,) + tuple(t.shape[t.ndim - p :]) if p else (-1,))
    return t.expand((num_samples,) + tuple(plain_shape))


def _sample_sites(trace):
    return [(n, s) for n, s in trace.nodes.items() if s["type"] == "sample"]


def _observed(site) -> bool:
    return site["is_observed"] and not is_deterministic_site(site)


def _vectorized(model, guide, args, kwargs, num_samples, nesting, base) -> ImportanceDraws:
    log_w, model_trace, _ = vectorized_importance_weights(
        model, guide, *args, num_samples=num_samples, max_plate_nesting=nesting, **kwargs
    )
    values, log_probs, layout = {}, {}, {}
    for name, site in _sample_sites(model_trace):
        if name not in base.nodes:
            continue
        plain = base.nodes[name]
        if not _observed(site):
            values[name] = _per_draw(site["value"], num_samples, plain["value"].shape)
            layout[name] = site["value"].detach()
        else:
            log_p = site["fn"].log_prob(site["value"])
            log_probs[name] = _per_draw(log_p, num_samples, plain["fn"].batch_shape)
    log_w = log_w.detach().reshape(num_samples)
    return ImportanceDraws(log_w, values, log_probs, base, True, layout)


def _sequential(model, guide, args, kwargs, num_samples, base, progress) -> ImportanceDraws:
    from tqdm.auto import tqdm

    log_w, values, log_probs = [], {}, {}
    for _ in tqdm(range(num_samples), desc="guide draws, one at a time", disable=not progress,
                  leave=False):  # fmt: skip
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        replayed = poutine.replay(model, trace=guide_trace)
        model_trace = poutine.trace(replayed).get_trace(*args, **kwargs)
        log_w.append(model_trace.log_prob_sum().detach() - guide_trace.log_prob_sum().detach())
        model_trace = prune_subsample_sites(model_trace)
        for name, site in _sample_sites(model_trace):
            if name not in base.nodes:
                continue
            if not _observed(site):
                values.setdefault(name, []).append(site["value"].detach())
            else:
                log_probs.setdefault(name, []).append(site["fn"].log_prob(site["value"]).detach())
    stack = {k: torch.stack(v) for k, v in values.items()}
    lp = {k: torch.stack(v) for k, v in log_probs.items()}
    return ImportanceDraws(torch.stack(log_w).reshape(num_samples), stack, lp, base, False)


@torch.no_grad()
def importance_draws(
    model,
    guide,
    *args,
    num_samples: int = 1000,
    max_plate_nesting: int | None = None,
    vectorize: bool | None = None,
    progress: bool = True,
    **kwargs,
) -> ImportanceDraws:
    """Draw ``num_samples`` times from ``guide`` and weigh each draw against ``model``.

    :param max_plate_nesting: the model's plate depth; read from a trace when ``None``.
    :param vectorize: ``True``: one vectorized pass (raises :class:`VectorizationError` if the
        model does not vectorize); ``False``: one draw at a time; ``None``: try the vectorized
        pass and fall back to one draw at a time with a warning.
    :param progress: show a progress bar when drawing one at a time.
    :raises ValueError: if ``num_samples < 2``.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro_gradroute.diagnostics.draws import importance_draws
        >>> model = lambda: pyro.sample("z", dist.Normal(0.0, 1.0))
        >>> guide = lambda: pyro.sample("z", dist.Normal(0.0, 1.0))
        >>> d = importance_draws(model, guide, num_samples=10)
        >>> bool((d.log_ratios.abs() < 1e-6).all())  # guide == posterior: log-ratios are log p(x) = 0
        True
        >>> importance_draws(model, guide, num_samples=10, vectorize=False).vectorized
        False
    """
    if num_samples < 2:
        raise ValueError(f"num_samples must be at least 2, got {num_samples}")
    base = trace_model(model, args, kwargs)
    if vectorize is False:
        return _sequential(model, guide, args, kwargs, num_samples, base, progress)
    nesting = plate_depth(base) if max_plate_nesting is None else max_plate_nesting
    try:
        return _vectorized(model, guide, args, kwargs, num_samples, nesting, base)
    except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as e:
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if vectorize:
            raise VectorizationError(
                f"the model or guide does not run vectorized over {num_samples} draws ({reason}). "
                "Declare every batch dimension with pyro.plate, or pass vectorize=False to draw "
                "one sample at a time."
            ) from e
        warnings.warn(
            f"the model or guide does not run vectorized over the draws ({reason}); drawing "
            "one sample at a time (pass vectorize=False to skip the vectorized attempt)",
            stacklevel=3,
        )
    return _sequential(model, guide, args, kwargs, num_samples, base, progress)
