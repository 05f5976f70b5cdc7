r"""Pathwise parts of Pyro's structured guides (``AutoStructured``, ``AutoGaussian``).

These guides map auxiliary noise :math:`\epsilon` affinely to each latent's unconstrained
value :math:`u_s = a_s + m_s`, push it through ``biject_to(support)`` and record a ``Delta``
whose ``log_density`` is minus the log-Jacobian. The pathwise part of the joint density needs
the noise :math:`\hat\epsilon(z; \bot(\phi))` that maps to the live sample: the guide's own
arithmetic is rerun with live parameters, then inverted with the parameters stopped,

.. math::

    \hat a_s = u_s - \bot(m_s), \qquad
    \hat\epsilon_s = \bot(A_s)^{-1}\Big(\hat a_s - \sum_{p} \bot(\text{dep}_{sp})(\hat a_p)\Big)

(a triangular solve; ``AutoGaussian``'s dense backend: :math:`(u_s - \bot(m_s)) /
\bot(\sigma_s)`). Every recomputed value is checked against the trace's, and anything else
(an overridden method, a callable conditional, the funsor backend) raises ``ValueError``
naming the site.
"""

from __future__ import annotations

import functools
from operator import attrgetter

import torch
from pyro.distributions import MultivariateNormal
from pyro.infer.autoguide import AutoStructured
from pyro.infer.autoguide.gaussian import AutoGaussian, AutoGaussianDense
from torch.distributions import biject_to

from .._compat import (
    autogaussian_dense_blocks,
    autogaussian_factors,
    autogaussian_unflatten,
    autostructured_shapes,
    autostructured_sites,
    find_frame,
    pyro_name,
)
from .detached import delta_base

__all__ = ["calling_structured_guide", "structured_pathwise"]
_DENSE_METHODS = ("_transform_values", "_sample_aux_values", "_dense_unflatten", "_dense_flatten")


@functools.cache
def _guide_codes() -> dict:
    return {
        AutoStructured.forward.__code__: AutoStructured,
        AutoGaussian.forward.__code__: AutoGaussian,
    }


def calling_structured_guide(max_depth: int = 48):
    """The ``AutoStructured`` / ``AutoGaussian`` whose ``forward`` (a frame up the stack, found
    by code object) is executing a sample statement now, or None."""
    frame, cls = find_frame(_guide_codes(), max_depth)
    if frame is None:
        return None
    guide = frame.f_locals.get("self")
    return guide if isinstance(guide, cls) else None


def _stopped_call(name: str, up: str, module, x):
    """``module(x)`` with the module's parameters (and buffers) detached: gradient to ``x`` only."""
    if not isinstance(module, torch.nn.Module):
        why = f"AutoStructured's dependency on '{up}' is a callable that is not a torch.nn.Module"
        use = "dependencies='linear' or an nn.Module, or " + _TRACE
        raise _refuse(name, why + " (it cannot be evaluated with its parameters stopped)", use)
    if torch.jit.is_tracing():  # (torch.func cannot call a module inside a traced program)
        raise NotImplementedError(
            f"guide site '{name}': AutoStructured's dependency on '{up}' is evaluated with its "
            "parameters stopped, which cannot be done inside a program traced by the JIT. Use "
            "the non-JIT ELBO (Trace_ELBO, TraceGraph_ELBO, TraceEnum_ELBO) with "
            "stick_the_landing, or pyro_gradroute.infer.TraceSTL_ELBO"
        )
    params = {k: v.detach() for k, v in module.named_parameters()}
    params.update({k: v for k, v in module.named_buffers()})
    return torch.func.functional_call(module, params, (x,))


def _check_close(name: str, what: str, got: torch.Tensor, want: torch.Tensor, scale=1.0) -> None:
    tol = 1e-9 if want.dtype == torch.float64 else 2e-4
    shape_ok = torch.broadcast_shapes(got.shape, want.shape) == want.shape
    if not (shape_ok and torch.allclose(got.detach(), want.detach(), rtol=tol, atol=tol * scale)):
        why = f"its {what} could not be reproduced from the structured guide's parameters (a "
        raise _refuse(name, why + "subclass or handler changed how the guide computes it)")


