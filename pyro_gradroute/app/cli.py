"""The ``pyro-gradroute`` command (also ``python -m pyro_gradroute``).

``pyro-gradroute compare [--model NAME] [--estimators trace,stl,dreg] [--steps N] [--out DIR]``
fits a model with each estimator from the same initialisation and seed, prints a table (training
loss, ELBO and log p(x) from guide draws, held-out log-likelihood, gradient SNR, time per step,
PSIS k-hat) and writes PNG plots to DIR; ``compare`` may be left out
(``pyro-gradroute --model NAME``). ``pyro-gradroute list`` lists models and estimators.

Arguments are checked before any fitting (exit status 2, naming the flag). An error raised in
the user's own model code is shown with the user's frames (exit status 1; ``--traceback`` for
the full traceback). Ctrl-C prints the table of the estimators that finished (exit status 130).
``list``, ``--help`` and ``--version`` do not import torch.

Example::

    >>> from pyro_gradroute.app.cli import main
    >>> main(["list"])  # doctest: +ELLIPSIS
    models:
    ...
    0
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import sysconfig
import tempfile
import textwrap
import time
import traceback
from collections.abc import Sequence

from .. import __version__
from .catalog import (
    DEFAULT_ESTIMATORS,
    DEFAULT_MODEL,
    DIVERGED,
    ESTIMATORS,
    MODEL_DESCRIPTIONS,
    RENYI_ESTIMATORS,
)

EXIT_USER_CODE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
COMMANDS = ("compare", "list")
DEFAULT_OUT = "gradroute-compare"
DEFAULT_ALPHA = 0.5


def _at_least(low: int):
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    check.__name__ = "int"
    return check


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _renyi_order(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if value == 1 or value != value or abs(value) == float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a finite number other than 1 (alpha=1 is the ELBO: use stl), got {text}"
        )
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pyro-gradroute",
        description="Compare gradient estimators for Pyro variational inference. "
        "'compare' is the default command: 'pyro-gradroute --model NAME' runs it.",
    )
    parser.add_argument("--version", action="version", version=f"pyro-gradroute {__version__}")
    sub = parser.add_subparsers(dest="command")
    c = sub.add_parser(
        "compare",
        help="fit a model with several estimators and compare them",
        description="Fit a model with each estimator from the same initialisation and seed, "
        "print a table and write PNG plots to --out.",
        epilog=_compare_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"bundled model name (listed below) or module:function (default {DEFAULT_MODEL})",
    )
    c.add_argument(
        "--estimators",
        default=None,
        help="comma-separated estimator names, listed below (default: "
        + ",".join(DEFAULT_ESTIMATORS)
        + ")",
    )
    c.add_argument(
        "--steps", type=_at_least(1), default=None, help="SVI steps (default: the model's)"
    )
    c.add_argument(
        "--lr", type=_positive_float, default=None, help="Adam learning rate (model default)"
    )
    c.add_argument(
        "--particles",
        type=_at_least(1),
        default=None,
        help="particles per step, vectorized (model default, usually 8)",
    )
    c.add_argument(
        "--alpha",
        type=_renyi_order,
        default=None,
        help=f"order of the Renyi bound, for the {' and '.join(RENYI_ESTIMATORS)} estimators "
        f"only (default {DEFAULT_ALPHA}; not 1, which is the ELBO)",
    )
    c.add_argument(
        "--seed", type=_at_least(0), default=0, help="random seed, 0 or more (default 0)"
    )
    c.add_argument(
        "--snr-draws",
        type=_at_least(2),
        default=20,
        help="gradient draws for the SNR (default 20)",
    )
    c.add_argument(
        "--samples",
        type=_at_least(2),
        default=1000,
        help="guide draws for k-hat, ELBO and log p(x) (default 1000)",
    )
    c.add_argument(
        "--warmup-steps",
        type=_at_least(0),
        default=0,
        help="start every estimator after the same N steps of Pyro's Trace_ELBO from the "
        "seed, to compare them near a fit (default 0: from the initialisation)",
    )
    c.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help=f"folder for the PNG plots, created if missing (default {DEFAULT_OUT}, in the "
        "current folder)",
    )
    c.add_argument(
        "--threads",
        type=_at_least(1),
        default=1,
        help="torch CPU threads (default 1: these models are small, and one thread "
        "times each step without contention)",
    )
    c.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (a one-line summary per estimator remains)",
    )
    c.add_argument(
        "--traceback",
        action="store_true",
        help="on an error in your model code, print the full traceback",
    )
    sub.add_parser("list", help="list bundled models and estimators")
    parser.compare_parser = c  # errors found after parsing name the compare command's usage
    return parser  # fmt: skip


def _compare_epilog() -> str:
    width = max(map(len, [*MODEL_DESCRIPTIONS, *ESTIMATORS])) + 2
    lines = ["bundled models (--model):"]
    lines += [f"  {name:<{width}}{desc}" for name, desc in MODEL_DESCRIPTIONS.items()]
    lines += [
        "  module:function".ljust(width + 2) + "your own: returns dict(model=, guide=, args=)"
    ]
    lines += ["", "estimators (--estimators):"]
    lines += [f"  {name:<{width}}{module}.{cls}: {desc}"
              for name, (module, cls, _, desc) in ESTIMATORS.items()]  # fmt: skip
    lines += ["", *textwrap.wrap("divergence: " + DIVERGED, 88)]
    return "\n".join(lines)


def _list() -> int:
    print("models:")
    for name, desc in MODEL_DESCRIPTIONS.items():
        print(f"  {name:<20} {desc}")
    print("  module:function      your own: a function returning dict(model=, guide=, args=)")
    print("estimators:")
    for name, (module, cls, _, desc) in ESTIMATORS.items():
        print(f"  {name:<20} {module}.{cls}: {desc}")
    return 0


def _estimator_names(parser, text: str | None) -> list[str]:
    if text is None:
        return list(DEFAULT_ESTIMATORS)
    names = [e.strip() for e in text.split(",")]
    if not any(names):
        parser.error(
            "argument --estimators: the list is empty; choose from " + ", ".join(ESTIMATORS)
        )
    if not all(names):
        parser.error(f"argument --estimators: empty name in {text!r}")
    unknown = [n for n in names if n not in ESTIMATORS]
    if unknown:
        parser.error(f"argument --estimators: unknown estimator {unknown[0]!r}; available: "
                     + ", ".join(ESTIMATORS))  # fmt: skip
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        parser.error(f"argument --estimators: {', '.join(dups)} listed more than once")
    return names


def _os_reason(e: OSError) -> str:
    """Why the file system refused, in words (ENOENT in a folder that exists: it takes no
    new entries, as /proc and /sys do)."""
    if e.errno == errno.ENOENT:
        return "the file system there takes no new files or folders (such as /proc or /sys)"
    return e.strerror or str(e)


def _check_writable(parser, out: str) -> None:
    """Refuse an ``--out`` folder that cannot be created or written to, leaving nothing
    behind: the existing folder must take a new file, or its nearest existing parent a new
    folder (each made and removed again)."""
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        parser.error(f"argument --out: {out!r} exists and is not a folder")
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        parser.error(f"argument --out: cannot create {out!r}: {probe!r} is not a folder")
    try:
        if probe == path:
            with tempfile.NamedTemporaryFile(dir=probe):
                pass
        else:
            with tempfile.TemporaryDirectory(dir=probe):
                pass
    except OSError as e:
        what = f"write to {probe!r}" if probe == path else f"create a folder in {probe!r}"
        parser.error(f"argument --out: cannot {what}: {_os_reason(e)}")


def _library_dirs() -> list[str]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # pyro_gradroute/
    dirs = {here, os.path.dirname(os.__file__)}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if sysconfig.get_paths().get(key):
            dirs.add(sysconfig.get_paths()[key])
    return [os.path.realpath(d) + os.sep for d in dirs]


def user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The frames of ``exc``'s traceback (and of the exceptions it came from) that lie in the
    user's own files: not in this package, the standard library or installed packages."""
    libs = _library_dirs()
    frames, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for f in traceback.extract_tb(exc.__traceback__):
            real = os.path.realpath(f.filename)
            if f.filename.startswith("<") or any(real.startswith(d) for d in libs):
                continue
            if (f.filename, f.lineno) not in {(g.filename, g.lineno) for g in frames}:
                frames.append(f)
        exc = exc.__cause__ or exc.__context__
    return frames


