"""Convergence on real models at fixed budgets: Pyro's Trace_ELBO against this package's estimators.

Run: ``python benchmarks/bench_convergence.py --quick`` (about 25 minutes on 2 cores) or
``--full`` (every model at its script's settings); ``--json PATH`` writes the results.

Models (each built afresh from the seed, so every estimator of a seed index starts from the
same initialisation and draws from the same seed: paired seeds). A seed's estimators train in
lockstep: one step of each in turn, each with its own parameters, optimizer and random stream
swapped in around its step, so a change in the machine's load falls on all of them alike. Every
evaluation draws its own random numbers from a seed of its own (the same for every estimator
of a seed: common random numbers), so paired differences are not drowned by evaluation noise:

* ``eight_schools``: Pyro's ``examples/eight_schools/svi.py`` -- its model, its guide with the
  ``0.1 * rand`` scales, Adam lr 0.01, 1000 steps (``eta``'s parameters of shape ``(J,)``,
  not the script's ``(J, 1)``, and ``.to_event(1)`` on each site: the script predates Pyro's
  shape validation, which refuses it as written);
* ``regression``: the Bayesian-regression tutorial's ``PyroModule[nn.Linear]`` model with
  ``AutoDiagonalNormal``, Adam lr 0.03, 1000 steps, on scikit-learn's bundled diabetes data
  (features and target standardized; 20% held out);
* ``vae``: Pyro's ``vae.py`` architecture on the binarized 8x8 digits
  (:mod:`pyro_gradroute.app.models.digits_vae`), Adam lr 3e-3; held-out log p(x) by
  importance sampling (100 draws per test digit);
* ``gmm``: a two-component Gaussian mixture as in Pyro's GMM tutorial (``config_enumerate``,
  assignments enumerated under ``TraceEnum_ELBO``), with a continuous ``AutoNormal`` guide on
  weights, locations and scale; lr 0.05;
* ``stoch_vol``: a 100-day stochastic-volatility model (AR(1) log-variance, non-centred
  innovations), ``AutoNormal``, lr 0.01;
* ``sv_centered`` / ``sv_centered_lowrank``: the centered stochastic-volatility model (the
  AR(1) log-volatility path as one latent; persistence, mean and shock scale latent),
  ``AutoNormal`` / ``AutoLowRankMultivariateNormal``, lr 0.05, 5000 steps, on returns drawn from
  its prior (:data:`SV_DATA_SEED`); ``sv_centered_b`` / ``sv_centered_b_lowrank``: the same on returns drawn at
  fixed persistence 0.95, mean log-volatility 8, shock scale 0.8 (:data:`SV_B_DATA`);
* ``glm``: a hierarchical logistic regression with random intercepts for 20 groups
  (simulated), ``AutoNormal``, lr 0.01; 20% of the points held out;
* ``irt``, ``bridge``, ``cox`` (and ``_lowrank``): an item-response model, a Brownian bridge
  and a log-Gaussian Cox process on fixed simulated data (:data:`NAMED`), ``AutoNormal`` /
  ``AutoLowRankMultivariateNormal``, lr 0.05, 2000 steps.

Estimators (a registry: one line each): ``trace`` (Pyro's ``Trace_ELBO``; ``TraceEnum_ELBO``
for the mixture), ``stl`` (``TraceSTL_ELBO``; for the mixture Pyro's ``TraceEnum_ELBO`` with
the guide under ``stick_the_landing``), ``trace->stl`` (``TraceSTL_ELBO(trace_steps=N)``
with N 30% of the steps: ``Trace_ELBO``'s gradient first, then STL), ``adaptive``
(``TraceAdaptiveSTL_ELBO()`` with its defaults; for the mixture ``TraceEnumAdaptiveSTL_ELBO``,
the same estimator over ``TraceEnum_ELBO``), ``switch`` (the measured switch:
``TraceAdaptiveSTL_ELBO(mix_gain=math.inf)``, ``Trace_ELBO`` first, STL once its measured second
moment is the lower, never a mix), and for the VAE ``iwae`` (Pyro's
``RenyiELBO(alpha=0, num_particles=8)``) and ``dreg`` (``TraceDReG_ELBO(num_particles=8)``).

Reported per model x estimator, over the seeds:

* ``ELBO``: the final ELBO of the fitted guide, a plain ``Trace_ELBO``-style estimate (the
  mean of ``log p(x, z) - log q(z)``) from ``--final-draws`` guide draws (2000 in ``--full``;
  the VAE: per digit, from ``final_draws / 100`` draws for each training digit, 20 in
  ``--full``; its cheap estimate one draw per digit) -- the same yardstick for
  every row, the K > 1 rows included; mean and its SE across seeds;
* ``d vs trace``: the paired difference to Pyro's ``Trace_ELBO`` (same seed), mean and SE;
* ``held-out``: VAE: held-out log p(x) per digit; regression and glm: held-out predictive
  log-likelihood (log of the guide-averaged likelihood, summed over the held-out points);
* ``to trace's result``: the CPU time of training (``time.thread_time``; evaluation excluded)
  at which the smoothed ELBO first reaches ``Trace_ELBO``'s final ELBO minus its SE, as a
  fraction of ``Trace_ELBO``'s total training CPU time on the same seed: the median over the
  seeds that reach it, their range and ``n/N`` reached; "not reached" where none does. The
  smoothed ELBO at an evaluation is the mean of it and its two neighbours (evaluations every
  ``1/evals`` of the steps, each ``eval_draws`` draws of its own, the same for every estimator
  of a seed); ``Trace_ELBO``'s final ELBO is the ``final_draws`` one of the seed, its SE the
  standard error across the seeds (the ``±`` of its row). A fraction below 1 is a saving, one
  above 1 an estimator whose steps cost more that gets there at its end; ``Trace_ELBO``'s own
  row reads its smoothed curve too (near 1, or "not reached" on a curve still rising);
* ``d @ equal time``: the ELBO (``final_draws``, common random numbers) at ``Trace_ELBO``'s
  total training CPU time, minus ``Trace_ELBO``'s final ELBO (paired, mean and SE). The
  parameters are kept every 2% of the steps; the two kept around that time are evaluated and
  the ELBO read on the chord between them (conservative on a concave curve); an estimator
  that finishes sooner is read at its end (also conservative);
* ``ms/step``: mean CPU time per training step (``time.thread_time``); ``CPU / trace``: the
  mean over seeds of the run's training CPU time over ``Trace_ELBO``'s, in the same lockstep.

``--quick``: 5 seeds, 30% of each model's steps (``trace->stl`` switches at 30% of those),
300 final draws (the VAE: 3 per training digit, its steps 150 and held-out 50 draws),
evaluations every 5% of the steps with 10 draws. ``--full``: 5 seeds, the script's steps,
2000 final draws, evaluations every 2% of the steps with 10 draws. The table goes to
``docs/results/convergence.md`` (``--quick``: ``convergence-quick.md``; ``--results PATH``
elsewhere), under a line with the command, date, git commit and machine load. One torch thread throughout; before a model's timed runs,
five untimed steps of each estimator (the process's first-call costs).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from _common import (
    ES_SIGMA,
    ES_Y,
    bayesian_regression,
    es_guide,
    es_model,
    results_header,
    write_results,
)
from pyro import poutine
from pyro.infer import SVI, RenyiELBO, Trace_ELBO, TraceEnum_ELBO, config_enumerate
from pyro.infer.autoguide import AutoDiagonalNormal, AutoLowRankMultivariateNormal, AutoNormal

from pyro_gradroute.infer import (
    TraceAdaptiveSTL_ELBO,
    TraceDReG_ELBO,
    TraceEnumAdaptiveSTL_ELBO,
    TraceSTL_ELBO,
)
from pyro_gradroute.poutine import stick_the_landing


# ----------------------------------------------------------------------------- models
@dataclass
class Problem:
    model: Callable
    guide: Callable
    args: tuple
    steps: int
    lr: float
    enum: bool = False  # TraceEnum_ELBO (enumerated discrete sites)
    max_plate_nesting: int = 1
    vectorizes: bool = True  # whether the ELBO estimate may run vectorized over draws
    heldout: Callable[[int], float] | None = None  # draws -> held-out metric
    final: Callable[[int], float] | None = None  # draws -> final ELBO (default: generic)


def eight_schools(seed: int) -> Problem:
    """Pyro's examples/eight_schools/svi.py (model, guide, init, lr, steps; eta's shape fixed)."""
    data = torch.stack([ES_Y, ES_SIGMA], dim=1)
    return Problem(es_model, es_guide, (data,), 1000, 0.01, vectorizes=False)


def _standardized(x, y, seed=0):
    x = torch.as_tensor(x, dtype=torch.float32)
    y = torch.as_tensor(y, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    y = (y - y.mean()) / y.std()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n = int(0.8 * len(x))
    return x[perm[:n]], y[perm[:n]], x[perm[n:]], y[perm[n:]]


def _predictive_ll(model, guide, train_args, test_args, draws: int) -> float:
    """log of the guide-averaged likelihood of the held-out data, summed over its points."""
    lls = []
    with torch.no_grad():
        for _ in range(draws):
            tr = poutine.trace(guide).get_trace(*train_args)
            mt = poutine.trace(poutine.replay(model, trace=tr)).get_trace(*test_args)
            lls.append(sum(s["fn"].log_prob(s["value"]) for s in mt.nodes.values()
                           if s["type"] == "sample" and s["is_observed"]))  # fmt: skip
    ll = torch.stack(lls)  # (draws, n_test)
    return float((ll.logsumexp(0) - math.log(draws)).sum())


def regression(seed: int) -> Problem:
    """The Bayesian-regression tutorial's model on the diabetes data."""
    from sklearn.datasets import load_diabetes

    d = load_diabetes()
    xtr, ytr, xte, yte = _standardized(d.data, d.target)

    model = bayesian_regression(xtr.shape[1])
    guide = AutoDiagonalNormal(model)
    return Problem(model, guide, (xtr, ytr), 1000, 0.03, vectorizes=False,
                   heldout=lambda n: _predictive_ll(model, guide, (xtr, ytr), (xte, yte), n))  # fmt: skip


