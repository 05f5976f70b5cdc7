"""PNG plots of a comparison (matplotlib's Agg backend; no display needed).

* ``loss_curves.png``: each estimator's training loss per step (moving average; the window is
  stated on the axis);
* ``gradient_snr.png``: norm SNR of the gradient for guide and model parameters, per estimator,
  with bootstrap error bars (68% interval over the gradient draws);
* ``forest.png``: ArviZ forest plot of the fitted guides' posteriors, one colour per estimator.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np

from ..diagnostics._arviz import forest_figure


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _smooth(x: Sequence[float], width: int) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    if width <= 1 or len(x) <= width:
        return x
    return np.convolve(x, np.ones(width) / width, mode="valid")


def smoothing_window(results) -> int:
    """Steps in the loss plot's moving average: 1/50 of the longest run, at least 1."""
    return max(1, max((len(r.losses) for r in results), default=0) // 50)


def plot_losses(results, path: str) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    lows, highs = [], []
    width = smoothing_window(results)
    for r in results:
        y = _smooth(r.losses, width)
        label = f"{r.name} (diverged at step {r.diverged_at})" if r.diverged else r.name
        ax.plot(np.arange(len(y)) + (len(r.losses) - len(y)), y, label=label)
        y = y[np.isfinite(y)]
        if len(y):
            lows.append(np.min(y))
            highs.append(np.percentile(y, 90))
    if lows and max(highs) < 1e300:
        pad = 0.05 * (max(highs) - min(lows) or 1.0)
        ax.set_ylim(min(lows) - pad, max(highs) + pad)
    # the y range ends at the 90th percentile so that the late steps, where estimators
    # differ, are readable; the first steps (largest losses) may leave the chart
    avg = f"moving average over {width} steps" if width > 1 else "every step, not smoothed"
    ax.set(xlabel="step", ylabel="loss (summed over the data)",
           title=f"Training loss ({avg}; early steps may be off-chart)")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_snr(results, path: str) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(results))
    series = []  # only the parameter groups the model has (e.g. no model params: no empty bars)
    for label, attr in [("guide params", "snr_guide"),
                        ("model params", "snr_model")]:  # fmt: skip
        vals = [getattr(r, attr) for r in results]
        if any(v is not None and math.isfinite(v) for v in vals):
            bars = [v if v is not None and math.isfinite(v) else 0.0 for v in vals]
            errs = np.zeros((2, len(results)))
            for j, r in enumerate(results):
                if r.grads is not None and math.isfinite(bars[j]):
                    lo, hi = getattr(r, f"{attr}_interval")  # contains the estimate
                    if math.isfinite(lo) and math.isfinite(hi):
                        errs[:, j] = [max(0.0, bars[j] - lo), max(0.0, hi - bars[j])]
            series.append((label, bars, errs))
    width = 0.76 / max(1, len(series))
    for i, (label, vals, errs) in enumerate(series):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width=width, label=label,
               yerr=errs, capsize=3)  # fmt: skip
    ax.set_xticks(x, [r.name for r in results])
    ax.set(ylabel="gradient SNR  |mean| / sd",
           title="Gradient signal-to-noise at the fit (bars: 68% bootstrap interval)")  # fmt: skip
    if series:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_forest(results, path: str, var_names=None) -> str:
    """ArviZ's forest plot of every estimator's guide draws (ArviZ 0.23 or 1.x)."""
    plt = _pyplot()
    results = [r for r in results if r.idata is not None]  # diverged fits have no draws
    if not results:
        return None
    height = 1.5 + 0.1 * _num_rows(results[0].idata, var_names) * len(results)
    fig = forest_figure({r.name: r.idata for r in results}, var_names, (7, height))
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _num_rows(idata, var_names) -> int:
    post = idata["posterior"]
    names = var_names or list(post.data_vars)
    return max(1, sum(int(np.prod(post[v].shape[2:])) for v in names))


def plot_control_variates(results, path: str) -> str | None:
    """The adaptive estimators' mean control-variate weight ``b`` over training (None if none ran)."""
    runs = [r for r in results if getattr(r, "cv_weights", None)]
    if not runs:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        steps = [s for s, _ in r.cv_weights]
        for param in r.cv_weights[-1][1]:
            ax.plot(
                steps,
                [w.get(param, float("nan")) for _, w in r.cv_weights],
                label=f"{r.name}: {param}",
            )
    ax.axhline(0.0, color="grey", lw=0.5)
    ax.axhline(1.0, color="grey", lw=0.5, ls="--")
    ax.set_xlabel("SVI step")
    ax.set_ylabel("mean weight b (0: STL/DReG, 1: Trace/IWAE)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(results, out_dir: str, var_names=None) -> list[str]:
    """Write the three PNGs into ``out_dir`` (created) and return their paths (no forest plot
    when no fit finished)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [
        plot_losses(results, os.path.join(out_dir, "loss_curves.png")),
        plot_snr(results, os.path.join(out_dir, "gradient_snr.png")),
        plot_forest(results, os.path.join(out_dir, "forest.png"), var_names),
        plot_control_variates(results, os.path.join(out_dir, "control_variates.png")),
    ]
    return [p for p in paths if p is not None]
