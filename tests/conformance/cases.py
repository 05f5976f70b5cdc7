"""The conformance registry: (model, guide, handlers, arguments) cases, crossed with every estimator.

Each :class:`Case` is built fresh for every cell (empty param store, fixed seed, the case's default
dtype): ``build()`` returns a :class:`Built` with the model, the guide, the arguments and, where the
guide family contains the exact posterior, a function ``exact()`` that moves the guide's parameters
there (the zero-gradient check). ``route`` is the ``block_grad`` route of the routed column (a model
site's terms kept from one guide or model parameter), ``raises`` the estimators that must raise (or,
``optional``, may raise instead of being correct), with a pattern the message must contain (the
site's name).

Estimator keys (see ``checks.ESTIMATORS``): ``Trace``, ``STL``, ``Adaptive``
(``TraceAdaptiveSTL_ELBO``: raises where STL does), ``DReG1`` (one particle),
``DReGK`` (K particles, vectorized) and ``RWS`` (``ReweightedWakeSleepDReG(K)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions.testing.rejection_gamma import RejectionGamma
from pyro.infer import autoguide as ag
from pyro.infer.reparam import LocScaleReparam, TransformReparam
from torch.distributions import constraints

from pyro_gradroute.guides import AutoMeanField
from tests import conjugate

DREG = ("DReG1", "DReGK", "RWS")
VECTORIZED_DREG = ("DReGK", "RWS")


@dataclass
class Built:
    model: Callable
    guide: Callable
    args: tuple = ()
    exact: Callable[[], None] | None = None  # moves the guide to the exact posterior


@dataclass
class Route:
    """``block_grad(sites=sites, params=params)`` around the model (and the guide, for messengers)."""

    sites: tuple[str, ...]
    params: tuple[str, ...]  # param-store names or fnmatch globs


@dataclass
class Raises:
    exc: type[BaseException]
    match: str  # a regex the message must contain: the site's name
    optional: bool = False  # True: raising or being correct both conform


@dataclass
class Case:
    name: str
    build: Callable[[], Built]
    route: Route
    max_plate_nesting: int = 1
    dtype: torch.dtype = torch.float64
    raises: dict[str, Raises] = field(default_factory=dict)  # estimator key (unrouted) -> Raises
    routed_raises: dict[str, Raises] = field(default_factory=dict)  # extra, for routed cells
    outer_scale: float | None = None  # N/b of a subsampled plate that holds every site
    score_guide: bool = False  # guide sites with a score-function part (no RenyiELBO reference)
    messenger: bool = False  # a GuideMessenger guide
    particles: int = 8  # vectorized particles per Trace/STL draw

    @property
    def build_has_exact(self) -> bool:
        """Whether the guide family holds the exact posterior (builds the case once, then cached)."""
        if not hasattr(self, "_has_exact"):
            old = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            with pyro.get_param_store().scope():
                self._has_exact = self.build().exact is not None
            torch.set_default_dtype(old)
        return self._has_exact

    def raise_for(self, est: str, routed: bool) -> Raises | None:
        est = (
            "STL" if est == "Adaptive" else est
        )  # the adaptive estimator is STL plus a control variate
        if routed and est in self.routed_raises:
            return self.routed_raises[est]
        return self.raises.get(est)


# ---------------------------------------------------------------- helpers


def set_params(values: dict) -> None:
    """Set param-store entries (by exact name) to *constrained* values."""
    store = pyro.get_param_store()
    for name, value in values.items():
        assert name in store, (name, sorted(store.keys()))
        conjugate.set_param(
            name, torch.as_tensor(value, dtype=store[name].dtype).reshape(store[name].shape)
        )


def _init(model, guide, args):
    """Run the guide and the model once so that every parameter exists."""
    guide(*args)
    model(*args)


def site_name(name: str) -> str:
    return rf"'{name}'"


def gaussian_chain_posterior(T, a, sx, x):
    """Posterior of ``z0 ~ N(0,1)``, ``z_t ~ N(a z_{t-1}, 1)``, ``x_t ~ N(z_t, sx)``: mean, covariance."""
    D = torch.eye(T)
    for t in range(1, T):
        D[t, t - 1] = -a
    J = D.T @ D + torch.eye(T) / sx**2
    cov = torch.linalg.inv(J)
    return cov @ (x / sx**2), cov


def chain_conditionals(mean, cov):
    """Forward conditionals ``q(z_t | z_{t-1}) = N(b_t + c_t z_{t-1}, s_t)`` of a Gaussian Markov chain."""
    out = [(mean[0], torch.tensor(0.0), cov[0, 0].sqrt())]
    for t in range(1, len(mean)):
        c = cov[t, t - 1] / cov[t - 1, t - 1]
        b = mean[t] - c * mean[t - 1]
        s = (cov[t, t] - c * cov[t, t - 1]).sqrt()
        out.append((b, c, s))
    return out


# ---------------------------------------------------------------- an iid Gaussian model (mean-field exact)


class IIDModel:
    """``z ~ N(theta, 1)`` (2 dims), ``w ~ N(0, 2)``, ``x_i ~ N(z, 1)``, ``y_i ~ N(w, 0.5)``."""

    n = 4

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(self.n, 2, generator=g) + 1.0
        self.y = torch.randn(self.n, generator=g) - 0.5

    def model(self):
        theta = pyro.param("theta", torch.tensor([0.3, -0.2]))
        z = pyro.sample("z", dist.Normal(theta, 1.0).to_event(1))
        w = pyro.sample("w", dist.Normal(0.0, 2.0))
        with pyro.plate("data", self.n):
            pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=self.x)
            pyro.sample("y", dist.Normal(w, 0.5), obs=self.y)

    def posterior(self):
        theta = pyro.param("theta").detach()
        zm, zs = (theta + self.x.sum(0)) / (1 + self.n), torch.full((2,), (1 + self.n) ** -0.5)
        prec = 1 / 4 + self.n / 0.25
        wm, ws = (self.y.sum() / 0.25) / prec, torch.tensor(prec**-0.5)
        return zm, zs, wm, ws


def _iid(guide_cls, exact_kind=None):
    def build():
        m = IIDModel()
        guide = guide_cls(m.model)
        _init(m.model, guide, ())

        def exact():
            zm, zs, wm, ws = m.posterior()
            p = guide_cls.__name__
            if exact_kind == "sites":
                set_params(
                    {f"{p}.locs.z": zm, f"{p}.scales.z": zs, f"{p}.locs.w": wm, f"{p}.scales.w": ws}
                )
            elif exact_kind == "flat":
                set_params(
                    {f"{p}.loc": torch.cat([zm, wm[None]]), f"{p}.scale": torch.cat([zs, ws[None]])}
                )
            elif exact_kind == "messenger":  # a GuideMessenger's params carry no prefix
                set_params({"locs.z": zm, "scales.z": zs, "locs.w": wm, "scales.w": ws})

        return Built(m.model, guide, (), exact if exact_kind else None)

    return build


# ---------------------------------------------------------------- correlated Gaussians (full / low rank)


def _mvn():
    S0 = torch.tensor([[1.0, 0.6, 0.2], [0.6, 1.5, -0.4], [0.2, -0.4, 0.8]])
    m = conjugate.GaussianModel(D=3, n=3, prior_cov=S0, obs_scale=1.2)
    guide = ag.AutoMultivariateNormal(m.model)
    _init(m.model, guide, ())

    def exact():
        mean, cov = m.posterior()
        L = torch.linalg.cholesky(cov)
        scale = L.diagonal()
        set_params(
            {
                "AutoMultivariateNormal.loc": mean,
                "AutoMultivariateNormal.scale": scale,
                "AutoMultivariateNormal.scale_tril": L / scale[:, None],
            }
        )

    return Built(m.model, guide, (), exact)


def _lowrank():
    u = torch.tensor([0.8, -0.5, 0.3])
    m = conjugate.GaussianModel(D=3, n=3, prior_cov=torch.eye(3) + torch.outer(u, u), obs_scale=1.0)
    guide = ag.AutoLowRankMultivariateNormal(m.model, rank=1)
    _init(m.model, guide, ())

    def exact():
        mean, cov = m.posterior()
        k = m.n / m.s**2
        c = 1 / (1 + u @ u)
        a = 1 / (1 + k)
        b = c / (1 + k) ** 2 / (1 - c * (u @ u) / (1 + k))
        torch.testing.assert_close(a * torch.eye(3) + b * torch.outer(u, u), cov)
        p = "AutoLowRankMultivariateNormal"
        set_params(
            {
                f"{p}.loc": mean,
                f"{p}.scale": torch.full((3,), a**0.5),
                f"{p}.cov_factor": (b / a) ** 0.5 * u[:, None],
            }
        )

    return Built(m.model, guide, (), exact)


def _iaf():
    m = conjugate.GaussianModel(D=2, n=3)
    guide = ag.AutoIAFNormal(m.model, hidden_dim=[4], num_transforms=1)
    _init(m.model, guide, ())
    return Built(m.model, guide)


# ---------------------------------------------------------------- Delta guides


class ScaleModel:
    """``z ~ N(0, 1)`` (2 dims), ``sigma ~ LogNormal(0, 0.5)``, ``x_i ~ N(z, sigma)``."""

    def __init__(self):
        g = torch.Generator().manual_seed(2)
        self.x = torch.randn(5, 2, generator=g) * 0.7 + 0.5

    def model(self):
        z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        sigma = pyro.sample("sigma", dist.LogNormal(0.0, 0.5))
        with pyro.plate("data", len(self.x)):
            pyro.sample("x", dist.Normal(z, sigma[..., None]).to_event(1), obs=self.x)


def _delta():
    m = ScaleModel()
    guide = ag.AutoDelta(m.model)
    _init(m.model, guide, ())
    return Built(m.model, guide)


def _guide_list():
    m = ScaleModel()
    guide = ag.AutoGuideList(m.model)
    guide.append(ag.AutoDelta(poutine.block(m.model, expose=["sigma"])))
    guide.append(ag.AutoNormal(poutine.block(m.model, hide=["sigma"])))
    _init(m.model, guide, ())
    return Built(m.model, guide)


# ---------------------------------------------------------------- conditional guides: chains of depth 1..5


class Chain:
    """``z0 -> z1 -> ... -> z_{T-1}`` (``pyro.markov``), an observation per level; guide linear-Gaussian."""

    sx = 0.7

    def __init__(self, T):
        self.T = T
        g = torch.Generator().manual_seed(T)
        self.x = torch.randn(T, generator=g) + 0.5

    def model(self):
        a = pyro.param("chain_a", torch.tensor(0.8))
        z = None
        for t in pyro.markov(range(self.T)):
            z = pyro.sample(f"z{t}", dist.Normal(0.0 if z is None else a * z, 1.0))
            pyro.sample(f"x{t}", dist.Normal(z, self.sx), obs=self.x[t])

    def guide(self):
        z = None
        for t in pyro.markov(range(self.T)):
            b = pyro.param(f"q_b{t}", torch.tensor(0.1 * t))
            s = pyro.param(f"q_s{t}", torch.tensor(0.8), constraint=constraints.positive)
            loc = b
            if z is not None:
                loc = loc + pyro.param(f"q_c{t}", torch.tensor(0.3)) * z
            z = pyro.sample(f"z{t}", dist.Normal(loc, s))

    def exact(self):
        a = pyro.param("chain_a").detach()
        mean, cov = gaussian_chain_posterior(self.T, a, self.sx, self.x)
        values = {}
        for t, (b, c, s) in enumerate(chain_conditionals(mean, cov)):
            values[f"q_b{t}"], values[f"q_s{t}"] = b, s
            if t:
                values[f"q_c{t}"] = c
        set_params(values)


def _chain(T):
    def build():
        m = Chain(T)
        _init(m.model, m.guide, ())
        return Built(m.model, m.guide, (), m.exact)

    return build


def _structured():
    """``z1 -> z2 -> x``; ``AutoStructured`` with a linear dependency holds the exact posterior."""
    m = Chain(2)
    guide = ag.AutoStructured(
        m.model,
        conditionals={"z0": "normal", "z1": "normal"},
        dependencies={"z1": {"z0": "linear"}},
    )
    _init(m.model, guide, ())

    def exact():
        a = pyro.param("chain_a").detach()
        mean, cov = gaussian_chain_posterior(2, a, m.sx, m.x)
        (m0, _, s0), (_, c1, s1) = chain_conditionals(mean, cov)
        p = "AutoStructured"
        set_params(
            {
                f"{p}.locs.z0": m0,
                f"{p}.scales.z0": s0,
                f"{p}.locs.z1": mean[1],
                f"{p}.scales.z1": s1,
                f"{p}.deps.z1.z0$$$weight": c1,
            }
        )

    return Built(m.model, guide, (), exact)


# ---------------------------------------------------------------- GuideMessengers


class ThreeLevel:
    """``z0 ~ N(0,1)``, ``z1 ~ N(z0, 1)``, ``z2 ~ N(z1, 1)``, an observation per level."""

    sx = 0.8

    def __init__(self):
        self.x = torch.tensor([0.4, 1.1, 1.6])

    def model(self):
        z = None
        for t in range(3):
            z = pyro.sample(f"z{t}", dist.Normal(0.0 if z is None else z, 1.0))
            pyro.sample(f"x{t}", dist.Normal(z, self.sx), obs=self.x[t])


def _hier_messenger():
    m = ThreeLevel()
    guide = ag.AutoHierarchicalNormalMessenger(m.model)
    _init(m.model, guide, ())

    def exact():
        mean, cov = gaussian_chain_posterior(3, 1.0, m.sx, m.x)
        values = {}  # a GuideMessenger's params carry no prefix
        for t, (b, c, s) in enumerate(chain_conditionals(mean, cov)):
            values[f"locs.z{t}"], values[f"scales.z{t}"] = b, s
            if t:
                values[f"weights.z{t}"] = c
        set_params(values)

    return Built(m.model, guide, (), exact)


# ---------------------------------------------------------------- AutoMeanField families (conjugate)


def _mean_field(make):
    def build():
        c = make()
        guide = AutoMeanField(c.model, family=c.family)
        _init(c.model, guide, (c.data,))

        def exact():
            post = c.posterior
            names = {
                dist.Gamma: ("concentration", "rate"),
                dist.Beta: ("concentration1", "concentration0"),
                dist.Dirichlet: ("concentration",),
            }[c.family]
            set_params({f"AutoMeanField.{c.site}.{n}": getattr(post, n) for n in names})

        return Built(c.model, guide, (c.data,), exact)

    return build


# ---------------------------------------------------------------- amortized encoders, plates


class Amortized:
    """Local ``z_i``, ``u_i`` per data point; ``x_i ~ N(dec_w z_i, 0.5)``, ``y_i ~ N(u_i, 0.8)``.

    A linear encoder feeds both sites (locs and log-scales); it holds the exact posterior.
    With ``batch`` the data plate (which holds every site) is subsampled by the indices passed in.
    """

    N = 6

    def __init__(self):
        g = torch.Generator().manual_seed(4)
        self.data = torch.randn(self.N, 2, generator=g) * 1.5
        self.enc = torch.nn.Linear(2, 4)

    def model(self, idx=None):
        w = pyro.param("dec_w", torch.tensor(1.3))
        with pyro.plate("data", self.N, subsample=idx) as i:
            d = self.data[i]
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            u = pyro.sample("u", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(w * z, 0.5), obs=d[:, 0])
            pyro.sample("y", dist.Normal(u, 0.8), obs=d[:, 1])

    def guide(self, idx=None):
        pyro.module("enc", self.enc)
        with pyro.plate("data", self.N, subsample=idx) as i:
            h = self.enc(self.data[i])
            pyro.sample("z", dist.Normal(h[:, 0], h[:, 2].exp()))
            pyro.sample("u", dist.Normal(h[:, 1], h[:, 3].exp()))

    def exact(self):
        w = pyro.param("dec_w").detach()
        pz, pu = 1 + w**2 / 0.25, 1 + 1 / 0.64
        with torch.no_grad():
            self.enc.weight.zero_()
            self.enc.weight[0, 0] = w / 0.25 / pz
            self.enc.weight[1, 1] = 1 / 0.64 / pu
            self.enc.bias.copy_(
                torch.stack([w * 0, w * 0, -0.5 * pz.log(), -0.5 * torch.log(torch.tensor(pu))])
            )


def _amortized(batch=None):
    def build():
        m = Amortized()
        args = () if batch is None else (torch.tensor(batch),)
        _init(m.model, m.guide, args)
        return Built(m.model, m.guide, args, m.exact)

    return build


def _nested():
    """Plates ``i`` (3) and ``j`` (2): ``z_ij``, ``x_ij`` in both, ``g_i``, ``y_i`` in ``i`` only."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(3, 2, generator=g), torch.randn(3, generator=g)

    def model():
        with pyro.plate("i", 3, dim=-2):
            gi = pyro.sample("g", dist.Normal(0.0, 1.0))
            pyro.sample("y", dist.Normal(gi, 0.6), obs=y[:, None])
            with pyro.plate("j", 2, dim=-1):
                z = pyro.sample("z", dist.Normal(0.5, 1.0))
                pyro.sample("x", dist.Normal(z, 0.5), obs=x)

    guide = ag.AutoNormal(model)
    _init(model, guide, ())

    def exact():
        pg, pz = 1 + 1 / 0.36, 1 + 1 / 0.25
        set_params(
            {
                "AutoNormal.locs.g": (y[:, None] / 0.36) / pg,
                "AutoNormal.scales.g": torch.full((3, 1), pg**-0.5),
                "AutoNormal.locs.z": (0.5 + x / 0.25) / pz,
                "AutoNormal.scales.z": torch.full((3, 2), pz**-0.5),
            }
        )

    return Built(model, guide, (), exact)