def vae(seed: int) -> Problem:
    from pyro_gradroute.app.models.digits_vae import VAE, load_binarized_digits

    train, test = load_binarized_digits()
    v = VAE()

    def per_point_log_w(x, draws):
        with torch.no_grad():
            h = v.encoder(x)
            q = dist.Normal(h[:, : v.z_dim], h[:, v.z_dim :].exp()).to_event(1)
            z = q.sample((draws,))
            prior = dist.Normal(torch.zeros(v.z_dim), 1.0).to_event(1)
            lik = dist.Bernoulli(logits=v.decoder(z)).to_event(1).log_prob(x)
            return prior.log_prob(z) + lik - q.log_prob(z)  # (draws, n)

    def final(draws):
        return float(per_point_log_w(train, draws).mean())  # ELBO per digit

    def heldout(draws):
        lw = per_point_log_w(test, draws)
        return float((lw.logsumexp(0) - math.log(draws)).mean())  # log p(x) per test digit

    return Problem(v.model, v.guide, (train,), 1000, 3e-3, final=final, heldout=heldout)


def gmm(seed: int) -> Problem:
    g = torch.Generator().manual_seed(1)
    data = torch.cat([torch.randn(60, generator=g) - 2.0, 0.7 * torch.randn(40, generator=g) + 3.0])
    K = 2

    @config_enumerate
    def model(data):
        weights = pyro.sample("weights", dist.Dirichlet(0.5 * torch.ones(K)))
        scale = pyro.sample("scale", dist.LogNormal(0.0, 2.0))
        with pyro.plate("components", K):
            locs = pyro.sample("locs", dist.Normal(0.0, 10.0))
        with pyro.plate("data", len(data)):
            assignment = pyro.sample("assignment", dist.Categorical(weights))
            pyro.sample("obs", dist.Normal(locs[assignment], scale), obs=data)

    guide = AutoNormal(poutine.block(model, hide=["assignment"]))
    return Problem(model, guide, (data,), 500, 0.05, enum=True, vectorizes=False)