_TRACE = "pyro_gradroute.infer.Trace_ELBO with this guide"


def _refuse(site: str, why: str, use: str = _TRACE) -> ValueError:
    """The error for a site whose pathwise part cannot be exact."""
    return ValueError(
        f"guide site '{site}': {why}, so its pathwise part is not available and dropping the "
        f"score part would bias the gradient. Use {use}."
    )


def _live(orig: torch.Tensor, recomputed: torch.Tensor) -> torch.Tensor:
    """``orig``'s value with ``recomputed``'s gradient."""
    return orig.detach() + (recomputed - recomputed.detach())


def _delta_part(name: str, rec, ld: torch.Tensor) -> tuple:
    """A Delta site's pathwise part: its recomputed ``log_density`` ``ld``, checked."""
    want = torch.as_tensor(delta_base(rec.fn).log_density).expand(ld.shape)
    _check_close(name, "log_density", ld, want)
    lp = rec.fn.log_prob(rec.value)
    return _live(lp, ld.expand(lp.shape)), False


def structured_pathwise(guide, records: dict) -> dict:
    """``{site name: (pathwise log_prob, is_point)}`` of a structured guide's sites in ``records``.

    ``records``: the run's sites by name (``value``: the sample, ``fn``: its distribution).
    ``is_point``: a Delta of an ``AutoStructured`` ``"delta"`` conditional (a function of
    parameters and upstream noise, no density). Raises ``ValueError`` naming the site where
    it cannot be exact.
    """
    if isinstance(guide, AutoStructured):
        if type(guide).get_deltas is not AutoStructured.get_deltas:
            raise _override(guide, "get_deltas")
        return _autostructured(guide, records)
    if isinstance(guide, AutoGaussian):
        latent = (n for n, s in autogaussian_factors(guide).items() if not s["is_observed"])
        name = next(latent, "?")
        if not isinstance(guide, AutoGaussianDense):
            why = f"{type(guide).__name__} (AutoGaussian with a backend other than 'dense') "
            use = "AutoGaussian(model, backend='dense') (or AutoMultivariateNormal), or " + _TRACE
            raise _refuse(name, why + "draws its auxiliary values by its own sampler", use)
        for meth in _DENSE_METHODS:
            if getattr(type(guide), meth) is not getattr(AutoGaussianDense, meth):
                raise _override(guide, meth)
        try:
            return _autogaussian(guide, records)
        except RuntimeError as e:  # a layout the recomputation does not reproduce
            why = f"this AutoGaussian's map could not be recomputed ({e})"
            raise _refuse(f"_{pyro_name(guide)}_latent", why) from e
    raise ValueError(f"unsupported structured guide {type(guide).__name__}")


def _override(guide, meth: str) -> ValueError:
    return ValueError(
        f"{type(guide).__name__} overrides {meth}, so the pathwise part of its Delta sites (whose "
        f"log_density reads the guide's parameters) is not available. Use {_TRACE}, or Pyro's own."
    )


def _record(records: dict, name: str, what: str):
    rec = records.get(name)
    if rec is None or not torch.is_tensor(rec.value):
        why = f"({what}) is not in this guide run as the guide records it (renamed, or hidden)"
        raise _refuse(name, why)
    return rec


