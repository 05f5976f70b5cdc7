"""Forward-carried pathwise gradients of flows: exact, inverse-free, wired into the split."""

import copy
import functools
import warnings

import pyro
import pyro.distributions as dist
import pyro.distributions.transforms as T
import pytest
import torch
from pyro.infer import RenyiELBO
from pyro.infer import Trace_ELBO as PyroTrace_ELBO
from pyro.infer import autoguide as ag
from pyro.nn import AutoRegressiveNN
from torch.distributions import constraints
from torch.distributions.transforms import AffineTransform, SigmoidTransform, Transform

from pyro_gradroute.distributions import SplitNotSupported, flows, split_log_prob, split_log_probs
from pyro_gradroute.infer import TraceDReG_ELBO, TraceSTL_ELBO
from tests.conjugate import GaussianModel


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _perturb(ts, std=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    for t in ts:
        if isinstance(t, torch.nn.Module):
            for p in t.parameters():
                p.data.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)


def _inverse_grad(q, y):
    """d log q(y) / dy through the inverse (a fresh tensor: no cache)."""
    yy = y.detach().clone().requires_grad_()
    return torch.autograd.grad(q.log_prob(yy).sum(), yy)[0]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


D = 5

FLOWS = {
    "affine": lambda: [
        AffineTransform(torch.randn(D).requires_grad_(), (torch.rand(D) + 0.5).requires_grad_())
    ],
    "exp_affine": lambda: [  # the elementwise rule for Exp, then a parametrized transform
        T.ExpTransform(),
        AffineTransform(torch.randn(D).requires_grad_(), (torch.rand(D) + 0.5).requires_grad_()),
    ],
    "spline": lambda: [T.spline(D, count_bins=6)],
    "affine_coupling": lambda: [T.affine_coupling(D)],
    "spline_coupling": lambda: [T.spline_coupling(D)],
    "affine_autoregressive": lambda: [T.affine_autoregressive(D, hidden_dims=[16])],
    "affine_autoregressive_stable": lambda: [
        T.affine_autoregressive(D, hidden_dims=[16], stable=True)
    ],
    "affine_autoregressive_skip_tanh": lambda: [
        T.AffineAutoregressive(
            AutoRegressiveNN(D, [12, 12], skip_connections=True, nonlinearity=torch.nn.Tanh())
        )
    ],
    "spline_autoregressive": lambda: [T.spline_autoregressive(D)],
    "householder": lambda: [T.householder(D, 3), T.affine_autoregressive(D)],
    "permute": lambda: [T.affine_autoregressive(D), T.permute(D), T.affine_coupling(D)],
    "spline_composition": lambda: [T.spline(D), T.permute(D), T.spline_coupling(D)],
    "composition": lambda: [
        T.iterated(2, T.affine_autoregressive, D, hidden_dims=[8]),
        T.permute(D),
        T.affine_coupling(D),
        T.householder(D, 2),
        AffineTransform(torch.zeros(D).requires_grad_(), 0.25),
        SigmoidTransform(),
    ],
}


def _cast(ts, dtype):
    """The same transforms in ``dtype`` (modules converted, affine parameters re-made)."""
    out = []
    for t in copy.deepcopy(ts):
        if isinstance(t, AffineTransform):
            t = AffineTransform(
                torch.as_tensor(t.loc).detach().to(dtype).requires_grad_(),
                torch.as_tensor(t.scale).detach().to(dtype),
            )
        elif isinstance(t, torch.nn.Module):
            t = t.to(dtype)
        out.append(t)
    return out


def _flow(name, dtype=torch.float64):
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        ts = FLOWS[name]()
        _perturb(ts)
        base = dist.Normal(torch.randn(D), torch.rand(D) + 0.5).to_event(1)
        x = base.sample([4])
    finally:
        torch.set_default_dtype(old)
    if dtype != torch.float64:
        ts = _cast(ts, dtype)
        base = dist.Normal(base.base_dist.loc.to(dtype), base.base_dist.scale.to(dtype)).to_event(1)
        x = x.to(dtype)
    return dist.TransformedDistribution(base, ts), x


