r"""A model's plates: run at their full size (:func:`full_plates`; :func:`full_data_error` names a
plate whose model reads only the minibatch), and the names and coordinates of their dimensions
(a plate's dimension is named after it, any other of site ``"w"`` is ``"w_dim_k"``, as ArviZ does).
"""

from __future__ import annotations

from contextlib import contextmanager

import pyro.poutine as poutine
from pyro.poutine.util import prune_subsample_sites

from .._compat import is_deterministic_site, replaced_subsample


class FullDataError(ValueError):
    """A subsampled plate's full data cannot be reached by the model."""


@contextmanager
def full_plates():
    """Within this context every ``pyro.plate(name, size, subsample_size=b)`` or
    ``pyro.plate(name, size, subsample=idx)`` uses all ``size`` indices.

    Yields a dict that fills, as plates are entered, with
    ``{plate name: (points the plate would have used, full size)}`` for each plate made full.
    (Pyro fixes a plate's indices in ``SubsampleMessenger``'s constructor, where no handler
    reaches: this swaps that helper, under a lock, for the duration.)

    Example::

        >>> import torch, pyro
        >>> from pyro_gradroute.diagnostics.plates import full_plates
        >>> with full_plates() as made_full:
        ...     with pyro.plate("data", 10, subsample_size=3) as ind:
        ...         pass
        >>> ind.tolist(), made_full
        ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], {'data': (3, 10)})
    """
    made_full: dict[str, tuple[int, int]] = {}

    def _subsample(fn, name, size, subsample_size, subsample, use_cuda, device):
        if size is not None and (subsample_size is not None or subsample is not None):
            used = subsample_size if subsample is None else len(subsample)
            if int(used) != int(size):
                made_full.setdefault(name, (int(used), int(size)))
            return fn(name, size, None, None, use_cuda, device)
        return fn(name, size, subsample_size, subsample, use_cuda, device)

    with replaced_subsample(_subsample):
        yield made_full


def full_data_error(made_full: dict, error: BaseException) -> FullDataError:
    """The error raised when a model with subsampled plates fails on its full plates."""
    plates = ", ".join(f"{n!r} ({b} of {N} points)" for n, (b, N) in made_full.items())
    return FullDataError(
        f"the model subsamples plate(s) {plates}; the diagnostics evaluate every point, but "
        f"the model failed with the full plate ({type(error).__name__}: "
        f"{str(error).splitlines()[0] if str(error) else ''}). Index the full data with the "
        "plate's indices (`with pyro.plate(name, N, subsample_size=b) as ind: ... obs=data[ind]`), "
        "or call the diagnostics on a model run without subsampling (subsample_size=None) and "
        "with all N observations."
    )


def trace_model(model, args: tuple, kwargs: dict):
    """One plain trace of ``model(*args, **kwargs)``, without recording into the param store,
    with every subsampled plate at its full size (:func:`full_plates`).

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
