"""ArviZ, imported lazily and used through the calls that ArviZ 0.23 and 1.x share.

ArviZ 0.23 (Python 3.10/3.11) takes ``from_dict(posterior=..., log_likelihood=..., ...)`` and
has ``psislw``; ArviZ 1.x (arviz-base/arviz-stats) takes ``from_dict({"posterior": ..., ...})``
and may move ``psislw``. Everything version-dependent lives here.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np


def import_arviz():
    """Import ArviZ quietly (0.23 warns about its 1.x refactor at import time)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import arviz

    return arviz


def from_dict(groups: Mapping[str, Mapping[str, np.ndarray]], coords: dict, dims: dict) -> Any:
    """``arviz.from_dict`` for either signature; ``groups`` maps group name -> {var: array}."""
    az = import_arviz()
    groups = {k: dict(v) for k, v in groups.items() if v}
    if "posterior" in inspect.signature(az.from_dict).parameters:  # ArviZ 0.x
        return az.from_dict(**groups, coords=coords, dims=dims)
    return az.from_dict(groups, coords=coords, dims=dims)  # ArviZ 1.x: one dict of groups


def psislw_khat(log_ratios: np.ndarray) -> float | None:
    """Pareto k-hat from ArviZ's PSIS, or ``None`` when this ArviZ has no ``psislw``."""
    az = import_arviz()
    psislw = getattr(az, "psislw", None)
    if psislw is None:
        try:  # ArviZ 1.x keeps the statistics in arviz_stats
            from arviz_stats import psislw  # type: ignore[no-redef]
        except ImportError:
            return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "k-hat > 0.7" is a result here, not a warning
        out = psislw(np.asarray(log_ratios, dtype=np.float64))
    khat = out[1] if isinstance(out, tuple) else getattr(out, "khat", None)
    return None if khat is None else float(np.asarray(khat))
