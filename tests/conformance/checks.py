"""The checks of one conformance cell: (case, estimator, routed or not).

Every check builds the case afresh (:func:`cell`) and compares the package's estimator with a
reference *on the same random seed*:

* ``loss``: the loss (``loss_and_grads`` and ``loss``) equals Pyro's estimator of the same objective
  (``Trace_ELBO`` for Trace/STL/DReG1, ``RenyiELBO(alpha=0)`` for DReG-K and RWS-DReG; for a
  subsampled plate holding every site, the hand-written per-point bound times N/b) to round-off;
* ``grad``: the gradient equals a *same-draw* reference on two seeds, to round-off: Pyro's
  ``Trace_ELBO`` (Trace); Pyro's ``Trace_ELBO`` surrogate on the same draws minus the score part
  ``log q(stop(z); phi)`` (STL, DReG1); the DReG-IWAE / RWS-DReG surrogate built from Pyro's
  ``RenyiELBO`` draws (DReGK, RWS). See "same-draw references" below. The adaptive estimator,
  and the guides the same-draw references do not cover (:class:`NoSameDrawReference`: flows
  without an inverse, Deltas whose log_density reads parameters, DReG with a Delta of a
  parameter or a site scaled apart from its plates), take ``unbiased``;
* ``unbiased``: the mean over draws of the per-draw *difference* from Pyro's estimator (or a
  hand-written surrogate where Pyro has none, or where Pyro's has another expectation: RWS
  wake-phi on a conditional guide, see :func:`_hand`) is within ``Z`` standard errors of zero,
  coordinate by coordinate (kept as its own cell for STL, DReG-K and RWS on a few cases:
  unbiasedness is what only statistics show);
* ``zero``: at the exact posterior (where the guide family holds it) the guide parameters'
  gradient is zero to float64 round-off (STL, DReG at any K, RWS-DReG);
* ``dreg1_stl``: ``TraceDReG_ELBO(num_particles=1)`` equals ``TraceSTL_ELBO`` draw by draw;
* ``routed``: the routed gradient equals the naive computation: every term's own backward, with the
  blocked parameters' share of the blocked terms dropped; for Trace/STL/DReG1 also the gradient with
  the blocked site scaled by 0 on the blocked parameters (every path of the site's cost removed);
* ``raises``: cells that must raise do, with a message naming the site.

Draw counts: ``GRADROUTE_CONFORMANCE_FULL=1`` (``python -m tests.conformance --full``) multiplies
them by 16.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import RenyiELBO, ReweightedWakeSleep
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from pyro.infer.util import get_dependent_plate_dims, is_identically_zero, torch_sum
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import prune_subsample_sites

from pyro_gradroute.infer import (
    ReweightedWakeSleepDReG,
    Trace_ELBO,
    TraceAdaptiveSTL_ELBO,
    TraceDReG_ELBO,
    TraceSTL_ELBO,
)
from pyro_gradroute.poutine import block_grad

from .cases import Case, Raises

ESTIMATORS = ("Trace", "STL", "Adaptive", "DReG1", "DReGK", "RWS")
K = 4  # particles of the importance-weighted estimators
Z = 5.0  # standard errors
FULL = os.environ.get("GRADROUTE_CONFORMANCE_FULL", "") not in ("", "0")
MULT = 16 if FULL else 1
#: gradient draws per estimator (Trace/STL draws each average ``case.particles`` vectorized particles)
DRAWS = {"Trace": 8, "STL": 16, "Adaptive": 16, "DReG1": 32, "DReGK": 96, "RWS": 96}
ZERO_TOL = 1e-6  # float64 round-off at the exact posterior
#: the statistical cells kept next to the same-draw ones: the estimator's mean equals Pyro's
#: estimator's (unbiasedness, which no single draw shows), on a few small seeded cases
UNBIASED_ESTIMATORS = ("STL", "DReGK", "RWS")
UNBIASED_CASES = ("AutoNormal", "chain3", "chain4", "amortized")


def draws(est: str) -> int:
    return DRAWS[est] * MULT


# ---------------------------------------------------------------- building a cell


@dataclass
class Cell:
    case: Case
    model: object
    guide: object
    args: tuple
    exact: object
    names: list  # (param name, leaf) in a fixed order
    guide_only: torch.Tensor  # flat mask: coordinates of guide-only parameters
    dependent: bool | None = None  # whether some plate does not hold every site (cached)
    conditional: bool | None = None  # whether a guide density reads an earlier draw (cached)


def _leaves():
    store = pyro.get_param_store()
    return [(k, store._params[k]) for k in sorted(store.keys())]


def _param_names(fn, args) -> set:
    tr = pyro.poutine.trace(fn).get_trace(*args)
    return {n for n, s in tr.nodes.items() if s["type"] == "param"}


def _unalias():
    """Give param-store entries that share storage their own copy (a guide initialized to a
    model parameter's value, e.g. AutoNormalMessenger's ``init_to_mean``, aliases it), so that
    moving one to the exact posterior leaves the other alone."""
    store = pyro.get_param_store()
    seen = set()
    for name in sorted(store.keys()):
        p = store._params[name]
        if p.data_ptr() in seen:
            store._params[name] = p.detach().clone().requires_grad_(p.requires_grad)
        seen.add(p.data_ptr())


@contextmanager
def cell(case: Case):
    """A fresh build of ``case``: empty param store, seed 0, validation on, the case's dtype."""
    old, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(case.dtype)
    torch.set_num_threads(1)  # tiny tensors: threads only cost
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    pyro.enable_validation(True)
    try:
        b = case.build()
        _unalias()
        pyro.set_rng_seed(0)
        guide_params = _param_names(b.guide, b.args) - _param_names(b.model, b.args)
        names = _leaves()
        mask = torch.cat([torch.full((p.numel(),), n in guide_params) for n, p in names])
        yield Cell(case, b.model, b.guide, b.args, b.exact, names, mask)
    finally:
        pyro.clear_param_store()
        torch.set_default_dtype(old)
        torch.set_num_threads(threads)


