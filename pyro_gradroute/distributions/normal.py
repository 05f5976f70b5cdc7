r"""The score part of a Normal site at its own parameters, in closed form.

For :math:`q(z; \mu, \sigma) = \mathcal N(z; \mu, \sigma^2)` with the sample :math:`z` held
fixed and :math:`d = (z - \mu) / \sigma`,

.. math::

    \frac{\partial}{\partial \mu} \log q(\bot(z); \mu, \sigma) = \frac{d}{\sigma}, \qquad
    \frac{\partial}{\partial \sigma} \log q(\bot(z); \mu, \sigma) = \frac{d^2 - 1}{\sigma}.

Both have mean zero under :math:`q`. An ELBO's gradient at a guide ``Normal``'s
:math:`\mu, \sigma` is the pathwise part plus these (times the site's scale and mask), so one
backward gives both parts there.
"""

from __future__ import annotations

import torch
from pyro.distributions.util import scale_and_mask
from pyro.poutine.util import site_is_subsample
from torch.distributions import Independent, Normal, TransformedDistribution

from ..routing import passes_product, reached_nodes, reaches_leaf_directly
from .detached import delta_base, density_reads_parameters
from .flows import _flatten

__all__ = ["normal_pushforward", "normal_score", "normal_sites"]


def normal_pushforward(fn) -> tuple[Normal | None, int, list]:
    r"""``(base, event_ndims, transforms)``: a ``Normal`` (torch's own ``log_prob`` and
    ``rsample``, ``z = loc + scale * eps``) under ``Independent`` wrappers, pushed forward by
    elementwise, bijective, parameter-free transforms (``LogNormal``, ``biject_to``'s ``exp``
    / ``sigmoid``), or ``(None, 0, [])``. The log-density at :math:`z` is the ``Normal``'s at
    :math:`u = T^{-1}(z)` plus a Jacobian term free of :math:`\mu, \sigma`: its score part at
    :math:`(\mu, \sigma)` is the ``Normal``'s at :math:`u`.

    Example::

        >>> import pyro.distributions as dist
        >>> base, n, ts = normal_pushforward(dist.LogNormal(0.0, 1.0).expand([2]).to_event(1))
        >>> type(base).__name__, n, [type(t).__name__ for t in ts]
        ('Normal', 1, ['ExpTransform'])
    """
    n, transforms = 0, []
    while isinstance(fn, (Independent, TransformedDistribution)):
        if isinstance(fn, Independent):
            n += fn.reinterpreted_batch_ndims
        else:  # parameter-free, elementwise bijections only
            parts = _flatten(fn.transforms)
            if type(fn).log_prob is not TransformedDistribution.log_prob or not all(
                t.bijective
                and t.domain.event_dim == t.codomain.event_dim == 0
                and not any(torch.is_tensor(v) and v.requires_grad for v in vars(t).values())
                for t in parts
            ):
                return None, 0, []
            transforms = parts + transforms
        fn = fn.base_dist
    cls = type(fn)
    torch_normal = cls.log_prob is Normal.log_prob and cls.rsample is Normal.rsample
    if isinstance(fn, Normal) and torch_normal and cls.sample is Normal.sample:
        return fn, n, transforms
    return None, 0, []


