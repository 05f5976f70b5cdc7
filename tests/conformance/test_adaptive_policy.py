"""Conformance cells of ``TraceAdaptiveSTL_ELBO()``'s weight policy, on every case of the registry.

The default estimator's step is ``g(b) = g_path + b * g_score`` with ``b`` chosen from earlier
steps; on one draw ``g_path`` is STL's gradient and ``g_path + g_score`` is ``Trace_ELBO``'s, so
for a frozen ``b`` the same-draw reference is ``(1 - b) * STL + b * Trace`` (Pyro's
``Trace_ELBO`` and the STL reference built from Pyro's traces, ``checks.stl_reference_grad``).

* ``first``: a fresh default estimator's first step equals Pyro's ``Trace_ELBO`` on the same seed
  (the policy starts at ``b = 1``);
* ``frozen``: with ``b`` frozen at -0.5 and at 2 the gradient equals the same-draw reference
  above (so the mean gradient is ``Trace_ELBO``'s for any frozen ``b``), with the case's
  vectorized particles and, on the cases in :data:`ONE_PASS` (every score-bearing guide site
  a plain ``Normal`` whose parameters read no sample), with one particle too. The first step
  forms the parts with a second backward; with one particle the second step of a
  :data:`ONE_PASS` case takes one backward (hooks at the ``Normal``'s parameters), vectorized
  particles a second backward: the cell also checks which path it took;
* ``direct``: a direct step (the policy predicts the better endpoint is within ``mix_gain`` of
  the mixed weights) equals Pyro's ``Trace_ELBO`` / the STL reference on the same seed, for a
  forced choice of each endpoint;
* ``gate``: a step the gate takes directly (the applied gradients bound any weights' gain
  within ``mix_gain``) equals Pyro's ``Trace_ELBO`` / the STL reference on the same seed, at
  each endpoint, and measures nothing (the moments do not move);
* ``switch``: ``mix_gain=math.inf`` (the measured switch), its gate held open so that it
  measures: every step, warm-up, fresh phase and settled, is one whole estimator's gradient,
  Pyro's ``Trace_ELBO``'s or the STL reference's, on the same seed; ``switch_uncentered``: the
  same with ``center=False`` (the fit through 0 never makes the switch mix);
* ``split`` (the :data:`ONE_PASS` cases, one particle): the fit at 1 on one ``Normal``
  parameter and at 0 on the others: the direct step is Pyro's ``Trace_ELBO`` gradient at the
  coordinates that parameter reads and the STL reference's elsewhere, and measures nothing;
* ``zero``: at the exact posterior (where the guide family holds it) the default policy moves to
  STL after its warm-up, and the guide parameters' gradient is then zero to round-off.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pyro
import pytest
import torch

from pyro_gradroute.infer import TraceAdaptiveSTL_ELBO, TraceSTL_ELBO

from ..conjugate import settle_at_split
from .cases import CASES
from .checks import (
    ZERO_TOL,
    NoSameDrawReference,
    _coord_names,
    _probe,
    _tols,
    cell,
    grad_of,
    reference_grad,
    seeded,
    stl_reference_grad,
)

WARMUP = 18  # steps before the default policy settles: the gate's first samples, 5 + 5 measured

#: the cases whose measured steps (after the first) take one backward
ONE_PASS = {
    "AutoNormal",
    "AutoDiagonalNormal",
    "AutoGuideList",
    "chain1",
    "nested_plates",
    "scale_tensor",
    "mask",
    "obs_mask",
    "LocScaleReparam",
    "TransformReparam",
    "LogNormal",
    "sigmoid_tail_AutoNormal",
    "sigmoid_tail",  # a Normal pushed forward by a sigmoid (one classifier: any parameter-free bijection)
}


def _default(case, **kw):
    P = case.particles
    return TraceAdaptiveSTL_ELBO(
        num_particles=P, vectorize_particles=P > 1, max_plate_nesting=case.max_plate_nesting, **kw
    )


def _ours(c, elbo, seed):
    return seeded(seed, lambda: grad_of(c, lambda: elbo.loss_and_grads(c.model, c.guide, *c.args)))[
        1
    ]


def check_first(case):
    with cell(case) as c:
        if _probe(c, "Adaptive", c.model, c.guide, case.raise_for("Adaptive", False)):
            return
        rtol, atol = _tols(case.dtype)
        g = _ours(c, _default(case), 0)
        ref = reference_grad(c, "Trace", 0, c.model, c.guide)
        torch.testing.assert_close(
            g,
            ref,
            rtol=rtol * 10,
            atol=atol * 10,
            msg=lambda m: f"{case.name}: first step != Pyro's Trace_ELBO (same seed)\n{m}",
        )


def _stl_reference(c, case, seed):
    try:
        return stl_reference_grad(c, "STL", seed, c.model, c.guide)
    except NoSameDrawReference:
        # the package's TraceSTL_ELBO on the same seed, itself checked against a
        # hand-written surrogate for these guides (tests/infer/test_structured_guides.py)
        P = case.particles
        stl_elbo = TraceSTL_ELBO(
            num_particles=P, vectorize_particles=P > 1, max_plate_nesting=case.max_plate_nesting
        )
        return _ours(c, stl_elbo, seed)


def check_frozen(case):
    for each in (case, replace(case, particles=1)) if case.name in ONE_PASS else (case,):
        _check_frozen(each)


def _check_frozen(case):
    with cell(case) as c:
        if _probe(c, "Adaptive", c.model, c.guide, case.raise_for("Adaptive", False)):
            return
        rtol, atol = _tols(case.dtype)
        for b in (-0.5, 2.0):
            elbo = _default(case, fixed_weight=b)
            for seed in (0, 1):
                g = _ours(c, elbo, seed)
                trace = reference_grad(c, "Trace", seed, c.model, c.guide)
                stl = _stl_reference(c, case, seed)
                ref = (1 - b) * stl + b * trace
                torch.testing.assert_close(
                    g,
                    ref,
                    rtol=rtol * 10,
                    atol=atol * 10 * (1 + abs(b)),
                    msg=lambda m, b=b, seed=seed: (
                        f"{case.name} ({case.particles} particles): b frozen at {b} != "
                        f"(1 - b) STL + b Trace (seed {seed})\n{m}"
                    ),
                )
            assert bool(elbo.schedule.one_pass) == (case.name in ONE_PASS), (
                f"{case.name}: measured steps in one pass: {elbo.schedule.one_pass}"
            )
            one_pass = case.name in ONE_PASS and case.particles == 1  # (not vectorized)
            assert elbo.schedule.sites == one_pass, (
                f"{case.name} ({case.particles} particles): the second step took "
                f"{'a second backward' if one_pass else 'one pass'}"
            )


def _assert_endpoint_step(c, case, g, end, what):
    """``g`` (seed 1) is Pyro's Trace_ELBO gradient (``end`` 1) or the STL reference (0)."""
    rtol, atol = _tols(case.dtype)
    if end == 1.0:
        ref = reference_grad(c, "Trace", 1, c.model, c.guide)
    else:
        ref = _stl_reference(c, case, 1)
    torch.testing.assert_close(
        g,
        ref,
        rtol=rtol * 10,
        atol=atol * 10,
        msg=lambda m: f"{case.name}: {what} at b = {end} != its reference\n{m}",
    )


