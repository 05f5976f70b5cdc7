"""Doubly-reparameterized importance-weighted estimators (Tucker, Lawson, Gu & Maddison 2019)."""

from __future__ import annotations

import math

import torch
from pyro.poutine import Trace

from .. import routing
from .._compat import set_unquantized, unquantized
from .._validation import check_float, check_int
from ..distributions.detached import delta_base
from ..poutine.pathwise import DeltaDensityError
from ..poutine.stick_the_landing_messenger import (
    StickTheLandingMessenger,
    STLPolicy,
)
from ..routing import reaches_leaf_directly
from .elbo import (
    EXTRA,
    PATHWISE,
    RoutedELBO,
    Terms,
    _joint_blocks,
    add_term,
    collect_blocks,
    get_split_importance_trace,
    name_nan,
    pathwise_log_prob,
    refuse_model_enumeration,
)


def _gate(guide_trace: Trace) -> Trace:
    """The trace whose values the model replays: each differentiable value read through a view,
    whose node :func:`_scale_gradient` hooks (the guide's own uses of the value bypass it)."""
    trace = guide_trace.copy()
    for name, site in guide_trace.nodes.items():
        value = site.get("value")
        if site["type"] == "sample" and torch.is_tensor(value) and value.requires_grad:
            site = dict(site)
            site["value"] = value.view_as(value)
            if unquantized(value) is not None:
                set_unquantized(site["value"], unquantized(value))
            trace.nodes[name] = site
    return trace


def _scale_gradient(model_trace: Trace, guide_trace: Trace, factors: dict) -> None:
    """Multiply the gradient the model sends to each gated guide value by the value's factor."""
    for name, f in factors.items():
        msite = model_trace.nodes.get(name)
        gsite = guide_trace.nodes.get(name)
        if msite is None or gsite is None:
            continue
        v, z = msite["value"], gsite["value"]
        if v is z or not torch.is_tensor(v) or v.grad_fn is None:
            continue  # not gated (one particle), or no gradient to scale
        if not torch.is_tensor(f) and f == 1:
            continue
        if torch.is_tensor(f):
            f = f.reshape(f.shape + (1,) * getattr(gsite["fn"], "event_dim", 0))

        def hook(grad_inputs, grad_outputs, f=f):
            # f's dims beyond the value's are size-1 (plates summed with keepdim)
            return tuple(None if g is None else (g * f).sum_to_size(g.shape) for g in grad_inputs)

        v.grad_fn.register_hook(hook)


def _sum_dependent(t: torch.Tensor, dims) -> torch.Tensor:
    dims = [d for d in dims if -t.dim() <= d]
    return t.sum(dims, keepdim=True) if dims else t


def _plates(sites) -> tuple[list[int], float]:
    """``(sum_dims, outer)``: Pyro's ``get_dependent_plate_dims`` (the dims of the plates not
    common to all ``sites``, frames compared as Pyro compares them) and the subsampling scale
    ``N / b`` of the vectorized plates (by name) that hold every site (1 without subsampling)."""
    frames, keyed, named = {}, [], []
    for s in sites:
        keys, names = set(), {}
        for f in s["cond_indep_stack"]:
            size = f.size.item() if torch.is_tensor(f.size) else f.size
            key = (f.name, f.dim, size, f.counter)
            frames[key] = f
            keys.add(key)
            if f.dim is not None:
                names[f.name] = f
        keyed.append(keys)
        named.append(names)
    common = set(frames).intersection(*keyed)
    sum_dims = sorted({f.dim for k, f in frames.items() if k not in common and f.dim is not None})
    shared = [named[0][n] for n in set(named[0]).intersection(*named[1:])] if named else []
    scales = (f.full_size / f.size for f in shared if f.full_size not in (None, f.size))
    return sum_dims, math.prod(scales, start=1.0)


def _inner_scale(site, outer: float):
    """The site's scale inside the log-weights (its scale over the common plates', times its mask)."""
    c = site["scale"] / outer
    mask = site["mask"]
    if mask is not None and mask is not True:
        c = c * (mask if torch.is_tensor(mask) else float(mask))
    return c


class _EverySite(STLPolicy):
    """DReG's: every reparameterized site's pathwise part; a site that cannot be split raises."""

    def uses_pathwise(self, site) -> bool:
        return getattr(site["fn"], "has_rsample", False)

    def fallback(self, name, error) -> bool:
        return False


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        dev = a.device if torch.is_tensor(a) else b.device
        a, b = torch.as_tensor(a, device=dev), torch.as_tensor(b, device=dev)
        a, b = torch.broadcast_tensors(a.to(b), b)
        return bool(torch.equal(a, b))
    return a == b