def normal_score(
    base: Normal, event_ndims: int, value: torch.Tensor, scale=1.0, mask=None
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    r"""``[(name, tensor, grad)]``: :math:`\partial_\theta \log q(\bot(z); \theta)` at ``base.loc``
    and ``base.scale`` (those that require grad), each summed to the tensor's shape.

    ``scale`` and ``mask`` weigh each point as a Pyro site's log-density is weighed
    (``site["scale"]``, ``site["mask"]``). The grads carry no graph.

    Example::

        >>> import torch
        >>> loc = torch.tensor([0.5, -1.0], requires_grad=True)
        >>> sigma = torch.tensor([2.0, 0.5], requires_grad=True)
        >>> q = torch.distributions.Normal(loc, sigma)
        >>> z = torch.tensor([1.0, 0.0])
        >>> ref = torch.autograd.grad(q.log_prob(z).sum(), [loc, sigma])
        >>> out = normal_score(q, 0, z)
        >>> [name for name, _, _ in out]
        ['loc', 'scale']
        >>> all(torch.allclose(g, r) for (_, _, g), r in zip(out, ref))
        True
    """
    loc, sigma = base.loc, base.scale
    inv = sigma.detach().reciprocal()
    d = (value.detach() - loc.detach()) * inv
    g_loc = d * inv
    grads = (("loc", loc, g_loc), ("scale", sigma, d * g_loc - inv))  # (d^2 - 1) / sigma
    out = [(k, t, g) for k, t, g in grads if t.requires_grad]
    if not (mask is None and isinstance(scale, float) and scale == 1.0):
        lead = d.shape[: d.dim() - event_ndims] if event_ndims else d.shape
        w = scale_and_mask(d.new_ones(lead), scale, mask)
        if event_ndims:
            w = w.reshape(w.shape + (1,) * event_ndims)
        out = [(k, t, g * w) for k, t, g in out]
    return [(k, t, g if g.shape == t.shape else g.sum_to_size(t.shape)) for k, t, g in out]


def normal_sites(trace) -> list[tuple[str, Normal, int, list]] | str:
    r"""``(name, base, event_ndims, transforms)`` (as :func:`normal_pushforward` gives them) of
    the guide sites whose score part is closed-form at their ``Normal``'s parameters, or the
    reason (naming the site) why a site is not one.

    Qualifies a guide trace whose latent sites are each: marked ``infer={"stl": False}``; a
    ``Delta`` reaching the parameters only through earlier samples; or a
    :func:`normal_pushforward` whose ``loc`` and ``scale`` read no earlier sample and come
    from no matrix product (not amortized), drawn by that ``Normal``, outside any subsampled
    plate. Its score part is then :func:`normal_score` at :math:`u = T^{-1}(z)`.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro import poutine
        >>> def guide():
        ...     m = pyro.param("m", torch.tensor(0.0))
        ...     pyro.sample("a", dist.LogNormal(m, 1.0))
        ...     pyro.sample("b", dist.Gamma(2.0, pyro.param("r", torch.tensor(1.0))))
        >>> normal_sites(poutine.trace(guide).get_trace())
        "guide site 'b' is a Gamma, not a plain Normal"
    """
    out, nodes = [], {}
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or site["is_observed"]:
            continue
        if site_is_subsample(site) or site["infer"].get("enumerate"):
            return f"guide site '{name}' is enumerated or a subsample site"
        fn, value = site["fn"], site["value"]
        grad = torch.is_tensor(value) and value.requires_grad
        delta = delta_base(fn)
        if delta is not None:
            if density_reads_parameters(delta, nodes):
                return f"guide site '{name}' is a Delta whose density reads parameters"
            if (
                site["infer"].get("is_auxiliary")
                and grad
                and reaches_leaf_directly(value, stop_nodes=nodes)
            ):
                return f"guide site '{name}' is an auxiliary Delta of parameters"
        elif not getattr(fn, "has_rsample", False):
            return f"guide site '{name}' is not reparameterized"
        elif site["infer"].get("stl", True) is not False:
            base, nd, transforms = normal_pushforward(fn)
            if base is None:
                return f"guide site '{name}' is a {type(fn).__name__}, not a plain Normal"
            ps = [t for t in (base.loc, base.scale) if t.requires_grad]
            if ps:
                if not grad or reached_nodes(ps, nodes):
                    return f"guide site '{name}' reads an earlier sample (or was replayed)"
                if passes_product(ps, nodes):
                    return f"guide site '{name}' is amortized (a network computes it)"
                if any(
                    f.full_size is not None and f.full_size != f.size
                    for f in site["cond_indep_stack"]
                ):
                    return f"guide site '{name}' is in a subsampled plate"
                out.append((name, base, nd, transforms))
        if torch.is_tensor(value) and value.grad_fn is not None:
            nodes[value.grad_fn] = len(nodes)
    return out