def _subsample_inner():
    """Global ``mu``, local ``z_i`` in a plate of 6 subsampled to 3 (the scale stays in the log-weights)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(6, generator=g) + 1.0

    def model(idx):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 6, subsample=idx) as i:
            z = pyro.sample("z", dist.Normal(mu, 1.0))
            pyro.sample("x", dist.Normal(z, 0.5), obs=x[i])

    guide = ag.AutoNormal(model)
    args = (torch.tensor([1, 4, 5]),)
    _init(model, guide, args)
    return Built(model, guide, args)


def _scale_tensor():
    """Global ``mu`` and local ``z_i`` under ``poutine.scale`` with a tensor scale, in model and guide."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, generator=g) + 0.5
    c = torch.tensor([0.25, 4.0, 1.0, 6.0])

    def model():
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 4), poutine.scale(scale=c):
            z = pyro.sample("z", dist.Normal(mu, 1.0))
            pyro.sample("x", dist.Normal(z, 0.5), obs=x)

    def guide():
        m = pyro.param("sc_m", torch.tensor(0.2))
        s = pyro.param("sc_s", torch.tensor(0.7), constraint=constraints.positive)
        lz = pyro.param("sc_lz", torch.zeros(4))
        sz = pyro.param("sc_sz", torch.full((4,), 0.6), constraint=constraints.positive)
        pyro.sample("mu", dist.Normal(m, s))
        with pyro.plate("data", 4), poutine.scale(scale=c):
            pyro.sample("z", dist.Normal(lz, sz))

    _init(model, guide, ())
    return Built(model, guide)


