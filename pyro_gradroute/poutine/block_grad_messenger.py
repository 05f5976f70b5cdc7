"""``block_grad``: keep the log-density terms of chosen sites from chosen parameters."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import TracebackType

import torch
from pyro.distributions import Delta, MaskedDistribution
from pyro.poutine.messenger import Messenger

from .._compat import Subsample, is_deterministic_site, mask_of
from .gated_distribution import GatedDistribution
from .resolve import BlockSpec, ModuleSpec, ParamSpec


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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
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
