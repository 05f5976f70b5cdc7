"""The ``pyro-gradroute`` command (also ``python -m pyro_gradroute``).

``pyro-gradroute compare [--model NAME] [--estimators trace,stl,dreg] [--steps N] [--out DIR]``
fits a model with each estimator from the same initialisation and seed, prints a table (training
loss, ELBO and log p(x) from guide draws, held-out log-likelihood, gradient SNR, time per step,
PSIS k-hat) and writes PNG plots to DIR. ``pyro-gradroute list`` lists models and estimators.

Example::

    >>> from pyro_gradroute.cli import main
    >>> main(["list"])  # doctest: +ELLIPSIS
    models:
    ...
    0
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

DEFAULT_MODEL = "logistic_regression"


def _default_estimators() -> str:
    from .diagnostics.estimators import available_estimators

    return ",".join(n for n in ("trace", "stl", "iwae", "dreg") if n in available_estimators())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pyro-gradroute",
        description="Compare gradient estimators for Pyro variational inference.",
    )
    sub = parser.add_subparsers(dest="command")
    c = sub.add_parser("compare", help="fit a model with several estimators and compare them")
    c.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"bundled model name or module:function (default {DEFAULT_MODEL})",
    )
    c.add_argument(
        "--estimators",
        default=None,
        help="comma-separated estimator names (default: all installed of trace,stl,iwae,dreg)",
    )
    c.add_argument("--steps", type=int, default=None, help="SVI steps (default: the model's)")
    c.add_argument("--lr", type=float, default=None, help="Adam learning rate (model default)")
    c.add_argument(
        "--particles",
        type=int,
        default=None,
        help="particles per step, vectorized (model default, usually 8)",
    )
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--snr-draws", type=int, default=20, help="gradient draws for the SNR")
    c.add_argument(
        "--samples", type=int, default=1000, help="guide draws for k-hat, ELBO and log p(x)"
    )
    c.add_argument("--out", default="gradroute-compare", help="folder for the PNG plots")
    c.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: these models are small, and one thread "
        "times each step without contention)",
    )
    c.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    sub.add_parser("list", help="list bundled models and installed estimators")
    return parser  # fmt: skip


def _list() -> int:
    from .diagnostics.estimators import ESTIMATORS, available_estimators
    from .models.registry import MODELS

    print("models:")
    for name, (_, desc) in MODELS.items():
        print(f"  {name:<20} {desc}")
    print("  module:function      your own: a function returning dict(model=, guide=, args=)")
    print("estimators:")
    have = available_estimators()
    for name, (module, cls, _, desc) in ESTIMATORS.items():
        note = "" if name in have else "  (not installed)"
        print(f"  {name:<20} {module}.{cls}: {desc}{note}")
    return 0


def _compare(args) -> int:
    import torch

    from .diagnostics.compare import compare_estimators, format_table, suggest
    from .diagnostics.plots import write_plots
    from .models.registry import load_problem

    torch.set_num_threads(max(1, args.threads))
    names = [e.strip() for e in (args.estimators or _default_estimators()).split(",") if e.strip()]
    problem = load_problem(args.model)  # errors early, listing what exists
    start = time.perf_counter()
    results = compare_estimators(
        args.model, names, steps=args.steps, lr=args.lr, num_particles=args.particles,
        seed=args.seed, snr_draws=args.snr_draws, num_samples=args.samples,
        progress=not args.no_progress,
    )  # fmt: skip
    print(f"\nmodel: {args.model}  ({problem.description or 'user model'})")
    print(format_table(results))
    print(suggest(results))
    paths = write_plots(results, args.out, var_names=problem.var_names)
    print(f"plots: {', '.join(paths)}")
    print(f"total time: {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status (2 for bad arguments)."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv or ["compare"])
    try:
        if args.command == "list":
            return _list()
        return _compare(args)
    except (ValueError, TypeError) as e:
        print(f"pyro-gradroute: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
