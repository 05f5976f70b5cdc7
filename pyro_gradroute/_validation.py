"""Argument checks shared by every public constructor and function: type first, then range.

Each check raises early, naming the argument (``where`` is the caller), the value received
and what is accepted. A wrong type raises :class:`ArgumentTypeError`, a ``TypeError`` that is
also a ``ValueError``; a value out of range raises ``ValueError``.

Example::

    >>> check_int(3, "num_particles", "Trace_ELBO", minimum=1)
    3
    >>> check_int(0, "num_particles", "Trace_ELBO", minimum=1)
    Traceback (most recent call last):
    ...
    ValueError: Trace_ELBO: num_particles must be an integer >= 1; got 0
    >>> isinstance(ArgumentTypeError("x"), TypeError) and isinstance(ArgumentTypeError("x"), ValueError)
    True
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a ``TypeError``, and a ``ValueError`` too, so that code
    catching the ``ValueError`` these checks' predecessors raised still catches it."""


def _bad(where: str, name: str, value, accepted: str, exc=ValueError):
    if exc is TypeError:
        exc = ArgumentTypeError
    return exc(f"{where}: {name} must be {accepted}; got {value!r}")


def check_int(
    value, name: str, where: str, *, minimum: int | None = None, allow_none: bool = False
):
    """An integer (``bool`` excluded) at or above ``minimum``; ``None`` where allowed."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = "an integer" + (" or None" if allow_none else "")
        if minimum is not None:
            kind += f" >= {minimum}"
        raise _bad(where, name, value, kind, TypeError)
    value = int(value)
    if minimum is not None and value < minimum:
        raise _bad(where, name, value, f"an integer >= {minimum}")
    return value


def check_float(
    value,
    name: str,
    where: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    allow_inf: bool = False,
    allow_none: bool = False,
):
    """A real number (``bool`` and strings excluded, a 0-d tensor accepted) in the given range.

    ``nan`` is always refused; ``inf`` only where ``allow_inf``.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise _bad(where, name, value, "a number (a tensor with one element)", TypeError)
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _bad(where, name, value, "a number" + (" or None" if allow_none else ""), TypeError)
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise _bad(where, name, value, "a finite number")
    if low is not None and (value < low or (low_open and value == low)):
        raise _bad(where, name, value, f"{'>' if low_open else '>='} {low}")
    if high is not None and (value > high or (high_open and value == high)):
        raise _bad(where, name, value, f"{'<' if high_open else '<='} {high}")
    return value


def check_choice(value, name: str, where: str, choices):
    """One of ``choices``."""
    if value not in choices:
        raise _bad(where, name, value, "one of " + ", ".join(repr(c) for c in choices))
    return value


def check_str(value, name: str, where: str, *, allow_none: bool = False):
    """A string (a site or parameter name)."""
    if value is None and allow_none:
        return None
    if not isinstance(value, str):
        raise _bad(where, name, value, "a string", TypeError)
    return value


def check_mapping(value, name: str, where: str, *, allow_none: bool = False):
    """A mapping (a ``dict``: e.g. ``fixed={"scale": 1.0}`` or ``{"label": elbo}``)."""
    if value is None and allow_none:
        return None
    if not isinstance(value, Mapping):
        kind = "a dict" + (" or None" if allow_none else "")
        raise _bad(where, name, value, kind, TypeError)
    return value


def check_elbo(value, name: str, where: str):
    """An ELBO *instance* (anything with a callable ``loss_and_grads``), not its class."""
    if isinstance(value, type):
        raise _bad(
            where, name, value,
            f"an ELBO instance, not the class: pass {value.__name__}()", TypeError,
        )  # fmt: skip
    if not callable(getattr(value, "loss_and_grads", None)):
        raise _bad(where, name, value, "an ELBO instance (with loss_and_grads)", TypeError)
    return value
