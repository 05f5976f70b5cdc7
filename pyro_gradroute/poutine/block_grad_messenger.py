"""``block_grad``: keep the log-density terms of chosen sites from chosen parameters (the
handler, its gate on a site's distribution, :func:`collect_blocks`, which reads the marks, and
the resolution of a spec against the param store)."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from pyro.distributions import Delta, MaskedDistribution, TorchDistribution
from pyro.distributions.score_parts import ScoreParts
from pyro.ops.provenance import detach_provenance, get_provenance, track_provenance
from pyro.poutine.messenger import Messenger
from torch import nn

from .. import routing
from .._compat import Subsample, is_deterministic_site, mask_of, param_store_leaves

ParamSpec = str | Callable[[str], bool] | torch.Tensor
ModuleSpec = str | nn.Module
_EMPTY = torch.Size()


@dataclass(frozen=True, eq=False)
class BlockSpec:
    """What one ``block_grad`` handler blocks: its sites, from its modules and params."""

    sites: frozenset[str]
    modules: tuple[ModuleSpec, ...]
    params: tuple[ParamSpec, ...]


def _matches(kind: str, spec, store: dict) -> dict[str, torch.Tensor]:
    """``{param-store name: unconstrained leaf}`` that one module / param spec selects."""
    module = kind == "module"
    if isinstance(spec, nn.Module) if module else torch.is_tensor(spec):
        if not module and not spec.is_leaf:
            raise ValueError(
                f"block_grad: params= got a non-leaf tensor of shape {tuple(spec.shape)} (the "
                "constrained value pyro.param returns?). Pass the param-store name instead; "
                f"available names: {sorted(store)}"
            )
        by_id = {id(t): n for n, t in store.items()}
        named = spec.named_parameters() if module else [("", spec)]
        prefix = type(spec).__name__ + "." if module else f"tensor{tuple(spec.shape)}"
        out = {by_id.get(id(p), prefix + n): p for n, p in named}
    elif module:
        out = {
            n: t for n, t in store.items() if n == spec or n.startswith((spec + "$$$", spec + "."))
        }
    elif callable(spec):
        out = {n: t for n, t in store.items() if spec(n)}
    elif any(c in spec for c in "*?["):
        out = {n: t for n, t in store.items() if fnmatch.fnmatchcase(n, spec)}
    else:
        out = {spec: store[spec]} if spec in store else {}
    if out:
        return out
    if module:
        roots = {n.split("$$$")[0] if "$$$" in n else n.rsplit(".", 1)[0] for n in store}
        avail = sorted(r for r in roots if r)
        use = "Use the name given to pyro.module(name, net) or the PyroModule's name, or pass "
        use += "the nn.Module object."
    else:
        avail = sorted(store)
        use = "Use a param-store name, a glob such as 'decoder$$$*', or a predicate."
    raise ValueError(
        f"block_grad: {kind} {spec!r} matches no parameter in the param store. "
        f"Available {kind} names: {avail or '(param store is empty)'}. {use}"
    )


def resolve(specs: Iterable[BlockSpec]) -> dict[str, torch.Tensor]:
    """Param-store name -> unconstrained leaf (what the optimizer updates), for the union of
    ``specs``; ``pyro.module("decoder", net)`` registers ``"decoder$$$<param>"``, a
    ``PyroModule`` named ``decoder`` ``"decoder.<param>"``."""
    store = param_store_leaves()
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        for m in spec.modules:
            out.update(_matches("module", m, store))
        for p in spec.params:
            out.update(_matches("param", p, store))
    return out


class WrappedDistribution(TorchDistribution):
    """``base_dist`` in every respect (sampling, shapes, support, attributes) except what a
    subclass overrides; ``_own`` names the subclass's own attributes."""

    arg_constraints: dict = {}
    _own: tuple = ("base_dist",)

    def __getattr__(self, name):
        if name in type(self)._own:
            raise AttributeError(name)
        return getattr(self.base_dist, name)

    @property
    def has_rsample(self):  # type: ignore[override]
        return self.base_dist.has_rsample

    @has_rsample.setter
    def has_rsample(self, value):
        # Pyro's broadcast copies a site's custom ``has_rsample_`` onto the expanded
        # distribution by assignment: it belongs to the base distribution
        self.base_dist.has_rsample = bool(value)

    has_enumerate_support = property(lambda self: self.base_dist.has_enumerate_support)  # type: ignore[assignment]
    support = property(lambda self: self.base_dist.support)  # type: ignore[assignment]
    mean = property(lambda self: self.base_dist.mean)
    variance = property(lambda self: self.base_dist.variance)

    def sample(self, sample_shape=_EMPTY):
        return self.base_dist.sample(sample_shape)

    def rsample(self, sample_shape=_EMPTY):
        return self.base_dist.rsample(sample_shape)

    def enumerate_support(self, expand=True):
        return self.base_dist.enumerate_support(expand=expand)


