"""Unconditional flow guides take the default STL path: no split node.

For every flow family (the flows of ``tests/distributions/test_flow_pathwise.py`` and the
inverse-free ones), in float64 on the same draws:

* ``TraceSTL_ELBO``, ``stick_the_landing`` in Pyro's ``Trace_ELBO``, ``TraceAdaptiveSTL_ELBO``
  (a fixed weight ``b``) and ``TraceDReG_ELBO`` (K=3)
  equal hand-written surrogates whose flow gradient
  :math:`\\nabla_y \\log q(y)` comes from the whole flow's Jacobian
  (``torch.autograd.functional.jacobian``, a dense solve and the gradient of the
  transforms' own ``log|det J|``), not from the forward rules;
* the default path equals the general split (relays, split node) to 1e-10, and the loss is
  bitwise Pyro's ``Trace_ELBO``'s;
* each guide takes the path expected of it: the default one for an unconditional flow, the
  general split for a conditional flow, a transform without a rule, an uncached transform,
  and a transform shared by two sites (its cache then holds the later sample's path).
"""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pyro.distributions.transforms as T
import pytest
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from pyro.nn import AutoRegressiveNN
from pyro.poutine.util import prune_subsample_sites
from torch.distributions import constraints
from torch.distributions.transforms import AffineTransform, ComposeTransform, SigmoidTransform

from pyro_gradroute._compat import transform_attrs, transform_cache
from pyro_gradroute.infer import TraceAdaptiveSTL_ELBO, TraceDReG_ELBO, TraceSTL_ELBO
from pyro_gradroute.poutine import stick_the_landing
from tests.distributions.test_flow_pathwise import _Cube  # a transform with no rule and no inverse

D, N_OBS, K, B = 4, 3, 3, 0.3  # latent dim, observations, particles, the adaptive weight
X = torch.linspace(-1.0, 1.5, N_OBS * D, dtype=torch.float64).reshape(N_OBS, D)


@pytest.fixture(autouse=True)
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def _affine():
    loc = pyro.param("aff_loc", torch.linspace(-0.2, 0.3, D))
    scale = pyro.param("aff_scale", torch.linspace(0.6, 1.4, D), constraint=constraints.positive)
    return AffineTransform(loc, scale, cache_size=1)  # built per call from the params


def _tail():
    return [AffineTransform(pyro.param("tail_loc", torch.zeros(D)), 0.25, cache_size=1)]


#: name -> (modules built once, transforms of one call from them)
FAMILIES = {
    "affine": (lambda: [], lambda ms: [_affine()]),
    "spline": (lambda: [T.spline(D, count_bins=6)], list),
    "affine_coupling": (lambda: [T.affine_coupling(D)], list),
    "spline_coupling": (lambda: [T.spline_coupling(D)], list),
    "affine_autoregressive": (lambda: [T.affine_autoregressive(D, hidden_dims=[16])], list),
    "affine_autoregressive_stable": (
        lambda: [T.affine_autoregressive(D, hidden_dims=[16], stable=True)],
        list,
    ),
    "affine_autoregressive_skip_tanh": (
        lambda: [
            T.AffineAutoregressive(
                AutoRegressiveNN(D, [12, 12], skip_connections=True, nonlinearity=torch.nn.Tanh())
            )
        ],
        list,
    ),
    "spline_autoregressive": (lambda: [T.spline_autoregressive(D)], list),
    "householder": (lambda: [T.householder(D, 3), T.affine_autoregressive(D)], list),
    "permute": (
        lambda: [T.affine_autoregressive(D), T.permute(D), T.affine_coupling(D)],
        list,
    ),
    "planar": (lambda: [T.planar(D)], list),
    "planar_x2": (lambda: [T.iterated(2, T.planar, D)], list),
    "radial": (lambda: [T.radial(D)], list),
    "sylvester": (lambda: [T.sylvester(D, 2)], list),
    "neural_autoregressive": (lambda: [T.neural_autoregressive(D, width=8)], list),
    "block_autoregressive": (lambda: [T.block_autoregressive(D)], list),
    # a saturating parameter-free tail after the flow: its gradient enters through the tail
    "composition": (
        lambda: [
            T.iterated(2, T.affine_autoregressive, D, hidden_dims=[8]),
            T.permute(D),
            T.affine_coupling(D),
            T.householder(D, 2),
        ],
        lambda ms: [*ms, *_tail(), SigmoidTransform(cache_size=1)],
    ),
}


