"""Doubly-reparameterized importance-weighted estimators (Tucker, Lawson, Gu & Maddison 2019)."""

from __future__ import annotations

import math

import torch
from pyro.infer.util import get_dependent_plate_dims
from pyro.poutine import Trace

from .elbo import RoutedELBO, Terms, add_term
from .traces import get_split_importance_trace


class _Weights:
    """Per-particle gradient factors, filled in once the importance weights are known."""

    factor: torch.Tensor | None = None


class _GradScale(torch.autograd.Function):
    """Identity in value; multiplies the incoming gradient by the particle's factor."""

    @staticmethod
    def forward(ctx, x, weights, event_dim):  # type: ignore[override]
        ctx.weights, ctx.event_dim = weights, event_dim
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        f = ctx.weights.factor
        f = f.reshape(f.shape + (1,) * ctx.event_dim)
        return grad * f, None, None


def _sum_dependent(t: torch.Tensor, dims) -> torch.Tensor:
    dims = [d for d in dims if -t.dim() <= d]
    return t.sum(dims, keepdim=True) if dims else t


class TraceDReG_ELBO(RoutedELBO):
    r"""The IWAE bound with doubly-reparameterized guide gradients (IWAE-DReG).

    With :math:`K` particles :math:`z_k = g(\epsilon_k; \phi)` from the guide, log-weights
    :math:`\log w_k = \log p_\theta(x, z_k) - \log q_\phi(z_k)` and normalized weights
    :math:`\tilde w_k = w_k / \sum_j w_j`:

    * ``loss`` is the negative IWAE bound :math:`-\log \frac1K \sum_k w_k`, equal to
      :class:`pyro.infer.RenyiELBO` with ``alpha=0`` on the same samples;
    * model parameters get the IWAE gradient :math:`\sum_k \tilde w_k \nabla_\theta \log w_k`;
    * guide parameters get the DReG gradient

      .. math::

          \sum_k \tilde w_k^2 \, \frac{\partial \log w_k}{\partial z_k}\bigg|_{\bot(\phi)}
          \frac{\partial z_k}{\partial \phi},

      whose signal-to-noise ratio grows with :math:`K` (IWAE's falls like
      :math:`1/\sqrt K`).

    One model pass, one guide pass and one backward for all particles: the surrogate is
    :math:`\sum_k \bot(\tilde w_k) [\log p(x, z_k) - \bot(\tilde w_k) \log q(z_k; \bot(\phi))]`,
    where the model reads each sample through a node that multiplies its gradient by
    :math:`\tilde w_k` (so the path through the model gets :math:`\tilde w_k^2`, the model
    parameters :math:`\tilde w_k`). The guide density with stopped parameters is the
    pathwise part of :func:`~pyro_gradroute.distributions.split_log_prob` (one evaluation;
    for conditional guides :math:`q(z_2 \mid z_1)` the path through :math:`z_1` is kept).
    With ``num_particles=1`` the gradient is :class:`TraceSTL_ELBO`'s.

    Weights are per element of the plates that hold every site (a VAE's data plate:
    one IWAE bound per data point), like ``RenyiELBO``. Works with amortized guides,
    AutoGuides whose sites are reparameterized (AutoNormal, AutoDiagonalNormal,
    AutoMultivariateNormal, AutoLowRankMultivariateNormal, AutoIAFNormal, AutoDelta),
    plates and subsampling, and :func:`~pyro_gradroute.poutine.block_grad`.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro_gradroute.infer import TraceDReG_ELBO
        >>> def model(x):  # a local latent per data point: one IWAE bound per point
        ...     with pyro.plate("data", len(x)):
        ...         z = pyro.sample("z", dist.Normal(0.0, 1.0))
        ...         pyro.sample("x", dist.Normal(z, 0.5), obs=x)
        >>> def guide(x):
        ...     w = pyro.param("w", torch.tensor(0.5))
        ...     with pyro.plate("data", len(x)):
        ...         pyro.sample("z", dist.Normal(w * x, 0.6))
        >>> pyro.clear_param_store()
        >>> elbo = TraceDReG_ELBO(num_particles=16)
        >>> loss = elbo.loss_and_grads(model, guide, torch.randn(10))
        >>> pyro.get_param_store()._params["w"].grad is not None
        True

    :param num_particles: :math:`K`.
    :param vectorize_particles: must be ``True`` when ``num_particles > 1`` (the
        weights couple the particles, so they are drawn in one vectorized pass).
    :raises ValueError: at the first step, naming the site, if a guide site is not
        reparameterized (DReG needs a pathwise derivative).
    """

    def __init__(self, num_particles: int = 2, vectorize_particles: bool = True, **kwargs):
        if num_particles > 1 and not vectorize_particles:
            raise ValueError(
                f"{type(self).__name__} couples its {num_particles} particles through the "
                "importance weights and draws them in one vectorized pass: use "
                "vectorize_particles=True"
            )
        # one particle needs no particle plate (and no max_plate_nesting guess)
        vectorize_particles = vectorize_particles and num_particles > 1
        super().__init__(num_particles=num_particles, vectorize_particles=vectorize_particles, **kwargs)

    # the two weightings that distinguish IWAE-DReG from RWS-DReG
    def _path_factor(self, w: torch.Tensor) -> torch.Tensor:
        """Extra factor on the gradient that flows through the samples into the model."""
        return w

    def _guide_weight(self, w: torch.Tensor) -> torch.Tensor:
        """Weight of each particle's guide log-density (stopped parameters)."""
        return w * w

    def _particle_divisor(self) -> int:
        return 1  # the bound already combines the particles

    def _get_trace(self, model, guide, args, kwargs):
        weights = _Weights()

        def gated(guide_trace: Trace) -> Trace:
            trace = guide_trace.copy()
            for name, site in guide_trace.nodes.items():
                if site["type"] == "sample" and torch.is_tensor(site["value"]) and site["value"].requires_grad:
                    event_dim = getattr(site["fn"], "event_dim", 0)
                    site = dict(site)
                    site["value"] = _GradScale.apply(site["value"], weights, event_dim)
                    trace.nodes[name] = site
            return trace

        model_trace, guide_trace = get_split_importance_trace(
            self.max_plate_nesting,
            model,
            guide,
            args,
            kwargs,
            replay_values=gated if self.num_particles > 1 else None,
        )  # every site split; one that cannot be split raises (DReG needs its pathwise part)
        guide_trace._gradroute_weights = weights
        return model_trace, guide_trace

    @staticmethod
    def _check_reparameterized(guide_trace: Trace) -> None:
        for name, site in guide_trace.nodes.items():
            if site["type"] != "sample" or site["is_observed"]:
                continue
            if not getattr(site["fn"], "has_rsample", False) or not site["value"].requires_grad:
                if site["infer"].get("is_auxiliary") or getattr(site["fn"], "has_rsample", False):
                    continue  # e.g. a Delta of a constant: no gradient to route
                raise ValueError(
                    f"Guide site '{name}' ({type(site['fn']).__name__}) is not reparameterized: "
                    "doubly-reparameterized gradients need a pathwise derivative through every "
                    "guide sample. Use a family with rsample for this site, or "
                    "pyro.infer.RenyiELBO(alpha=0) / pyro.infer.ReweightedWakeSleep."
                )

    def _particle_terms(self, model_trace, guide_trace) -> tuple[float, Terms]:
        self._check_reparameterized(guide_trace)
        sites = [s for t in (model_trace, guide_trace) for s in t.nodes.values() if s["type"] == "sample"]
        sum_dims = get_dependent_plate_dims(sites)
        model_lp = {n: _sum_dependent(s["log_prob"], sum_dims) for n, s in model_trace.nodes.items() if s["type"] == "sample"}
        guide_sites = {n: s for n, s in guide_trace.nodes.items() if s["type"] == "sample"}
        log_w = sum(lp.detach() for lp in model_lp.values()) - sum(
            _sum_dependent(s["log_prob"].detach(), sum_dims) for s in guide_sites.values()
        )
        log_w = torch.as_tensor(log_w)
        K = self.num_particles
        if K > 1:
            elbo = (torch.logsumexp(log_w, dim=0) - math.log(K)).sum().item()
            w = torch.softmax(log_w, dim=0)
        else:
            elbo = log_w.sum().item()
            w = torch.ones_like(log_w)
        guide_trace._gradroute_weights.factor = self._path_factor(w)
        gw = self._guide_weight(w)
        terms: Terms = {}
        for name, lp in model_lp.items():
            add_term(terms, ("model", name), (w * lp).sum())
        for name, site in guide_sites.items():
            add_term(terms, ("guide", name), -(gw * _sum_dependent(site["split"].pathwise, sum_dims)).sum())
        return elbo, terms


