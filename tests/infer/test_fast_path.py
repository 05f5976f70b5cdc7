"""The handler's per-site mechanisms against independent same-draw references.

* For every case of the conformance registry, ``stick_the_landing`` inside Pyro's
  ``Trace_ELBO`` equals ``TraceSTL_ELBO`` (which the conformance matrix checks against
  Pyro's surrogate minus the score part) on the same draws, to float64 round-off.
* Conditional guides keep the gradient through earlier samples: a hand-written STL
  surrogate on the same draws (chains, trees, polytrees, dense DAGs), which the detached
  copy alone would miss.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from torch.distributions import constraints

from pyro_gradroute.infer import TraceSTL_ELBO
from pyro_gradroute.poutine import stick_the_landing
from tests.conformance import cases as C
from tests.conformance import checks as K

CASE_IDS = [c.name for c in C.CASES]


def _tol(dtype):
    return dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)


def _stl_grad(c, elbo, seed):
    return K.grad_of(
        c, lambda: K.seeded(seed, lambda: elbo.loss_and_grads(c.model, c.guide, *c.args))
    )


def _stl(case):
    n = 1 if case.messenger else 2
    return TraceSTL_ELBO(num_particles=n, max_plate_nesting=case.max_plate_nesting)


@pytest.mark.parametrize("case", [c for c in C.CASES if not c.messenger], ids=lambda c: c.name)
def test_handler_in_pyros_trace_elbo_equals_trace_stl_elbo(case):
    spec = case.raise_for("STL", routed=False)
    with K.cell(case) as c:
        elbo = PyroTrace_ELBO(max_plate_nesting=case.max_plate_nesting)
        fast_guide = stick_the_landing(c.guide)
        if spec is not None and not spec.optional:  # refused: on every run, the first included
            for _ in range(2):
                with pytest.raises(spec.exc, match=spec.match):
                    elbo.loss_and_grads(c.model, fast_guide, *c.args)
            return
        ours = TraceSTL_ELBO(max_plate_nesting=case.max_plate_nesting)
        for seed in (0, 1):

            def step(e, g, seed=seed):
                pyro.set_rng_seed(seed)
                return e.loss_and_grads(c.model, g, *c.args)

            try:
                lf, gf = K.grad_of(c, lambda: step(elbo, fast_guide))
            except (ValueError, NotImplementedError):
                assert spec is not None and spec.optional
                return
            lo, go = K.grad_of(c, lambda: step(ours, c.guide))
            assert lf == pytest.approx(lo, rel=1e-10 if case.dtype == torch.float64 else 1e-6)
            torch.testing.assert_close(gf, go, **_tol(case.dtype))


# ----------------------------------------------------------------------------- conditional guides
def _chain_problem(T: int, dense: bool):
    x = torch.linspace(-1.0, 2.0, T, dtype=torch.float64)

    def model():
        prev = torch.zeros((), dtype=torch.float64)
        for t in range(T):
            prev = pyro.sample(f"z{t}", dist.Normal(0.8 * prev, 1.0))
            pyro.sample(f"x{t}", dist.Normal(prev, 0.5), obs=x[t])

    def params():
        a = pyro.param("a", torch.full((T,), 0.5, dtype=torch.float64))
        b = pyro.param("b", torch.linspace(0.0, 1.0, T, dtype=torch.float64))
        c = pyro.param("c", torch.full((T,), -0.3, dtype=torch.float64))
        s = pyro.param(
            "s", torch.full((T,), 0.7, dtype=torch.float64), constraint=constraints.positive
        )
        return a, b, c, s

    def mean(t, z, a, b, c):
        m = b[t] + (a[t] * z[t - 1] if t > 0 else 0.0)
        if dense and t > 1:
            m = m + c[t] * z[t - 2]  # reads z[t-2] directly and through z[t-1]
        return m

    def guide():
        a, b, c, s = params()
        z = []
        for t in range(T):
            z.append(pyro.sample(f"z{t}", dist.Normal(mean(t, z, a, b, c), s[t])))

    def reference(values):
        """-(log p(x, z) - log q(z; stop(phi))) with z rebuilt from the same eps, live in phi."""
        a, b, c, s = params()
        with torch.no_grad():
            eps, z = [], []
            for t in range(T):
                eps.append((values[t] - mean(t, z, a, b, c)) / s[t])
                z.append(values[t])
        z = []
        for t in range(T):
            z.append(mean(t, z, a, b, c) + s[t] * eps[t])
        ad, bd, cd, sd = (p.detach() for p in (a, b, c, s))
        lq = sum(dist.Normal(mean(t, z, ad, bd, cd), sd[t]).log_prob(z[t]) for t in range(T))
        lp = 0.0
        for t in range(T):
            lp = lp + dist.Normal(0.8 * (z[t - 1] if t > 0 else 0.0), 1.0).log_prob(z[t])
            lp = lp + dist.Normal(z[t], 0.5).log_prob(x[t])
        return -(lp - lq)

    return model, guide, reference


def _flat(names):
    store = pyro.get_param_store()
    leaves = [store.get_param(n).unconstrained() for n in names]
    return torch.cat([torch.zeros_like(p) if p.grad is None else p.grad for p in leaves])


@pytest.mark.parametrize("dense", [False, True], ids=["markov", "dense"])
def test_conditional_guide_keeps_the_path_through_earlier_samples(dense):
    pyro.clear_param_store()
    model, guide, reference = _chain_problem(5, dense)
    guide()
    names = ["a", "b", "c", "s"]
    for seed in range(3):
        pyro.set_rng_seed(seed)
        tr = poutine.trace(guide).get_trace()
        values = [tr.nodes[f"z{t}"]["value"].detach() for t in range(5)]
        for p in pyro.get_param_store().values():
            p.unconstrained().grad = None
        reference(values).backward()
        ref = _flat(names)
        for p in pyro.get_param_store().values():
            p.unconstrained().grad = None
        pyro.set_rng_seed(seed)
        TraceSTL_ELBO().loss_and_grads(model, guide)
        ours = _flat(names)
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)

        # what the detached copy alone (no path through the earlier samples) would give
        for p in pyro.get_param_store().values():
            p.unconstrained().grad = None
        z = [tr.nodes[f"z{t}"]["value"] for t in range(5)]
        lq = sum(_detached(tr.nodes[f"z{t}"]["fn"]).log_prob(z[t]) for t in range(5))
        lp = poutine.trace(poutine.replay(model, trace=tr)).get_trace().log_prob_sum()
        (-(lp - lq)).backward()
        naive = _flat(names)
        assert (naive - ref).abs().max() > 1e-2


def _detached(fn):
    return dist.Normal(fn.loc.detach(), fn.scale.detach())


def test_conditional_site_under_the_handler_matches_the_reference():
    pyro.clear_param_store()
    model, guide, reference = _chain_problem(4, dense=True)
    guide()
    stl_guide = stick_the_landing(guide)
    elbo = PyroTrace_ELBO()
    for seed in range(3):
        pyro.set_rng_seed(seed)
        tr = poutine.trace(guide).get_trace()
        values = [tr.nodes[f"z{t}"]["value"].detach() for t in range(4)]
        for p in pyro.get_param_store().values():
            p.unconstrained().grad = None
        reference(values).backward()
        ref = _flat(["a", "b", "c", "s"])
        for p in pyro.get_param_store().values():
            p.unconstrained().grad = None
        pyro.set_rng_seed(seed)
        elbo.loss_and_grads(model, stl_guide)
        torch.testing.assert_close(_flat(["a", "b", "c", "s"]), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("guide_cls", ["AutoNormalMessenger", "AutoMeanField"])
def test_saturated_sigmoid_loss_equals_pyros_for_other_guides(guide_cls):
    """A unit-interval site with its guide deep in the float32 tail (loc 14, scale 2)."""
    from pyro.infer.autoguide import AutoNormalMessenger

    from pyro_gradroute.guides import AutoMeanField

    def model():
        p = pyro.sample("p", dist.Beta(2.0, 2.0))
        pyro.sample("x", dist.Bernoulli(p), obs=torch.tensor(1.0))

    pyro.clear_param_store()
    g = {"AutoNormalMessenger": AutoNormalMessenger, "AutoMeanField": AutoMeanField}[guide_cls](
        model
    )
    PyroTrace_ELBO().loss(model, g)
    store = pyro.get_param_store()
    for k in list(store.keys()):
        store[k] = torch.full_like(store[k], 14.0 if "loc" in k else 2.0)
    for seed in range(3):
        pyro.set_rng_seed(seed)
        ref = PyroTrace_ELBO().loss(model, g)
        for p in store.values():
            p.unconstrained().grad = None
        pyro.set_rng_seed(seed)
        ours = TraceSTL_ELBO().loss_and_grads(model, g)
        assert ours == pytest.approx(ref, rel=1e-6)
        grads = [p.unconstrained().grad for p in store.values()]
        assert all(gr is not None and torch.isfinite(gr).all() for gr in grads)


def test_detached_copy_of_a_non_distribution_is_a_clear_error():
    from pyro_gradroute.distributions.detached import detached_copy

    with pytest.raises(TypeError, match="expects a torch.distributions.Distribution, got float"):
        detached_copy(1.0)


def test_detached_copy_at_a_draw_skips_only_the_copys_support_check():
    """With ``value`` (a draw), the copy reads its density without the support check (the
    draw is in the support by construction); the original still checks, and without a value
    the copy checks too."""
    from pyro_gradroute.distributions.detached import detached_copy

    loc = torch.tensor(0.4, requires_grad=True)
    q = dist.Independent(dist.Gamma(loc.exp(), torch.ones(3)), 1)
    z = q.rsample()
    outside = -z.detach()  # (a value the check refuses: a stand-in for an unchecked draw)
    with pyro.validation_enabled(True):
        c = detached_copy(q, z)
        assert c.log_prob(z).item() == pytest.approx(q.log_prob(z).item(), rel=1e-6)
        c.log_prob(outside)  # no check
        for checked in (q, detached_copy(q)):
            with pytest.raises(ValueError, match="support"):
                checked.log_prob(outside)


def test_a_conditional_site_is_split_at_its_draw_unchecked_and_without_a_detached_copy(
    monkeypatch,
):
    """From a family's second sight on, a site whose parameters read an earlier sample goes to
    the split node without a detached copy, which evaluates it at its own draw without the
    support check; the gradient is unchanged (hand-written surrogate on the same draw)."""
    import pyro_gradroute.poutine.pathwise as pw
    from pyro_gradroute.distributions.detached import unchecked

    checked = []

    class Counted(dist.Normal):
        def _validate_sample(self, value):
            checked.append(value)
            super()._validate_sample(value)

    def guide():
        m = pyro.param("m", torch.tensor(0.3))
        z1 = pyro.sample("z1", dist.Normal(m, 1.0))
        pyro.sample("z2", Counted(0.5 * z1 * m, 1.0))

    def model():
        z1 = pyro.sample("z1", dist.Normal(0.0, 1.0))
        pyro.sample("z2", dist.Normal(z1, 1.0))

    copies = []
    real = pw.detached_copy
    monkeypatch.setattr(pw, "detached_copy", lambda fn, *a: copies.append(fn) or real(fn, *a))
    pyro.clear_param_store()
    with pyro.validation_enabled(True):
        TraceSTL_ELBO().loss_and_grads(model, guide)  # (the first sight verifies the copy)
        m = pyro.param("m").unconstrained()
        m.grad, copies[:], checked[:] = None, [], []
        pyro.set_rng_seed(1)
        guide_tr = poutine.trace(guide).get_trace()
        pyro.set_rng_seed(1)
        TraceSTL_ELBO().loss_and_grads(model, guide)
    assert [type(c) for c in copies] == [dist.Normal] and checked == []  # z1's copy only
    z1, z2 = (guide_tr.nodes[n]["value"] for n in ("z1", "z2"))
    md = m.detach()
    surrogate = (  # log p - log q(z1; stop m) - log q(z2 | z1; stop m) (path through z1 kept)
        dist.Normal(0.0, 1.0).log_prob(z1) + dist.Normal(z1, 1.0).log_prob(z2)
        - dist.Normal(md, 1.0).log_prob(z1) - dist.Normal(0.5 * z1 * md, 1.0).log_prob(z2)
    )  # fmt: skip
    (ref,) = torch.autograd.grad(-surrogate, m)
    torch.testing.assert_close(m.grad, ref)
    q = Counted(m, 1.0)
    u = unchecked(q)
    assert type(u) is Counted and u.loc is m and u.log_prob(torch.tensor(0.1)).requires_grad
    d = dist.Delta(m)
    assert checked == [] and unchecked(d) is d  # (not a plain family: itself)
    q.log_prob(torch.tensor(0.1))
    assert len(checked) == 1


# ----------------------------------------------------------------------------- which path, exactly
def _graph_problem(kind: str, T: int = 8):
    """A float64 guide whose site ``t`` reads the samples ``parents(t)`` (a linear-Gaussian DAG).

    ``chain``: ``z_{t-1}``; ``tree``: ``z_{(t-1)//2}`` (siblings independent, depth 3);
    ``polytree``: two independent roots both read by ``z_2``, then a chain; ``dense``:
    ``z_{t-1}`` and ``z_{t-2}`` (one computed from the other).
    """
    parents = {
        "chain": lambda t: [t - 1] if t else [],
        "tree": lambda t: [(t - 1) // 2] if t else [],
        "polytree": lambda t: [] if t < 2 else ([0, 1] if t == 2 else [t - 1]),
        "dense": lambda t: [u for u in (t - 1, t - 2) if u >= 0],
    }[kind]
    x = torch.linspace(-1.0, 2.0, T, dtype=torch.float64)

    def model():
        for t in range(T):
            z = pyro.sample(f"z{t}", dist.Normal(0.0, 1.5))
            pyro.sample(f"x{t}", dist.Normal(z, 0.5), obs=x[t])

    def guide():
        a = pyro.param("a", torch.linspace(0.3, 0.9, T, dtype=torch.float64))
        b = pyro.param("b", torch.linspace(-0.5, 1.0, T, dtype=torch.float64))
        s = pyro.param(
            "s", torch.full((T,), 0.7, dtype=torch.float64), constraint=constraints.positive
        )
        z = []
        for t in range(T):
            loc = b[t] + sum(a[t] * (0.5 + 0.1 * j) * z[u] for j, u in enumerate(parents(t)))
            z.append(pyro.sample(f"z{t}", dist.Normal(loc, s[t])))

    return model, guide


def _stl_reference(model, guide, seed, names):
    """Pyro's ``Trace_ELBO`` surrogate on the draws of ``seed`` minus the score part
    ``log q(stop(z); phi)`` (every sample held fixed: the guide replayed on the detached draws)."""
    for p in pyro.get_param_store().values():
        p.unconstrained().grad = None
    elbo = PyroTrace_ELBO()
    pyro.set_rng_seed(seed)
    ((mt, gt),) = list(elbo._get_traces(model, guide, (), {}))
    _, surrogate = elbo._differentiable_loss_particle(mt, gt)
    values = {n: s["value"].detach() for n, s in gt.nodes.items() if s["type"] == "sample"}
    fixed = poutine.trace(poutine.condition(guide, data=values)).get_trace()
    score = sum(s["fn"].log_prob(s["value"]).sum() for n, s in fixed.nodes.items() if n in values)
    (surrogate - score).backward()
    return _flat(names)


@pytest.mark.parametrize("kind", ["chain", "tree", "polytree", "dense"])
def test_conditional_guides_equal_the_same_draw_reference(kind):
    """Chains, trees, polytrees and dense DAGs (the upstream product cuts below each sample
    read) give the same-draw STL reference, float64, in the estimator and in the handler."""
    model, guide = _graph_problem(kind)
    pyro.clear_param_store()
    guide()
    names = ["a", "b", "s"]
    handler = stick_the_landing(guide)
    for seed in range(3):
        grads = []
        for elbo, g in ((TraceSTL_ELBO(), guide), (PyroTrace_ELBO(), handler)):
            for p in pyro.get_param_store().values():
                p.unconstrained().grad = None
            pyro.set_rng_seed(seed)
            elbo.loss_and_grads(model, g)
            grads.append(_flat(names))
        ref = _stl_reference(model, guide, seed, names)
        for g in grads:
            torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-10)


def test_detached_copy_keeps_a_familys_own_copy_rules():
    """The copy is ``cls.__new__`` plus the instance dict only where copy.copy would do the same."""
    from pyro_gradroute.distributions.detached import detached_copy, param_tensors

    calls = []

    class OwnCopy(dist.Normal):
        def __copy__(self):
            calls.append(1)
            new = type(self).__new__(type(self))
            new.__dict__.update(self.__dict__)
            return new

    loc = torch.tensor(0.4, requires_grad=True)
    for q, copied in ((dist.Normal(loc, 1.0), []), (OwnCopy(loc, 1.0), [1])):
        z = q.rsample()
        stopped = []
        c = detached_copy(q, z, stopped)
        assert calls == copied
        assert [id(t) for t in stopped] == [id(t) for t in param_tensors(q)] != []
        assert type(c) is type(q) and c.loc is not loc and not c.loc.requires_grad
        assert c.log_prob(z).item() == q.log_prob(z).item()
        (g,) = torch.autograd.grad(c.log_prob(z), loc)
        torch.testing.assert_close(g, -(z - loc).detach())


@pytest.mark.parametrize("est", ["TraceSTL_ELBO", "stick_the_landing"])
@pytest.mark.parametrize("guide_cls", ["AutoNormalMessenger", "AutoMeanField"])
def test_saturated_sigmoid_gradient_equals_the_same_draw_reference(guide_cls, est):
    """Deep in the float32 tail (loc 14, scale 2) some draws saturate (sigmoid(u) == 1).

    Reference: Pyro's ``Trace_ELBO`` gradient on the same draw minus the score part at the
    sampled pre-image ``u`` (read from the transform's cache, not inverted):
    ``d/dloc log N(u; loc, s) = (u - loc) / s^2`` and ``d/dlog s = (u - loc)^2 / s^2 - 1``.
    """
    from pyro.infer.autoguide import AutoNormalMessenger

    from pyro_gradroute._compat import transform_cache
    from pyro_gradroute.guides import AutoMeanField

    n = 20

    def model():
        with pyro.plate("n", n):
            p = pyro.sample("p", dist.Beta(2.0, 2.0))
            pyro.sample("x", dist.Bernoulli(p), obs=torch.zeros(n))

    pyro.clear_param_store()
    g = {"AutoNormalMessenger": AutoNormalMessenger, "AutoMeanField": AutoMeanField}[guide_cls](
        model
    )
    PyroTrace_ELBO().loss(model, g)
    store = pyro.get_param_store()
    loc_name = next(k for k in store.keys() if "loc" in k)
    scale_name = next(k for k in store.keys() if "scale" in k)
    store[loc_name] = torch.full((n,), 14.0)
    store[scale_name] = torch.full((n,), 2.0)
    names = (loc_name, scale_name)

    def grads(fn, seed):
        for p in store.values():
            p.unconstrained().grad = None
        pyro.set_rng_seed(seed)
        loss = fn()
        return loss, [store[k].unconstrained().grad.clone() for k in names]

    saturated = 0
    for seed in range(3):
        pyro.set_rng_seed(seed)
        t = poutine.trace(g).get_trace().nodes["p"]["fn"].transforms[0]
        u = transform_cache(t)[0].detach()
        saturated += int((torch.sigmoid(u) == 1).sum())
        ref_loss, (gl, gs) = grads(lambda: PyroTrace_ELBO().loss_and_grads(model, g), seed)
        eps = (u - 14.0) / 2.0
        ref = (gl - eps / 2.0, gs - (eps.square() - 1))
        if est == "TraceSTL_ELBO":
            loss, got = grads(lambda: TraceSTL_ELBO().loss_and_grads(model, g), seed)
        else:
            loss, got = grads(
                lambda: PyroTrace_ELBO().loss_and_grads(model, stick_the_landing(g)), seed
            )
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert saturated > 0  # the case the test is about