def stoch_vol(seed: int) -> Problem:
    T = 100
    g = torch.Generator().manual_seed(2)
    h, hs = 0.0, []
    for _ in range(T):
        h = -1.0 + 0.95 * (h + 1.0) + 0.3 * float(torch.randn((), generator=g))
        hs.append(h)
    y = torch.tensor(hs).div(2).exp() * torch.randn(T, generator=g)

    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
        sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
        eps = pyro.sample("eps", dist.Normal(0.0, 1.0).expand([T]).to_event(1))
        phi = 0.95
        hs = []
        mu_, sigma_ = mu.unsqueeze(-1), sigma.unsqueeze(-1)
        h = mu_ + sigma_ / math.sqrt(1 - phi**2) * eps[..., :1]
        hs.append(h)
        for t in range(1, T):
            h = mu_ + phi * (h - mu_) + sigma_ * eps[..., t : t + 1]
            hs.append(h)
        h = torch.cat(hs, -1)
        pyro.sample("y", dist.Normal(0.0, (h / 2).exp()).to_event(1), obs=y)

    return Problem(model, AutoNormal(model), (y,), 1000, 0.01, max_plate_nesting=0)


class AR1(dist.TorchDistribution):
    r"""A stationary Gaussian AR(1) path of length ``T`` as one event:
    :math:`h_1 \sim N(\mu, \sigma^2 / (1 - \phi^2))`,
    :math:`h_t \sim N(\mu + \phi (h_{t-1} - \mu), \sigma^2)`."""

    arg_constraints = {
        "loc": dist.constraints.real,
        "persistence": dist.constraints.interval(-1.0, 1.0),
        "scale": dist.constraints.positive,
    }
    support = dist.constraints.real_vector

    def __init__(self, mean, persistence, scale, T: int, validate_args=None):
        self.loc, self.persistence, self.scale = torch.broadcast_tensors(
            torch.as_tensor(mean), torch.as_tensor(persistence), torch.as_tensor(scale)
        )
        self.T = T
        super().__init__(self.loc.shape, torch.Size([T]), validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        shape = torch.Size(batch_shape)
        return AR1(self.loc.expand(shape), self.persistence.expand(shape),
                   self.scale.expand(shape), self.T)  # fmt: skip

    def sample(self, sample_shape=()):
        shape = self._extended_shape(torch.Size(sample_shape))[:-1]
        m, phi, s = (x.expand(shape) for x in (self.loc, self.persistence, self.scale))
        with torch.no_grad():
            h = m + s / (1 - phi**2).sqrt() * torch.randn(shape, dtype=m.dtype, device=m.device)
            hs = [h]
            for _ in range(self.T - 1):
                h = m + phi * (h - m) + s * torch.randn(shape, dtype=m.dtype, device=m.device)
                hs.append(h)
        return torch.stack(hs, -1)

    def log_prob(self, value):
        m, phi, s = (x.unsqueeze(-1) for x in (self.loc, self.persistence, self.scale))
        first = dist.Normal(m[..., 0], s[..., 0] / (1 - phi[..., 0] ** 2).sqrt())
        rest = dist.Normal(m + phi * (value[..., :-1] - m), s)
        return first.log_prob(value[..., 0]) + rest.log_prob(value[..., 1:]).sum(-1)


class _Persistence(dist.TransformedDistribution):
    """``2 * Beta(a, b) - 1`` on its support ``(-1, 1)`` (a plain affine transform would
    declare the whole real line: the guide's unconstrained draws could leave ``(-1, 1)``)."""

    support = dist.constraints.interval(-1.0, 1.0)


def _sv_centered_model(T: int):
    def model(y):
        persistence = pyro.sample(
            "persistence",
            _Persistence(dist.Beta(20.0, 1.5), dist.transforms.AffineTransform(-1.0, 2.0)),
        )
        mean_log_vol = pyro.sample("mean_log_vol", dist.Cauchy(0.0, 5.0))
        shock_scale = pyro.sample("shock_scale", dist.HalfCauchy(2.0))
        log_vol = pyro.sample("log_vol", AR1(mean_log_vol, persistence, shock_scale, T))
        pyro.sample("returns", dist.Normal(0.0, (log_vol / 2).exp()).to_event(1), obs=y)

    return model


#: the random seed of the centered model's data, drawn from its prior (a moderate volatility)
SV_DATA_SEED = 3

#: ``sv_centered_b``'s data: the path and returns drawn at fixed global values, with larger
#: volatility and shocks than the prior draw (every estimator still climbs at the full budget)
SV_B_DATA = {"seed": 0, "persistence": 0.95, "mean_log_vol": 8.0, "shock_scale": 0.8}


def _sv_centered_data(T: int = 100, seed: int = SV_DATA_SEED, **fixed: float) -> torch.Tensor:
    """Returns drawn from the centered model itself (seed ``seed``, the global RNG restored):
    every latent from its prior, or the global ones named in ``fixed`` (``persistence``,
    ``mean_log_vol``, ``shock_scale``) held at the given values and the path drawn given them."""
    model = _sv_centered_model(T)
    if fixed:
        model = poutine.condition(model, data={k: torch.tensor(v) for k, v in fixed.items()})
    with torch.random.fork_rng(devices=[]):
        pyro.set_rng_seed(seed)
        trace = poutine.trace(model).get_trace(None)
    return trace.nodes["returns"]["value"].detach()


def _sv_centered(guide: Callable, y: torch.Tensor) -> Problem:
    """The centered stochastic-volatility problem on returns ``y``: ``guide(model)``, Adam lr
    0.05, 5000 steps."""
    model = _sv_centered_model(len(y))
    return Problem(model, guide(model), (y,), 5000, 0.05, max_plate_nesting=0)


def stoch_vol_centered(seed: int) -> Problem:
    """The centered stochastic-volatility model: persistence ~ 2 Beta(20, 1.5) - 1,
    mean_log_vol ~ Cauchy(0, 5), shock_scale ~ HalfCauchy(2), log_vol a stationary AR(1) path
    of 100 (one event: 103 latents), returns ~ Normal(0, exp(log_vol / 2)); AutoNormal at
    Pyro's default init, Adam lr 0.05, 5000 steps."""
    return _sv_centered(AutoNormal, _sv_centered_data(100))


def stoch_vol_centered_lowrank(seed: int) -> Problem:
    """:func:`stoch_vol_centered` with ``AutoLowRankMultivariateNormal`` (Pyro's default rank
    and init)."""
    return _sv_centered(AutoLowRankMultivariateNormal, _sv_centered_data(100))


def stoch_vol_centered_b(seed: int) -> Problem:
    """:func:`stoch_vol_centered` on the returns of :data:`SV_B_DATA`."""
    return _sv_centered(AutoNormal, _sv_centered_data(100, **SV_B_DATA))


def stoch_vol_centered_b_lowrank(seed: int) -> Problem:
    """:func:`stoch_vol_centered_lowrank` on the returns of :data:`SV_B_DATA`."""
    return _sv_centered(AutoLowRankMultivariateNormal, _sv_centered_data(100, **SV_B_DATA))


#: the data of the item-response, Brownian-bridge and Cox-process models (drawn once, fixed)
IRT_SHAPE, BRIDGE_T, COX_N = (60, 25), 60, 40


def _irt_model(y):
    S, I = y.shape
    students, items = pyro.plate("students", S, dim=-2), pyro.plate("items", I, dim=-1)
    with items:
        difficulty = pyro.sample("difficulty", dist.Normal(0.0, 2.0))
        discrimination = pyro.sample("discrimination", dist.LogNormal(0.0, 0.5))
    with students:
        ability = pyro.sample("ability", dist.Normal(0.0, 1.0))
    with students, items:
        pyro.sample("y", dist.Bernoulli(logits=discrimination * (ability - difficulty)), obs=y)


def _irt_data() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    S, I = IRT_SHAPE
    ability, difficulty = torch.randn(S, 1, generator=g), 1.5 * torch.randn(I, generator=g)
    discrimination = (0.4 * torch.randn(I, generator=g)).exp()
    return torch.bernoulli(torch.sigmoid(discrimination * (ability - difficulty)), generator=g)


def _bridge_model(y):
    T = len(y)
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    walk = y.new_ones(T, T).tril()  # x = sigma * cumsum(eps): a centred random walk
    x = pyro.sample(
        "x", dist.MultivariateNormal(y.new_zeros(T), scale_tril=sigma[..., None, None] * walk)
    )
    pyro.sample("end", dist.Normal(x[..., -1], 0.01), obs=y.new_zeros(()))  # pinned at 0
    pyro.sample("y", dist.Normal(x, 0.5).to_event(1), obs=y)


def _bridge_data() -> torch.Tensor:
    g = torch.Generator().manual_seed(12)
    x = torch.cumsum(0.3 * torch.randn(BRIDGE_T, generator=g), 0)
    x = x - torch.linspace(0, 1, BRIDGE_T) * x[-1]
    return x + 0.5 * torch.randn(BRIDGE_T, generator=g)


def _cox_model(y):
    n = len(y)
    t = torch.linspace(0, 1, n, dtype=y.dtype, device=y.device)
    K = (-((t[:, None] - t) ** 2) / (2 * 0.1**2)).exp() + 1e-4 * torch.eye(
        n, dtype=y.dtype, device=y.device
    )
    L = torch.linalg.cholesky(K)
    mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
    amp = pyro.sample("amp", dist.HalfNormal(1.0))
    f = pyro.sample("f", dist.MultivariateNormal(mu[..., None] * y.new_ones(n),
                                                 scale_tril=amp[..., None, None] * L))  # fmt: skip
    pyro.sample("y", dist.Poisson(f.exp()).to_event(1), obs=y)


def _cox_data() -> torch.Tensor:
    t = torch.linspace(0, 1, COX_N)
    return torch.poisson(
        (1.0 + torch.sin(6 * t)).exp(), generator=torch.Generator().manual_seed(13)
    )


def _named(model, data, guide, nesting: int) -> Callable[[int], Problem]:
    def problem(seed: int) -> Problem:
        return Problem(model, guide(model), (data(),), 2000, 0.05, max_plate_nesting=nesting)

    return problem


#: a two-parameter item-response model (60 students x 25 items, Bernoulli on
#: ``discrimination * (ability - difficulty)``), a Brownian bridge (a centred random walk of 60
#: observed with noise, its end pinned at 0, its scale latent) and a log-Gaussian Cox process
#: (Poisson counts in 40 cells, a squared-exponential GP log-intensity of fixed length scale,
#: latent mean and amplitude): ``AutoNormal`` and ``AutoLowRankMultivariateNormal`` at Pyro's
#: default init, Adam lr 0.05, 2000 steps
NAMED = {
    f"{name}{suffix}": _named(model, data, guide, nesting)
    for name, model, data, nesting in (
        ("irt", _irt_model, _irt_data, 2),
        ("bridge", _bridge_model, _bridge_data, 0),
        ("cox", _cox_model, _cox_data, 0),
    )  # fmt: skip
    for suffix, guide in (("", AutoNormal), ("_lowrank", AutoLowRankMultivariateNormal))
}


def glm(seed: int) -> Problem:
    G, n_per, P = 20, 20, 3
    g = torch.Generator().manual_seed(3)
    group = torch.arange(G).repeat_interleave(n_per)
    x = torch.randn(G * n_per, P, generator=g)
    a = 0.5 + 1.0 * torch.randn(G, generator=g)
    logits = a[group] + x @ torch.tensor([1.0, -0.5, 0.25])
    y = torch.bernoulli(torch.sigmoid(logits), generator=g)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(4))
    tr, te = perm[: int(0.8 * len(y))], perm[int(0.8 * len(y)) :]

    def model(x, group, y=None):
        mu_a = pyro.sample("mu_a", dist.Normal(0.0, 2.0))
        sigma_a = pyro.sample("sigma_a", dist.HalfNormal(1.0))
        beta = pyro.sample("beta", dist.Normal(0.0, 1.0).expand([P]).to_event(1))
        with pyro.plate("groups", G):
            a = pyro.sample("a", dist.Normal(mu_a, sigma_a))
        logits = a[..., group] + (x * beta).sum(-1)
        with pyro.plate("data", len(group)):
            pyro.sample("y", dist.Bernoulli(logits=logits), obs=y)

    guide = AutoNormal(model)
    train, test = (x[tr], group[tr], y[tr]), (x[te], group[te], y[te])
    return Problem(model, guide, train, 1000, 0.01,
                   heldout=lambda n: _predictive_ll(model, guide, train, test, n))  # fmt: skip


