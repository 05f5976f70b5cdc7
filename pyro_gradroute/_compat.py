"""Every use of Pyro's private API in this package, in one place, with what it stands for.

Pyro 1.9 has no public spelling for these. When Pyro changes one, only this module changes.
Where a public API exists it is used instead (e.g. ``pyro.get_param_store().named_parameters()``
for the unconstrained leaves, rather than the store's ``_params`` dict).

Example::

    >>> import pyro, pyro.distributions as dist, pyro.poutine as poutine
    >>> from pyro_gradroute._compat import is_deterministic_site, param_store_leaves
    >>> def model():
    ...     pyro.deterministic("d", pyro.sample("z", dist.Normal(0.0, 1.0)) + 1)
    >>> tr = poutine.trace(model).get_trace()
    >>> is_deterministic_site(tr.nodes["d"]), is_deterministic_site(tr.nodes["z"])
    (True, False)
    >>> pyro.clear_param_store(); _ = pyro.param("w", lambda: dist.Normal(0.0, 1.0).sample())
    >>> sorted(param_store_leaves())
    ['w']
"""

from __future__ import annotations

import pyro
import torch
from pyro.nn import PyroModule
from pyro.poutine.subsample_messenger import _Subsample

__all__ = [
    "Subsample",
    "calling_elbo",
    "SameNameContainer",
    "is_deterministic_site",
    "param_store_leaves",
    "pyro_context",
    "pyro_name",
]

#: the distribution of a ``pyro.plate``'s subsample site (``pyro.poutine.subsample_messenger``)
Subsample = _Subsample


def is_deterministic_site(site: dict) -> bool:
    """Whether a trace site was made by ``pyro.deterministic`` (Pyro marks it with the private
    ``infer["_deterministic"]`` flag; it is an observed ``Delta`` otherwise)."""
    return bool(site["infer"].get("_deterministic", False))


def param_store_leaves() -> dict[str, torch.Tensor]:
    """``{name: unconstrained leaf}`` of Pyro's param store, through its public
    ``named_parameters()``."""
    return dict(pyro.get_param_store().named_parameters())


def pyro_name(module: PyroModule) -> str:
    """A PyroModule's full Pyro name (the prefix of its param-store names)."""
    return module._pyro_name


def pyro_context(module: PyroModule):
    """A PyroModule's context: inside it, reading a ``PyroParam`` is a ``pyro.param`` statement
    (what ``module(...)`` enters around ``forward``)."""
    return module._pyro_context


class SameNameContainer(PyroModule):
    """A PyroModule whose children are named as if they were attributes of its parent
    (overrides PyroModule's private ``_pyro_set_supermodule`` naming hook)."""

    def _pyro_set_supermodule(self, name: str, context) -> None:
        super()._pyro_set_supermodule(name.rpartition(".")[0], context)


def calling_elbo(depth: int = 40):
    """The innermost ``pyro.infer.ELBO`` instance whose method is on the call stack, if any.

    Python has no public way for a guide's handler to know which estimator runs it; this
    walks the frames (``sys._getframe``) and reads each one's ``self``.
    """
    import sys

    from pyro.infer.elbo import ELBO

    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name in _ELBO_METHODS:  # reading f_locals costs: only these frames
            obj = frame.f_locals.get("self")
            if isinstance(obj, ELBO):
                return obj
        frame = frame.f_back
    return None


#: the methods through which an ELBO runs a guide (Pyro's and this package's)
_ELBO_METHODS = frozenset(
    {
        "_get_trace",
        "_get_traces",
        "_get_vectorized_trace",
        "loss",
        "loss_and_grads",
        "differentiable_loss",
        "_differentiable_loss_particle",
    }
)


def will_engine_execute(node) -> bool:
    """Whether the backward pass now running will run (or capture at) autograd ``node``.

    torch has no public spelling for this query (``torch._C._will_engine_execute_node``);
    it raises ``RuntimeError`` for an input leaf of ``torch.autograd.grad``, which is captured.
    """
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return True


def tensor_backward_hooks(t: torch.Tensor) -> dict | None:
    """The ordered dict of hooks ``t.register_hook`` added (torch's ``Tensor._backward_hooks``)."""
    return getattr(t, "_backward_hooks", None)


def find_frame(codes: dict, depth: int = 48):
    """``(frame, value)`` of the innermost caller frame whose code object is a key of ``codes``."""
    import sys

    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None, None
        hit = codes.get(frame.f_code)
        if hit is not None:
            return frame, hit
        frame = frame.f_back
    return None, None
