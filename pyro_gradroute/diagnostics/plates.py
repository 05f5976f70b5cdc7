"""Dimension names and coordinates of a model's sites, read from its plates: a plate's
dimension is named after it (coordinates ``range(size)``), any other of site ``"w"`` is
``"w_dim_k"`` (ArviZ's own default naming)."""

from __future__ import annotations

import pyro.poutine as poutine
from pyro.poutine.util import prune_subsample_sites

from .._compat import is_deterministic_site
from .full_data import full_data_error, full_plates


def trace_model(model, args: tuple, kwargs: dict):
    """One plain trace of ``model(*args, **kwargs)``, without recording into the param store,
    with every subsampled plate at its full size (:func:`.full_data.full_plates`).

    :raises FullDataError: if the model fails with its subsampled plates made full."""
    with full_plates() as made_full, poutine.block(hide_types=["param"]):
        try:
            trace = prune_subsample_sites(poutine.trace(model).get_trace(*args, **kwargs))
            if made_full:  # observations that are only the minibatch fail here, not later
                trace.compute_log_prob()
            return trace
        except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as e:
            if made_full:
                raise full_data_error(made_full, e) from e
            raise


def max_plate_nesting(trace) -> int:
    """The deepest vectorized plate dimension used by any sample site of ``trace``."""
    dims = [
        -f.dim
        for site in trace.nodes.values()
        if site["type"] == "sample"
        for f in site["cond_indep_stack"]
        if f.vectorized and f.dim is not None
    ]
    return max(dims, default=0)


def site_dims(site) -> list[str]:
    """Names of the dimensions of ``site["value"]`` (batch dims by plate, then the rest)."""
    frames = {f.dim: f.name for f in site["cond_indep_stack"] if f.vectorized}
    shape = site["value"].shape
    batch_ndim = len(shape) - len(site["fn"].event_shape)
    if is_deterministic_site(site):  # pyro.deterministic makes every dim an event dim
        batch_ndim = len(shape)
    names, k = [], 0
    for i in range(len(shape)):
        dim = i - batch_ndim
        if i < batch_ndim and dim in frames:
            names.append(frames[dim])
        else:
            names.append(f"{site['name']}_dim_{k}")
            k += 1
    return names


def plate_coords(trace) -> dict[str, list[int]]:
    """``{plate name: range(size of that dimension)}`` for every vectorized plate in ``trace``."""
    coords: dict[str, list[int]] = {}
    for site in trace.nodes.values():
        if site["type"] != "sample":
            continue
        shape = site["value"].shape
        batch_ndim = len(shape) - len(site["fn"].event_shape)
        for f in site["cond_indep_stack"]:
            if f.vectorized and f.dim is not None and -f.dim <= batch_ndim:
                size = shape[batch_ndim + f.dim]
                if size > 1 or f.size == 1:
                    coords.setdefault(f.name, list(range(size)))
    return coords
