r"""Guide draws with their importance log-ratios: the shared input of the diagnostics.

For :math:`S` draws :math:`z_s \sim q(z)` the importance log-ratio is

.. math::

    \log r_s = \log p(x, z_s) - \log q(z_s).

Model and guide run once, vectorized over an outer ``pyro.plate``, or one draw at a time for a
model that does not vectorize (:func:`importance_draws`). Subsampled plates run at their full
size (:mod:`.plates`) and discrete sites enumerated in the model are summed out
(:mod:`.enumerated`), as ``docs/diagnostics.md`` tells.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import pyro
import pyro.poutine as poutine
import torch
from pyro.distributions.util import scale_and_mask
from pyro.poutine.util import prune_subsample_sites

from .._compat import is_deterministic_site
from .._validation import check_int
from .enumerated import EnumerationError, enumerate_model, marginal_terms
from .plates import full_data_error, full_plates, trace_model
from .plates import max_plate_nesting as plate_depth

_DRAWS = "_diagnostic_draws"  # the plate over guide draws


class VectorizationError(RuntimeError):
    """The model or guide failed when run vectorized over the draws."""


@dataclass
class ImportanceDraws:
    r"""``S`` guide draws replayed through the model.

    :ivar log_ratios: ``(S,)`` tensor of :math:`\log p(x, z_s) - \log q(z_s)`.
    :ivar values: ``{site: (S,) + plain value shape}`` for every latent (and deterministic)
        sample site of the model.
    :ivar log_probs: ``{site: (S,) + plain batch shape}``: unscaled ``log p(value | ...)`` of
        every observed site (event dimensions summed), or the reason (a string) where there is
        none (an enumerated site summed out over several points or sites).
    :ivar base_trace: one plain (unvectorized) trace of the model: shapes, plates, observations.
    :ivar vectorized: whether the draws were made in one vectorized pass.
    :ivar full_plates: ``{plate: (points the model's plate draws, full size)}`` for each
        subsampled plate that was evaluated at its full size.
    :ivar enumerated: names of the enumerated model sites that were summed out (they have no
        draws in :attr:`values`).
    :ivar log_q: ``(S,)`` tensor of the guide's :math:`\log q(z_s)`; the model's
        :math:`\log p(x, z_s)` is ``log_ratios + log_q`` (ArviZ 1.x's
        ``loo_approximate_posterior`` takes the two).
    """

    log_ratios: torch.Tensor
    values: dict = field(repr=False)
    log_probs: dict = field(repr=False)
    base_trace: object = field(repr=False)
    vectorized: bool = True
    #: latent draws in the layout ``Predictive`` takes: vectorized (``(S, 1, ..., *shape)``,
    #: the draw dimension left of the plates) or stacked (``(S, *shape)``) when drawn one by one
    predictive_values: dict = field(default_factory=dict, repr=False)
    full_plates: dict = field(default_factory=dict)
    enumerated: set = field(default_factory=set)
    log_q: torch.Tensor | None = field(default=None, repr=False)

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
        shaped ``(S,) + the site's plain batch shape`` (event dimensions summed), with the
        enumerated sites summed out.

        :raises EnumerationError: where that log-likelihood does not factor over points."""
        lp = self.log_probs[name]
        if isinstance(lp, str):
            raise EnumerationError(
                f"no pointwise log-likelihood for observed site {name!r}: {lp}. "
                "psis_khat and the log-ratios still work; for az.loo, make the enumerated "
                "site local to one observed site's plate."
            )
        return lp

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


def _reduce(t: torch.Tensor, particle_dim: int | None) -> torch.Tensor:
    """Sum a log-density term over everything but the draw dimension: ``(S,)`` or ``(1,)``
    (a term that does not depend on the draw), or a scalar when drawing one at a time."""
    if particle_dim is None:
        return t.sum()
    n = -particle_dim
    if t.dim() < n:
        t = t.reshape((1,) * (n - t.dim()) + tuple(t.shape))
    lead = t.shape[: t.dim() - n]
    if any(size != 1 for size in lead):
        raise AssertionError(f"a log-density term has undeclared leading dimensions {lead}")
    t = t.reshape(t.shape[t.dim() - n :])
    return t.sum(tuple(range(1, n))) if n > 1 else t


def _traces(model, guide, args, kwargs, num_samples: int | None, nesting: int):
    """Guide and model traces of one pass (vectorized over ``num_samples`` draws in an outer
    plate, or one draw when ``None``), every subsampled plate full and every enumerated model
    site enumerated. Returns the traces, the made-full plates and the draw plate's dim."""
    particle_dim = None if num_samples is None else -(nesting + 1)
    first_enum = -(nesting + 1) if particle_dim is None else particle_dim - 1

    def vectorize(fn):
        if num_samples is None:
            return fn

        def _fn(*a, **k):
            with pyro.plate(_DRAWS, num_samples, dim=particle_dim):
                return fn(*a, **k)

        return _fn

    with full_plates() as made_full:
        try:
            guide_trace = poutine.trace(vectorize(guide)).get_trace(*args, **kwargs)
            replayed = poutine.replay(vectorize(model), trace=guide_trace)
            model_trace = poutine.trace(enumerate_model(replayed, first_enum)).get_trace(
                *args, **kwargs
            )
        except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as e:
            if made_full and not isinstance(e, EnumerationError):
                raise full_data_error(made_full, e) from e
            raise
    return prune_subsample_sites(guide_trace), prune_subsample_sites(model_trace), made_full


def _log_ratio_and_log_probs(guide_trace, model_trace, particle_plate):
    """``log p(x, z) - log q(z)`` and ``log q(z)`` per draw (enumerated sites summed out), the
    unscaled pointwise ``log p(x_i | z)`` of each observed site (or the reason it has none), and
    the enumerated sites."""
    msites = dict(_sample_sites(model_trace))
    mlp = {n: s["fn"].log_prob(s["value"]) for n, s in msites.items()}
    terms, pointwise, enumerated = marginal_terms(msites, mlp, particle_plate)
    particle_dim = None
    if particle_plate is not None:
        particle_dim = next(
            f.dim for s in msites.values() for f in s["cond_indep_stack"]
            if f.name == particle_plate
        )  # fmt: skip
    log_w = sum(_reduce(t, particle_dim) for t in terms)
    log_q = 0.0
    for _, s in _sample_sites(guide_trace):
        lq = scale_and_mask(s["fn"].log_prob(s["value"]), s["scale"], s["mask"])
        log_q = log_q + _reduce(lq, particle_dim)
    log_w = log_w - log_q
    log_probs = {}
    for n, s in msites.items():
        if _observed(s):
            log_probs[n] = pointwise.get(n, mlp[n])
    return (
        log_w,
        torch.as_tensor(log_q, dtype=log_w.dtype, device=log_w.device),
        log_probs,
        enumerated,
    )


def _draws(model, guide, args, kwargs, num_samples, nesting, base) -> ImportanceDraws:
    """``num_samples`` draws in one vectorized pass, or one draw when ``None``."""
    n = 1 if num_samples is None else num_samples
    guide_trace, model_trace, made_full = _traces(model, guide, args, kwargs, num_samples,
                                                  nesting)  # fmt: skip
    plate = None if num_samples is None else _DRAWS
    log_w, log_q, lps, enumerated = _log_ratio_and_log_probs(guide_trace, model_trace, plate)
    values, log_probs, layout = {}, {}, {}
    for name, site in _sample_sites(model_trace):
        if name not in base.nodes or name in enumerated:
            continue
        plain = base.nodes[name]
        if not _observed(site):
            values[name] = _per_draw(site["value"], n, plain["value"].shape)
            layout[name] = site["value"].detach()
        elif isinstance(lps[name], str):  # the reason it has none
            log_probs[name] = lps[name]
        else:
            log_probs[name] = _per_draw(lps[name], n, plain["fn"].batch_shape)
    log_w, log_q = (t.detach().expand(n).clone() for t in (log_w, log_q))
    return ImportanceDraws(log_w, values, log_probs, base, num_samples is not None,
                           layout if num_samples else {}, made_full, enumerated, log_q)  # fmt: skip


def _sequential(model, guide, args, kwargs, num_samples, base, progress) -> ImportanceDraws:
    from tqdm.auto import tqdm

    nesting = plate_depth(base)
    bar = tqdm(range(num_samples), desc="guide draws, one at a time", disable=not progress,
               leave=False)  # fmt: skip
    ds = [_draws(model, guide, args, kwargs, None, nesting, base) for _ in bar]
    last = ds[-1]

    def cat(field: str) -> dict:
        parts = [getattr(d, field) for d in ds]
        return {
            k: v if isinstance(v, str) else torch.cat([p[k] for p in parts])
            for k, v in parts[-1].items()
        }

    return ImportanceDraws(torch.cat([d.log_ratios for d in ds]), cat("values"), cat("log_probs"),
                           base, False, {}, last.full_plates, last.enumerated,
                           torch.cat([d.log_q for d in ds]))  # fmt: skip


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
    :raises ValueError: if ``num_samples`` is not an integer >= 2, or ``max_plate_nesting``
        not an integer >= 0 (or ``None``).

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
    num_samples = check_int(num_samples, "num_samples", "importance_draws", minimum=2)
    check_int(max_plate_nesting, "max_plate_nesting", "importance_draws", minimum=0,
              allow_none=True)  # fmt: skip
    base = trace_model(model, args, kwargs)
    if vectorize is False:
        return _sequential(model, guide, args, kwargs, num_samples, base, progress)
    nesting = plate_depth(base) if max_plate_nesting is None else max_plate_nesting
    try:
        return _draws(model, guide, args, kwargs, num_samples, nesting, base)
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