SPECS_KEY = "block_grad_specs"


class GatedDistribution(WrappedDistribution):
    r"""``base_dist`` with :math:`\nabla_\theta \log p = 0` for the blocked parameters :math:`\theta`.

    Sampling, shapes, support and every other attribute are those of ``base_dist``;
    ``log_prob`` and the three ``score_parts`` are passed through
    :func:`~pyro_gradroute.routing.gate`. ``kl_divergence`` is deliberately not
    registered, so ``TraceMeanField_ELBO`` uses its Monte Carlo fallback at a gated site
    (an analytic KL mixes the model's and the guide's terms, which routes cannot split).

    Example::

        >>> import torch, pyro.distributions as dist
        >>> from pyro_gradroute.poutine.block_grad_messenger import BlockSpec
        >>> loc = torch.tensor(0.0, requires_grad=True)
        >>> spec = BlockSpec(frozenset({"x"}), (), (loc,))
        >>> d = GatedDistribution(dist.Normal(loc, 1.0), [spec])
        >>> d.log_prob(torch.tensor(1.0)).backward()
        >>> loc.grad is None  # the only parameter is blocked: no gradient at all
        True
    """

    def __init__(self, base_dist=None, specs=(), site=None, score_sites=None, **params):
        if base_dist is None or params:
            # a reparameterizer rebuilding the site's distribution (type(fn)(**params))
            raise TypeError(
                f"block_grad: a gated distribution (site {site!r}) was rebuilt from "
                f"{sorted(params)}, as a reparameterizer does; the rebuilt one cannot carry "
                "the route. Put block_grad outside poutine.reparam and block the sample "
                "site(s) the reparameterizer creates."
            )
        self.base_dist = base_dist
        self.specs = tuple(specs)
        self.site = site
        self.score_sites = score_sites if score_sites is not None else []
        super().__init__(base_dist.batch_shape, base_dist.event_shape, validate_args=False)

    @classmethod
    def wrap(cls, fn, spec: BlockSpec, site=None, score_sites=None) -> GatedDistribution:
        """``fn`` gated by ``spec`` (merging with an existing gate: nested handlers compose)."""
        if isinstance(fn, cls):
            merged = list(fn.score_sites) + [
                s for s in score_sites or () if s not in fn.score_sites
            ]
            return cls(fn.base_dist, fn.specs + (spec,), fn.site or site, merged)
        return cls(fn, (spec,), site, score_sites)

    def _gate(self, t):
        if torch.jit.is_tracing():
            raise NotImplementedError(
                "block_grad routes cannot be traced by the JIT (JitTrace_ELBO and friends). "
                "Use pyro.infer.Trace_ELBO / TraceGraph_ELBO / TraceMeanField_ELBO / RenyiELBO, "
                "or pyro_gradroute.infer.Trace_ELBO / TraceSTL_ELBO (fastest with routes)."
            )
        if not (torch.is_tensor(t) and t.requires_grad):
            return t
        # TraceGraph_ELBO tracks which sites a log-density depends on with ProvenanceTensor
        # (a __torch_function__ subclass): gate the plain tensor, then restore the provenance.
        provenance = get_provenance(t)
        plain, blocked = detach_provenance(t), resolve(self.specs)
        self._check_score_function_paths(plain, blocked)
        gated = routing.gate(plain, blocked)
        return track_provenance(gated, provenance) if provenance else gated

    def _check_score_function_paths(self, t, blocked) -> None:
        """Raise where a blocked parameter can only be reached through a REINFORCE term: Pyro's
        ELBOs build those from *detached* model log-densities, which a gate here cannot reach
        (a latent site whose value has no gradient has such a term)."""
        others = [n for n in self.score_sites if n != self.site]
        if not others:
            return
        reached = set(routing.reachable_leaves(t))
        unreached = sorted(n for n, p in blocked.items() if p not in reached)
        if unreached:
            raise NotImplementedError(
                f"block_grad: site {self.site!r} is blocked from {unreached}, which its "
                "log-density does not reach pathwise, and latent site(s) "
                f"{others} have no reparameterized gradient: their score-function "
                "(REINFORCE) terms carry this site's cost, and Pyro's ELBOs build those "
                "terms from detached log-densities, so this route cannot be applied there. "
                "Use pyro_gradroute.infer.Trace_ELBO or TraceSTL_ELBO, which route "
                "REINFORCE terms per site."
            )

    def log_prob(self, value, *args, **kwargs):
        return self._gate(self.base_dist.log_prob(value, *args, **kwargs))

    def score_parts(self, value, *args, **kwargs):
        parts = self.base_dist.score_parts(value, *args, **kwargs)
        return ScoreParts(*(self._gate(t) for t in parts))

    def expand(self, batch_shape, _instance=None):
        return GatedDistribution(
            self.base_dist.expand(batch_shape), self.specs, self.site, self.score_sites
        )