def _modules(ts):
    return [m for t in ts for m in (t.parts if isinstance(t, ComposeTransform) else [t])]


def _build(name, nested=False):
    make, call = FAMILIES[name]
    torch.manual_seed(0)
    ms = make()
    g = torch.Generator().manual_seed(1)
    for m in _modules(ms):
        if isinstance(m, torch.nn.Module):
            for p in m.parameters():
                p.data.add_(0.3 * torch.randn(p.shape, generator=g))
    modules = torch.nn.ModuleList([m for m in _modules(ms) if isinstance(m, torch.nn.Module)])

    def model():
        z = pyro.sample("z", dist.Normal(torch.zeros(D), 1.0).to_event(1))
        with pyro.plate("data", N_OBS):
            pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=X)

    def guide():
        if len(modules):
            pyro.module("flow", modules)
        loc = pyro.param("loc", torch.linspace(0.1, 0.4, D))
        scale = pyro.param("scale", torch.linspace(0.5, 1.2, D), constraint=constraints.positive)
        base = dist.Normal(loc, scale).to_event(1)
        ts = call(ms)
        if nested:  # TD(TD(base, first), rest): the same flow, flattened by the estimators
            q = dist.TransformedDistribution(dist.TransformedDistribution(base, ts[:1]), ts[1:])
        else:
            q = dist.TransformedDistribution(base, ts)
        pyro.sample("z", q)

    pyro.clear_param_store()
    guide()
    return model, guide


# ----------------------------------------------------------------------------- references
def _leaves():
    return [p.unconstrained() for p in pyro.get_param_store().values()]


def _grads(fn, seed):
    """Run ``fn`` (a step) from zeroed grads on ``seed``; its value and the flat gradient."""
    for p in _leaves():
        p.grad = None
    pyro.set_rng_seed(seed)
    loss = fn()
    g = torch.cat(
        [torch.zeros(p.numel()) if p.grad is None else p.grad.flatten() for p in _leaves()]
    )
    for p in _leaves():
        p.grad = None
    return loss, g


def _flat(ts):
    return [u for t in ts for u in (_flat(t.parts) if isinstance(t, ComposeTransform) else [t])]


def _explicit_grad(fn, x0):
    r""":math:`\nabla_y \log q(y)` at :math:`y = T(x_0)`, row by row, from the whole flow's Jacobian:
    :math:`J^{-T}(\nabla \log q_0(x_0) - \nabla_{x_0} \sum_i \log|\det J_i|)`."""
    leaves = _flat(fn.transforms)
    base = fn.base_dist
    while isinstance(base, dist.TransformedDistribution):  # nested: the inner transforms first
        leaves = _flat(base.transforms) + leaves
        base = base.base_dist

    def forward(x):
        for t in leaves:
            x = t._call(x)
        return x

    def ladj(x):
        s = 0.0
        for t in leaves:
            y = t._call(x)
            s = s + t.log_abs_det_jacobian(x, y).sum()
            x = y
        return s

    xb = x0.detach().clone().requires_grad_()
    (gx,) = torch.autograd.grad(base.log_prob(xb).sum(), xb)
    rows = []
    for x, g in zip(x0.detach().reshape(-1, D), gx.reshape(-1, D)):
        J = torch.autograd.functional.jacobian(forward, x)  # J[i, j] = dy_i / dx_j
        xx = x.clone().requires_grad_()
        s = ladj(xx)
        (gl,) = torch.autograd.grad(s, xx, allow_unused=True) if s.requires_grad else (None,)
        gl = torch.zeros_like(x) if gl is None else gl
        rows.append(torch.linalg.solve(J.T, g - gl))
    return torch.stack(rows).reshape(x0.shape)


