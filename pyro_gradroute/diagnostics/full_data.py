r"""Run a model with every subsampled ``pyro.plate`` at its full size.

A model fitted on minibatches (``pyro.plate("data", N, subsample_size=b)`` or ``subsample=idx``)
draws a different random minibatch on every run. The diagnostics need one consistent set of
points: the pointwise log-likelihood must belong to the ``observed_data`` next to it, and the
importance log-ratio must be :math:`\log p(x_{1..N}, z) - \log q(z)`, not a rescaled random
minibatch estimate. Inside :func:`full_plates` every subsampled plate takes the full index
``torch.arange(N)`` (scale 1), in the model and in the guide.

A model that indexes its data with the plate's indices (``data[ind]``) then sees all ``N`` points.
A model whose observations are only the minibatch (``obs=batch`` with ``subsample_size=len(batch)``)
cannot: it fails with the full plate, and :func:`full_data_error` turns that failure into a
clear error naming the plate.
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

    Pyro computes a plate's indices inside ``SubsampleMessenger``'s constructor and checks them
    against ``subsample_size`` there, so no effect handler can change them; this context swaps
    that helper (under a lock, restored on exit) for one that drops ``subsample_size`` and
    ``subsample`` when the plate has a size.

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