def collect_blocks(model_trace, guide_trace) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    """``{("model" | "guide", site): {param name: unconstrained leaf}}`` for every marked site.

    A site is marked by its gate, or by the specs an estimator unwrapped it to (under
    ``site["block_grad_specs"]``). The keys are :class:`~pyro_gradroute.infer.RoutedELBO`'s
    term keys; the values what :func:`pyro_gradroute.routing.backward` takes as a block entry.

    Example::

        >>> import pyro, torch, pyro.distributions as dist
        >>> from pyro import poutine
        >>> from pyro_gradroute.poutine import block_grad
        >>> def model():
        ...     w = pyro.param("w", torch.tensor(1.0))
        ...     pyro.sample("x", dist.Normal(w, 1.0), obs=torch.tensor(0.5))
        >>> tr = poutine.trace(block_grad(model, sites="x", params="w")).get_trace()
        >>> list(collect_blocks(tr, poutine.Trace()))
        [('model', 'x')]
    """
    blocks: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for role, trace in (("model", model_trace), ("guide", guide_trace)):
        for name, site in trace.nodes.items():
            if site["type"] != "sample":
                continue
            fn = site["fn"]
            specs = fn.specs if isinstance(fn, GatedDistribution) else site.get(SPECS_KEY, ())
            if specs:
                blocks[(role, name)] = resolve(specs)
    return blocks


def _as_tuple(x, what: str) -> tuple:
    if x is None:
        return ()
    # one name, one module (a ModuleDict / Sequential is one module, not its keys or
    # children) or one tensor (not its rows)
    if isinstance(x, (str, torch.nn.Module, torch.Tensor)) or not isinstance(x, Iterable):
        out: tuple = (x,)
    else:
        out = tuple(x)
    if what == "sites" and not all(isinstance(s, str) for s in out):
        raise TypeError(f"block_grad: sites must be site names (str), got {out!r}")
    for item in out:
        if what == "modules" and not isinstance(item, (str, torch.nn.Module)):
            kind = f"the class {item.__name__}" if isinstance(item, type) else repr(item)
            raise TypeError(
                f"block_grad: modules= expects module names (str) or nn.Module objects, got "
                f"{kind}; pass the module instance (the one given to pyro.module or the "
                "PyroModule itself) or its name"
            )
        if what == "params" and (
            isinstance(item, type)
            or not (isinstance(item, str) or torch.is_tensor(item) or callable(item))
        ):
            raise TypeError(
                f"block_grad: params= expects param-store names or globs (str), predicates "
                f"name -> bool, or leaf tensors, got {item!r}"
            )
    return out


