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

import contextlib
import sys
import threading

import pyro
import torch
from pyro.infer.elbo import ELBO
from pyro.nn import PyroModule
from pyro.poutine.subsample_messenger import _Subsample
from torch.autograd.graph import _engine_run_backward  # (torch.autograd.grad's engine call)
from torch.distributions.utils import _sum_rightmost
from torch.overrides import has_torch_function

__all__ = ["Subsample", "calling_elbo", "SameNameContainer", "is_deterministic_site",
           "param_store_leaves", "pyro_context", "pyro_name"]  # fmt: skip

#: the distribution of a ``pyro.plate``'s subsample site (``pyro.poutine.subsample_messenger``)
Subsample = _Subsample
AccumulateGrad = torch._C._functions.AccumulateGrad  #: a leaf's autograd node (no children)


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


def calling_elbo(depth: int | None = None):
    """The innermost ``pyro.infer.ELBO`` instance whose method is on the call stack, if any.

    Python has no public way for a guide's handler to know which estimator runs it; this
    walks the frames (``sys._getframe``) and reads each one's ``self``. ``depth``: at most
    that many frames (``None``: the whole stack, so that no number of handlers around the
    guide hides the estimator; the walk stops at the first ELBO found).
    """
    frame = sys._getframe(2)
    n = 0
    while frame is not None and (depth is None or n < depth):
        if frame.f_code.co_name in _ELBO_METHODS:  # reading f_locals costs: only these frames
            obj = frame.f_locals.get("self")
            if isinstance(obj, ELBO):
                return obj
        frame = frame.f_back
        n += 1
    return None


#: the methods through which an ELBO runs a guide (Pyro's and this package's)
_ELBO_METHODS = frozenset({"_get_trace", "_get_traces", "_get_vectorized_trace", "loss",
                           "loss_and_grads", "differentiable_loss",
                           "_differentiable_loss_particle"})  # fmt: skip


def handler_stack() -> list:
    """The messengers of the Pyro handlers active now, innermost first (Pyro's ``_PYRO_STACK``)."""
    from pyro.poutine.runtime import _PYRO_STACK

    return list(reversed(_PYRO_STACK))


def will_engine_execute(node) -> bool:
    """Whether the backward pass now running will run (or capture at) autograd ``node``.

    torch has no public spelling for this query (``torch._C._will_engine_execute_node``);
    it raises ``RuntimeError`` for an input leaf of ``torch.autograd.grad``, which is captured.
    """
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return True


def vjp(outputs, inputs, seeds, retain_graph: bool = True) -> tuple:
    """``torch.autograd.grad(outputs, inputs, seeds, retain_graph, allow_unused=True)``: for
    plain tensors, the engine call without ``grad``'s Python check of each seed (the engine
    checks shapes), which costs microseconds a seed; torch's function otherwise."""
    outputs, inputs, seeds = tuple(outputs), tuple(inputs), tuple(seeds)
    if has_torch_function(outputs) or any(s is None for s in seeds):
        return torch.autograd.grad(outputs, inputs, seeds, retain_graph, allow_unused=True)
    return _engine_run_backward(
        outputs, seeds, retain_graph, False, inputs, True, accumulate_grad=False
    )


def tensor_backward_hooks(t: torch.Tensor) -> dict | None:
    """The ordered dict of hooks ``t.register_hook`` added (torch's ``Tensor._backward_hooks``)."""
    return getattr(t, "_backward_hooks", None)


def find_frame(codes: dict, depth: int = 48):
    """``(frame, value)`` of the innermost caller frame whose code object is a key of ``codes``."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None, None
        hit = codes.get(frame.f_code)
        if hit is not None:
            return frame, hit
        frame = frame.f_back
    return None, None


# ---------------------------------------------------------------- transform caches (flows)
# torch's Transform keeps its last call in ``_cached_x_y`` when ``_cache_size`` is 1; Pyro's
# flows keep the intermediate terms of their last call on further private attributes.
def transform_cache(t) -> tuple | None:
    """``(x, y)`` of a transform's last call, ``(None, None)`` before one, None if uncached."""
    if not getattr(t, "_cache_size", 0):
        return None
    return t._cached_x_y


def transform_attrs(t) -> dict:
    """A transform's attributes, less torch's cache of its last call (no parameter of it)."""
    return {k: v for k, v in vars(t).items() if k != "_cached_x_y"}


def set_transform_cache(t, x, y) -> None:
    """Make a cached transform's cache hold ``(x, y)`` (its inverse at ``y`` then returns ``x``)."""
    object.__setattr__(t, "_cached_x_y", (x, y))


def cached_log_scale(t) -> torch.Tensor:
    """The log-scale of an ``AffineCoupling`` / ``AffineAutoregressive`` layer's last call."""
    return t._cached_log_scale


def spline_log_derivative(t) -> torch.Tensor:
    """The elementwise log-derivatives of a ``SplineAutoregressive`` / ``SplineCoupling`` call."""
    return t._cache_log_detJ


def cached_log_det_jacobian(t) -> torch.Tensor:
    """A Pyro flow's cached log-Jacobian term (``BlockAutoregressive``: its log-diagonal)."""
    return t._cached_logDetJ


def naf_cache(t) -> tuple[torch.Tensor, ...]:
    """``(log_df_inv_dx, A, W_pre, C, T_C)``: a ``NeuralAutoregressive`` call's DSF terms."""
    return t._cached_log_df_inv_dx, t._cached_A, t._cached_W_pre, t._cached_C, t._cached_T_C


def conditioned_params(t) -> tuple:
    """The parameters of a conditioned Pyro transform (``ConditionedPlanar``, ...)."""
    p = t._params
    return p() if callable(p) else p


