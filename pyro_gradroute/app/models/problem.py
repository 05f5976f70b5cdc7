"""Problems for ``pyro-gradroute compare``: bundled ones by name, a user's as ``module:function``.

A *problem* is a model, a fresh guide and the data, as a :class:`Problem` or a plain dict with
the same keys. A user's own problem is a zero-argument function returning one, named on the
command line as ``module:function`` (``module`` importable, e.g. a file ``my_model.py`` in the
current directory is ``my_model:problem``). The function is called once per estimator, after
seeding, so that it builds the same fresh guide (and networks) every time.

Example::

    >>> from pyro_gradroute.app.models.problem import load_problem
    >>> problem = load_problem("eight_schools")
    >>> problem.heldout_args is None
    True
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from ..._validation import check_choice


@dataclass
class Problem:
    """What ``compare`` needs about a model.

    :ivar model: the Pyro model.
    :ivar guide: a fresh guide for it (built inside the problem function).
    :ivar args: the model's positional arguments for training (tuple).
    :ivar kwargs: its keyword arguments.
    :ivar heldout_args: the model's arguments for held-out data, or ``None``.
    :ivar heldout: how held-out log-likelihood is computed: ``"predictive"`` (global latents:
        :math:`\\frac1n \\sum_i \\log \\frac1S \\sum_s p(\\tilde x_i \\mid z_s)`, :math:`z_s \\sim q`)
        or ``"marginal"`` (local latents, amortized guide: importance-weighted
        :math:`\\frac1n \\log p(\\tilde x)` with the guide as proposal).
    :ivar diag_args: arguments for the PSIS k-hat and ArviZ draws (default ``args``), e.g.
        a few data points of a VAE.
    :ivar coords, dims: ArviZ coordinates and dimension names (see ``to_inference_data``).
    :ivar var_names: latent sites to show in the forest plot (default: all).
    :ivar steps, lr, num_particles: defaults for ``compare``.
    :ivar description: one line for ``pyro-gradroute list``.
    """

    model: Callable
    guide: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    heldout_args: tuple | None = None
    heldout: str = "predictive"
    diag_args: tuple | None = None
    coords: dict = field(default_factory=dict)
    dims: dict = field(default_factory=dict)
    var_names: Sequence[str] | None = None
    steps: int = 500
    lr: float = 0.02
    num_particles: int = 8
    description: str = ""

    def __post_init__(self) -> None:
        if not callable(self.model) or not callable(self.guide):
            raise TypeError("Problem: 'model' and 'guide' must be callables")
        self.args = tuple(self.args)
        if self.heldout_args is not None:
            self.heldout_args = tuple(self.heldout_args)
        check_choice(self.heldout, "heldout", "Problem", ("predictive", "marginal"))


def _available() -> str:
    from ..catalog import MODEL_DESCRIPTIONS

    return ", ".join(MODEL_DESCRIPTIONS)


def _import_function(path: str) -> Callable:
    module_name, _, func_name = path.partition(":")
    if not module_name or not func_name:
        raise ValueError(
            f"Model path {path!r} must look like 'module:function' (e.g. my_model:problem). "
            f"Bundled models: {_available()}"
        )
    if module_name.endswith(".py"):
        stem = module_name[: -len(".py")].replace(os.sep, ".").replace("/", ".")
        raise ValueError(
            f"Model path {path!r} names a file; give the module name without '.py': "
            f"--model {stem}:{func_name} (run from the file's folder, or put it on PYTHONPATH)"
        )
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # console scripts do not put the current folder there
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"Cannot import module {module_name!r} of model path {path!r}: {e}. Check that it "
            f"is on the Python path (run from its folder). Bundled models: {_available()}"
        ) from e
    func = getattr(module, func_name, None)
    if not callable(func):
        found = sorted(
            n
            for n, f in vars(module).items()
            if inspect.isfunction(f) and f.__module__ == module.__name__ and not n.startswith("_")
        )
        raise ValueError(
            f"Module {module_name!r} has no function {func_name!r}; its functions are: "
            f"{', '.join(found) or '(none)'}"
        )
    return func


def as_problem(obj: Any, where: str = "problem") -> Problem:
    """A :class:`Problem` from a ``Problem`` or a dict with its keys (``model``, ``guide``,
    ``args`` and optionally the others); a clear error for anything else."""
    if isinstance(obj, Problem):
        return obj
    if not isinstance(obj, Mapping):
        raise TypeError(
            f"{where} must return a dict with keys 'model', 'guide', 'args' (optional: "
            f"{', '.join(f.name for f in fields(Problem)[3:])}) or a "
            f"pyro_gradroute.app.models.Problem; got {type(obj).__name__}"
        )
    known = {f.name for f in fields(Problem)}
    unknown = sorted(set(obj) - known)
    missing = sorted({"model", "guide"} - set(obj))
    if unknown or missing:
        raise ValueError(
            f"{where} returned a dict with "
            + (f"unknown keys {unknown}" if unknown else "")
            + (" and " if unknown and missing else "")
            + (f"missing keys {missing}" if missing else "")
            + f"; the keys are {sorted(known)}"
        )
    return Problem(**obj)


def load_problem(name: str) -> Problem:
    """Build the problem ``name``: a bundled name (see :data:`MODELS`) or ``module:function``.

    :raises ValueError: for an unknown name, an unimportable module or a missing function,
        listing what exists.
    """
    from ..catalog import MODEL_DESCRIPTIONS

    if name in MODEL_DESCRIPTIONS:
        from . import MODELS

        problem = as_problem(MODELS[name](), where=name)
        problem.description = problem.description or MODEL_DESCRIPTIONS[name]
        return problem
    if ":" not in name:
        raise ValueError(
            f"Unknown model {name!r}. Bundled models: {_available()}; or name your own as "
            "'module:function' (a function returning a dict with model, guide, args)."
        )
    return as_problem(_import_function(name)(), where=name)