def blocked_mask(c: Cell) -> torch.Tensor:
    """Flat mask of the route's blocked parameters."""
    pats = c.case.route.params
    hit = [any(fnmatch.fnmatchcase(n, p) for p in pats) for n, _ in c.names]
    assert any(hit), (pats, [n for n, _ in c.names])
    return torch.cat([torch.full((p.numel(),), h) for h, (_, p) in zip(hit, c.names)])


def routed_pair(c: Cell):
    r = c.case.route
    model = block_grad(c.model, sites=r.sites, params=r.params)
    guide = block_grad(c.guide, sites=r.sites, params=r.params) if c.case.messenger else c.guide
    return model, guide


def _is_route_site(name: str, sites) -> bool:
    for s in sites:
        if name in (s, s + "_observed", s + "_unobserved"):
            return True
    return False


class _SiteScale(Messenger):
    """Multiply the scale of the named sites (obs_mask parts included) by ``scale``."""

    def __init__(self, sites, scale):
        super().__init__()
        self.sites, self.scale = sites, scale

    def _process_message(self, msg):
        if msg["type"] == "sample" and _is_route_site(msg["name"], self.sites):
            msg["scale"] = msg["scale"] * self.scale


def scaled_pair(c: Cell, scale: float):
    sites = c.case.route.sites
    model = _SiteScale(sites, scale)(c.model)
    guide = _SiteScale(sites, scale)(c.guide) if c.case.messenger else c.guide
    return model, guide


# ---------------------------------------------------------------- estimators


def ours(est: str, case: Case):
    mpn = case.max_plate_nesting
    P = case.particles
    if est in ("Trace", "STL", "Adaptive"):
        cls = {"Trace": Trace_ELBO, "STL": TraceSTL_ELBO, "Adaptive": TraceAdaptiveSTL_ELBO}[est]
        return cls(num_particles=P, vectorize_particles=P > 1, max_plate_nesting=mpn)
    if est == "DReG1":
        return TraceDReG_ELBO(num_particles=1, max_plate_nesting=mpn)
    if est == "DReGK":
        return TraceDReG_ELBO(num_particles=K, vectorize_particles=True, max_plate_nesting=mpn)
    if est == "RWS":
        return ReweightedWakeSleepDReG(num_particles=K, max_plate_nesting=mpn)
    raise KeyError(est)


def pyro_trace(est: str, case: Case):
    P = case.particles if est in ("Trace", "STL", "Adaptive") else 1
    return PyroTrace_ELBO(
        num_particles=P, vectorize_particles=P > 1, max_plate_nesting=case.max_plate_nesting
    )


def flat_grad(c: Cell) -> torch.Tensor:
    return torch.cat(
        [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for _, p in c.names]
    ).double()


def _zero_grads(c: Cell):
    for _, p in c.names:
        p.grad = None


def grad_of(c: Cell, fn) -> tuple[float, torch.Tensor]:
    """Run ``fn()`` (a ``loss_and_grads`` call) from zeroed grads; return its value and the flat gradient."""
    _zero_grads(c)
    value = fn()
    g = flat_grad(c)
    _zero_grads(c)
    return value, g


def seeded(seed, fn):
    pyro.set_rng_seed(seed)
    return fn()


# ---------------------------------------------------------------- hand-written importance-weighted references


