"""ArviZ, imported lazily; every difference between the 0.23 line (``InferenceData``) and the
1.x line (``arviz-base``/``-stats``/``-plots``: an ``xarray.DataTree``) lives here."""

from __future__ import annotations

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


def arviz_major() -> int:
    """The installed ArviZ's major version: 0 (the 0.23 line) or 1."""
    return int(import_arviz().__version__.split(".")[0])


def from_dict(
    groups: Mapping[str, Mapping[str, np.ndarray]],
    coords: dict,
    dims: dict,
    attrs: Mapping[str, Mapping[str, Any]] | None = None,
) -> Any:
    """``arviz.from_dict`` on either line, from ``{group: {variable: array}}`` (empty groups
    dropped) and ``{group: attributes}``."""
    az = import_arviz()
    groups = {k: dict(v) for k, v in groups.items() if v}
    if arviz_major() >= 1:
        data = az.from_dict(groups, coords=coords, dims=dims)  # one dict of groups
    else:
        data = az.from_dict(**groups, coords=coords, dims=dims)
    for group, group_attrs in (attrs or {}).items():
        if group in group_names(data):
            data[group].attrs.update(group_attrs)
    return data


def group_names(data) -> list[str]:
    """The group names of an ``InferenceData`` (0.23) or of a ``DataTree`` (1.x)."""
    groups = data.groups
    if callable(groups):  # InferenceData.groups()
        return list(groups())
    return list(data.children)  # DataTree: groups are the root's children


def psislw_khat(log_ratios: np.ndarray) -> float | None:
    """Pareto k-hat of the importance log-ratios ``log_ratios`` from ArviZ's PSIS (``az.psislw``
    on 0.23, ``DataArray.azstats.psislw`` on 1.x), or ``None`` where this ArviZ cannot fit it
    (1.x: fewer than 25 draws, as its tail is a fifth of them and needs 5)."""
    lw = np.asarray(log_ratios, dtype=np.float64).reshape(-1)
    az = import_arviz()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "k-hat > 0.7" is a result here, not a warning
        if arviz_major() >= 1:
            if lw.size < 25:
                return None
            import arviz_stats  # noqa: F401  (registers the .azstats accessor)
            import xarray as xr

            # 1.x's psislw takes a log-likelihood, whose negation is the LOO log-ratio
            _, khat = xr.DataArray(-lw, dims=["draw"]).azstats.psislw(dim="draw")
        else:
            _, khat = az.psislw(lw)
    return float(np.asarray(khat))


def forest_figure(datas: Mapping[str, Any], var_names, figsize: tuple[float, float]):
    """ArviZ's forest plot of several models' posteriors (one per key of ``datas``, combined
    chains) as a matplotlib figure, on either ArviZ line."""
    az = import_arviz()
    if arviz_major() >= 1:
        pc = az.plot_forest(dict(datas), var_names=var_names, combined=True,
                            backend="matplotlib", figure_kwargs={"figsize": figsize})  # fmt: skip
        pc.add_legend("model")
        return pc.viz["figure"].item()
    axes = az.plot_forest(list(datas.values()), model_names=list(datas), var_names=var_names,
                          combined=True, figsize=figsize)  # fmt: skip
    return np.ravel(axes)[0].figure
