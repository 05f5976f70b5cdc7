r"""Run a model with every subsampled ``pyro.plate`` at its full size.

The diagnostics need one consistent set of points (the pointwise log-likelihood belongs to the
``observed_data`` beside it; the log-ratio is :math:`\log p(x_{1..N}, z) - \log q(z)`, not a
random minibatch's estimate). A model that indexes its data with the plate's indices
(``data[ind]``) then sees all ``N`` points; one whose observations are only the minibatch fails,
and :func:`full_data_error` names the plate.
"""

from __future__ import annotations

from contextlib import contextmanager

from .._compat import replaced_subsample


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
        >>> from pyro_gradroute.diagnostics.full_data import full_plates
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