def _hand(c: Cell, model, guide, rws: bool):
    """One draw of the IWAE bound (``rws``: RWS wake-theta + wake-phi) with per-point weights.

    The traces come from Pyro's own ``RenyiELBO`` / ``ReweightedWakeSleep`` (same random draws);
    log-densities of a subsampled plate holding every site are unscaled inside the log-mean-exp
    and the bound multiplied by N/b. Guide sites with a score-function part get the IWAE score
    term ``L * sum_k score_k`` (no Pyro reference has it at alpha=0). Returns ``(loss, surrogate)``
    where ``-surrogate``'s gradient is the reference.
    """
    mpn = c.case.max_plate_nesting
    if rws:
        elbo = ReweightedWakeSleep(
            num_particles=K, insomnia=1.0, max_plate_nesting=mpn, vectorize_particles=True
        )
    else:
        elbo = RenyiELBO(alpha=0, num_particles=K, max_plate_nesting=mpn, vectorize_particles=True)
    ((mt, gt),) = list(elbo._get_traces(model, guide, c.args, {}))
    s = c.case.outer_scale or 1.0
    msites = [x for x in mt.nodes.values() if x["type"] == "sample"]
    gsites = [x for x in gt.nodes.values() if x["type"] == "sample"]
    dims = get_dependent_plate_dims(msites)
    log_p = sum(torch_sum(x["log_prob"], dims) for x in msites) / s
    log_q = sum(torch_sum(x["log_prob"], dims) for x in gsites) / s
    log_w = log_p - (log_q.detach() if rws else log_q)
    L = torch.logsumexp(log_w, 0) - math.log(K)
    loss = -(s * L.sum()).item()
    if rws:
        # wake-phi holds every draw fixed: the guide replayed on its detached draws, so that a
        # conditional density reads the earlier draws detached and a Delta's log_density (a
        # Jacobian term, a function of the draws) has no gradient. Pyro's ReweightedWakeSleep
        # detaches the values only: its conditional densities and Deltas keep the pathwise
        # graph of the earlier draws, a different expectation where the guide is conditional.
        if _has_conditional_site(c):
            fixed = gt.copy()
            for x in fixed.nodes.values():
                if x["type"] == "sample":
                    x["value"] = x["value"].detach()
            replay = pyro.poutine.replay(elbo._vectorized_num_particles(guide), trace=fixed)
            with pyro.poutine.block():
                ft = prune_subsample_sites(pyro.poutine.trace(replay).get_trace(*c.args))
            ft.compute_log_prob()
            fsites = [x for x in ft.nodes.values() if x["type"] == "sample"]
        else:  # (the same, without a second run of the guide: its plates' subsamples stand)
            fsites = [
                {"log_prob": x["log_prob"].detach() if _is_delta(x["fn"]) else x["log_prob"]}
                for x in gsites
            ]
        log_q_phi = sum(torch_sum(x["log_prob"], dims) for x in fsites) / s
        wt = torch.softmax(log_w.detach(), 0)
        surrogate = s * (L.sum() + (wt * log_q_phi).sum())
    else:
        score = 0.0
        for x in gsites:
            sf = x["score_parts"].score_function
            if torch.is_tensor(sf) and sf.requires_grad:
                score = score + torch_sum(sf, dims)
        surrogate = s * L.sum()
        if torch.is_tensor(score):
            surrogate = surrogate + s * (L.detach() * score.sum(0)).sum()
    return loss, surrogate


def _is_delta(fn) -> bool:
    from pyro_gradroute.distributions.detached import delta_base

    return delta_base(fn) is not None


def _has_delta_density(c: Cell) -> bool:
    """Whether a guide site is a Delta whose log_density carries a gradient (a Jacobian term)."""
    with pyro.poutine.block():
        tr = pyro.poutine.trace(c.guide).get_trace(*c.args)
    for x in tr.nodes.values():
        if x["type"] == "sample" and _is_delta(x["fn"]):
            d = x["fn"]
            while not hasattr(d, "log_density"):
                d = d.base_dist
            if torch.is_tensor(d.log_density) and d.log_density.requires_grad:
                return True
    return False


def _has_conditional_site(c: Cell) -> bool:
    """Whether a guide site's density at its (detached) draw reads an earlier draw."""
    if c.conditional is None:
        with pyro.poutine.block():
            tr = pyro.poutine.trace(c.guide).get_trace(*c.args)
        c.conditional, earlier = False, []
        for x in tr.nodes.values():
            if x["type"] != "sample":
                continue
            lp = x["fn"].log_prob(x["value"].detach())
            if earlier and lp.requires_grad:
                gs = torch.autograd.grad(lp.sum(), earlier, allow_unused=True, retain_graph=True)
                if any(g is not None for g in gs):
                    c.conditional = True
                    break
            if x["value"].requires_grad:
                earlier.append(x["value"])
    return c.conditional