def _explicit_reference(q, x):
    """J^{-T} (g_x - grad log|det J|) for the whole flow, J and log|det J| from autograd."""
    leaves = flows._flatten(q.transforms)

    def forward(z):
        for t in leaves:
            z = t._call(z)
        return z

    out = []
    for xb in x:
        xx = xb.clone().requires_grad_()
        J = torch.autograd.functional.jacobian(forward, xx, create_graph=True)
        gl = torch.autograd.grad(torch.linalg.slogdet(J)[1], xx)[0]
        x2 = xb.clone().requires_grad_()
        gx = torch.autograd.grad(q.base_dist.log_prob(x2), x2)[0]
        out.append(torch.linalg.solve(J.detach().T, gx - gl))
    return torch.stack(out)


@pytest.mark.parametrize("name", sorted(FLOWS))
def test_forward_gradient_equals_inverse_based_float64(name, float64):
    """1e-10 relative to the inverse-based gradient (or, where Pyro's spline inverse is the less
    accurate of the two, to an explicit-Jacobian reference)."""
    q, x = _flow(name)
    y, g = flows.flow_grad(q, x)
    assert g.dtype == torch.float64
    err = _rel(g, _inverse_grad(q, y))
    if err >= 1e-10 and "spline" in name or name == "composition":
        err = min(err, _rel(g, _explicit_reference(q, x)))
    assert err < 1e-10


@pytest.mark.parametrize("name", sorted(FLOWS))
def test_forward_gradient_equals_inverse_based_float32(name):
    """Float32 against the float64 result: within 1e-5, no worse than the inverse in float32, or
    within float32's round-off bound for the solve, 4 cond(J) u (u = 2^-24: a backward-stable
    solve of an ill-conditioned sample loses that much, on every machine's kernels)."""
    q64, x64 = _flow(name)
    _, g64 = flows.flow_grad(q64, x64)
    leaves = flows._flatten(q64.transforms)

    def forward(z):
        for t in leaves:
            z = t._call(z)
        return z

    cond = max(
        torch.linalg.cond(torch.autograd.functional.jacobian(forward, xb)).item() for xb in x64
    )
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        q, x = _flow(name, torch.float32)
        y, g = flows.flow_grad(q, x)
        assert g.dtype == torch.float32
        inverse = _rel(_inverse_grad(q, y).double(), g64)
    finally:
        torch.set_default_dtype(old)
    ours = _rel(g.double(), g64)
    assert ours < max(1e-5, 2 * inverse, 4 * cond * 2.0**-24), (ours, inverse, cond)


def _jacobian_reference(t, base, x):
    """J^{-T} (g_x - grad log|det J|) with J from autograd.functional.jacobian, per sample."""
    out = []
    for xb in x:
        J = torch.autograd.functional.jacobian(lambda z: t._call(z), xb)
        xx = xb.clone().requires_grad_()
        with torch.enable_grad():
            gl = torch.autograd.grad(t.log_abs_det_jacobian(xx, t._call(xx)), xx)[0]
            x2 = xb.clone().requires_grad_()
            gx = torch.autograd.grad(base.log_prob(x2), x2)[0]
        out.append(torch.linalg.solve(J.T, gx - gl))
    return torch.stack(out)


@pytest.mark.parametrize(
    "make",
    [
        lambda: T.planar(D),
        lambda: T.radial(D),
        lambda: T.sylvester(D, 2),
        lambda: T.neural_autoregressive(D, width=8),
        lambda: T.block_autoregressive(D),
    ],
    ids=["planar", "radial", "sylvester", "naf", "bnaf"],
)
def test_inverse_free_flows_against_explicit_jacobian(make, float64):
    torch.manual_seed(1)
    t = make()
    _perturb([t], std=0.5)
    base = dist.Normal(torch.randn(D), torch.rand(D) + 0.5).to_event(1)
    q = dist.TransformedDistribution(base, [t])
    x = base.sample([3])
    _, g = flows.flow_grad(q, x)
    assert _rel(g, _jacobian_reference(t, base, x)) < 1e-10


def _grads(y, params):
    return torch.autograd.grad(y, params, retain_graph=True, allow_unused=True)