class BlockGradMessenger(Messenger):
    r"""Block the named sites' log-density terms from the named parameters.

    For every sample or ``pyro.factor`` site :math:`s` in ``sites`` (model or guide,
    observed or latent) and every parameter :math:`\theta` selected by ``modules`` /
    ``params``, the ELBO's gradient loses exactly the contribution of :math:`s`'s
    terms (its log-density and, for non-reparameterized guide sites, its
    score-function term) to :math:`\theta`:

    .. math::

        \hat\nabla_\theta = \nabla_\theta \mathcal{L}
            - \nabla_\theta \big[\text{terms of } s\big]
            \qquad (\theta \text{ blocked for } s)

    Every other path is unchanged, including the contribution of :math:`s` to the
    other parameters *through* :math:`\theta`'s module (e.g. an encoder upstream of a
    blocked decoder still learns from :math:`s`). Handlers nest (their blocks add up).

    The handler wraps each matched site's distribution in a :class:`GatedDistribution`:
    Pyro's own ELBOs differentiate through the gate (exact, slower); this package's
    ELBOs unwrap it, read its specs (:func:`collect_blocks`) and route with
    :func:`pyro_gradroute.routing.backward` (fast). Names are resolved against the param store when log-densities are
    computed. A site in ``sites`` that never occurs raises ``ValueError`` when the
    handler exits (naming it and listing the sites seen).

    With ``poutine.reparam``: put ``block_grad`` *outside* it and name the sample sites
    the reparameterizer creates (``x_decentered`` for ``LocScaleReparam``); naming the
    site it made deterministic (``x``), or putting ``block_grad`` inside, raises
    ``ValueError`` saying so (``pyro.deterministic`` sites likewise have no term). Under
    Pyro's ELBOs, a site blocked from parameters that it reaches only through the
    score-function term of a non-reparameterized latent raises ``NotImplementedError``
    (Pyro builds those terms from detached log-densities); this package's ELBOs route them.

    Example::

        >>> import pyro, torch, pyro.distributions as dist
        >>> def model():
        ...     w = pyro.param("w", torch.tensor(1.0))
        ...     pyro.factor("penalty", -w**2)
        >>> with BlockGradMessenger(sites=["penalty"], params=["w"]):
        ...     tr = pyro.poutine.trace(model).get_trace()
        >>> type(tr.nodes["penalty"]["fn"]).__name__
        'GatedDistribution'

    :param sites: site name(s) whose terms are blocked.
    :param modules: ``pyro.module`` / ``PyroModule`` name(s) or ``nn.Module`` object(s).
    :param params: param-store name(s), glob(s) (``fnmatch``), predicate(s)
        ``name -> bool``, or leaf tensors.
    """

    def __init__(
        self,
        sites: str | Iterable[str],
        modules: ModuleSpec | Iterable[ModuleSpec] | None = None,
        params: ParamSpec | Iterable[ParamSpec] | None = None,
    ) -> None:
        super().__init__()
        site_names = frozenset(_as_tuple(sites, "sites"))
        mods, prms = _as_tuple(modules, "modules"), _as_tuple(params, "params")
        if not site_names:
            raise ValueError("block_grad: give at least one site name in sites=[...]")
        if not (mods or prms):
            raise ValueError(
                f"block_grad(sites={sorted(site_names)}): nothing to block; pass modules=[...] "
                "and/or params=[...]"
            )
        self.spec = BlockSpec(site_names, mods, prms)
        self._seen: list[str] = []

    def __enter__(self) -> BlockGradMessenger:
        self._seen = []
        self._open: list[str] = []  # gated sites whose message is still being processed
        self._score_sites: list[str] = []  # latent sites whose value has no gradient
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        super().__exit__(exc_type, exc_value, traceback)
        if exc_type is not None and self._open:
            # e.g. a reparameterizer (outer poutine.reparam) that cannot handle a gated fn
            name = self._open[-1]
            raise ValueError(
                f"block_grad: processing site {name!r} failed after it was gated ("
                f"{type(exc_value).__name__}: {exc_value}). If an outer poutine.reparam "
                "reparameterizes it, put block_grad outside poutine.reparam and block the "
                f"sample site(s) the reparameterizer creates instead (e.g. '{name}_decentered' "
                f"for LocScaleReparam, '{name}_base' for TransformReparam): "
                "block_grad(poutine.reparam(model, config), sites=[...], ...)."
            ) from exc_value
        if exc_type is None:
            missing = sorted(self.spec.sites.difference(self._seen))
            if missing:
                raise ValueError(
                    f"block_grad: site(s) {missing} never occurred while the handler was "
                    f"active. Sample/factor sites seen: {sorted(set(self._seen))}. "
                    "Check the names, and that the handler wraps the model or guide "
                    "(or the svi.step call) that contains them."
                )

    def _process_message(self, msg) -> None:
        if msg["type"] != "sample":
            return
        name = msg["name"]
        if isinstance(msg["fn"], Subsample):  # a plate's subsample site, not a term
            if name in self.spec.sites:
                raise ValueError(
                    f"block_grad: '{name}' is a plate, not a sample or factor site. Name the "
                    "sample/factor sites inside the plate whose terms are to be blocked."
                )
            return
        self._seen.append(name)
        # pyro.sample(..., obs_mask=...) splits site "x" into sample sites "x_observed" and
        # "x_unobserved" (plus a deterministic "x"): all of them are site "x"'s terms
        for suffix in ("_observed", "_unobserved"):
            if name.endswith(suffix) and name[: -len(suffix)] in self.spec.sites:
                name = name[: -len(suffix)]
        if name not in self.spec.sites:
            return
        if _is_deterministic(msg):
            if {name + "_observed", name + "_unobserved"} & set(self._seen):
                return  # obs_mask's deterministic "x": its terms were gated above
            made = [s for s in self._seen if s.startswith(name + "_")]
            raise ValueError(
                f"block_grad: site {name!r} is deterministic here (poutine.reparam turned it "
                "into a deterministic site, or it is pyro.deterministic): it has no "
                "log-density term to block. Its terms now live in the sample site(s) the "
                f"reparameterizer created ({made or 'none seen yet'}): block those instead, "
                f"e.g. block_grad(..., sites={made or [name + '_decentered']}, ...)."
            )
        # The gated fn is the mark (not msg["infer"]: replay copies a guide site's infer
        # dict onto the model site, which would leak the route into the model's term).
        msg["fn"] = GatedDistribution.wrap(msg["fn"], self.spec, name, self._score_sites)
        self._open.append(msg["name"])

    def _postprocess_message(self, msg) -> None:
        if msg["type"] != "sample" or isinstance(msg["fn"], Subsample):
            return
        if self._open and self._open[-1] == msg["name"]:
            self._open.pop()
        value = msg["value"]
        if (
            not msg["is_observed"]
            and torch.is_tensor(value)
            and not value.requires_grad
            and not _is_deterministic(msg)
            and not msg["infer"].get("enumerate")
        ):
            self._score_sites.append(msg["name"])