def _has_dependent_plates(c: Cell) -> bool:
    if c.dependent is None:
        with pyro.poutine.block():
            tr = pyro.poutine.trace(c.model).get_trace(*c.args)
        c.dependent = bool(get_dependent_plate_dims(list(tr.nodes.values())))
    return c.dependent


def reference_loss(c: Cell, est: str, seed: int) -> float:
    model, guide = c.model, c.guide
    mpn = c.case.max_plate_nesting
    if est in ("Trace", "STL", "Adaptive", "DReG1"):
        return seeded(seed, lambda: pyro_trace(est, c.case).loss(model, guide, *c.args))
    if c.case.outer_scale:
        return seeded(seed, lambda: _hand(c, model, guide, rws=False)[0])
    renyi = RenyiELBO(alpha=0, num_particles=K, max_plate_nesting=mpn, vectorize_particles=True)
    return seeded(seed, lambda: renyi.loss(model, guide, *c.args))


def reference_grad(c: Cell, est: str, seed: int, model, guide) -> torch.Tensor:
    """One draw of the reference gradient of the negative objective (same seed as ours)."""
    mpn = c.case.max_plate_nesting
    if est in ("Trace", "STL", "Adaptive", "DReG1"):
        elbo = pyro_trace(est, c.case)
        return seeded(seed, lambda: grad_of(c, lambda: elbo.loss_and_grads(model, guide, *c.args)))[
            1
        ]
    rws = est == "RWS"
    hand = c.case.outer_scale is not None or (
        c.case.score_guide
        if not rws
        else (_has_dependent_plates(c) or _has_delta_density(c) or _has_conditional_site(c))
    )
    if hand:

        def run():
            _, surrogate = _hand(c, model, guide, rws=rws)
            if surrogate.requires_grad:  # else no parameter is reached (a Delta guide's wake-phi)
                (-surrogate).backward()

        return seeded(seed, lambda: grad_of(c, run))[1]
    if rws:
        elbo = ReweightedWakeSleep(
            num_particles=K, insomnia=1.0, max_plate_nesting=mpn, vectorize_particles=True
        )
    else:
        elbo = RenyiELBO(alpha=0, num_particles=K, max_plate_nesting=mpn, vectorize_particles=True)
    return seeded(seed, lambda: grad_of(c, lambda: elbo.loss_and_grads(model, guide, *c.args)))[1]


# ---------------------------------------------------------------- same-draw references
#
# The pathwise estimators' gradients on the *same draws* as Pyro's own estimators, built from
# Pyro's traces and one identity: a reparameterized site's log-density ``log q(z(phi); phi)``
# has the total gradient ``pathwise + explicit``, and the explicit part (the score part that
# STL and DReG drop) is the gradient of ``log q(stop(z); phi)``: the guide replayed on its
# own draws, detached (:func:`detached_replay`). Conditional sites keep the path through earlier
# draws, since the replay reads the earlier draws detached only where the site's own value is.
# None of this calls the package; the draws are those of Pyro's estimator on the seed.


def _vectorized(elbo, fn):
    return elbo._vectorized_num_particles(fn) if elbo.vectorize_particles else fn


class NoSameDrawReference(Exception):
    """The guide has a site that the same-draw references do not cover (see :func:`_coverage`)."""


def detached_replay(elbo, guide, guide_trace, args):
    """The guide run again on ``guide_trace``'s draws, detached (under ``elbo``'s particle plate).

    ``guide_trace`` is the guide's own trace before pruning (its subsample sites replay the
    same minibatch). Every site's ``score_parts`` is then a function of the parameters only,
    at the same values.
    """
    det = pyro.poutine.Trace()
    for name, site in guide_trace.nodes.items():
        if site["type"] == "sample" and not site["is_observed"]:
            det.add_node(name, **dict(site, value=site["value"].detach()))
    replayed = pyro.poutine.trace(pyro.poutine.replay(_vectorized(elbo, guide), trace=det))
    try:
        with pyro.poutine.block():
            tr = replayed.get_trace(*args)
        tr = prune_subsample_sites(tr)
        tr.compute_score_parts()
    except (KeyError, NotImplementedError) as e:  # a transform without an inverse (Planar)
        raise NoSameDrawReference(f"the guide's log-density at a given value: {e}") from e
    return tr


def _recorder(guide):
    """``guide`` traced before Pyro prunes its subsample sites (a GuideMessenger: itself)."""
    if isinstance(pyro.poutine.unwrap(guide), Messenger):
        return guide
    return pyro.poutine.trace(guide)


def _recorded(rec, guide_trace):
    return rec.trace if hasattr(rec, "trace") else guide_trace


def _delta(fn):
    while not isinstance(fn, dist.Delta) and hasattr(fn, "base_dist"):
        fn = fn.base_dist
    return fn if isinstance(fn, dist.Delta) else None


