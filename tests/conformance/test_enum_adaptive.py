"""Conformance cells of ``TraceEnumAdaptiveSTL_ELBO`` (the adaptive estimator under enumeration).

References are Pyro's ``TraceEnum_ELBO`` on the same seed (``b = 1``) and Pyro's
``TraceEnum_ELBO`` with the guide under ``stick_the_landing`` (``b = 0``; the handler's own
cells under Pyro's ELBOs are in ``tests/poutine/test_stick_the_landing.py``), so for a frozen
``b`` the same-draw reference is ``(1 - b) * STL + b * TraceEnum``:

* ``first``: a fresh estimator's first step equals ``TraceEnum_ELBO``'s;
* ``frozen``: ``b`` frozen at -0.5 and 2, on two seeds;
* ``direct``: a settled policy's direct step at each endpoint equals that endpoint's reference
  and measures nothing;
* ``gate``: a quiet gate's step at each endpoint equals its reference and measures nothing;
* ``switch``: ``mix_gain=math.inf`` with its gate held open: every step of 12 is one of the
  two references;
* ``mix``: per-element weights: element by element ``(1 - b) * STL + b * TraceEnum``;
* ``split``: a settled fit at 1 on one Normal parameter and 0 on the others: the direct step
  (and ``differentiable_loss``) is ``TraceEnum``'s gradient at that parameter and STL's at
  the others, and measures nothing.

Cases: a two-component mixture with ``AutoNormal`` on the continuous sites (Pyro's GMM
tutorial pattern), and a hand-written mean-field guide of a mixture with a scale parameter.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import TraceEnum_ELBO, config_enumerate
from pyro.infer.autoguide import AutoNormal
from torch.distributions import constraints

from pyro_gradroute.infer import TraceEnumAdaptiveSTL_ELBO
from pyro_gradroute.poutine import block_grad, stick_the_landing

from ..conjugate import settle_at_split
from .test_adaptive_policy import _quiet_gate, _settled_as_good, open_gate

DATA = torch.tensor([-2.1, -1.8, -2.4, -0.3, 1.9, 2.2, 2.5, 0.4])


@config_enumerate
def gmm_model(data):
    weights = pyro.sample("weights", dist.Dirichlet(0.5 * torch.ones(2)))
    scale = pyro.sample("scale", dist.LogNormal(0.0, 2.0))
    with pyro.plate("components", 2):
        locs = pyro.sample("locs", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(data)):
        k = pyro.sample("k", dist.Categorical(weights))
        pyro.sample("obs", dist.Normal(locs[k], scale), obs=data)


def _auto_normal():
    return gmm_model, AutoNormal(poutine.block(gmm_model, hide=["k"]))


@config_enumerate
def mix_model(data):
    with pyro.plate("components", 2):
        locs = pyro.sample("locs", dist.Normal(0.0, 3.0))
    with pyro.plate("data", len(data)):
        k = pyro.sample("k", dist.Categorical(torch.ones(2) / 2))
        pyro.sample("obs", dist.Normal(locs[k], 0.5), obs=data)


def mix_guide(data):
    m = pyro.param("m", torch.tensor([-1.5, 1.5]))
    s = pyro.param("s", torch.tensor([0.4, 0.6]), constraint=constraints.positive)
    with pyro.plate("components", 2):
        pyro.sample("locs", dist.Normal(m, s))


CASES = {"AutoNormal-GMM": _auto_normal, "mean-field": lambda: (mix_model, mix_guide)}


def _grads(elbo, model, guide, seed, by_name=False):
    pyro.set_rng_seed(seed)
    for p in pyro.get_param_store().values():
        p.unconstrained().grad = None
    elbo.loss_and_grads(model, guide, DATA)
    store = dict(pyro.get_param_store().named_parameters())
    grads = {
        k: (p.grad if p.grad is not None else 0 * p).detach().clone() for k, p in store.items()
    }
    for p in store.values():
        p.grad = None
    return grads if by_name else torch.cat([grads[k].reshape(-1) for k in sorted(grads)])


#: the parameter behind each Normal parameter of the guide sites (``"<site>.loc"``, ...)
PARAM_OF = {
    "AutoNormal-GMM": lambda key: "AutoNormal.{}.{}".format(
        "locs" if key.endswith(".loc") else "scales",
        key.rsplit(".", 1)[0].removesuffix("_unconstrained"),
    ),
    "mean-field": lambda key: {"locs.loc": "m", "locs.scale": "s"}[key],
}


def _build(name):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model, guide = CASES[name]()
    guide(DATA)  # create the parameters
    return model, guide


def _refs(model, guide, seed):
    enum = TraceEnum_ELBO(max_plate_nesting=1)
    return _grads(enum, model, stick_the_landing(guide), seed), _grads(enum, model, guide, seed)


def _ours(**kw):
    return TraceEnumAdaptiveSTL_ELBO(max_plate_nesting=1, **kw)


def _close(a, b, msg):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"{msg}\n{m}")


def _moments(elbo):
    return {k: st["n"] for k, st in elbo.control_variate.state.items()}


def check_first(name):
    model, guide = _build(name)
    _close(_grads(_ours(), model, guide, 0), _refs(model, guide, 0)[1], f"{name}: first step")


def check_frozen(name):
    model, guide = _build(name)
    for b in (-0.5, 2.0):
        elbo = _ours(fixed_weight=b)
        for seed in (0, 1):
            stl, trace = _refs(model, guide, seed)
            _close(_grads(elbo, model, guide, seed), (1 - b) * stl + b * trace, f"{name}: b={b}")


def _endpoint(name, measured, prepare, what):
    model, guide = _build(name)
    for end in (1.0, 0.0):
        elbo = _ours()
        open_gate(elbo.schedule.gate)
        for seed in range(100, 100 + measured):
            _grads(elbo, model, guide, seed)
        prepare(elbo, end)
        before = _moments(elbo)
        g = _grads(elbo, model, guide, 1)
        assert _moments(elbo) == before, f"{name}: the {what} measured"
        stl, trace = _refs(model, guide, 1)
        _close(g, trace if end == 1.0 else stl, f"{name}: {what} at b = {end}")


def check_direct(name):
    _endpoint(name, 2, _settled_as_good, "direct step")


def check_gate(name):
    _endpoint(name, 1, _quiet_gate, "gate's step")


def check_switch(name):
    model, guide = _build(name)
    elbo = _ours(mix_gain=math.inf)
    open_gate(elbo.schedule.gate)
    for seed in range(12):
        g = _grads(elbo, model, guide, 200 + seed)
        refs = _refs(model, guide, 200 + seed)
        assert any(torch.allclose(g, r, rtol=1e-4, atol=1e-4) for r in refs), (
            f"{name}: step {seed} of the switch is neither TraceEnum_ELBO's nor STL's"
        )


def check_mix(name):
    model, guide = _build(name)
    elbo = _ours(mix_gain=None)
    _grads(elbo, model, guide, 0)
    (key,) = elbo.control_variate.state
    st = elbo.control_variate.state[key]
    cv = elbo.control_variate
    st["n"], st["qw"] = 10**6, 1.0
    b = torch.linspace(-0.5, 2.0, cv.moments(key)["scc"].numel())
    cv.fit(key).update(b=b, views=None, constant=None)
    st["age"] = -(10**6)
    g = _grads(elbo, model, guide, 7, by_name=True)
    enum = TraceEnum_ELBO(max_plate_nesting=1)
    stl = _grads(enum, model, stick_the_landing(guide), 7, by_name=True)
    trace = _grads(enum, model, guide, 7, by_name=True)
    # every guide parameter here is elementwise in its Normal's loc or scale: that element's
    # weight is the parameter element's
    for k, w in cv.split(key, b).items():
        p = PARAM_OF[name](k)
        _close(g[p], (1 - w) * stl[p] + w * trace[p], f"{name}: per-element weights, {p}")


def check_split(name):
    model, guide = _build(name)
    elbo = _ours()
    open_gate(elbo.schedule.gate)
    for seed in range(100, 102):
        _grads(elbo, model, guide, seed)
    cv = elbo.control_variate
    (key,) = cv.state
    names = [k for k, _ in cv.layouts[key]]
    at_one = {names[0]}  # one Normal parameter keeps its score part, every other drops it
    st = cv.state[settle_at_split(elbo, at_one)]
    assert elbo.schedule.endpoint(cv) == frozenset(at_one), f"{name}: not a split"
    n0 = st["n"]
    g = _grads(elbo, model, guide, 7, by_name=True)
    assert st["n"] == n0, f"{name}: the split's direct step measured"
    enum = TraceEnum_ELBO(max_plate_nesting=1)
    stl = _grads(enum, model, stick_the_landing(guide), 7, by_name=True)
    trace = _grads(enum, model, guide, 7, by_name=True)
    for k in names:
        p = PARAM_OF[name](k)
        _close(g[p], (trace if k in at_one else stl)[p], f"{name}: split at {sorted(at_one)}, {p}")
    # differentiable_loss takes the same split
    params = dict(pyro.get_param_store().named_parameters())
    pyro.set_rng_seed(7)
    loss = elbo.differentiable_loss(model, guide, DATA)
    gs = dict(zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True)))
    for k in names:
        p = PARAM_OF[name](k)
        ref = (trace if k in at_one else stl)[p]
        _close(gs[p], ref, f"{name}: differentiable_loss at the split, {p}")


CHECKS = {
    "first": check_first,
    "frozen": check_frozen,
    "direct": check_direct,
    "gate": check_gate,
    "switch": check_switch,
    "mix": check_mix,
    "split": check_split,
}
CELLS = [(n, k) for n in CASES for k in CHECKS]


@pytest.mark.parametrize("name, check", CELLS, ids=[f"{n}-{k}" for n, k in CELLS])
def test_enum_adaptive(name, check):
    CHECKS[check](name)


# ----------------------------------------------------------------------------- what it refuses
def test_guide_that_is_not_a_plain_normal_is_refused_naming_the_site():
    pyro.clear_param_store()

    def guide(data):
        c = pyro.param("c", torch.ones(2), constraint=constraints.positive)
        with pyro.plate("components", 2):
            pyro.sample("locs", dist.Gamma(c, 1.0))

    with pytest.raises(ValueError, match=r"'locs' is a Gamma.*TraceEnum_ELBO.*stick_the_landing"):
        _ours().loss_and_grads(mix_model, guide, DATA)


def test_block_grad_and_vectorize_are_refused():
    model, guide = _build("mean-field")
    with pytest.raises(ValueError, match="block_grad routes"):
        _ours().loss_and_grads(model, block_grad(guide, sites=["locs"], params=["m"]), DATA)
    with pytest.raises(NotImplementedError, match="vectorize_particles"):
        TraceEnumAdaptiveSTL_ELBO(num_particles=2, vectorize_particles=True, max_plate_nesting=1)


@config_enumerate
def _delta_mixture(data):
    locs = pyro.sample("locs", dist.Normal(0.0, 10.0).expand([2]).to_event(1))
    with pyro.plate("data", len(data)):
        a = pyro.sample("a", dist.Categorical(torch.tensor([0.3, 0.7])))
        pyro.sample("obs", dist.Normal(locs[a], 1.0), obs=data)


@pytest.mark.parametrize("guide_kind", ["AutoDelta", "AutoNormal"])
def test_every_method_equals_trace_enum_elbo_on_the_same_seed(guide_kind):
    """``loss``, ``loss_and_grads`` (so ``svi.step``) and ``differentiable_loss`` sum the
    enumerated site out: each equals ``TraceEnum_ELBO``'s value on the same seed."""
    from pyro.infer import SVI
    from pyro.infer.autoguide import AutoDelta

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    auto = AutoDelta if guide_kind == "AutoDelta" else AutoNormal
    guide = auto(poutine.block(_delta_mixture, hide=["a"]))
    data = DATA * 3
    guide(data)  # create the parameters (their initialization draws random numbers)
    ref, ours = TraceEnum_ELBO(max_plate_nesting=1), _ours()
    for seed in range(3):
        values = []
        for method in ("loss", "loss_and_grads", "differentiable_loss"):
            for elbo in (ref, ours):
                pyro.set_rng_seed(seed)
                v = getattr(elbo, method)(_delta_mixture, guide, data)
                values.append(float(v))
            for p in pyro.get_param_store().values():
                p.unconstrained().grad = None
        for i in range(0, 6, 2):
            assert values[i + 1] == pytest.approx(values[i], rel=1e-6, abs=1e-5), values
    svi = SVI(_delta_mixture, guide, pyro.optim.Adam({"lr": 0.01}), ours)
    pyro.set_rng_seed(5)
    got = svi.evaluate_loss(data)
    pyro.set_rng_seed(5)
    assert got == pytest.approx(ref.loss(_delta_mixture, guide, data), rel=1e-6)


def test_differentiable_loss_is_the_endpoints_trace_enum_elbo():
    """A fresh estimator's ``differentiable_loss`` (endpoint ``b = 1``): ``TraceEnum_ELBO``'s
    value and gradient on the same seed."""
    model, guide = _build("mean-field")
    params = [p.unconstrained() for p in pyro.get_param_store().values()]

    def value_and_grads(elbo):
        pyro.set_rng_seed(3)
        loss = elbo.differentiable_loss(model, guide, DATA)
        return loss.item(), torch.autograd.grad(loss, params)

    (v, gs), (v_ref, gs_ref) = (
        value_and_grads(_ours()),
        value_and_grads(TraceEnum_ELBO(max_plate_nesting=1)),
    )
    assert v == pytest.approx(v_ref, rel=1e-6)
    for g, r in zip(gs, gs_ref):
        _close(g, r, "differentiable_loss gradient")
