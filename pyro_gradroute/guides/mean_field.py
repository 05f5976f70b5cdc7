"""AutoMeanField: an AutoGuide with one independent factor of a chosen family per latent site."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.autoguide import AutoGuide
from pyro.infer.autoguide.initialization import InitMessenger, init_to_feasible, init_to_sample
from pyro.infer.autoguide.utils import deep_setattr, helpful_support_errors
from pyro.ops.tensor_utils import periodic_repeat
from torch.distributions import Distribution, Transform, biject_to, constraints

from .._compat import SameNameContainer, pyro_name
from .._validation import check_float, check_mapping
from .init import has_moment_init, moment_init, support_spread
from .parametrized import ParametrizedDistribution, as_pyro_family
from .support import family_support, match_support

__all__ = ["AutoMeanField", "FamilySpec"]

#: a class for every site, ``{site name: class}`` (other sites: Normal), or ``site -> class | None``.
FamilySpec = type | Mapping[str, type] | Callable[[dict], type | None]


class _Factor:
    """One site's factor: ``params()`` on the site's support, or pushed through ``transform``."""

    def __init__(self, params: ParametrizedDistribution, transform: Transform | None) -> None:
        self.params = params
        self.transform = transform

    def __call__(self) -> Distribution:
        d = self.params()
        if self.transform is None:
            return d
        # a transform of its own per draw: its cache then holds this draw's pre-image only
        # (a transform shared across calls would hold the previous draw's, a tensor computed
        # from the parameters, and be read as a parametrized flow)
        return dist.TransformedDistribution(d, [self.transform.with_cache(0).with_cache(1)])

    def quantiles(self, q: torch.Tensor, num_samples: int, seed: int) -> torch.Tensor:
        """Quantiles ``q`` (1-D) of every element: exact (``icdf``) where possible, else Monte Carlo."""
        base = self.params.distribution()
        q = q.to(device=next(self.params.parameters(), q).device)  # the factor's (e.g. CUDA)
        try:
            values = base.icdf(q.reshape((-1,) + (1,) * len(base.batch_shape)))
            if self.transform is not None:
                sign = torch.as_tensor(self.transform.sign)
                if not bool((sign > 0).all()):
                    raise NotImplementedError
                values = self.transform(values)
            return values
        except NotImplementedError:
            pass
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            samples = self().sample((num_samples,))
        samples = samples.sort(0).values
        pos = q.to(samples.dtype) * (num_samples - 1)
        lo = pos.floor().long()
        hi = (lo + 1).clamp_max(num_samples - 1)
        frac = (pos - lo).reshape((-1,) + (1,) * (samples.dim() - 1))
        return samples[lo] + frac * (samples[hi] - samples[lo])


class AutoMeanField(AutoGuide):
    r"""Mean-field guide :math:`q(z) = \prod_{\text{sites } s} q_s(z_s)` with a chosen family per site.

    Each latent site gets an independent factor from ``family`` whose arguments
    are constrained module parameters (:class:`~pyro.nn.PyroParam`, as in AutoNormal: the
    guide's ``parameters()``, ``state_dict()``, ``torch.save`` and
    ``pyro.settings.set(module_local_params=True)`` work), registered in Pyro's param store as
    ``f"AutoMeanField.{site}.{arg}"`` (see :class:`ParametrizedDistribution`):

    * if the family's support equals the site's (Gamma or LogNormal for a
      positive site, Beta for a unit-interval site, Dirichlet for a simplex site)
      the factor *is* the family: :math:`q_s = \text{family}(\theta_s)`;
    * if the family lives on the reals (Normal, StudentT, Laplace, ...) it is
      pushed through :math:`T = \texttt{biject\_to}(\text{support})` like
      :class:`~pyro.infer.autoguide.AutoNormal`: :math:`z_s = T(u)`,
      :math:`u \sim \text{family}(\theta_s)`;
    * anything else is an error naming the site, its support and the family's.

    The factor is sampled directly at the site (no auxiliary site), so
    reparameterized families (Normal, LogNormal, Gamma, Beta, Dirichlet,
    StudentT, ...; torch's implicit reparameterization covers Gamma, Beta and
    Dirichlet) get the one-pass score/pathwise split of
    :class:`~pyro_gradroute.infer.TraceSTL_ELBO`. A family without ``rsample``
    (Bernoulli for a discrete site, VonMises) is an error unless
    ``allow_score_function=True``; then Trace_ELBO uses the score-function
    estimator at that site.

    Initialisation: ``init_loc_fn`` gives each site's value :math:`m`; the factor
    starts with mean :math:`m` and the spread of AutoNormal's factor with the same
    ``init_scale`` (sd ``init_scale`` in unconstrained space; in constrained space
    by the delta method, e.g. ``init_scale * m`` on a positive site), by moment
    matching (:mod:`pyro_gradroute.guides.init`). Other families need
    ``init_params={site: {arg: value}}``, which also overrides moment matching.

    Plates: parameters of sites in plates are full-size and indexed by the
    subsample inside a subsampled plate (``pyro.param(..., event_dim=...)``).

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro.infer import SVI, Trace_ELBO
        >>> from pyro_gradroute.guides import AutoMeanField
        >>> def model(x):
        ...     rate = pyro.sample("rate", dist.Gamma(2.0, 1.0))
        ...     with pyro.plate("data", len(x)):
        ...         pyro.sample("x", dist.Poisson(rate), obs=x)
        >>> pyro.clear_param_store()
        >>> guide = AutoMeanField(model, family=dist.Gamma)   # Gamma factor for "rate"
        >>> svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
        >>> x = torch.tensor([3.0, 4.0, 2.0])
        >>> for _ in range(3):
        ...     loss = svi.step(x)
        >>> sorted(pyro.get_param_store().keys())
        ['AutoMeanField.rate.concentration', 'AutoMeanField.rate.rate']
        >>> type(guide.get_posterior(x)["rate"]).__name__
        'Gamma'
        >>> sorted(guide.state_dict())
        ['factor_modules.rate.concentration_unconstrained', 'factor_modules.rate.rate_unconstrained']

    :param model: a Pyro model.
    :param family: a distribution class for every site, a dict ``{site: class}``
        (unlisted sites get AutoNormal's Normal), or ``callable(site) -> class``
        (``None`` for Normal). Torch classes are mapped to Pyro's wrappers.
    :param init_loc_fn: per-site initialisation (see ``pyro.infer.autoguide.initialization``).
    :param init_scale: spread of the initial factors (AutoNormal's meaning).
    :param init_params: ``{site: {arg: constrained value}}`` overriding moment matching.
    :param allow_score_function: accept families without ``rsample``.
    :param create_plates: as for :class:`~pyro.infer.autoguide.AutoGuide`.
    :raises TypeError: if ``family`` or a dict value is not a distribution class.
    :raises ValueError: (at the first call) for an unknown site in the ``family``
        dict or ``init_params``, a support mismatch, a family without ``rsample``,
        or a family without a moment-matching rule and no ``init_params``.
    """

    #: samples used by :meth:`quantiles` / :meth:`median` for families without ``icdf``.
    quantile_num_samples: int = 4000

    def __init__(
        self,
        model: Callable,
        *,
        family: FamilySpec = dist.Normal,
        init_loc_fn: Callable = init_to_feasible,
        init_scale: float = 0.1,
        init_params: Mapping[str, Mapping[str, Any]] | None = None,
        allow_score_function: bool = False,
        create_plates: Callable | None = None,
    ) -> None:
        if isinstance(family, Mapping):
            for site, fam in family.items():
                try:
                    as_pyro_family(fam)
                except TypeError as e:
                    raise TypeError(f"AutoMeanField: family for site {site!r}: {e}") from None
        elif isinstance(family, type):
            as_pyro_family(family)
        elif isinstance(family, Distribution):
            raise TypeError(
                f"AutoMeanField: family must be a distribution class, got an instance "
                f"{family!r}; pass the class itself (family={type(family).__name__}), whose "
                "parameters the guide learns"
            )
        elif not callable(family):
            raise TypeError(
                "AutoMeanField: family must be a distribution class, a dict {site: class} or a "
                f"callable site -> class; got {family!r}"
            )
        self.family = family
        self.init_loc_fn = init_loc_fn
        self._init_scale = check_float(
            init_scale, "init_scale", "AutoMeanField", low=0.0, low_open=True
        )
        check_mapping(init_params, "init_params", "AutoMeanField", allow_none=True)
        for site, args in (init_params or {}).items():
            if not isinstance(args, Mapping):
                raise TypeError(
                    f"AutoMeanField: init_params[{site!r}] must be a dict {{arg: constrained "
                    f"value}} naming the factor's arguments (e.g. {{'loc': 0.0, 'scale': 1.0}}), "
                    f"got {args!r}"
                )
        self.init_params = {k: dict(v) for k, v in (init_params or {}).items()}
        self.allow_score_function = allow_score_function
        self._factors: dict[str, _Factor] = {}
        super().__init__(InitMessenger(self._init_loc)(model), create_plates=create_plates)

    def _init_loc(self, site: dict) -> torch.Tensor:
        """``init_loc_fn``, falling back to a prior draw at discrete sites it cannot handle."""
        try:
            return self.init_loc_fn(site)
        except (NotImplementedError, ValueError):
            if site["fn"].support.is_discrete:
                return init_to_sample(site)
            raise

    # ---------------------------------------------------------------- setup
    def _family_for(self, name: str, site: dict) -> type:
        spec = self.family
        if isinstance(spec, Mapping):
            fam = spec.get(name)
        elif isinstance(spec, type):
            fam = spec
        else:
            fam = spec(site)
        try:
            return as_pyro_family(dist.Normal if fam is None else fam)
        except TypeError as e:
            raise TypeError(f"AutoMeanField: family for site {name!r}: {e}") from None

    def _check_names(self) -> None:
        latent = [name for name, _ in self.prototype_trace.iter_stochastic_nodes()]
        given = [("family", self.family)] if isinstance(self.family, Mapping) else []
        given.append(("init_params", self.init_params))
        for label, mapping in given:
            unknown = sorted(set(mapping) - set(latent))
            if unknown:
                raise ValueError(
                    f"AutoMeanField: {label} names unknown site(s) {unknown}; the model's latent "
                    f"sites are {latent}"
                )

    def _setup_prototype(self, *args, **kwargs) -> None:
        super()._setup_prototype(*args, **kwargs)
        try:
            self._check_names()
            self._factors = {}
            # named as attributes of the guide: AutoMeanField.{site}.{arg}, the documented names
            self.factor_modules = SameNameContainer()
            for name, site in self.prototype_trace.iter_stochastic_nodes():
                factor = self._make_factor(name, site)
                deep_setattr(self.factor_modules, name, factor.params)
                self._factors[name] = factor
        except Exception:
            self.prototype_trace = None  # a later call sets up again (and raises again)
            raise

    def _make_factor(self, name: str, site: dict) -> _Factor:
        family = self._family_for(name, site)
        fn, value = site["fn"], site["value"].detach()
        where = f"AutoMeanField site {name!r} ({family.__name__} factor)"
        with helpful_support_errors(site):
            how = match_support(fn.support, family, name)
            transform = biject_to(fn.support).with_cache(1) if how == "pushforward" else None
            x = value if transform is None else transform.inv(value).detach()
        declared = getattr(family, "has_rsample", None)
        if isinstance(declared, bool):  # else a property: checked on the built instance below
            self._check_rsample(where, family, declared)
        event_dim = fn.event_dim + x.dim() - value.dim()
        family_event_dim = family_support(family).event_dim
        if event_dim < family_event_dim:
            raise ValueError(
                f"{where}: the family's samples have {family_event_dim} event dims but the site "
                f"has {event_dim}"
            )
        for frame in site["cond_indep_stack"]:  # subsampled plates: parameters are full-size
            full_size = frame.full_size or frame.size
            if full_size != frame.size:
                x = periodic_repeat(x, full_size, frame.dim - event_dim).contiguous()
        batch_shape = x.shape[: x.dim() - family_event_dim]
        args = self._init_args(where, name, family, fn.support, x, transform is not None)
        arg_constraints = family.arg_constraints if isinstance(family.arg_constraints, dict) else {}
        for arg, v in list(args.items()):  # full batch shape, one value per element
            c = arg_constraints.get(arg)
            if c is None or constraints.is_dependent(c) or c.is_discrete:
                continue
            v = torch.as_tensor(v, dtype=x.dtype)
            arg_event = v.shape[v.dim() - c.event_dim :] if c.event_dim else ()
            try:
                args[arg] = v.expand(batch_shape + arg_event).clone()
            except RuntimeError:
                raise ValueError(
                    f"{where}: initial value of {arg!r} has shape {tuple(v.shape)}, which does not "
                    f"broadcast to the factor's shape {tuple(batch_shape + arg_event)}"
                ) from None
        try:
            params = ParametrizedDistribution(
                f"{pyro_name(self)}.{name}", family, event_dim=event_dim - family_event_dim, **args
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from e
        self._check_rsample(where, family, params.has_rsample)
        return _Factor(params, transform)

    def _check_rsample(self, where: str, family: type, has_rsample: bool) -> None:
        if not has_rsample and not self.allow_score_function:
            raise ValueError(
                f"{where}: {family.__name__} has no rsample, so reparameterized estimators "
                "(Trace_ELBO's pathwise gradient, TraceSTL_ELBO) cannot differentiate through "
                "it. Choose a reparameterizable family, or pass allow_score_function=True to "
                "use score-function gradients at this site (higher variance)."
            )

    def _init_args(self, where, name, family, support, x, pushed) -> dict[str, Any]:
        user = self.init_params.get(name, {})
        if not has_moment_init(family):
            if user:
                return dict(user)
            raise ValueError(
                f"{where}: no moment-matching initialisation for {family.__name__}; pass "
                f"init_params={{{name!r}: {{...}}}} with initial values of its arguments "
                f"{sorted(family.arg_constraints)}"
            )
        sd = self._init_scale if pushed else support_spread(support, x, self._init_scale)
        return {**moment_init(family, x, torch.as_tensor(sd, dtype=x.dtype)), **user}

    # ---------------------------------------------------------------- guide
    @property
    def factors(self) -> dict[str, ParametrizedDistribution]:
        """Site name -> its factor's :class:`ParametrizedDistribution` (on the unconstrained
        space for pushed-forward families). Available after the first call."""
        return {name: f.params for name, f in self._factors.items()}

    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Sample every latent site from its factor; same ``*args, **kwargs`` as the model.

        :return: site name -> sampled value.
        """
        self._ensure_setup(args, kwargs)
        plates = self._create_plates(*args, **kwargs)
        result = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            with ExitStack() as stack:
                for frame in site["cond_indep_stack"]:
                    if frame.vectorized:
                        stack.enter_context(plates[frame.name])
                result[name] = pyro.sample(name, self._factors[name]())
        return result

    def _ensure_setup(self, args, kwargs) -> None:
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)

    def get_posterior(self, *args, **kwargs) -> dict[str, Distribution]:
        """Site name -> its (full-size, constrained-space) factor distribution.

        Example: ``guide.get_posterior(x)["rate"].mean``.
        """
        self._ensure_setup(args, kwargs)
        return {name: f() for name, f in self._factors.items()}

    @torch.no_grad()
    def quantiles(self, quantiles, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Site name -> tensor of shape ``(len(quantiles),) + site shape`` of marginal quantiles.

        Exact through ``icdf`` for families that have one (Normal, Laplace, ...),
        pushed through monotone bijections; otherwise Monte Carlo from
        :attr:`quantile_num_samples` draws with a fixed seed (deterministic).
        """
        self._ensure_setup(args, kwargs)
        q = torch.as_tensor(quantiles, dtype=torch.get_default_dtype()).reshape(-1)
        return {
            name: f.quantiles(q, self.quantile_num_samples, seed=i)
            for i, (name, f) in enumerate(self._factors.items())
        }

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Site name -> the marginal medians (see :meth:`quantiles`)."""
        return {name: q[0] for name, q in self.quantiles([0.5], *args, **kwargs).items()}