def _coverage(detached, outer: float, dreg: bool) -> None:
    """Raise :class:`NoSameDrawReference` where the references' identity does not hold.

    * a Delta whose ``log_density`` depends on parameters other than through the draws
      (AutoStructured, AutoGaussian): its score part holds the latent, not the auxiliary draw,
      fixed;
    * DReG only: a Delta whose value is a parameter (AutoDelta: its path takes ``w~``, not
      ``w~^2``), or a reparameterized site whose scale is not the plates' common one (its
      path takes ``(1 - c) w~ + c w~^2``): the per-site factors need a per-site split.
    """
    for name, site in detached.nodes.items():
        if site["type"] != "sample":
            continue
        d = _delta(site["fn"])
        if d is not None:
            ld = d.log_density
            if torch.is_tensor(ld) and ld.requires_grad:
                raise NoSameDrawReference(f"Delta site '{name}': log_density reads parameters")
            if dreg and d.v.requires_grad:
                raise NoSameDrawReference(f"Delta site '{name}': its value is a parameter")
        elif dreg and not is_identically_zero(site["score_parts"].entropy_term):
            scale = torch.as_tensor(site["scale"]) / outer
            if not bool((scale == 1).all()):
                raise NoSameDrawReference(f"site '{name}': scale {site['scale']} of {outer}")


def _explicit_log_q(guide_trace, detached, dims=None):
    """Sum of the reparameterized guide sites' log-densities at the detached draws.

    Sites without a pathwise part (Pyro's ``entropy_term`` is zero) keep their whole estimator.
    ``dims``: sum these dims (the dependent plates) and keep the rest; else a scalar.
    """
    total = 0.0
    for name, site in guide_trace.nodes.items():
        if site["type"] != "sample" or is_identically_zero(site["score_parts"].entropy_term):
            continue
        et = detached.nodes[name]["score_parts"].entropy_term
        total = total + (torch_sum(et, dims) if dims is not None else et.sum())
    return total


def stl_reference_grad(c: Cell, est: str, seed: int, model, guide) -> torch.Tensor:
    """Sticking the landing on Pyro's ``Trace_ELBO`` draws: its surrogate minus the score part."""
    elbo = pyro_trace(est, c.case)
    rec = _recorder(guide)

    def run():
        for mt, gt in elbo._get_traces(model, rec, c.args, {}):
            _, surrogate = elbo._differentiable_loss_particle(mt, gt)
            detached = detached_replay(elbo, guide, _recorded(rec, gt), c.args)
            _coverage(detached, 1.0, dreg=False)
            explicit = _explicit_log_q(gt, detached)
            total = (surrogate - explicit) / elbo.num_particles
            if torch.is_tensor(total) and total.requires_grad:
                total.backward()

    return seeded(seed, lambda: grad_of(c, run))[1]


def dreg_reference_grad(c: Cell, est: str, seed: int, model, guide) -> torch.Tensor:
    """DReG-IWAE (``DReGK``) or RWS-DReG's wake-phi (``RWS``) on Pyro's draws.

    With ``log w_k = log p - log q`` per point of a plate holding every site (unscaled, the bound
    times N/b), ``w~ = softmax(log w)`` and the pathwise derivative
    ``d_path log w_k = d(log w_k + log q(stop(z_k)))``: model parameters get
    ``-sum_k w~_k d log w_k``; guide parameters ``-sum_k f_k d_path log w_k`` with
    ``f = w~^2`` (DReG-IWAE) or ``w~ - w~^2`` (RWS-DReG).
    """
    mpn = c.case.max_plate_nesting
    # the draws of RenyiELBO (RWS-DReG draws as DReG does)
    elbo = RenyiELBO(alpha=0, num_particles=K, max_plate_nesting=mpn, vectorize_particles=True)
    rec = _recorder(guide)
    leaves = [p for _, p in c.names]
    shared = _param_names(c.guide, c.args) & _param_names(c.model, c.args)
    assert not shared, f"parameters in both the model and the guide: {sorted(shared)}"

    def run():
        ((mt, gt),) = list(elbo._get_traces(model, rec, c.args, {}))
        s = c.case.outer_scale or 1.0
        msites = [x for x in mt.nodes.values() if x["type"] == "sample"]
        gsites = [x for x in gt.nodes.values() if x["type"] == "sample"]
        dims = get_dependent_plate_dims(msites)
        log_w = (
            sum(torch_sum(x["log_prob"], dims) for x in msites)
            - sum(torch_sum(x["log_prob"], dims) for x in gsites)
        ) / s
        detached = detached_replay(elbo, guide, _recorded(rec, gt), c.args)
        _coverage(detached, s, dreg=True)
        explicit = _explicit_log_q(gt, detached, dims) / s
        w = torch.softmax(log_w.detach(), 0)
        f = w - w**2 if est == "RWS" else w**2
        theta = s * (w * log_w).sum()
        phi = s * (f * (log_w + explicit)).sum()
        return _flat(
            torch.autograd.grad(-theta, leaves, allow_unused=True, retain_graph=True)
        ), _flat(torch.autograd.grad(-phi, leaves, allow_unused=True))

    def _flat(gs):
        return torch.cat(
            [torch.zeros(p.numel()) if g is None else g.reshape(-1) for g, p in zip(gs, leaves)]
        ).double()

    g_theta, g_phi = seeded(seed, run)
    return torch.where(c.guide_only, g_phi, g_theta)