def open_gate(gate):
    """Hold the gate open (its bound known and unbounded): every step measures until settled."""
    gate.known, gate.bound = (lambda: True), (lambda: math.inf)


def _check_endpoint_steps(case, measured, prepare, what):
    """For each endpoint, ``prepare(elbo, end)`` after ``measured`` measured steps (the gate
    held open) makes the next step a direct one: it equals its same-draw reference and
    measures nothing."""
    with cell(case) as c:
        if _probe(c, "Adaptive", c.model, c.guide, case.raise_for("Adaptive", False)):
            return
        for end in (1.0, 0.0):
            elbo = _default(case)
            open_gate(elbo.schedule.gate)
            for seed in range(100, 100 + measured):
                _ours(c, elbo, seed)
            if not elbo.control_variate.state:
                return  # no score part anywhere: nothing to choose
            prepare(elbo, end)
            (st,) = elbo.control_variate.state.values()
            n0 = st["n"]
            g = _ours(c, elbo, 1)
            assert st["n"] == n0, f"{case.name}: the {what} measured"
            _assert_endpoint_step(c, case, g, end, what)


def _settled_as_good(elbo, end):
    """Settled, the fit at endpoint ``end`` on every tensor, predicted as good as the fitted
    mix: a direct step is next."""
    cv = elbo.control_variate
    for key, st in cv.state.items():
        st["n"] = 10**6
        fit = cv.fit(key)
        st["age"] = -(10**6)
        fit.update(b=torch.full_like(fit["b"], end), constant=end, ratio=1.0, views=None)
    elbo.schedule.unmeasured = 0


def _quiet_gate(elbo, end):
    """No weights could gain over ``end``: the gate takes the next step directly."""
    gate = elbo.schedule.gate
    gate.reset(end)
    gate.bound = lambda: 1.0
    gate.known = lambda: True


def check_direct(case):
    # two measured steps create the moments (the residual ones on the second)
    _check_endpoint_steps(case, 2, _settled_as_good, "direct step")


def check_gate(case):
    # the first step measures (it names the parameters)
    _check_endpoint_steps(case, 1, _quiet_gate, "gate's step")


