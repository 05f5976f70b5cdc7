"""``from_pyro_svi`` (alias ``to_inference_data``): a fitted guide's draws as ArviZ data."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyro
import torch
from pyro.distributions import Unit
from pyro.infer import Predictive
from pyro.poutine.uncondition_messenger import UnconditionMessenger
from pyro.poutine.util import prune_subsample_sites

from .. import _validation
from .._compat import is_deterministic_site
from ._arviz import from_dict
from .draws import ImportanceDraws, importance_draws
from .plates import full_plates, plate_coords, site_dims
from .psis import pareto_khat


def _numpy_draws(t: torch.Tensor):
    return t.detach().cpu().double().numpy()[None]  # (chain=1, draw=S, ...)


def latent_and_observed(trace) -> tuple[list[str], list[str]]:
    """Names of the latent sample sites (and ``pyro.deterministic`` sites) and of the observed
    sample sites that are data (not ``pyro.factor``)."""
    latent, observed = [], []
    for name, site in prune_subsample_sites(trace).nodes.items():
        if site["type"] != "sample":
            continue
        if not site["is_observed"] or is_deterministic_site(site):
            latent.append(name)
        elif not isinstance(site["fn"], Unit):
            observed.append(name)
    return latent, observed


class _UnconditionData(UnconditionMessenger):
    """``poutine.uncondition`` that leaves ``pyro.deterministic`` sites alone (unconditioning
    their Delta makes Pyro 1.9 draw wrongly shaped values)."""

    def _pyro_sample(self, msg) -> None:
        if not is_deterministic_site(msg):
            super()._pyro_sample(msg)


def _posterior_predictive(model, draws: ImportanceDraws, observed, args, kwargs):
    predictive = Predictive(
        _UnconditionData()(model),
        posterior_samples=draws.latent_values(),
        num_samples=draws.num_samples,
        return_sites=list(observed),
        parallel=draws.vectorized,
    )
    with full_plates():  # the same points as the log-likelihood and observed_data
        out = predictive(*args, **kwargs)
    base = draws.base_trace.nodes
    return {k: draws.per_draw(out[k], base[k]["value"].shape) for k in observed}


def from_pyro_svi(
    model,
    guide,
    *args,
    num_samples: int = 1000,
    max_plate_nesting: int | None = None,
    posterior_predictive: bool = True,
    coords: Mapping[str, Sequence] | None = None,
    dims: Mapping[str, Sequence[str]] | None = None,
    vectorize: bool | None = None,
    progress: bool = True,
    **kwargs,
) -> Any:
    r"""A fitted ``guide``'s draws as ArviZ data (``to_inference_data`` is this function).

    An ``xarray.DataTree`` on ArviZ 1.x, an ``arviz.InferenceData`` on ArviZ 0.23, with the same
    groups, variables, dimensions and coordinates; each sample group has ``chain = 1`` and
    ``draw = num_samples`` (ArviZ 1.x's ``from_numpyro_svi`` layout, with ``(chain, draw)``
    rather than ``sample``, so ``az.summary``, ``az.loo`` and the plots need no ``sample_dims``):

    * ``posterior``: the guide's draws :math:`z_s \sim q(z)` of every latent site of the model;
    * ``posterior_predictive``: :math:`\tilde x_s \sim p(x \mid z_s)` for every observed site
      (the model run with its data sites unconditioned by :class:`pyro.infer.Predictive`);
    * ``log_likelihood``: :math:`\log p(x_i \mid z_s)` per draw and per element of the site's
      plates (event dimensions summed), so ``az.loo`` works; ``pyro.factor`` sites count in the
      log-ratio but have no entry;
    * ``observed_data``: the observed values;
    * ``sample_stats``: ``log_importance_ratio`` :math:`= \log p(x, z_s) - \log q(z_s)`, ``lp``
      :math:`= \log p(x, z_s)` and ``log_q`` :math:`= \log q(z_s)` (what ArviZ 1.x's
      ``az.loo_approximate_posterior`` takes), with the attribute ``pareto_k``, the PSIS
      :math:`\hat k` of the ratios (:func:`~pyro_gradroute.diagnostics.pareto_khat`).

    Dimensions inside a ``pyro.plate`` are named after the plate, with coordinates
    ``0..size-1``; others are named ``"{site}_dim_{k}"``.

    **Subsampled plates** are evaluated at their full size ``N`` in the model, the guide and the
    predictive (:func:`~pyro_gradroute.diagnostics.plates.full_plates`): ``observed_data``,
    ``log_likelihood``, ``posterior_predictive`` and the ratios cover all ``N`` points (groups'
    attribute ``subsampled_plates_evaluated_in_full``). A model whose observations are only the
    minibatch (``obs=batch``, not ``data[ind]``) raises
    :class:`~pyro_gradroute.diagnostics.plates.FullDataError` naming the plate.

    **Discrete sites enumerated in the model** are summed out
    (:mod:`~pyro_gradroute.diagnostics.enumerated`, which lists what raises
    ``EnumerationError``): ``log_likelihood`` is :math:`\operatorname{logsumexp}_k [\log p(k_i)
    + \log p(x_i \mid k_i, z)]`, the log-ratio :math:`\log \sum_k p(x, z, k) - \log q(z)`; they
    have no ``posterior`` entry (attribute ``enumerated_sites_summed_out``), and
    ``posterior_predictive`` draws them from their prior.

    The draws are independent (one ``chain`` of :math:`S` i.i.d. guide draws), not a Markov
    chain: summarize them with ``az.summary(idata, kind="stats")``; the MCMC columns (ESS, MCSE,
    ``r_hat``) that plain ``az.summary`` adds do not apply to them.

    :param model: the Pyro model the guide was fitted to.
    :param guide: the guide (any callable with the model's latent sites, e.g. an AutoGuide).
    :param args: the model's positional arguments (the data it conditions on).
    :param num_samples: number of guide draws :math:`S` (an integer, at least 2).
    :param max_plate_nesting: the model's plate depth (read from a trace when ``None``).
    :param posterior_predictive: set ``False`` to skip the ``posterior_predictive`` group.
    :param coords: coordinates that replace or add to the plate-derived ones,
        e.g. ``{"school": names}``.
    :param dims: dimension names per variable that replace the derived ones,
        e.g. ``{"w": ["feature"]}``: one name per dimension of the site's value (batch then
        event dimensions), else a ``ValueError`` naming the entry.
    :param vectorize: as in :func:`~pyro_gradroute.diagnostics.draws.importance_draws`: by
        default one vectorized pass, falling back to one draw at a time with a warning.
    :param progress: show a progress bar when drawing one at a time.
    :param kwargs: the model's keyword arguments.

    Example::

        >>> import torch, pyro, pyro.distributions as dist, arviz as az
        >>> from pyro.infer.autoguide import AutoNormal
        >>> pyro.clear_param_store()
        >>> from pyro_gradroute.diagnostics import from_pyro_svi
        >>> def model(x):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", len(x)):
        ...         pyro.sample("x", dist.Normal(mu, 1.0), obs=x)
        >>> x = torch.randn(20)
        >>> guide = AutoNormal(model)
        >>> idata = from_pyro_svi(model, guide, x, num_samples=200)
        >>> idata.log_likelihood["x"].dims
        ('chain', 'draw', 'data')
        >>> loo = az.loo(idata)
        >>> list(az.summary(idata, kind="stats").columns)[:2]
        ['mean', 'sd']
    """
    where = "from_pyro_svi"
    num_samples = _validation.check_int(num_samples, "num_samples", where, minimum=2)
    draws = importance_draws(
        model,
        guide,
        *args,
        num_samples=num_samples,
        max_plate_nesting=max_plate_nesting,
        vectorize=vectorize,
        progress=progress,
        **kwargs,
    )
    base = draws.base_trace
    latent, observed = latent_and_observed(base)
    latent = [k for k in latent if k not in draws.enumerated]
    groups: dict[str, dict] = {
        "posterior": {k: _numpy_draws(draws.site_draws(k)) for k in latent},
        "log_likelihood": {k: _numpy_draws(draws.pointwise_log_prob(k)) for k in observed},
        "observed_data": {
            k: base.nodes[k]["value"].detach().cpu().double().numpy() for k in observed
        },
        "sample_stats": {
            "log_importance_ratio": _numpy_draws(draws.log_ratios),
            "lp": _numpy_draws(draws.log_ratios + draws.log_q),
            "log_q": _numpy_draws(draws.log_q),
        },
    }
    if posterior_predictive and observed:
        pp = _posterior_predictive(model, draws, observed, args, kwargs)
        groups["posterior_predictive"] = {k: _numpy_draws(v) for k, v in pp.items()}
    all_dims = {k: site_dims(base.nodes[k]) for k in latent + observed}
    all_dims.update(_checked_dims(dims, all_dims, where))
    all_coords: dict[str, Sequence] = dict(plate_coords(base))
    all_coords.update(coords or {})
    library = {"inference_library": "pyro", "inference_library_version": pyro.__version__}
    provenance = _provenance(draws)
    attrs = {group: dict(library) for group in groups}
    attrs["log_likelihood"].update(provenance)
    attrs["sample_stats"].update(provenance)
    try:
        attrs["sample_stats"]["pareto_k"] = float(pareto_khat(draws.log_ratios))
    except ValueError:  # NaN ratios or fewer than 2 finite ones: no k-hat (psis_khat says why)
        pass
    return from_dict(groups, coords=all_coords, dims=all_dims, attrs=attrs)


to_inference_data = from_pyro_svi


def _checked_dims(dims, derived: dict[str, list[str]], where: str) -> dict[str, list[str]]:
    """The user's ``dims``, each entry naming as many dimensions as its site's value has."""
    out = {}
    for name, names in (dims or {}).items():
        names = [names] if isinstance(names, str) else list(names)
        if name in derived and len(names) != len(derived[name]):
            raise ValueError(
                f"{where}: dims[{name!r}] names {len(names)} dimension(s) {names}, but site "
                f"{name!r} has {len(derived[name])} (besides chain and draw), derived as "
                f"{derived[name]}: give one name per dimension, batch then event dimensions"
            )
        out[name] = names
    return out


def _provenance(draws: ImportanceDraws) -> dict[str, str]:
    """Which points and sites the log-likelihood and the log-ratios are computed on."""
    attrs = {}
    if draws.full_plates:
        attrs["subsampled_plates_evaluated_in_full"] = ", ".join(
            f"{name}: all {size} points (the model subsamples {used})"
            for name, (used, size) in draws.full_plates.items()
        )
    if draws.enumerated:
        attrs["enumerated_sites_summed_out"] = ", ".join(sorted(draws.enumerated))
    return attrs