# ---------------------------------------------------------------- expected raises


def _probe(c: Cell, est: str, model, guide, spec: Raises | None) -> bool:
    """For an optional-raise cell: True if the estimator raises as allowed (the cell conforms)."""
    if spec is None:
        return False
    try:
        seeded(
            0, lambda: grad_of(c, lambda: ours(est, c.case).loss_and_grads(model, guide, *c.args))
        )
    except spec.exc as e:
        assert re.search(spec.match, str(e)), (
            f"raised {type(e).__name__} without naming {spec.match}: {e}"
        )
        return True
    return False


def check_raises(case: Case, est: str, routed: bool) -> None:
    spec = case.raise_for(est, routed)
    assert spec is not None and not spec.optional
    with cell(case) as c:
        model, guide = routed_pair(c) if routed else (c.model, c.guide)
        elbo = ours(est, case)
        with pytest.raises(spec.exc, match=spec.match):
            seeded(0, lambda: elbo.loss_and_grads(model, guide, *c.args))
        # the loss value itself is defined: loss() may raise likewise, or be right
        try:
            value = seeded(0, lambda: elbo.loss(model, guide, *c.args))
        except spec.exc as e:
            assert re.search(spec.match, str(e)), e
        else:
            ref = reference_loss(c, est, 0)
            rtol, atol = _tols(case.dtype)
            assert math.isclose(value, ref, rel_tol=rtol, abs_tol=atol), (value, ref)


# ---------------------------------------------------------------- the checks


def _tols(dtype):
    return (1e-9, 1e-9) if dtype == torch.float64 else (2e-6, 1e-4)


def check_loss(case: Case, est: str, routed: bool) -> str | None:
    with cell(case) as c:
        model, guide = routed_pair(c) if routed else (c.model, c.guide)
        if _probe(c, est, model, guide, case.raise_for(est, routed)):
            return "raised"
        rtol, atol = _tols(case.dtype)
        for seed in (0, 1):
            ref = reference_loss(c, est, seed)
            lg = seeded(
                seed,
                lambda: grad_of(c, lambda: ours(est, case).loss_and_grads(model, guide, *c.args)),
            )[0]
            lo = seeded(seed, lambda: ours(est, case).loss(model, guide, *c.args))
            for name, v in (("loss_and_grads", lg), ("loss", lo)):
                assert math.isclose(v, ref, rel_tol=rtol, abs_tol=atol), (
                    f"{case.name}/{est}: {name} {v!r} != reference {ref!r} (seed {seed})"
                )
    return None


def _coord_names(c: Cell):
    out = []
    for n, p in c.names:
        out += [f"{n}[{i}]" if p.numel() > 1 else n for i in range(p.numel())]
    return out


def same_draw_reference_grad(c: Cell, est: str, seed: int, model, guide) -> torch.Tensor:
    """The reference gradient on the draws of ``seed``: exact, not a mean (see the section above)."""
    if est == "Trace":
        return reference_grad(c, est, seed, model, guide)
    if est in ("STL", "DReG1"):
        return stl_reference_grad(c, est, seed, model, guide)
    return dreg_reference_grad(c, est, seed, model, guide)


def check_grad(case: Case, est: str, routed: bool) -> str | None:
    """Our gradient equals the same-draw reference on two seeds (float64 round-off).

    ``Adaptive`` (its control variate's weight is the estimator's state) and guides that the
    same-draw references do not cover (:class:`NoSameDrawReference`) take :func:`check_unbiased`.
    """
    if est == "Adaptive":
        return check_unbiased(case, est, routed)
    with cell(case) as c:
        model, guide = routed_pair(c) if routed else (c.model, c.guide)
        if _probe(c, est, model, guide, case.raise_for(est, routed)):
            return "raised"
        block = blocked_mask(c) if routed else None
        m0, g0 = scaled_pair(c, 0.0) if routed else (None, None)
        rtol, atol = _tols(case.dtype)
        elbo = ours(est, case)
        try:
            for seed in (0, 1):
                g = seeded(
                    seed, lambda: grad_of(c, lambda: elbo.loss_and_grads(model, guide, *c.args))
                )[1]
                if routed:  # full gradient off the route, the site's every path removed on it
                    ref = torch.where(
                        block,
                        same_draw_reference_grad(c, est, seed, m0, g0),
                        same_draw_reference_grad(c, est, seed, c.model, c.guide),
                    )
                else:
                    ref = same_draw_reference_grad(c, est, seed, model, guide)
                torch.testing.assert_close(
                    g,
                    ref,
                    rtol=rtol * 10,
                    atol=atol * 10,
                    msg=lambda m, seed=seed: (
                        f"{case.name}/{est}{'+route' if routed else ''}: gradient != the "
                        f"same-draw reference (seed {seed})\n{m}"
                    ),
                )
        except NoSameDrawReference:
            pass
        else:
            return None
    return check_unbiased(case, est, routed)