def _autostructured(g, records: dict) -> dict:
    out: dict = {}
    live: dict = {}  # aux_values with live parameters (the guide's own arithmetic)
    hat: dict = {}  # aux_values recovered from the live sample, parameters stopped
    for name, site in autostructured_sites(g):
        rec = _record(records, name, "a latent")
        cond = g.conditionals[name]
        loc = attrgetter(name)(g.locs)
        if callable(cond) or cond not in ("delta", "normal", "mvn"):
            why = f"AutoStructured's conditional {cond!r} for it is not 'delta', 'normal' or 'mvn'"
            raise _refuse(name, why, "the 'normal' or 'mvn' conditional, or " + _TRACE)
        deps = attrgetter(name)(g.deps)
        ups = list(g.dependencies.get(name, {}))
        if cond == "delta":
            a = torch.zeros_like(loc)
        else:
            aux = _record(records, name + "_aux", "its auxiliary draw")
            eps = aux.value
            if eps.requires_grad:
                why = "AutoStructured's auxiliary draw depends on parameters (a handler changed it)"
                raise _refuse(name + "_aux", why)
            scale = attrgetter(name)(g.scales)
            scale0 = scale.detach()
            if cond == "normal":
                a = eps * scale
                ld0 = (-scale0.log()).expand_as(a)
            else:
                tril = attrgetter(name)(g.scale_trils)
                tril0 = tril.detach()
                a = eps @ tril.T * scale
                ld0 = (-tril0.diagonal(dim1=-2, dim2=-1).log() - scale0.log()).expand_as(a)
        for up in ups:
            a = a + attrgetter(up)(deps)(live[up])
        live[name] = a
        site_batch, event_shape = autostructured_shapes(g, name)
        batch_shape = torch.broadcast_shapes(a.shape[:-1], site_batch)
        flat = a + loc
        u = flat.reshape(batch_shape + event_shape)
        transform = biject_to(site["fn"].support)
        value = transform(u)
        _check_close(name, "value", value, rec.value)
        if cond == "delta":
            # a point: no density; its aux value downstream is a function of upstream noise
            r = torch.zeros_like(loc)
            for up in ups:
                r = r + _stopped_call(name, up, attrgetter(up)(deps), hat[up])
            hat[name] = r
            out[name] = (None, True)
            continue
        r = hat[name] = flat - loc.detach()
        for up in ups:
            r = r - _stopped_call(name, up, attrgetter(up)(deps), hat[up])
        r = r / scale0
        if cond == "mvn":
            r = torch.linalg.solve_triangular(tril0, r.unsqueeze(-1), upper=False).squeeze(-1)
        _check_close(name + "_aux", "auxiliary draw", r, eps, scale=1.0 + eps.abs().max().item())
        out[name + "_aux"] = (_live(aux.fn.log_prob(aux.value), aux.fn.log_prob(r)), False)
        ld = ld0.reshape(batch_shape + (-1,)).sum(-1)
        ld = ld + transform.inv.log_abs_det_jacobian(value, u)
        out[name] = _delta_part(name, rec, ld)
    return out


def _autogaussian(g, records: dict) -> dict:
    aux_name = f"_{pyro_name(g)}_latent"
    aux = _record(records, aux_name, "the auxiliary Gaussian draw")
    fn = aux.fn
    if not isinstance(fn, MultivariateNormal):
        why = f"AutoGaussian's auxiliary draw is a {type(fn).__name__}, not the dense backend's MVN"
        raise _refuse(aux_name, why)
    x = autogaussian_unflatten(g, aux.value)
    out: dict = {}
    x_hat: dict = {}
    for name, site in autogaussian_factors(g).items():
        if site["is_observed"]:
            continue
        rec = _record(records, name, "a latent")
        loc = attrgetter(name)(g.locs)
        scale = attrgetter(name)(g.scales)
        u = x[name] * scale + loc
        transform = biject_to(site["fn"].support)
        value = transform(u)
        _check_close(name, "value", value, rec.value)
        x_hat[name] = (u - loc.detach()) / scale.detach()
        ld = transform.inv.log_abs_det_jacobian(value, u) - scale.detach().log().reshape(
            site["fn"].batch_shape + (-1,)
        ).sum(-1)
        out[name] = _delta_part(name, rec, ld)
    for name in autogaussian_dense_blocks(g):
        if name not in x_hat:  # an observed site's block (its values are the data)
            x_hat[name] = x[name].detach()
    # flattened as the auxiliary draw is laid out (Pyro's _dense_flatten infers each block's
    # sample shape from its own shape, which differs between blocks under vectorized particles)
    sample_shape = aux.value.shape[:-1]
    flat_hat = torch.cat(
        [x_hat[d].reshape(sample_shape + (-1,)) for d in autogaussian_dense_blocks(g)], -1
    )
    _check_close(
        aux_name, "auxiliary draw", flat_hat, aux.value, 1.0 + aux.value.abs().max().item()
    )
    stopped = MultivariateNormal(fn.loc.detach(), scale_tril=fn.scale_tril.detach())
    out[aux_name] = (_live(fn.log_prob(aux.value), stopped.log_prob(flat_hat)), False)
    return out