MODELS: dict[str, Callable[[int], Problem]] = {
    "eight_schools": eight_schools,
    "regression": regression,
    "vae": vae,
    "gmm": gmm,
    "stoch_vol": stoch_vol,
    "sv_centered": stoch_vol_centered,
    "sv_centered_lowrank": stoch_vol_centered_lowrank,
    "sv_centered_b": stoch_vol_centered_b,
    "sv_centered_b_lowrank": stoch_vol_centered_b_lowrank,
    "glm": glm,
    **NAMED,
}


# ----------------------------------------------------------------------------- estimators
def _stl(p: Problem):
    if p.enum:  # Pyro's TraceEnum_ELBO with the guide under stick_the_landing
        return TraceEnum_ELBO(max_plate_nesting=p.max_plate_nesting), stick_the_landing(p.guide)
    return TraceSTL_ELBO(), p.guide


def _trace(p: Problem):
    if p.enum:
        return TraceEnum_ELBO(max_plate_nesting=p.max_plate_nesting), p.guide
    return Trace_ELBO(), p.guide


def _trace_steps(fraction: float):
    """``TraceSTL_ELBO(trace_steps=...)`` (the mixture: ``stick_the_landing(guide, trace_steps=...)``)."""

    def make(p):
        built = {}

        def schedule(step, total):
            if "e" not in built:
                n = int(fraction * total)
                if p.enum:
                    built["e"] = (
                        TraceEnum_ELBO(max_plate_nesting=p.max_plate_nesting),
                        stick_the_landing(p.guide, trace_steps=n),
                    )
                else:
                    built["e"] = (TraceSTL_ELBO(trace_steps=n), p.guide)
            return built["e"]

        return schedule

    return make