def _first_input(fn):
    """The base sample, from the first transform's cache (the draw, not an inverse)."""
    while isinstance(fn.base_dist, dist.TransformedDistribution):
        fn = fn.base_dist
    return transform_cache(_flat(fn.transforms)[0])[0]


def _hand(model, guide, seed, kind):
    """``(loss, surrogate)`` on the draws of Pyro's vectorized ELBOs (K particles at dim -2).

    ``kind``: ``"stl"`` (mean over particles of ``log p - <stop(g), z>``) or ``"dreg"``
    (IWAE's loss; the guide surrogate ``sum_k stop(w_k^2) (log p_k - <stop(g_k), z_k>)``).
    """
    pyro.set_rng_seed(seed)
    with pyro.plate("num_particles_vectorized", K, dim=-2):
        gt = poutine.trace(guide).get_trace()
        mt = poutine.trace(poutine.replay(model, trace=gt)).get_trace()
    mt, gt = prune_subsample_sites(mt), prune_subsample_sites(gt)
    mt.compute_log_prob()
    gt.compute_log_prob()

    def per_particle(tr):
        return sum(
            s["log_prob"].reshape(K, -1).sum(-1) for s in tr.nodes.values() if s["type"] == "sample"
        )

    logp, logq = per_particle(mt), per_particle(gt)
    site = gt.nodes["z"]
    z = site["value"]
    g = _explicit_grad(site["fn"], _first_input(site["fn"]))
    path = logp - (g * z).reshape(K, -1).sum(-1)
    log_w = logp - logq
    if kind == "stl":
        return -log_w.mean().item(), path.mean()
    w = torch.softmax(log_w.detach(), 0)
    iwae = torch.logsumexp(log_w, 0) - torch.log(torch.tensor(float(K)))
    return -iwae.item(), (w * w * path).sum()


def _reference(model, guide, seed, kind):
    def step():
        loss, surrogate = _hand(model, guide, seed, kind)
        (-surrogate).backward()
        return loss

    return _grads(step, seed)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10 * max(1.0, b.abs().max().item()))


def _stl(adaptive=False):
    if adaptive:
        elbo = TraceAdaptiveSTL_ELBO(
            num_particles=K, vectorize_particles=True, max_plate_nesting=1, fixed_weight=B
        )
    else:
        elbo = TraceSTL_ELBO(num_particles=K, vectorize_particles=True, max_plate_nesting=1)
    return elbo


def _pyro_trace():
    return PyroTrace_ELBO(num_particles=K, vectorize_particles=True, max_plate_nesting=1)


# ----------------------------------------------------------------------------- the estimators
NAMES = sorted(FAMILIES)


NESTED = ["householder", "permute", "composition"]  # several transforms: TD(TD(base, t1), rest)