def check_unbiased(case: Case, est: str, routed: bool) -> str | None:
    """The mean over draws of our gradient minus Pyro's estimator's (or a hand-written one's)
    on the same seed is within ``Z`` standard errors of zero, coordinate by coordinate."""
    with cell(case) as c:
        model, guide = routed_pair(c) if routed else (c.model, c.guide)
        if _probe(c, est, model, guide, case.raise_for(est, routed)):
            return "raised"
        block = blocked_mask(c) if routed else None
        if routed:
            m1, g1 = c.model, c.guide
            m0, g0 = scaled_pair(c, 0.0)
        n = draws(est)
        diffs, refs = [], []
        elbo = ours(est, case)
        for i in range(n):
            seed = 1000 + i
            g = seeded(
                seed, lambda: grad_of(c, lambda: elbo.loss_and_grads(model, guide, *c.args))
            )[1]
            if routed:  # full gradient off the route, the site's every path removed on it
                ref = torch.where(
                    block,
                    reference_grad(c, est, seed, m0, g0),
                    reference_grad(c, est, seed, m1, g1),
                )
            else:
                ref = reference_grad(c, est, seed, model, guide)
            diffs.append(g - ref)
            refs.append(ref)
        D, R = torch.stack(diffs), torch.stack(refs)
        mean, se = D.mean(0), D.std(0) / math.sqrt(n)
        floor = (1e-8 if case.dtype == torch.float64 else 1e-4) * (1 + R.abs().mean(0))
        bad = mean.abs() > Z * se + floor
        if bad.any():
            names = _coord_names(c)
            rows = [
                f"  {names[j]}: ours {R[:, j].mean() + mean[j]:+.4g}, reference {R[:, j].mean():+.4g}, "
                f"paired diff {mean[j]:+.4g} +/- {se[j]:.2g} ({(mean[j] / se[j]).abs():.1f} SE)"
                for j in bad.nonzero().reshape(-1).tolist()[:8]
            ]
            raise AssertionError(
                f"{case.name}/{est}{'+route' if routed else ''}: biased ({n} draws)\n"
                + "\n".join(rows)
            )
    return None


def check_zero(case: Case, est: str) -> str | None:
    with cell(case) as c:
        if _probe(c, est, c.model, c.guide, case.raise_for(est, False)):
            return "raised"
        c.exact()
        elbo = ours(est, case)
        for seed in range(3):
            g = seeded(
                seed, lambda: grad_of(c, lambda: elbo.loss_and_grads(c.model, c.guide, *c.args))
            )[1]
            worst = g[c.guide_only].abs().max().item()
            assert worst <= ZERO_TOL, (
                f"{case.name}/{est}: gradient {worst:.3g} at the exact posterior (seed {seed}); "
                f"guide coordinates: {dict(zip((n for n, m in zip(_coord_names(c), c.guide_only) if m), g[c.guide_only].tolist()))}"
            )
    return None


def check_dreg1_stl(case: Case, routed: bool) -> str | None:
    with cell(case) as c:
        model, guide = routed_pair(c) if routed else (c.model, c.guide)
        if _probe(c, "DReG1", model, guide, case.raise_for("DReG1", routed)):
            return "raised"
        stl = TraceSTL_ELBO(num_particles=1, max_plate_nesting=case.max_plate_nesting)
        dreg = TraceDReG_ELBO(num_particles=1, max_plate_nesting=case.max_plate_nesting)
        rtol, atol = _tols(case.dtype)
        for seed in (0, 1):
            ls, gs = seeded(
                seed, lambda: grad_of(c, lambda: stl.loss_and_grads(model, guide, *c.args))
            )
            ld, gd = seeded(
                seed, lambda: grad_of(c, lambda: dreg.loss_and_grads(model, guide, *c.args))
            )
            assert math.isclose(ls, ld, rel_tol=rtol, abs_tol=atol), (ls, ld)
            torch.testing.assert_close(
                gd,
                gs,
                rtol=rtol * 10,
                atol=atol * 10,
                msg=lambda m: f"{case.name}: DReG(K=1) != STL\n{m}",
            )
    return None