class ReweightedWakeSleepDReG(TraceDReG_ELBO):
    r"""Reweighted wake-sleep with a doubly-reparameterized wake-phase guide update (RWS-DReG).

    Next to :class:`pyro.infer.ReweightedWakeSleep` (with ``insomnia=1``: wake-phase
    updates only). Model parameters get the wake-theta (IWAE) gradient
    :math:`\sum_k \tilde w_k \nabla_\theta \log w_k`; guide parameters get the wake-phi
    gradient :math:`\mathbb E[\sum_k \tilde w_k \nabla_\phi \log q_\phi(z_k)]`
    (a KL(p || q) descent direction) in its doubly-reparameterized form

    .. math::

        \sum_k (\tilde w_k - \tilde w_k^2)\, \frac{\partial \log w_k}{\partial z_k}
        \bigg|_{\bot(\phi)} \frac{\partial z_k}{\partial \phi},

    unbiased for the same expectation and with lower variance than the score-function
    form. ``loss`` is the negative IWAE bound (a float, as SVI expects), the wake-theta
    objective. Requires ``num_particles > 1``.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro.infer import SVI
        >>> from pyro.infer.autoguide import AutoDiagonalNormal
        >>> from pyro_gradroute.infer import ReweightedWakeSleepDReG
        >>> def model(y):
        ...     rate = pyro.sample("rate", dist.Gamma(2.0, 1.0))
        ...     with pyro.plate("obs", len(y)):
        ...         pyro.sample("y", dist.Poisson(rate), obs=y)
        >>> pyro.clear_param_store()
        >>> svi = SVI(model, AutoDiagonalNormal(model), pyro.optim.Adam({"lr": 0.05}),
        ...           ReweightedWakeSleepDReG(num_particles=8))
        >>> loss = svi.step(torch.tensor([3.0, 1.0, 4.0]))
    """

    def __init__(self, num_particles: int = 2, vectorize_particles: bool = True, **kwargs):
        if num_particles < 2:
            raise ValueError("ReweightedWakeSleepDReG needs num_particles > 1 (self-normalized weights)")
        super().__init__(num_particles=num_particles, vectorize_particles=vectorize_particles, **kwargs)

    def _path_factor(self, w: torch.Tensor) -> torch.Tensor:
        return 1 - w

    def _guide_weight(self, w: torch.Tensor) -> torch.Tensor:
        return w - w * w