def _is_deterministic(msg) -> bool:
    """A pyro.deterministic site, or one poutine.reparam made deterministic (masked Delta)."""
    if is_deterministic_site(msg):
        return True
    fn = msg["fn"]
    return (
        isinstance(fn, MaskedDistribution)
        and mask_of(fn) is False
        and isinstance(fn.base_dist, Delta)
    )


def block_grad(
    fn: Callable | None = None,
    sites: str | Iterable[str] = (),
    modules: ModuleSpec | Iterable[ModuleSpec] | None = None,
    params: ParamSpec | Iterable[ParamSpec] | None = None,
) -> BlockGradMessenger | Callable:
    """Handler form of :class:`BlockGradMessenger` (like ``pyro.poutine.scale``).

    Example (an auxiliary label likelihood may shape the encoder, not the decoder)::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from torch import nn
        >>> from pyro_gradroute.poutine import block_grad
        >>> dec = nn.Linear(1, 1)
        >>> def model(x, y):
        ...     pyro.module("decoder", dec)
        ...     z = pyro.sample("z", dist.Normal(0.0, 1.0))
        ...     pyro.sample("x", dist.Normal(dec(z.reshape(1, 1)).squeeze(), 1.0), obs=x)
        ...     pyro.sample("y", dist.Normal(dec(z.reshape(1, 1)).squeeze(), 1.0), obs=y)
        >>> routed = block_grad(model, sites=["y"], modules=["decoder"])
        >>> with block_grad(sites="y", modules=[dec]):
        ...     model(torch.tensor(0.0), torch.tensor(1.0))

    :returns: the wrapped ``fn``, or the messenger (a context manager) if ``fn`` is None.
    """
    msngr = BlockGradMessenger(sites=sites, modules=modules, params=params)
    return msngr if fn is None else msngr(fn)