class TraceDReG_ELBO(RoutedELBO):
    r"""Renyi / IWAE bounds with doubly-reparameterized guide gradients (DReG, VR-IWAE).

    With :math:`K` particles :math:`z_k = g(\epsilon_k; \phi)` from the guide, log-weights
    :math:`\log w_k = \log p_\theta(x, z_k) - \log q_\phi(z_k)`, :math:`\beta = 1 - \alpha`
    and normalized weights :math:`\tilde w_k = w_k^\beta / \sum_j w_j^\beta`:

    * ``loss`` is the negative Renyi bound
      :math:`-L = -\frac{1}{\beta} \log \frac1K \sum_k w_k^\beta` (``alpha=0``: IWAE), equal
      to :class:`pyro.infer.RenyiELBO` with the same ``alpha`` on the same samples
      (subsampling: see below);
    * model parameters get :math:`\nabla_\theta L = \sum_k \tilde w_k \nabla_\theta \log w_k`;
    * guide parameters get the doubly-reparameterized gradient: through a draw whose
      log-density enters the log-weights with scale :math:`c` (``poutine.scale``, a mask, a
      subsampled plate that does not hold every site)

    .. math::

        \sum_k \tilde w_k \big(1 - c\beta + c\beta\, \tilde w_k\big)\,
        \frac{\partial \log w_k}{\partial z_k}\bigg|_{\bot(\phi)}
        \frac{\partial z_k}{\partial \phi}.

    **Derivation.** In :math:`\nabla_\phi L = \sum_k \tilde w_k (\partial_z \log w_k \,
    \partial_\phi z_k - c\, \partial_\phi \log q_\phi(z_k)|_{z_k})` the score part is replaced
    by the identity :math:`\mathbb E[f\, \partial_\phi \log q_\phi(z)] = \mathbb E[\partial_z f
    \, \partial_\phi z]` at :math:`f = \tilde w_k`, :math:`\partial_z \tilde w_k = \beta \tilde
    w_k (1 - \tilde w_k) \partial_z \log w_k`. Unbiased for :math:`\nabla_\phi L` and zero at
    an exact posterior; at :math:`c = 1` it is VR-IWAE (Daudel, Benton, Shi & Doucet, 2023),
    :math:`\sum_k (\alpha \tilde w_k + \beta \tilde w_k^2)(\dots)`, at :math:`\alpha = 0`
    Tucker et al.'s :math:`\sum_k \tilde w_k^2 (\dots)`. A path that reaches a parameter
    through no random draw (an ``AutoDelta`` value) keeps the factor :math:`\tilde w_k`.

    One model pass, one guide pass and one backward for all particles (for a conditional guide
    the path through earlier draws is kept at any depth). With ``num_particles=1`` the
    gradient is :class:`TraceSTL_ELBO`'s.

    **Subsampling.** Weights are per element of the plates that hold every site (one bound per
    data point of a VAE). A subsampled such plate's scale :math:`N/b` is taken *out* of the
    log-mean-exp, as in NumPyro's ``RenyiELBO``: the loss is an unbiased minibatch estimate of
    the full-data bound (Pyro's ``RenyiELBO`` keeps it inside, a tempered bound; without
    subsampling the two are equal).

    A guide it does not cover (``docs/dreg.md`` lists them) raises ``ValueError`` naming the
    site; use :class:`pyro.infer.RenyiELBO` there.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro_gradroute.infer import TraceDReG_ELBO
        >>> def model(x):  # a local latent per data point: one bound per point
        ...     with pyro.plate("data", len(x)):
        ...         z = pyro.sample("z", dist.Normal(0.0, 1.0))
        ...         pyro.sample("x", dist.Normal(z, 0.5), obs=x)
        >>> def guide(x):
        ...     w = pyro.param("w", torch.tensor(0.5))
        ...     with pyro.plate("data", len(x)):
        ...         pyro.sample("z", dist.Normal(w * x, 0.6))
        >>> pyro.clear_param_store()
        >>> elbo = TraceDReG_ELBO(num_particles=16, alpha=0.5)
        >>> loss = elbo.loss_and_grads(model, guide, torch.randn(10))
        >>> pyro.param("w").unconstrained().grad is not None
        True

    :param num_particles: :math:`K`.
    :param vectorize_particles: draw the particles in one vectorized pass (default).
        ``False`` draws them in a loop, as :class:`pyro.infer.RenyiELBO` does by default (a
        model that does not vectorize over particles), with the vectorized pass's loss and
        gradients on the same draws.
    :param alpha: the Renyi order (default 0: IWAE); ``alpha=1`` (the ELBO) is
        :class:`TraceSTL_ELBO`.
    """

    def __init__(
        self,
        num_particles: int = 2,
        vectorize_particles: bool = True,
        alpha: float = 0.0,
        **kwargs,
    ):
        where = type(self).__name__
        num_particles = check_int(num_particles, "num_particles", where, minimum=1)
        self.alpha = check_float(alpha, "alpha", where)
        if self.alpha == 1:
            raise ValueError(
                "TraceDReG_ELBO: alpha=1 is the ELBO itself (the Renyi bound's limit), for which "
                "the doubly-reparameterized gradient is sticking the landing: use TraceSTL_ELBO."
            )
        if (
            num_particles > 1
            and not vectorize_particles
            and type(self)._particle_terms is not TraceDReG_ELBO._particle_terms
        ):
            raise ValueError(
                f"{where} draws its {num_particles} particles in one vectorized "
                "pass only: use vectorize_particles=True, or TraceDReG_ELBO(num_particles=..., "
                "vectorize_particles=False) for a model that does not vectorize over particles."
            )
        # one particle needs no particle plate (and no max_plate_nesting guess); with
        # vectorize_particles=False the particles are drawn in a loop and combined after
        vectorize_particles = vectorize_particles and num_particles > 1
        super().__init__(
            num_particles=num_particles, vectorize_particles=vectorize_particles, **kwargs
        )
        self._handler = StickTheLandingMessenger(_policy=_EverySite(where))

    # the weightings that distinguish IWAE-DReG from RWS-DReG
    def _draw_factor(self, w: torch.Tensor, c) -> torch.Tensor:
        """Factor on the gradient through a random draw whose log-density has scale ``c``."""
        a = c * (1 - self.alpha)
        return w if not torch.is_tensor(a) and a == 1 else 1 - a + a * w

    def _param_factor(self, w: torch.Tensor):
        """Factor on a path that reaches a parameter through no random draw (a Delta's value)."""
        return 1.0

    def _particle_divisor(self) -> int:
        return 1  # the bound already combines the particles

    def _get_trace(self, model, guide, args, kwargs):
        try:  # every site's pathwise part; one that cannot be split raises
            model_trace, guide_trace = get_split_importance_trace(
                self.max_plate_nesting,
                model,
                guide,
                args,
                kwargs,
                replay_values=_gate if self.num_particles > 1 else None,
                context=self._handler,
            )
        except DeltaDensityError as e:
            raise ValueError(f"{type(self).__name__}: {e}") from None
        refuse_model_enumeration(self, model_trace, guide_trace)
        return model_trace, guide_trace

    def _get_traces(self, model, guide, args, kwargs):
        if not self.vectorize_particles:
            yield from super()._get_traces(model, guide, args, kwargs)
            return
        try:
            pair = next(super()._get_traces(model, guide, args, kwargs))
        except NotImplementedError:
            raise  # a documented refusal (a RuntimeError too), not a failed vectorized pass
        except (RuntimeError, IndexError) as e:
            raise type(e)(
                f"{type(self).__name__}: the model or guide failed while its "
                f"{self.num_particles} particles were drawn in one vectorized pass ({e}). A "
                "model that does not vectorize over particles (for instance one that calls "
                "torch.nn.Linear on a sampled weight, or reads a sample's shape) needs "
                f"{type(self).__name__}(num_particles={self.num_particles}, "
                "vectorize_particles=False), which draws the particles in a loop."
            ) from e
        yield pair

    def _iter_particles(self, model, guide, args, kwargs):
        if self.vectorize_particles or self.num_particles == 1:
            yield from super()._iter_particles(model, guide, args, kwargs)
            return
        pairs = list(self._get_traces(model, guide, args, kwargs))
        blocks: dict = {}
        for model_trace, guide_trace in pairs:
            for key, blocked in collect_blocks(model_trace, guide_trace).items():
                blocks[key] = {**blocks.get(key, {}), **blocked}
        elbo, terms = self._weighted_terms(pairs)
        if elbo != elbo:  # NaN: a NaN log-density is named
            for model_trace, guide_trace in pairs:
                name_nan(guide_trace, model_trace)
        blocks = _joint_blocks(terms, blocks)
        trainable = any(
            site["type"] == "param" for pair in pairs for t in pair for site in t.nodes.values()
        )
        terms = {k: v for k, v in terms.items() if torch.is_tensor(v) and v.requires_grad}
        yield elbo, terms, blocks, trainable, None

    def _check_sites(self, guide_trace: Trace) -> None:
        for name, site in guide_trace.nodes.items():
            if site["type"] != "sample" or site["is_observed"]:
                continue
            fn = site["fn"]
            parts = site["score_parts"]
            if not getattr(fn, "has_rsample", False):
                if torch.is_tensor(parts.log_prob) and parts.log_prob.requires_grad:
                    raise ValueError(
                        f"Guide site '{name}' ({type(fn).__name__}) is not reparameterized, and "
                        "DReG needs a pathwise derivative through every guide sample that reads "
                        "parameters (auxiliary sites included). Use a family with rsample, or "
                        "pyro.infer.RenyiELBO(alpha=0) / pyro.infer.ReweightedWakeSleep."
                    )
                continue
            sf = parts.score_function
            if torch.is_tensor(sf) and sf.requires_grad:
                raise ValueError(
                    f"Guide site '{name}' ({type(fn).__name__}) has its own score-function term "
                    "(a rejection sampler's), which DReG does not cover. Use "
                    "pyro.infer.RenyiELBO(alpha=0), or a family with a plain rsample."
                )

    def _site_factors(self, guide_sites, w, outer) -> dict:
        """``name -> factor`` on the gradient through each guide site's value (see the class docs)."""
        records = {n: s.get(PATHWISE) for n, s in guide_sites.items()}
        by_value = {id(r.value): n for n, r in records.items() if r is not None}
        c = {n: _inner_scale(s, outer) for n, s in guide_sites.items()}
        draws = {
            n
            for n, s in guide_sites.items()
            if torch.is_tensor(s["value"])
            and s["value"].requires_grad
            and delta_base(s["fn"]) is None
        }
        # a structured guide (AutoStructured, AutoGaussian): its Deltas and auxiliary draws
        # are one reparameterized draw of the joint q(z) (see distributions.structured)
        structured = [n for n, r in records.items() if r is not None and r.owner is not None]
        structured.sort(key=lambda n: delta_base(records[n].fn) is None)  # name a latent first
        for n in structured:
            if isinstance(self, ReweightedWakeSleepDReG):
                raise ValueError(
                    f"{type(self).__name__}: guide site '{n}' belongs to "
                    f"{type(records[n].owner).__name__}, whose wake-phase (KL(p || q)) update "
                    "is not supported. Use TraceDReG_ELBO or TraceSTL_ELBO with this guide."
                )
            if records[n].point and self.num_particles > 1:
                raise ValueError(
                    f"{type(self).__name__}: guide site '{n}' is an AutoStructured 'delta' "
                    "conditional, whose value reads parameters and random draws (paths whose "
                    "DReG weights differ). Use its 'normal' or 'mvn' conditional, or "
                    "pyro.infer.RenyiELBO(alpha=0)."
                )
        draws |= {n for n in structured if not records[n].point}
        factors = {n: self._draw_factor(w, c[n]) for n in draws}
        uniform = all(_same(c[a], c[b]) for a in draws for b in draws)
        for n, site in guide_sites.items():
            rec = records.get(n)
            value = site["value"]
            if rec is None or n in draws or not (torch.is_tensor(value) and value.requires_grad):
                continue
            reached = [
                by_value[id(rec.upstream[i])] for i in routing.reached(rec.value, rec.upstream)
            ]
            direct = reaches_leaf_directly(rec.value, rec.upstream)
            if reached and direct:
                raise ValueError(
                    f"{type(self).__name__}: guide site '{n}' is a Delta whose value reads random "
                    f"draws ({reached}) and guide parameters directly (paths whose DReG weights "
                    "differ). Use pyro.infer.RenyiELBO(alpha=0) with this guide."
                )
            if not reached:
                factors[n] = self._param_factor(w)
                continue
            self._check_same_scale(n, reached, c)
            factors[n] = factors[reached[0]]
        if not uniform:  # conditional links must join draws of one scale
            for n in draws:
                rec = records.get(n)
                if rec is not None and rec.upstream:
                    hit = set(routing.reached(rec.value, rec.upstream))
                    if rec.score is not None:  # (what the split node's density reads)
                        hit |= set(routing.reached(rec.score, rec.upstream))
                    linked = [by_value[id(rec.upstream[i])] for i in sorted(hit)]
                    self._check_same_scale(n, linked + [n], c)
        return factors

    def _check_same_scale(self, name, others, c) -> None:
        for o in others:
            if not _same(c[o], c[others[0]]):
                raise ValueError(
                    f"{type(self).__name__}: guide site '{name}' depends on guide sites "
                    f"{others} whose log-densities have different scales inside the "
                    "log-weights (poutine.scale, or a subsampled plate that does not hold every "
                    "site); the doubly-reparameterized weight of a path depends on the scale of "
                    "the draw it ends at, which this estimator cannot apply along a conditional "
                    "link. Give those sites one scale, or use pyro.infer.RenyiELBO(alpha=0)."
                )

    def _log_weights(self, model_trace, guide_trace):
        """``(log_w, outer, model_sites, guide_sites)`` of one trace pair (``log_w`` detached)."""
        self._check_sites(guide_trace)
        model_sites = {n: s for n, s in model_trace.nodes.items() if s["type"] == "sample"}
        guide_sites = {n: s for n, s in guide_trace.nodes.items() if s["type"] == "sample"}
        sites = [*model_sites.values(), *guide_sites.values()]
        sum_dims, outer = _plates(sites)
        m = [_sum_dependent(s["log_prob"].detach(), sum_dims) for s in model_sites.values()]
        g = [_sum_dependent(s["log_prob"].detach(), sum_dims) for s in guide_sites.values()]
        log_w = sum(m[1:], m[0]) if m else 0  # (no 0 + ... op)
        if g:
            log_w = log_w - sum(g[1:], g[0])
        log_w = torch.as_tensor(log_w)
        return log_w if outer == 1 else log_w / outer, outer, model_sites, guide_sites

    def _weighted_terms(self, pairs) -> tuple[float, Terms]:
        """The bound and the surrogate terms of the particles in ``pairs``: one trace pair
        (its leftmost batch dimension holds the particles), or one per particle (stacked)."""
        parts = [self._log_weights(m, g) for m, g in pairs]
        outer = parts[0][1]
        if any(not _same(p[1], outer) for p in parts):
            raise ValueError(
                f"{type(self).__name__}: the particles' subsampling scales differ (the "
                "plates that hold every site have different sizes across particles)."
            )
        log_w = parts[0][0]
        if len(pairs) > 1:
            log_w = torch.stack(torch.broadcast_tensors(*(p[0] for p in parts)))
        K, beta = self.num_particles, 1 - self.alpha
        if K > 1:
            bl = log_w if beta == 1 else beta * log_w
            lse = torch.logsumexp(bl, dim=0) - math.log(K)
            elbo = outer * (lse if beta == 1 else lse / beta).sum().item()
            w = torch.softmax(bl, dim=0)
        else:
            elbo = outer * log_w.sum().item()
            w = torch.ones_like(log_w)
        terms: Terms = {}
        ws = w.unbind(0) if len(pairs) > 1 else [w]
        for (model_trace, guide_trace), (_, _, model_sites, guide_sites), wk in zip(
            pairs, parts, ws
        ):
            factors = self._site_factors(guide_sites, wk, outer)
            _scale_gradient(model_trace, guide_trace, factors)
            for name, site in model_sites.items():
                add_term(terms, ("model", name), (wk * site["log_prob"]).sum())
            for name, site in guide_sites.items():
                path = pathwise_log_prob(site)
                if torch.is_tensor(path) and path.requires_grad:
                    f = factors.get(name, 1.0)
                    add_term(terms, ("guide", name), -(wk * f * path).sum())
        if len(pairs) == 1:  # the particle's record, for estimators built on this one
            terms[EXTRA] = {"weights": w, "factors": factors}
        return elbo, terms

    def _particle_terms(self, model_trace, guide_trace, blocks=None) -> tuple[float, Terms]:
        return self._weighted_terms([(model_trace, guide_trace)])


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
        alpha = kwargs.pop("alpha", 0.0)
        if alpha != 0:
            raise ValueError(
                f"ReweightedWakeSleepDReG has no Renyi order: its wake-theta objective is the "
                f"IWAE bound (alpha=0), got alpha={alpha!r}. For the Renyi bound of order alpha "
                "with doubly-reparameterized gradients use TraceDReG_ELBO(alpha=...)."
            )
        if num_particles < 2:
            raise ValueError(
                "ReweightedWakeSleepDReG needs num_particles > 1 (self-normalized weights)"
            )
        super().__init__(
            num_particles=num_particles, vectorize_particles=vectorize_particles, **kwargs
        )

    def _draw_factor(self, w: torch.Tensor, c) -> torch.Tensor:
        return c * (1 - w)

    def _param_factor(self, w: torch.Tensor):
        return 0.0  # the wake-phi objective has no gradient through a Delta's value