def _always(make):
    """A schedule of one estimator, built once per problem."""

    def build(p):
        e = make(p)
        return lambda step, total: e

    return build


def _adaptive(p: Problem):
    if p.enum:  # the same estimator over TraceEnum_ELBO
        return TraceEnumAdaptiveSTL_ELBO(max_plate_nesting=p.max_plate_nesting), p.guide
    return TraceAdaptiveSTL_ELBO(), p.guide


def _switch(p: Problem):
    if p.enum:
        return (
            TraceEnumAdaptiveSTL_ELBO(max_plate_nesting=p.max_plate_nesting, mix_gain=math.inf),
            p.guide,
        )
    return TraceAdaptiveSTL_ELBO(mix_gain=math.inf), p.guide


#: name -> (problem -> (step, total) -> (elbo, guide)); models a row applies to (None: all)
ESTIMATORS: dict[str, tuple[Callable, set | None]] = {
    "trace": (_always(_trace), None),
    "stl": (_always(_stl), None),
    "trace->stl": (_trace_steps(0.3), None),
    "adaptive": (_always(_adaptive), None),
    "switch": (_always(_switch), None),
    "iwae": (
        _always(
            lambda p: (
                RenyiELBO(alpha=0, num_particles=8, vectorize_particles=True, max_plate_nesting=1),
                p.guide,
            )
        ),
        {"vae"},
    ),  # fmt: skip
    "dreg": (
        _always(lambda p: (TraceDReG_ELBO(num_particles=8, max_plate_nesting=1), p.guide)),
        {"vae"},
    ),  # fmt: skip
}