def module_attr(m, name: str):
    """``m.name`` read from the module's own registries, without ``PyroModule.__getattr__``
    (a param-store look-up per access)."""
    if isinstance(m, torch.nn.Module):
        d = m.__dict__
        for reg in ("_parameters", "_buffers", "_modules"):
            if name in d[reg]:
                return d[reg][name]
    return getattr(m, name)


def sum_rightmost(x, dim: int):
    """Sum out the ``dim`` rightmost dimensions (torch's ``distributions.utils._sum_rightmost``)."""
    return _sum_rightmost(x, dim)


def trace_elbo_particles(elbo, model, guide, args, kwargs):
    """``(model_trace, guide_trace, loss, surrogate)`` for each particle of Pyro's
    ``Trace_ELBO`` ``elbo``: what its ``loss_and_grads`` differentiates (its private
    ``_get_traces`` and ``_differentiable_loss_particle``)."""
    for model_trace, guide_trace in elbo._get_traces(model, guide, args, kwargs):
        loss, surrogate = elbo._differentiable_loss_particle(model_trace, guide_trace)
        yield model_trace, guide_trace, loss, surrogate


def trace_enum_elbo_particles(elbo, model, guide, args, kwargs):
    """``(model_trace, guide_trace, loss, surrogate)`` for each particle of Pyro's
    ``TraceEnum_ELBO`` ``elbo``: what its ``loss_and_grads`` differentiates (its private
    ``_get_traces`` and ``traceenum_elbo._compute_dice_elbo``)."""
    from pyro.infer.traceenum_elbo import _compute_dice_elbo

    for model_trace, guide_trace in elbo._get_traces(model, guide, args, kwargs):
        elbo_particle = _compute_dice_elbo(model_trace, guide_trace)
        loss = -float(elbo_particle.detach() if torch.is_tensor(elbo_particle) else elbo_particle)
        yield model_trace, guide_trace, loss, -elbo_particle


# ---------------------------------------------------------------- distributions and handlers
def mask_of(fn):
    """The mask of a Pyro ``MaskedDistribution`` (its private ``_mask``: a bool or a tensor)."""
    return fn._mask


def unquantized(value):
    """The relaxed sample a straight-through value carries (Pyro's ``value._unquantize``,
    set by ``RelaxedOneHotCategoricalStraightThrough`` and friends), or None."""
    return getattr(value, "_unquantize", None)


def set_unquantized(value, relaxed) -> None:
    """Make the straight-through ``value`` carry ``relaxed`` as its relaxed sample."""
    value._unquantize = relaxed


def transform_call(t, x, cls=None):
    """A transform's forward map without its cache (torch's ``Transform._call``), looked up
    on ``cls`` when given (a class's own map, bypassing an override)."""
    return t._call(x) if cls is None else cls._call(t, x)


def default_dense_forward(net) -> bool:
    """Whether a Pyro ``ConditionalDenseNN`` (or ``DenseNN``) runs the class's own private
    ``_forward`` (no subclass override)."""
    from pyro.nn import ConditionalDenseNN

    return type(net)._forward is ConditionalDenseNN._forward


def wrapping_messengers(fn) -> list:
    """The messengers of the Pyro handlers applied to ``fn`` (``handler(fn)``), outermost first:
    Pyro's ``handler(fn)`` is ``functools.partial(_context_wrap, messenger, fn)``."""
    import functools

    from pyro.poutine.messenger import Messenger

    out = []
    while isinstance(fn, functools.partial):
        if len(fn.args) >= 2 and isinstance(fn.args[0], Messenger):
            out.append(fn.args[0])
            fn = fn.args[1]
        else:
            fn = fn.func
    return out


@contextlib.contextmanager
def replaced_subsample(new):
    """Within the block, Pyro's plates draw their subsample with ``new(fn, name, size,
    subsample_size, subsample, use_cuda, device)``, ``fn`` being Pyro's own
    ``SubsampleMessenger._subsample`` (a private static method, replaced on the class under a
    lock: one block at a time)."""
    from pyro.poutine.subsample_messenger import SubsampleMessenger

    original = SubsampleMessenger.__dict__["_subsample"]
    fn = original.__func__

    def _subsample(name, size=None, subsample_size=None, subsample=None, use_cuda=None,
                   device=None):  # fmt: skip
        return new(fn, name, size, subsample_size, subsample, use_cuda, device)

    with _SUBSAMPLE_LOCK:
        SubsampleMessenger._subsample = staticmethod(_subsample)
        try:
            yield
        finally:
            SubsampleMessenger._subsample = original


_SUBSAMPLE_LOCK = threading.RLock()


# ---------------------------------------------------------------- Pyro's structured autoguides
def autostructured_sites(g) -> list:
    """``(name, site)`` of an ``AutoStructured``'s latent sites in its order (``_sorted_sites``)."""
    return g._sorted_sites


def autostructured_shapes(g, name: str) -> tuple:
    """``(batch_shape, unconstrained event_shape)`` of an ``AutoStructured``'s site ``name``."""
    return g._batch_shapes[name], g._unconstrained_event_shapes[name]


def autogaussian_factors(g) -> dict:
    """``name -> site`` of an ``AutoGaussian``'s factors, observed ones included (``_factors``)."""
    return g._factors


def autogaussian_dense_blocks(g) -> dict:
    """``name -> shape`` of the blocks of an ``AutoGaussianDense``'s auxiliary draw, in its
    layout (``_dense_shapes``)."""
    return g._dense_shapes


def autogaussian_unflatten(g, x) -> dict:
    """An ``AutoGaussianDense``'s auxiliary draw ``x`` split into its blocks (``_dense_unflatten``)."""
    return g._dense_unflatten(x)