def _naive_routed(c: Cell, elbo, model, guide, block: torch.Tensor) -> torch.Tensor:
    """Every term's own backward; the blocked terms' gradient dropped on the blocked parameters."""
    leaves = [p for _, p in c.names]
    total = torch.zeros(block.shape, dtype=torch.float64)
    sites = c.case.route.sites
    for item in elbo._iter_particles(model, guide, c.args, {}):
        terms = item[1]  # (elbo, terms, blocks, ...)
        for key, t in terms.items():
            gs = torch.autograd.grad(-t, leaves, allow_unused=True, retain_graph=True)
            g = torch.cat(
                [torch.zeros(p.numel()) if x is None else x.reshape(-1) for x, p in zip(gs, leaves)]
            ).double()
            if key[0] == "model" and _is_route_site(key[1], sites):
                g = torch.where(block, torch.zeros_like(g), g)
            total = total + g
    return total


def check_routed(case: Case, est: str) -> str | None:
    with cell(case) as c:
        model, guide = routed_pair(c)
        if _probe(c, est, model, guide, case.raise_for(est, True)):
            return "raised"
        block = blocked_mask(c)
        rtol, atol = _tols(case.dtype)
        elbo = ours(est, case)
        m0, g0 = scaled_pair(c, 0.0)
        for seed in (0, 1):
            g = seeded(
                seed, lambda: grad_of(c, lambda: elbo.loss_and_grads(model, guide, *c.args))
            )[1]
            # With a score-function term the site's cost also reaches parameters through
            # another site's term: the per-term split is not "every path" there (the scaled-by-0
            # reference below is).
            # (not for Adaptive: these are STL's terms, and its weight starts at Trace_ELBO's)
            if est != "Adaptive" and not (
                case.score_guide and est in ("Trace", "STL", "Adaptive", "DReG1")
            ):
                naive = seeded(seed, lambda: _naive_routed(c, elbo, model, guide, block))
                torch.testing.assert_close(
                    g,
                    naive,
                    rtol=rtol * 10,
                    atol=atol * 10,
                    msg=lambda m: f"{case.name}/{est}: routed != per-term naive\n{m}",
                )
            if est in ("Trace", "STL", "Adaptive", "DReG1"):
                full = seeded(
                    seed, lambda: grad_of(c, lambda: elbo.loss_and_grads(c.model, c.guide, *c.args))
                )[1]
                cut = seeded(
                    seed, lambda: grad_of(c, lambda: elbo.loss_and_grads(m0, g0, *c.args))
                )[1]
                ref = torch.where(block, cut, full)
                torch.testing.assert_close(
                    g,
                    ref,
                    rtol=rtol * 10,
                    atol=atol * 10,
                    msg=lambda m: (
                        f"{case.name}/{est}: routed != site scaled by 0 on the blocked params\n{m}"
                    ),
                )
    return None


# ---------------------------------------------------------------- the matrix


def cells(cases):
    """``(case, est, routed, check)`` for every applicable cell."""
    out = []
    for case in cases:
        for routed in (False, True):
            for est in ESTIMATORS:
                spec = case.raise_for(est, routed)
                if spec is not None and not spec.optional:
                    out.append((case, est, routed, "raises"))
                    continue
                out.append((case, est, routed, "loss"))
                if not routed or est in ("Trace", "STL", "Adaptive", "DReG1"):
                    out.append((case, est, routed, "grad"))
                if not routed and est in UNBIASED_ESTIMATORS and case.name in UNBIASED_CASES:
                    out.append((case, est, routed, "unbiased"))
                if routed:
                    out.append((case, est, routed, "routed"))
                # the adaptive policy starts at Trace_ELBO: its zero cells (after the warm-up)
                # are in test_adaptive_policy.py
                if not routed and est not in ("Trace", "Adaptive") and case.build_has_exact:
                    out.append((case, est, routed, "zero"))
                if est == "DReG1":
                    out.append((case, est, routed, "dreg1_stl"))
    return out


def run_cell(case: Case, est: str, routed: bool, check: str) -> str | None:
    """Run one cell; returns ``"raised"`` when an optional raise happened, else None (or raises)."""
    if check == "raises":
        check_raises(case, est, routed)
        return "expected-raise"
    if check == "loss":
        return check_loss(case, est, routed)
    if check == "grad":
        return check_grad(case, est, routed)
    if check == "unbiased":
        return check_unbiased(case, est, routed)
    if check == "zero":
        return check_zero(case, est)
    if check == "dreg1_stl":
        return check_dreg1_stl(case, routed)
    if check == "routed":
        return check_routed(case, est)
    raise KeyError(check)