# ----------------------------------------------------------------------------- measuring
def elbo_estimate(p: Problem, draws: int, seed: int = 0, stream: int = 0) -> float:
    """Mean of ``log p(x, z) - log q(z)`` over ``draws`` guide draws (no gradients).

    The draws come from their own generator state (``seed``, ``stream``: the final estimate
    0, the ``k``-th evaluation ``k``), so every estimator's guide is scored on the same random
    numbers (common random numbers: paired estimates), successive evaluations on independent
    ones, and the training run's random stream is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(10_000 + seed + 100_000 * stream)
        if p.final is not None:
            return p.final(max(1, draws // 100))  # per digit: a draw for each training digit
        with torch.no_grad():
            if p.enum:
                elbo = TraceEnum_ELBO(num_particles=draws, max_plate_nesting=p.max_plate_nesting)
            elif p.vectorizes:
                elbo = Trace_ELBO(num_particles=draws, vectorize_particles=True,
                                  max_plate_nesting=p.max_plate_nesting)  # fmt: skip
            else:
                elbo = Trace_ELBO(num_particles=draws)
            return -elbo.loss(p.model, p.guide, *p.args)


class _Run:
    """One estimator's training run, with its own parameters, optimizer and random stream.

    The runs of a seed take their steps in turn (lockstep): before a step the run's
    parameters and random state are swapped in, after it they are swapped out (untimed). So
    a change in the machine's load falls on every estimator's steps alike.
    """

    def __init__(self, model: str, est: str, seed: int):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        self.p = MODELS[model](seed)
        self.schedule = ESTIMATORS[est][0](self.p)
        self.store = pyro.get_param_store().get_state()
        self.rng = torch.get_rng_state()
        self.optim = pyro.optim.Adam({"lr": self.p.lr})
        self.svi, self.current = None, None
        self.cpu, self.history, self.snapshots = 0.0, [], []

    def __enter__(self):
        pyro.clear_param_store()
        pyro.get_param_store().set_state(self.store)
        torch.set_rng_state(self.rng)
        return self

    def __exit__(self, *exc):
        self.store = pyro.get_param_store().get_state()
        self.rng = torch.get_rng_state()

    def snapshot(self) -> None:
        """The parameters now (copies) and the training CPU time so far."""
        values = {k: v.detach().clone() for k, v in pyro.get_param_store().named_parameters()}
        self.snapshots.append((self.cpu, values))

    def step(self, step: int, steps: int) -> None:
        elbo, guide = self.schedule(step, steps)
        if elbo is not self.current:  # a new estimator (a schedule's switch): same optimizer
            self.svi, self.current = SVI(self.p.model, guide, self.optim, elbo), elbo
        t0 = time.thread_time()
        self.svi.step(*self.p.args)
        self.cpu += time.thread_time() - t0

    def elbo_at(self, cpu: float, draws: int, seed: int) -> float:
        """The ELBO (``draws`` draws) of the parameters at training CPU time ``cpu``.

        Linear between the two snapshots around ``cpu`` (a chord: conservative on a concave
        curve); past the last snapshot, the last (the final parameters).
        """
        live = dict(pyro.get_param_store().named_parameters())  # unconstrained leaves
        final = {k: v.detach().clone() for k, v in live.items()}
        i = bisect.bisect_left([c for c, _ in self.snapshots], cpu)
        points = self.snapshots[max(i - 1, 0) : i + 1] or self.snapshots[-1:]
        out = []
        try:
            for c, values in points:
                with torch.no_grad():
                    for k, v in values.items():
                        live[k].copy_(v)
                out.append((c, elbo_estimate(self.p, draws, seed)))
        finally:
            with torch.no_grad():
                for k, v in final.items():
                    live[k].copy_(v)
        return _at_time([(None, c, e) for c, e in out], cpu)


def run_seed(model: str, ests: list[str], seed: int, cfg: dict) -> dict:
    """Every estimator of ``ests`` trained on ``model`` from seed ``seed``, in lockstep.

    Returns ``{estimator: result}`` for the estimators that apply to the model.
    """
    runs = {est: _Run(model, est, seed) for est in ests}
    steps = cfg["steps"](model, next(iter(runs.values())).p.steps)
    runs = {est: r for est, r in runs.items() if r.schedule(0, steps) is not None}
    if not runs:
        return {}
    every = max(1, steps // cfg["evals"])
    snap_every = max(1, steps // 50)
    for step in range(steps):
        for r in runs.values():
            with r:
                r.step(step, steps)
                if (step + 1) % snap_every == 0 or step + 1 == steps:
                    r.snapshot()
                if (step + 1) % every == 0 or step + 1 == steps:
                    k = len(r.history) + 1  # the evaluation's own draws (the same for every run)
                    r.history.append(
                        (step + 1, r.cpu, elbo_estimate(r.p, cfg["eval_draws"], seed, k))
                    )
    out = {}
    base = runs.get("trace")
    for est, r in runs.items():
        with r:
            res = {
                "elbo": elbo_estimate(r.p, cfg["final_draws"], seed),
                "history": r.history,
                "cpu": r.cpu,
                "ms_per_step": 1000 * r.cpu / steps,
            }
            if base is not None:
                res["elbo_eq_time"] = (
                    res["elbo"] if r is base else r.elbo_at(base.cpu, cfg["final_draws"], seed)
                )
            if r.p.heldout is not None:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(20_000 + seed)
                    res["heldout"] = r.p.heldout(cfg["heldout_draws"])
        out[est] = res
    return out


def _mse(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return math.nan, math.nan
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan
    return statistics.mean(xs), se


def _at_time(history, cpu: float) -> float:
    """The estimate at CPU time ``cpu`` from ``(step, cpu, estimate)`` points: linear between
    the two around it.

    (A curve that rises ever more slowly lies above its chords, so this is conservative.)
    Before the first point, the first; past the last, the last.
    """
    t_prev, e_prev = 0.0, None
    for _, c, e in history:
        if c >= cpu:
            if e_prev is None:
                return e
            return e_prev + (e - e_prev) * (cpu - t_prev) / (c - t_prev)
        t_prev, e_prev = c, e
    return history[-1][2]


#: evaluations on either side of a point that the smoothed ELBO averages
SMOOTH = 1


def smoothed(history) -> list[tuple[float, float]]:
    """``(cpu, smoothed ELBO)`` at each evaluation of ``(step, cpu, ELBO)`` points: the mean of
    the evaluations within :data:`SMOOTH` of it (a centred window: no lag on a straight rise;
    at the ends, the points there are)."""
    out = []
    for i, (_, c, _) in enumerate(history):
        window = [e for _, _, e in history[max(0, i - SMOOTH) : i + SMOOTH + 1]]
        out.append((c, sum(window) / len(window)))
    return out


def time_to_result(history, target: float) -> float:
    """The CPU time of the first evaluation whose smoothed ELBO reaches ``target`` (``nan``:
    never)."""
    return next((c for c, e in smoothed(history) if e >= target), math.nan)


def summarize(results: dict) -> list[dict]:
    rows = []
    for model, by_est in results.items():
        base = by_est.get("trace")
        for est, runs in by_est.items():
            if not runs:
                continue
            row = {"model": model, "estimator": est, "seeds": len(runs)}
            row["elbo"], row["elbo_se"] = _mse([r["elbo"] for r in runs])
            row["ms_per_step"] = statistics.mean(r["ms_per_step"] for r in runs)
            if runs[0].get("heldout") is not None:
                row["heldout"], row["heldout_se"] = _mse([r["heldout"] for r in runs])
            if base:
                row["diff"], row["diff_se"] = _mse(
                    [r["elbo"] - b["elbo"] for r, b in zip(runs, base)]
                )
                row["cpu_ratio"] = statistics.mean(r["cpu"] / b["cpu"] for r, b in zip(runs, base))
                _, trace_se = _mse([b["elbo"] for b in base])
                fractions = [
                    time_to_result(
                        r["history"], b["elbo"] - (trace_se if trace_se == trace_se else 0.0)
                    )
                    / b["cpu"]
                    for r, b in zip(runs, base)
                ]
                reached = [f for f in fractions if f is not None and math.isfinite(f)]
                row["to_result"] = statistics.median(reached) if reached else math.nan
                row["to_result_range"] = (min(reached), max(reached)) if reached else None
                row["reached"] = f"{len(reached)}/{len(runs)}"
                row["diff_eq_time"], row["diff_eq_time_se"] = _mse(
                    [r["elbo_eq_time"] - b["elbo"] for r, b in zip(runs, base)]
                )
            rows.append(row)
    return rows


def _f(x, spec=".2f"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _reach(r: dict) -> str:
    """The time-to-result cell: median fraction (range, n/N), or "not reached"."""
    if "reached" not in r:
        return "-"
    if r["to_result_range"] is None:
        return f"not reached (0/{r['seeds']})"
    lo, hi = r["to_result_range"]
    return f"{r['to_result']:.2f} ({lo:.2f}-{hi:.2f}, {r['reached']})"


def markdown(rows: list[dict]) -> str:
    head = ("| model | estimator | ELBO | d vs trace | held-out | to trace's result | "
            "d @ equal time | ms/step | CPU / trace |")  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['estimator']} | {_f(r['elbo'])} ± {_f(r['elbo_se'])} | "
            f"{_f(r.get('diff'))} ± {_f(r.get('diff_se'))} | "
            + (f"{_f(r['heldout'])} ± {_f(r['heldout_se'])}" if "heldout" in r else "-")
            + f" | {_reach(r)} | "
            f"{_f(r.get('diff_eq_time'))} ± {_f(r.get('diff_eq_time_se'))} | "
            f"{_f(r['ms_per_step'], '.2f')} | {_f(r.get('cpu_ratio'), '.3f')} |"
        )
    return "\n".join(lines)


#: a few steps of every estimator on a model before its timed runs (lazy imports, caches)
_WARM = {"steps": lambda m, s: 5, "evals": 1, "eval_draws": 2, "final_draws": 2,
         "heldout_draws": 2}  # fmt: skip


def _resummarize(path: str, results: str | None, header: str) -> None:
    """The table of a saved run (``--json``), summarized by this code, into ``results`` (the
    run's own header line kept where that file has one)."""
    with open(path) as f:
        saved = json.load(f)
    rows = summarize(saved["runs"])
    table = markdown(rows)
    print(table)
    if results:
        p = Path(results)
        first = p.read_text().split("\n", 1)[0] if p.exists() else ""
        if first.startswith("Command:"):
            header = f"{first}\n\nTable re-summarized from the run's JSON: {header}"
        write_results(results, [table], header)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the short run (see module docs)")
    mode.add_argument("--full", action="store_true", help="the scripts' settings (default)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--estimators", default=",".join(ESTIMATORS))
    ap.add_argument("--json", default="bench_convergence.json", help="results file")
    ap.add_argument("--results", default=None,
                    help="the Markdown table's file (default docs/results/convergence.md, "
                    "with --quick docs/results/convergence-quick.md; '' writes none)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=None, help="every model's steps (a smoke run)")
    ap.add_argument("--final-draws", type=int, default=None, help="draws of the final ELBO")
    ap.add_argument("--from-json", default=None,
                    help="re-summarize a saved run's JSON (no training): its table to --results")  # fmt: skip
    args = ap.parse_args(argv)
    header = results_header(None if argv is None else [__file__, *argv])
    if args.from_json:
        return _resummarize(args.from_json, args.results, header)
    if args.results is None:
        name = "convergence-quick.md" if args.quick else "convergence.md"
        args.results = str(Path(__file__).resolve().parent.parent / "docs" / "results" / name)
    torch.set_num_threads(1)
    if args.quick:
        cfg = {"steps": lambda m, s: 150 if m == "vae" else int(0.3 * s), "evals": 20,
               "eval_draws": 10, "final_draws": 300, "heldout_draws": 50}  # fmt: skip
    else:
        cfg = {"steps": lambda m, s: s, "evals": 50, "eval_draws": 10, "final_draws": 2000,
               "heldout_draws": 100}  # fmt: skip
    if args.steps is not None:
        cfg["steps"] = lambda m, s: args.steps
    if args.final_draws is not None:
        cfg["final_draws"] = args.final_draws
    models = args.models.split(",")
    ests = args.estimators.split(",")
    for m in models + ests:
        if m not in MODELS and m not in ESTIMATORS:
            raise SystemExit(
                f"unknown model or estimator {m!r}: {sorted(MODELS)}, {sorted(ESTIMATORS)}"
            )
    t_start = time.perf_counter()
    results: dict = {}
    for model in models:
        applies = [e for e in ests if ESTIMATORS[e][1] is None or model in ESTIMATORS[e][1]]
        runs: dict = {e: [] for e in applies}
        run_seed(model, applies, 999, _WARM)  # untimed: the process's first-call costs
        for seed in range(args.seeds):  # a seed's estimators train in lockstep (run_seed)
            for est, r in run_seed(model, applies, seed, cfg).items():
                runs[est].append(r)
        results[model] = {e: r for e, r in runs.items() if r}
        print(f"{model:>14}: {args.seeds} seeds x {len(results[model])} estimators, "
              f"{time.perf_counter() - t_start:.0f} s elapsed", flush=True)  # fmt: skip
    rows = summarize(results)
    with open(args.json, "w") as f:
        json.dump({"mode": "quick" if args.quick else "full", "rows": rows, "runs": results}, f)
    print()
    print(markdown(rows))
    wall = time.perf_counter() - t_start
    print(f"\ntotal {wall:.0f} s wall clock; results in {args.json}")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    write_results(args.results, [markdown(rows)],
                  f"{header} Wall clock {wall:.0f} s; load at the end: {load}.")  # fmt: skip


if __name__ == "__main__":
    main()