def test_split_of_a_planar_flow_is_exact(float64):
    """Values bitwise the ordinary log_prob; pathwise = g_y . dy/dphi; score + pathwise = full."""
    torch.manual_seed(2)
    flow = T.iterated(2, T.planar, 3)
    _perturb([flow], std=0.5)
    loc = torch.randn(3, requires_grad=True)
    q = dist.TransformedDistribution(dist.Normal(loc, 1.0).to_event(1), [flow])
    z = q.rsample([4])
    lp, score, path = split_log_prob(q, z)
    ref = q.log_prob(z)  # cached: Pyro's own value and (total) gradient
    assert torch.equal(lp, ref) and torch.equal(path, ref) and torch.equal(score, ref)
    params = [loc, *flow.parameters()]
    w = torch.randn(4)
    # pathwise: g_y . dy/dphi with g_y from an explicit Jacobian, chained through both layers
    x0 = flow.parts[0]._cached_x_y[0]
    base = dist.Normal(loc.detach(), 1.0).to_event(1)
    x1 = flow.parts[0]._cached_x_y[1]
    g1 = _jacobian_reference(flow.parts[0], base, x0.detach())
    layer = flows.FlowLayer(flow.parts[1], x1, z)
    gy = flows.flow_rule(flow.parts[1])(layer, g1)
    expected = _grads((z * (w[:, None] * gy)).sum(), params)
    for a, b in zip(_grads((w * path).sum(), params), expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for f, s, p in zip(
        _grads((w * lp).sum(), params),
        _grads((w * score).sum(), params),
        _grads((w * path).sum(), params),
    ):
        torch.testing.assert_close(f, s + p, rtol=1e-10, atol=1e-12)
    for a, b in zip(_grads((w * lp).sum(), params), _grads((w * ref).sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _conditional(kind):
    if kind == "affine_autoregressive":
        return T.conditional_affine_autoregressive(3, 1, hidden_dims=[8])
    return T.conditional_affine_coupling(3, 1, hidden_dims=[8])


@pytest.mark.parametrize("kind", ["affine_autoregressive", "affine_coupling"])
def test_conditional_flow_keeps_the_upstream_path(kind, float64):
    """q(z2 | z1): the pathwise part's gradient equals log q(z2 | z1; stop(phi)) through the inverse."""
    torch.manual_seed(3)
    cflow = _conditional(kind)
    _perturb([cflow], std=0.3)
    a = torch.tensor([0.4], requires_grad=True)
    params = [a, *cflow.parameters()]
    z1 = dist.Normal(a, 1.0).rsample([4])  # (4, 1)
    base = dist.Normal(torch.zeros(4, 3), 1.0).to_event(1)
    q2 = dist.ConditionalTransformedDistribution(base, [cflow]).condition(z1)
    z2 = q2.rsample()
    q1 = dist.Normal(a, 1.0)
    parts = split_log_probs([(q1, z1, ()), (q2, z2, [z1])])
    frozen = copy.deepcopy(cflow)
    ref_path = dist.ConditionalTransformedDistribution(base, [frozen]).condition(z1)
    ref = ref_path.log_prob(z2.clone())  # not the cached tensor: the inverse runs
    w = torch.randn(4)
    torch.testing.assert_close(parts[1].pathwise, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(_grads((w * parts[1].pathwise).sum(), params), _grads((w * ref).sum(), params)):
        if r is None:
            assert g is None or g.abs().max() == 0
        else:
            torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)


def test_triangular_solve_counts_and_tolerance(float64):
    torch.manual_seed(4)
    t = T.affine_autoregressive(16, hidden_dims=[32])
    q = dist.TransformedDistribution(dist.Normal(torch.zeros(16), 1.0).to_event(1), [t])
    x = torch.randn(8, 16)
    with flows.record_solves() as recs:
        _, g = flows.flow_grad(q, x)
    (rec,) = recs
    assert rec.transform == "AffineAutoregressive" and rec.dim == 16
    assert 2 <= rec.iterations <= 17 and rec.residual <= 1e-12
    with flows.solve_settings(rtol=1e-4), flows.record_solves() as loose:
        _, g4 = flows.flow_grad(q, x)
    assert loose[0].iterations <= rec.iterations
    assert _rel(g4, g) < 1e-3
    _perturb([t], std=0.5)
    with flows.solve_settings(max_iter=2), pytest.raises(flows.FlowSolveError, match="residual"):
        flows.flow_grad(q, x)


def test_non_convergence_names_the_site():
    gm = GaussianModel(D=4)
    pyro.clear_param_store()
    guide = ag.AutoIAFNormal(gm.model, hidden_dim=[16])
    guide(gm.x)
    _perturb(guide.transform.parts if hasattr(guide.transform, "parts") else [guide.transform], 1.0)
    with flows.solve_settings(max_iter=2):
        with pytest.raises(ValueError, match="_AutoIAFNormal_latent.*\n.*residual"):
            TraceSTL_ELBO().loss_and_grads(gm.model, guide, gm.x)


def _planar_guide(gm, n=2):
    pyro.clear_param_store()
    guide = ag.AutoNormalizingFlow(gm.model, functools.partial(T.iterated, n, T.planar))
    guide(gm.x)
    return guide


@pytest.mark.parametrize(
    "elbo",
    [
        TraceSTL_ELBO(num_particles=3, vectorize_particles=True),
        TraceDReG_ELBO(num_particles=3),
    ],
    ids=["STL", "DReG"],
)
def test_inverse_free_flows_no_longer_warn_and_keep_the_loss(elbo):
    gm = GaussianModel(D=2)
    guide = _planar_guide(gm)
    ref = (
        PyroTrace_ELBO(num_particles=3, vectorize_particles=True)
        if isinstance(elbo, TraceSTL_ELBO)
        else RenyiELBO(alpha=0, num_particles=3, vectorize_particles=True)
    )
    pyro.set_rng_seed(5)
    expected = ref.loss(gm.model, guide, gm.x)
    pyro.set_rng_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = elbo.loss_and_grads(gm.model, guide, gm.x)
    assert loss == pytest.approx(expected, rel=1e-6)


def test_loss_value_is_the_ordinary_one_bitwise(float64):
    gm = GaussianModel(D=3)
    pyro.clear_param_store()
    guide = ag.AutoIAFNormal(gm.model, hidden_dim=[8], num_transforms=2)
    guide(gm.x)
    for seed in range(3):
        pyro.set_rng_seed(seed)
        a = PyroTrace_ELBO(num_particles=4, vectorize_particles=True).loss(gm.model, guide, gm.x)
        pyro.set_rng_seed(seed)
        b = TraceSTL_ELBO(num_particles=4, vectorize_particles=True).loss_and_grads(
            gm.model, guide, gm.x
        )
        assert a == b


class _Cube(Transform):
    """``y = x + x^3`` elementwise: no rule, no inverse."""

    domain = constraints.real_vector
    codomain = constraints.real_vector
    bijective = True

    def __init__(self, scale):
        super().__init__(cache_size=1)
        self.scale = scale

    def _call(self, x):
        return self.scale * (x + x**3)

    def log_abs_det_jacobian(self, x, y):
        return (self.scale.log() + torch.log1p(3 * x**2)).sum(-1)


def _cube_guide(gm):
    def guide(x=None):
        s = pyro.param("cube_scale", torch.tensor(0.5), constraint=constraints.positive)
        loc = pyro.param("cube_loc", torch.zeros(gm.D))
        base = dist.Normal(loc, 1.0).to_event(1)
        pyro.sample("z", dist.TransformedDistribution(base, [_Cube(s)]))

    return guide


def test_transform_without_rule_or_inverse_still_raises_with_dreg():
    gm = GaussianModel(D=2)
    pyro.clear_param_store()
    guide = _cube_guide(gm)
    assert flows.flow_rule(_Cube(torch.tensor(1.0))) is None
    with pytest.raises(SplitNotSupported, match="Guide site 'z'"):
        TraceDReG_ELBO(num_particles=3).loss_and_grads(gm.model, guide, gm.x)


def test_a_registered_user_rule_makes_it_split():
    gm = GaussianModel(D=2)
    pyro.clear_param_store()
    guide = _cube_guide(gm)

    def cube_rule(layer, g):
        s, x = layer.transform.scale.detach(), layer.x
        d = s * (1 + 3 * x**2)  # diagonal Jacobian
        return (g - 6 * x / (1 + 3 * x**2)) / d

    flows.register_flow_rule(_Cube)(cube_rule)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            TraceDReG_ELBO(num_particles=3).loss_and_grads(gm.model, guide, gm.x)
        q = dist.TransformedDistribution(
            dist.Normal(torch.zeros(2), 1.0).to_event(1), [_Cube(torch.tensor(0.7))]
        )
        x = torch.randn(3, 2)
        _, g = flows.flow_grad(q, x)
        assert _rel(g, _jacobian_reference(q.transforms[0], q.base_dist, x)) < 1e-5
    finally:
        flows._RULES.pop(_Cube)


def test_rules_table_lists_the_built_in_transforms():
    names = {row[0] for row in flows.RULES_TABLE}
    for n in (
        "AffineAutoregressive",
        "AffineCoupling",
        "SplineCoupling",
        "SplineAutoregressive",
        "ConditionedPlanar",
        "ConditionedRadial",
        "Sylvester",
        "ConditionedHouseholder",
        "Permute",
        "BlockAutoregressive",
        "NeuralAutoregressive",
    ):
        assert n in names