def _fed(c, guide_trace, names) -> torch.Tensor:
    """Which coordinates of the flat gradient the Normal parameters ``names`` (``"<site>.loc"``,
    ...) of ``guide_trace``'s sites read (non-zero derivative)."""
    leaves = [p for _, p in c.names]
    out = torch.zeros(sum(p.numel() for p in leaves), dtype=torch.bool)
    for name in names:
        site, part = name.rsplit(".", 1)
        fn = guide_trace.nodes[site]["fn"]
        while not isinstance(fn, torch.distributions.Normal):
            fn = fn.base_dist
        t = getattr(fn, part)
        gs = torch.autograd.grad(t.sum(), leaves, allow_unused=True, retain_graph=True)
        out |= torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) != 0
                          for g, p in zip(gs, leaves)])  # fmt: skip
    return out


def check_split(case):
    """One Normal parameter at 1, every other at 0: the direct step is Trace_ELBO's gradient at
    the coordinates that parameter reads and STL's elsewhere, and measures nothing."""
    case = replace(case, particles=1)  # one-pass measured steps (a split needs them)
    with cell(case) as c:
        if _probe(c, "Adaptive", c.model, c.guide, case.raise_for("Adaptive", False)):
            return
        elbo = _default(case)
        open_gate(elbo.schedule.gate)
        for seed in (100, 101, 102):  # two backwards on the first, then one pass
            _ours(c, elbo, seed)
        cv = elbo.control_variate
        if not cv.state:
            return  # no score part anywhere: nothing to choose
        assert elbo.schedule.sites, f"{case.name}: the measured steps took a second backward"
        (key,) = cv.state
        names = [n for n, _ in cv.layouts[key]]
        at_one = {names[0]}
        st = cv.state[settle_at_split(elbo, at_one)]
        n0 = st["n"]
        g = _ours(c, elbo, 1)
        assert st["n"] == n0, f"{case.name}: the split's direct step measured"
        guide_trace = seeded(1, lambda: pyro.poutine.trace(c.guide).get_trace(*c.args))
        kept = _fed(c, guide_trace, at_one)
        rest = _fed(c, guide_trace, [n for n in names if n not in at_one])
        assert not (kept & rest).any(), f"{case.name}: {names[0]} shares coordinates"
        trace = reference_grad(c, "Trace", 1, c.model, c.guide)
        ref = torch.where(kept, trace, _stl_reference(c, case, 1))
        rtol, atol = _tols(case.dtype)
        torch.testing.assert_close(
            g,
            ref,
            rtol=rtol * 10,
            atol=atol * 10,
            msg=lambda m: f"{case.name}: the split at {names[0]} != its reference\n{m}",
        )


def check_switch(case, center=True):
    with cell(case) as c:
        if _probe(c, "Adaptive", c.model, c.guide, case.raise_for("Adaptive", False)):
            return
        rtol, atol = _tols(case.dtype)
        elbo = _default(case, mix_gain=math.inf, center=center)
        open_gate(elbo.schedule.gate)
        for seed in range(12):  # past the warm-up (5) into the fresh phase (5) and beyond
            g = _ours(c, elbo, 200 + seed)
            refs = (
                reference_grad(c, "Trace", 200 + seed, c.model, c.guide),
                _stl_reference(c, case, 200 + seed),
            )
            assert any(torch.allclose(g, ref, rtol=rtol * 10, atol=atol * 10) for ref in refs), (
                f"{case.name}: step {seed} of the switch is neither Trace_ELBO's nor STL's"
            )


def check_zero(case):
    with cell(case) as c:
        if _probe(c, "Adaptive", c.model, c.guide, case.raise_for("Adaptive", False)):
            return
        c.exact()
        elbo = _default(case)
        for seed in range(WARMUP + 2):  # the warm-up at Trace_ELBO, then the policy's choice
            _ours(c, elbo, 100 + seed)
        for seed in range(3):
            g = _ours(c, elbo, seed)
            worst = g[c.guide_only].abs().max().item() if c.guide_only.any() else 0.0
            assert worst <= ZERO_TOL, (
                f"{case.name}: gradient {worst:.3g} at the exact posterior after the warm-up "
                f"(seed {seed}); guide coordinates: "
                f"{dict(zip((n for n, m in zip(_coord_names(c), c.guide_only) if m), g[c.guide_only].tolist()))}"
            )


def _cells():
    out = []
    for case in CASES:
        spec = case.raise_for("Adaptive", False)
        if spec is not None and not spec.optional:
            continue  # the matrix's raises cells cover these
        out += [(case, "first"), (case, "frozen"), (case, "direct"), (case, "gate")]
        out += [(case, "switch"), (case, "switch_uncentered")]
        if case.name in ONE_PASS:
            out.append((case, "split"))
        if case.build_has_exact:
            out.append((case, "zero"))
    return out


CELLS = _cells()


@pytest.mark.parametrize("case, check", CELLS, ids=[f"{c.name}-{k}" for c, k in CELLS])
def test_adaptive_policy(case, check):
    checks = {"first": check_first, "frozen": check_frozen, "direct": check_direct}
    checks["gate"], checks["switch"] = check_gate, check_switch
    checks["switch_uncentered"] = lambda case: check_switch(case, center=False)
    {**checks, "zero": check_zero, "split": check_split}[check](case)