def _mask():
    """``poutine.mask`` on the likelihood of some points: their ``z`` posterior is the prior."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, generator=g)
    keep = torch.tensor([True, False, True, True])

    def model():
        with pyro.plate("data", 4):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            with poutine.mask(mask=keep):
                pyro.sample("x", dist.Normal(z, 0.5), obs=x)

    guide = ag.AutoNormal(model)
    _init(model, guide, ())

    def exact():
        p = 1 + keep.double() / 0.25
        set_params({"AutoNormal.locs.z": keep * x / 0.25 / p, "AutoNormal.scales.z": p**-0.5})

    return Built(model, guide, (), exact)


def _obs_mask():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(4, generator=g)
    observed = torch.tensor([True, False, True, False])

    def model():
        with pyro.plate("data", 4):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("x", dist.Normal(z, 0.5), obs=x, obs_mask=observed)

    guide = ag.AutoNormal(model)
    _init(model, guide, ())
    return Built(model, guide)


def _loc_scale_reparam():
    g = torch.Generator().manual_seed(10)
    x = torch.randn(4, generator=g) + 1.0

    def base():
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 4):
            z = pyro.sample("z", dist.Normal(mu, 2.0))
            pyro.sample("x", dist.Normal(z, 0.5), obs=x)

    model = poutine.reparam(base, config={"z": LocScaleReparam(centered=0.0)})
    guide = ag.AutoNormal(model)
    _init(model, guide, ())
    return Built(model, guide)


def _transform_reparam():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, generator=g) + 1.0

    def base():
        with pyro.plate("data", 4):
            z = pyro.sample(
                "z",
                dist.TransformedDistribution(
                    dist.Normal(0.0, 1.0), dist.transforms.AffineTransform(1.0, 2.0)
                ),
            )
            pyro.sample("x", dist.Normal(z, 0.5), obs=x)

    model = poutine.reparam(base, config={"z": TransformReparam()})
    guide = ag.AutoNormal(model)
    _init(model, guide, ())

    def exact():
        p = 1 + 4 / 0.25
        set_params(
            {
                "AutoNormal.locs.z_base": (2 * (x - 1) / 0.25) / p,
                "AutoNormal.scales.z_base": torch.full((4,), p**-0.5),
            }
        )

    return Built(model, guide, (), exact)


# ---------------------------------------------------------------- distributions


def _compose_transform():
    """Log-normal posterior; guide ``exp(affine(N(0,1)))`` through a ComposeTransform: exact."""
    m = conjugate.LogNormalModel()

    def guide():
        loc = pyro.param("ct_loc", torch.tensor(0.2))
        scale = pyro.param("ct_scale", torch.tensor(0.6), constraint=constraints.positive)
        t = dist.transforms.ComposeTransform(
            [dist.transforms.AffineTransform(loc, scale), dist.transforms.ExpTransform()]
        )
        pyro.sample("z", dist.TransformedDistribution(dist.Normal(torch.zeros(()), 1.0), t))

    _init(m.model, guide, ())

    def exact():
        mean, sd = m.posterior_log()
        set_params({"ct_loc": mean, "ct_scale": sd})

    return Built(m.model, guide, (), exact)


def _lognormal():
    """Log-normal posterior; guide ``dist.LogNormal`` (a Normal pushed forward by exp): exact."""
    m = conjugate.LogNormalModel()

    def guide():
        loc = pyro.param("ln_loc", torch.tensor(0.2))
        scale = pyro.param("ln_scale", torch.tensor(0.6), constraint=constraints.positive)
        pyro.sample("z", dist.LogNormal(loc, scale))

    _init(m.model, guide, ())

    def exact():
        mean, sd = m.posterior_log()
        set_params({"ln_loc": mean, "ln_scale": sd})

    return Built(m.model, guide, (), exact)


def _spline():
    m = conjugate.GaussianModel(D=1, n=3)
    flow = dist.transforms.Spline(1, count_bins=4, bound=4.0)

    def model():
        z = pyro.sample("z", dist.Normal(torch.zeros(1), 1.0).to_event(1))
        with pyro.plate("data", m.n):
            pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=m.x)

    def guide():
        pyro.module("spline", flow)
        loc = pyro.param("sp_loc", torch.tensor([0.3]))
        base = dist.Normal(loc, 0.8).to_event(1)
        pyro.sample("z", dist.TransformedDistribution(base, [flow]))

    _init(model, guide, ())
    return Built(model, guide)


def _rejection_gamma():
    c = conjugate.poisson_gamma()

    def guide(x):
        a = pyro.param("rg_a", torch.tensor(8.0), constraint=constraints.greater_than(1.0))
        b = pyro.param("rg_b", torch.tensor(2.0), constraint=constraints.positive)
        pyro.sample("rate", RejectionGamma(a, b))

    _init(c.model, guide, (c.data,))
    return Built(c.model, guide, (c.data,))


class AuxModel:
    def __init__(self):
        self.x = torch.tensor(0.9)

    def model(self):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("x", dist.Normal(z, 0.5), obs=self.x)


def _aux_reparam():
    m = AuxModel()

    def guide():
        mu_u = pyro.param("aux_mu", torch.tensor(0.1))
        u = pyro.sample("u", dist.Normal(mu_u, 1.0), infer={"is_auxiliary": True})
        m_ = pyro.param("aux_m", torch.tensor(0.2))
        d = pyro.param("aux_d", torch.tensor(0.3))
        s = pyro.param("aux_s", torch.tensor(0.6), constraint=constraints.positive)
        pyro.sample("z", dist.Normal(m_ + d * u, s))

    _init(m.model, guide, ())
    return Built(m.model, guide)


def _aux_nonreparam():
    m = AuxModel()

    def guide():
        p = pyro.param("aux_p", torch.tensor(0.4), constraint=constraints.unit_interval)
        u = pyro.sample("u", dist.Bernoulli(p), infer={"is_auxiliary": True})
        m_ = pyro.param("aux_m", torch.tensor(0.2))
        d = pyro.param("aux_d", torch.tensor(0.5))
        s = pyro.param("aux_s", torch.tensor(0.6), constraint=constraints.positive)
        pyro.sample("z", dist.Normal(m_ + d * u, s))

    _init(m.model, guide, ())
    return Built(m.model, guide)


def _bernoulli():
    m = conjugate.MixedModel()
    m.x = torch.tensor(1.7)
    _init(m.model, m.guide, ())
    return Built(m.model, m.guide)


def _poisson():
    def model():
        n = pyro.sample("n", dist.Poisson(3.0))
        pyro.sample("x", dist.Normal(n, 1.0), obs=torch.tensor(2.0))

    def guide():
        rate = pyro.param("po_rate", torch.tensor(2.5), constraint=constraints.positive)
        pyro.sample("n", dist.Poisson(rate))

    _init(model, guide, ())
    return Built(model, guide)


def _masked_nonreparam():
    """A guide site ``Bernoulli(p).mask(m)``: Pyro masks its log-density, not its score function."""
    x = torch.tensor([1.2, 3.0])
    keep = torch.tensor([True, False])

    def model():
        with pyro.plate("data", 2):
            b = pyro.sample("b", dist.Bernoulli(0.5))
            pyro.sample("x", dist.Normal(b, 1.0), obs=x)

    def guide():
        p = pyro.param("mb_p", torch.tensor([0.3, 0.6]), constraint=constraints.unit_interval)
        with pyro.plate("data", 2):
            pyro.sample("b", dist.Bernoulli(p).mask(keep))

    _init(model, guide, ())
    return Built(model, guide)


def _sigmoid_tail_autonormal():
    """The same site under AutoNormal (``biject_to(unit_interval)``: a sigmoid), deep in the tail."""
    k = torch.ones(50)

    def model():
        p = pyro.sample("p", dist.Beta(2.0, 2.0))
        with pyro.plate("data", 50):
            pyro.sample("k", dist.Bernoulli(p), obs=k)

    init = ag.init_to_value(values={"p": torch.sigmoid(torch.tensor(15.5))})
    guide = ag.AutoNormal(model, init_loc_fn=init, init_scale=0.5)
    _init(model, guide, ())
    return Built(model, guide)


def _sigmoid_tail():
    """A unit-interval site through a sigmoid, the guide deep in the float32 tail."""
    k = torch.ones(50)

    def model():
        p = pyro.sample("p", dist.Beta(2.0, 2.0))
        with pyro.plate("data", 50):
            pyro.sample("k", dist.Bernoulli(p), obs=k)

    def guide():
        loc = pyro.param("sg_loc", torch.tensor(15.5))
        scale = pyro.param("sg_scale", torch.tensor(0.5), constraint=constraints.positive)
        pyro.sample(
            "p",
            dist.TransformedDistribution(
                dist.Normal(loc, scale), [dist.transforms.SigmoidTransform()]
            ),
        )

    _init(model, guide, ())
    return Built(model, guide)


# ---------------------------------------------------------------- the registry


def _nonreparam_raises(site):
    return {e: Raises(ValueError, site_name(site)) for e in DREG}


def _optional(site, ests=DREG, exc=(ValueError, NotImplementedError)):
    return {e: Raises(exc, site_name(site), optional=True) for e in ests}


_MESSENGER = {e: Raises(NotImplementedError, "GuideMessenger") for e in VECTORIZED_DREG}
# a model site's cost reaching a guide parameter through a score-function term: every path is
# blocked, or the route is an error naming the site
_REINFORCE_ROUTE = {
    e: Raises((ValueError, NotImplementedError), site_name("x"), optional=True)
    for e in ("Trace", "STL")
}

CASES: list[Case] = [
    Case("AutoNormal", _iid(ag.AutoNormal, "sites"), Route(("x",), ("AutoNormal.locs.z",))),
    Case("AutoDiagonalNormal", _iid(ag.AutoDiagonalNormal, "flat"), Route(("y",), ("theta",))),
    Case("AutoMultivariateNormal", _mvn, Route(("x",), ("AutoMultivariateNormal.loc",))),
    Case(
        "AutoLowRankMultivariateNormal",
        _lowrank,
        Route(("x",), ("AutoLowRankMultivariateNormal.cov_factor",)),
    ),
    Case("AutoIAFNormal", _iaf, Route(("x",), ("AutoIAFNormal.*",))),
    Case("AutoDelta", _delta, Route(("x",), ("AutoDelta.sigma",))),
    Case("AutoGuideList", _guide_list, Route(("x",), ("AutoGuideList.0.sigma",))),
    # a Delta whose log_density depends on the guide's parameters: the pathwise estimators
    # are exact (and zero at the exact posterior) or raise naming the site
    Case(
        "AutoStructured",
        _structured,
        Route(("x1",), ("AutoStructured.locs.z0",)),
        raises=_optional("z0", ("STL", *DREG)),
    ),
    Case(
        "AutoNormalMessenger",
        _iid(ag.AutoNormalMessenger, "messenger"),
        Route(("x",), ("locs.z",)),
        raises=dict(_MESSENGER),
        messenger=True,
    ),
    Case(
        "AutoHierarchicalNormalMessenger",
        _hier_messenger,
        Route(("x2",), ("locs.z0",)),
        raises=dict(_MESSENGER),
        messenger=True,
    ),
    Case(
        "AutoMeanField-Gamma",
        _mean_field(conjugate.poisson_gamma),
        Route(("x",), ("AutoMeanField.rate.rate",)),
    ),
    Case(
        "AutoMeanField-Beta",
        _mean_field(conjugate.binomial_beta),
        Route(("k",), ("AutoMeanField.p.concentration1",)),
    ),
    Case(
        "AutoMeanField-Dirichlet",
        _mean_field(conjugate.categorical_dirichlet),
        Route(("x",), ("AutoMeanField.theta.concentration",)),
    ),
    *[Case(f"chain{T}", _chain(T), Route((f"x{T - 1}",), ("q_b0",))) for T in range(1, 6)],
    Case("amortized", _amortized(), Route(("x",), ("enc$$$weight",)), max_plate_nesting=1),
    Case("subsample_all", _amortized([1, 4]), Route(("y",), ("enc$$$bias",)), outer_scale=3.0),
    Case("nested_plates", _nested, Route(("x",), ("AutoNormal.locs.z",)), max_plate_nesting=2),
    Case("subsample_inner", _subsample_inner, Route(("x",), ("AutoNormal.locs.mu",))),
    Case("scale_tensor", _scale_tensor, Route(("x",), ("sc_m",))),
    Case("mask", _mask, Route(("x",), ("AutoNormal.locs.z",))),
    Case("obs_mask", _obs_mask, Route(("x",), ("AutoNormal.locs.z",))),
    Case("LocScaleReparam", _loc_scale_reparam, Route(("x",), ("AutoNormal.locs.mu",))),
    Case("TransformReparam", _transform_reparam, Route(("x",), ("AutoNormal.locs.z_base",))),
    Case("ComposeTransform", _compose_transform, Route(("x",), ("ct_loc",))),
    Case("LogNormal", _lognormal, Route(("x",), ("ln_loc",))),
    Case("spline", _spline, Route(("x",), ("spline$$$*",))),
    Case(
        "RejectionGamma",
        _rejection_gamma,
        Route(("x",), ("rg_b",)),
        raises=_optional("rate"),
        score_guide=True,
    ),
    Case("aux_reparam", _aux_reparam, Route(("x",), ("aux_mu",)), max_plate_nesting=0),
    Case(
        "aux_nonreparam",
        _aux_nonreparam,
        Route(("x",), ("aux_p",)),
        max_plate_nesting=0,
        raises=_optional("u"),
        routed_raises=_REINFORCE_ROUTE,
        score_guide=True,
    ),
    Case(
        "Bernoulli",
        _bernoulli,
        Route(("x",), ("p",)),
        max_plate_nesting=0,
        raises=_nonreparam_raises("b"),
        routed_raises=_REINFORCE_ROUTE,
        score_guide=True,
    ),
    Case(
        "Poisson",
        _poisson,
        Route(("x",), ("po_rate",)),
        max_plate_nesting=0,
        raises=_nonreparam_raises("n"),
        routed_raises=_REINFORCE_ROUTE,
        score_guide=True,
    ),
    Case(
        "masked_nonreparam",
        _masked_nonreparam,
        Route(("x",), ("mb_p",)),
        raises=_nonreparam_raises("b"),
        routed_raises=_REINFORCE_ROUTE,
        score_guide=True,
    ),
    Case("sigmoid_tail", _sigmoid_tail, Route(("k",), ("sg_loc",)), dtype=torch.float32),
    Case(
        "sigmoid_tail_AutoNormal",
        _sigmoid_tail_autonormal,
        Route(("k",), ("AutoNormal.locs.p",)),
        dtype=torch.float32,
    ),
]

BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES)