@pytest.mark.parametrize(
    "name, nested",
    [(n, False) for n in NAMES] + [(n, True) for n in NESTED],
    ids=NAMES + [f"{n}-nested" for n in NESTED],
)
def test_stl_default_path_equals_explicit_jacobian_and_general_split(name, nested):
    model, guide = _build(name, nested)
    for seed in (0, 1):
        elbo = _stl()
        loss, g = _grads(lambda e=elbo: e.loss_and_grads(model, guide), seed)
        ref_loss, ref = _reference(model, guide, seed, "stl")
        _close(g, ref)
        pyro.set_rng_seed(seed)
        pyro_loss = _pyro_trace().loss(model, guide)
        assert loss == pyro_loss  # bitwise the ordinary log q
        assert loss == pytest.approx(ref_loss, rel=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_handler_default_path_equals_explicit_jacobian_and_general_split(name):
    model, guide = _build(name)
    fast = stick_the_landing(guide)
    elbo = _pyro_trace()
    for seed in (1,):
        _, g = _grads(lambda: elbo.loss_and_grads(model, fast), seed)
        _, ref = _reference(model, guide, seed, "stl")
        _close(g, ref)


@pytest.mark.parametrize("name", NAMES)
def test_adaptive_default_path_equals_the_fixed_mix_of_references(name):
    """``TraceAdaptiveSTL_ELBO(fixed_weight=b)``: STL's gradient plus ``b`` times the score
    part, i.e. ``(1 - b) * STL + b * Trace_ELBO`` on the same draws (its score part is the
    full log-density's gradient less the default path's pathwise one)."""
    model, guide = _build(name)
    for seed in (1,):
        elbo = _stl(adaptive=True)
        _, g = _grads(lambda e=elbo: e.loss_and_grads(model, guide), seed)
        _, stl_ref = _reference(model, guide, seed, "stl")
        _, trace = _grads(lambda: _pyro_trace().loss_and_grads(model, guide), seed)
        _close(g, (1 - B) * stl_ref + B * trace)


@pytest.mark.parametrize("name", NAMES)
def test_dreg_equals_explicit_jacobian_surrogate(name):
    """DReG takes the general split; its flow gradient equals the explicit-Jacobian one."""
    model, guide = _build(name)
    elbo = TraceDReG_ELBO(num_particles=K, max_plate_nesting=1)
    for seed in (1,):
        loss, g = _grads(lambda: elbo.loss_and_grads(model, guide), seed)
        ref_loss, ref = _reference(model, guide, seed, "dreg")
        assert loss == pytest.approx(ref_loss, rel=1e-12)
        _close(g, ref)


# ----------------------------------------------------------------------------- which path
def _path_guide(kind):
    planar = T.planar(D)

    def model():
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        z = pyro.sample("z", dist.Normal(torch.zeros(D) + w, 1.0).to_event(1))
        if kind == "shared":
            pyro.sample("z2", dist.Normal(torch.zeros(D), 1.0).to_event(1))
        with pyro.plate("data", N_OBS):
            pyro.sample("x", dist.Normal(z, 1.0).to_event(1), obs=X)

    def guide():
        pyro.module("planar", planar)
        w = pyro.sample("w", dist.Normal(pyro.param("m", torch.tensor(0.2)), 0.7))
        loc = pyro.param("loc", torch.linspace(0.1, 0.4, D))
        ts = {
            "flow": [planar],
            "conditional": [planar],
            "shared": [planar],
            "no rule": [
                _Cube(pyro.param("cube", torch.tensor(0.5), constraint=constraints.positive))
            ],
            "uncached": [AffineTransform(loc, 1.5), planar],
        }[kind]
        base_loc = loc + w.unsqueeze(-1) if kind == "conditional" else loc
        pyro.sample("z", dist.TransformedDistribution(dist.Normal(base_loc, 1.0).to_event(1), ts))
        if kind == "shared":  # the same transform again: its cache now holds z2's path
            pyro.sample("z2", dist.TransformedDistribution(dist.Normal(loc, 1.0).to_event(1), ts))

    return model, guide


@pytest.mark.parametrize(
    "kind, general",
    [
        ("flow", False),
        ("conditional", True),
        ("shared", True),
        ("no rule", True),
        ("uncached", True),
    ],
)
def test_each_flow_guide_takes_the_expected_path(kind, general):
    model, guide = _path_guide(kind)
    elbo = TraceSTL_ELBO(max_plate_nesting=1)
    pyro_trace = PyroTrace_ELBO(max_plate_nesting=1)
    pyro.set_rng_seed(0)
    guide()  # the parameters
    with warnings.catch_warnings(record=True) as caught:  # (no rule: the ordinary gradient)
        warnings.simplefilter("always")
        fast = _grads(lambda: elbo.loss_and_grads(model, guide), 3)
    assert any("cannot be split" in str(w.message) for w in caught) is (kind == "no rule")
    if kind != "shared":  # (Pyro's own log_prob cannot invert z: its cache holds z2's path)
        assert fast[0] == _grads(lambda: pyro_trace.loss_and_grads(model, guide), 3)[0]
    # the handler inside Pyro's estimator: the same loss and gradient ("no rule": z's ordinary)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handled = _grads(lambda: pyro_trace.loss_and_grads(model, stick_the_landing(guide)), 3)
    assert fast[0] == handled[0]
    _close(fast[1], handled[1])
    # the handler: the default path (no split node), or the split node
    wrapped = stick_the_landing(guide)
    for _ in range(2):
        pyro.set_rng_seed(0)
        tr = poutine.trace(wrapped).get_trace()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore" if kind == "no rule" else "error")
            tr.compute_log_prob()
    # the split node; none on the default path, nor where the split falls back to
    # the ordinary gradient (no rule and no inverse: with a warning)
    split = general and kind != "no rule"
    assert _custom_nodes(tr.nodes["z"]["log_prob"]) == ({"split"} if split else set())


def _custom_nodes(t) -> set:
    """Which of the package's autograd Functions ``t``'s graph holds (``"split"``: its split node)."""
    seen, stack, found = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "_PathwiseBackward":
            found.add("split")
        stack.extend(f for f, _ in node.next_functions)
    return found


def test_a_transform_cache_is_no_parameter_of_a_flow():
    """A parameter-free transform whose cache holds a draw computed from parameters holds no
    parameter of its own; such a site is no flow (the detached copy takes it)."""
    from pyro_gradroute.distributions import flows
    from pyro_gradroute.poutine.pathwise import _flow_pathwise

    loc = torch.zeros(2, requires_grad=True)
    t = SigmoidTransform(cache_size=1)
    y = t(loc + 1.0)
    assert transform_cache(t)[1] is y and "_cached_x_y" not in transform_attrs(t)
    assert flows.holds_params(t, cache=True) and not flows.holds_params(t)
    assert flows.holds_params(AffineTransform(loc, 1.0))
    q = dist.TransformedDistribution(dist.Normal(loc, 1.0).to_event(1), [t])
    z = q.rsample()
    assert _flow_pathwise("u", q, z, [], {}) is None  # (the detached copy takes it)


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pyro's JIT tracer warnings
def test_the_handler_under_the_jit_takes_the_general_split_for_flows():
    """A handler on the default path with a flow, then traced by the JIT: the general split
    (the forward rules cannot be traced), equal to the non-JIT step on the same draw."""
    model, guide = _build("affine_autoregressive")
    wrapped = stick_the_landing(guide)
    elbo = PyroTrace_ELBO(max_plate_nesting=1)
    for seed in (0, 1):
        _, g = _grads(lambda: elbo.loss_and_grads(model, wrapped), seed)
    jit = pyro.infer.JitTrace_ELBO(max_plate_nesting=1)
    _grads(lambda: jit.loss_and_grads(model, wrapped), 0)  # compiles (two runs of the guide)
    _, gj = _grads(lambda: jit.loss_and_grads(model, wrapped), 1)  # the traced program
    _close(gj, g)


def test_shapes_of_a_batch_of_flow_sites():
    """A plate of flow sites (batch dims under the particle plate) on the default path."""
    planar = T.planar(D)

    def model():
        with pyro.plate("g", 2):
            pyro.sample("z", dist.Normal(torch.zeros(D), 1.0).to_event(1))

    def guide():
        pyro.module("planar", planar)
        loc = pyro.param("loc", torch.linspace(0.1, 0.4, 2 * D).reshape(2, D))
        with pyro.plate("g", 2):
            q = dist.TransformedDistribution(dist.Normal(loc, 0.8).to_event(1), [planar])
            pyro.sample("z", q)

    pyro.set_rng_seed(0)
    guide()
    fast = TraceSTL_ELBO(num_particles=K, vectorize_particles=True, max_plate_nesting=1)
    lf, gf = _grads(lambda: fast.loss_and_grads(model, guide), 2)
    _, ref = _reference(model, guide, 2, "stl")
    _close(gf, ref)
    pyro.set_rng_seed(2)
    assert lf == _pyro_trace().loss(model, guide)