def _raised_by_the_app(exc: BaseException) -> bool:
    """Whether ``exc`` is one of this app's own input checks (raised in ``app/``), as opposed
    to a failure inside the library, which keeps its traceback."""
    tb = traceback.extract_tb(exc.__traceback__)
    app_dir = os.path.dirname(os.path.realpath(__file__)) + os.sep
    return bool(tb) and os.path.realpath(tb[-1].filename).startswith(app_dir)


def _report_user_error(exc: BaseException, frames, full: bool) -> int:
    err = sys.stderr
    if full:
        traceback.print_exception(exc, file=err)
        return EXIT_USER_CODE
    print("pyro-gradroute: error in your model code:", file=err)
    print("".join(traceback.format_list(frames)).rstrip("\n"), file=err)
    text = str(exc).strip().splitlines()
    print(f"{type(exc).__name__}: {text[0] if text else ''}", file=err)
    for line in text[1:]:
        print(f"  {line}", file=err)
    print("(run with --traceback for the full traceback)", file=err)
    return EXIT_USER_CODE


def _compare(parser, args, start: float) -> int:
    names = _estimator_names(parser, args.estimators)
    if args.alpha is not None and not set(names) & set(RENYI_ESTIMATORS):
        parser.error(
            f"argument --alpha: only the {' and '.join(RENYI_ESTIMATORS)} estimators use it, "
            f"and --estimators has neither ({','.join(names)}); add one, or drop --alpha"
        )
    alpha = DEFAULT_ALPHA if args.alpha is None else args.alpha
    _check_writable(parser, args.out)
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    import torch

    from .compare import TABLE_NOTE, format_table, iter_compare, suggest
    from .models.problem import load_problem

    torch.set_num_threads(args.threads)
    problem = load_problem(args.model)  # errors early, listing what exists
    results = []
    header = f"\nmodel: {args.model}  ({problem.description or 'user model'})"
    try:
        for r in iter_compare(
            lambda: load_problem(args.model), names, steps=args.steps, lr=args.lr, num_particles=args.particles,
            seed=args.seed, snr_draws=args.snr_draws, num_samples=args.samples,
            progress=not args.no_progress, quiet=False, alpha=alpha,
            warmup_steps=args.warmup_steps,
        ):  # fmt: skip
            results.append(r)
    except KeyboardInterrupt:
        done = ", ".join(r.name for r in results) or "none"
        print(f"\ninterrupted; finished estimators: {done}", file=sys.stderr)
        if results:
            print(header)
            print(format_table(results))
            print(TABLE_NOTE)
        return EXIT_INTERRUPTED
    print(header)
    print(format_table(results))
    print(TABLE_NOTE)
    for r in results:
        if r.variance_ratio == r.variance_ratio:  # not nan: an adaptive estimator
            base = "DReG and IWAE" if r.name == "adaptive-dreg" else "STL and Trace_ELBO"
            print(f"{r.name}: guide-gradient variance {r.variance_ratio:.3g} x the better of {base}, "
                  f"at its fitted parameters ({args.snr_draws} draws each)")  # fmt: skip
    print(suggest(results))
    print(f"writing plots to {args.out} ...", file=sys.stderr, flush=True)
    from .plots import smoothing_window, write_plots

    paths = write_plots(results, args.out, var_names=problem.var_names)
    window = smoothing_window(results)
    smooth = f"moving average over {window} steps" if window > 1 else "not smoothed"
    print(f"plots: {', '.join(paths)} (loss curves: {smooth})")
    print(f"total time: {time.perf_counter() - start:.1f} s (wall clock, from start to finish)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status: 0, 1 for an error in the
    user's model code, 2 for bad arguments, 130 when interrupted."""
    start = time.perf_counter()
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in COMMANDS and not argv[0].startswith("-"):
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: unknown command {argv[0]!r}; the commands are: "
              f"{', '.join(COMMANDS)} (compare is the default: "
              f"'{parser.prog} --model NAME')", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help", "--version")):
        argv = ["compare", *argv]  # 'compare' is the default command
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:
            return int(e.code or 0)
        if args.command == "list":
            return _list()
        try:
            return _compare(parser.compare_parser, args, start)
        except SystemExit as e:  # parser.error
            return int(e.code or 0)
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except Exception as e:  # noqa: BLE001 - sorted into user code / usage below
            frames = user_frames(e)
            if frames:
                return _report_user_error(e, frames, args.traceback)
            if isinstance(e, (ValueError, TypeError)) and _raised_by_the_app(e):
                if args.traceback:
                    traceback.print_exception(e, file=sys.stderr)
                print(f"pyro-gradroute: error: {e}", file=sys.stderr)
                return EXIT_USAGE
            raise
        finally:
            sys.stdout.flush()
    except BrokenPipeError:  # e.g. 'pyro-gradroute list | head': the reader left
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
