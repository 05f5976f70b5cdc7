"""split_log_prob: one evaluation, three parts, each with the gradients of the two-evaluation reference."""

import copy

import pyro.distributions as dist
import pyro.distributions.transforms as T
import pytest
import torch
import torch.distributions as td
from torch.distributions import transforms as tT

from pyro_gradroute.distributions import SplitLogProb, split_log_prob
from pyro_gradroute.distributions.detached import delta_base


def _normal(p):
    return dist.Normal(p["loc"], p["scale"].exp())


def _gamma(p):
    return dist.Gamma(p["loc"].exp(), p["scale"].exp())


def _beta(p):
    return dist.Beta(p["loc"].exp(), p["scale"].exp())


def _dirichlet(p):
    return dist.Dirichlet(p["conc"].exp())


def _independent(p):
    return dist.Normal(p["loc"], p["scale"].exp()).to_event(1)


def _expand(p):
    return dist.Normal(p["loc"][0], p["scale"][0].exp()).expand([3, 4]).to_event(1)


def _mask(p):
    mask = torch.tensor([True, False, True, True])
    return dist.Normal(p["loc"], p["scale"].exp()).mask(mask)


def _mvn(p):
    return dist.MultivariateNormal(
        p["loc"], scale_tril=p["tril"].tril(-1) + torch.diag(p["scale"].exp())
    )


def _lowrank(p):
    return dist.LowRankMultivariateNormal(p["loc"], p["tril"][:, :2], p["scale"].exp())


def _transformed(p):
    base = dist.Normal(p["loc"], p["scale"].exp())
    return dist.TransformedDistribution(base, [tT.AffineTransform(0.5, 2.0), tT.ExpTransform()])


def _transformed_param_transform(p):
    base = dist.Normal(torch.zeros(4), 1.0).to_event(1)
    return dist.TransformedDistribution(
        base, [tT.AffineTransform(p["loc"], p["scale"].exp(), event_dim=1)]
    )


FAMILIES = {
    "normal": (_normal, {"loc": (4,), "scale": (4,)}),
    "gamma": (_gamma, {"loc": (4,), "scale": (4,)}),
    "beta": (_beta, {"loc": (4,), "scale": (4,)}),
    "dirichlet": (_dirichlet, {"conc": (3, 4)}),
    "independent": (_independent, {"loc": (3, 4), "scale": (3, 4)}),
    "expand": (_expand, {"loc": (4,), "scale": (4,)}),
    "mask": (_mask, {"loc": (4,), "scale": (4,)}),
    "mvn": (_mvn, {"loc": (4,), "scale": (4,), "tril": (4, 4)}),
    "lowrank_mvn": (_lowrank, {"loc": (4,), "scale": (4,), "tril": (4, 4)}),
    "transformed": (_transformed, {"loc": (4,), "scale": (4,)}),
    "transformed_param_transform": (_transformed_param_transform, {"loc": (4,), "scale": (4,)}),
}


# The same families as plain ``torch.distributions`` objects (no ``score_parts``: Pyro's
# default parts are used, ``(log_prob, 0, log_prob)`` for a reparameterized family).
def _td_normal(p):
    return td.Normal(p["loc"], p["scale"].exp())


def _td_gamma(p):
    return td.Gamma(p["loc"].exp(), p["scale"].exp())


def _td_beta(p):
    return td.Beta(p["loc"].exp(), p["scale"].exp())


def _td_dirichlet(p):
    return td.Dirichlet(p["conc"].exp())


def _td_independent(p):
    return td.Independent(td.Normal(p["loc"], p["scale"].exp()), 1)


def _td_mvn(p):
    return td.MultivariateNormal(
        p["loc"], scale_tril=p["tril"].tril(-1) + torch.diag(p["scale"].exp())
    )


def _td_lowrank(p):
    return td.LowRankMultivariateNormal(p["loc"], p["tril"][:, :2], p["scale"].exp())


def _td_transformed(p):
    base = td.Normal(p["loc"], p["scale"].exp())
    return td.TransformedDistribution(base, [tT.AffineTransform(0.5, 2.0), tT.ExpTransform()])


def _td_transformed_param_transform(p):
    base = td.Independent(td.Normal(torch.zeros(4), 1.0), 1)
    return td.TransformedDistribution(
        base, [tT.AffineTransform(p["loc"], p["scale"].exp(), event_dim=1)]
    )


FAMILIES.update(
    {
        "torch_normal": (_td_normal, FAMILIES["normal"][1]),
        "torch_gamma": (_td_gamma, FAMILIES["gamma"][1]),
        "torch_beta": (_td_beta, FAMILIES["beta"][1]),
        "torch_dirichlet": (_td_dirichlet, FAMILIES["dirichlet"][1]),
        "torch_independent": (_td_independent, FAMILIES["independent"][1]),
        "torch_mvn": (_td_mvn, FAMILIES["mvn"][1]),
        "torch_lowrank_mvn": (_td_lowrank, FAMILIES["lowrank_mvn"][1]),
        "torch_transformed": (_td_transformed, FAMILIES["transformed"][1]),
        "torch_transformed_param_transform": (
            _td_transformed_param_transform,
            FAMILIES["transformed_param_transform"][1],
        ),
    }
)


def _params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: (0.3 * torch.randn(s, generator=g)).requires_grad_() for k, s in shapes.items()}


def _grads(y, params):
    gs = torch.autograd.grad(y, list(params.values()), allow_unused=True, retain_graph=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(gs, params.values())]


def _assert_close(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_split_matches_two_evaluation_reference(name):
    make, shapes = FAMILIES[name]
    params = _params(shapes)
    torch.manual_seed(1)
    q = make(params)
    z = q.rsample([2])
    event_dim = len(q.event_shape)
    w = torch.randn(z.shape[: z.dim() - event_dim] if event_dim else z.shape)
    parts = split_log_prob(q, z)
    assert isinstance(parts, SplitLogProb)

    # two-evaluation references: stop the sample / stop the parameters
    ref_full = make(params).log_prob(z)
    ref_score = make(params).log_prob(z.detach())
    ref_path = make({k: v.detach() for k, v in params.items()}).log_prob(z)
    for part, ref in zip(parts, (ref_full, ref_score, ref_path)):
        torch.testing.assert_close(part, ref.expand_as(part), rtol=1e-5, atol=1e-5)
        _assert_close(_grads((w * part).sum(), params), _grads((w * ref).sum(), params))


@pytest.mark.parametrize("module", [dist, td], ids=["pyro", "torch"])
def test_flow_with_module_parameters(module):
    torch.manual_seed(0)
    flow = T.affine_autoregressive(3, hidden_dims=[8])
    torch.nn.init.normal_(flow.arn.layers[-1].weight, std=0.3)
    params = dict(flow.named_parameters())
    frozen = copy.deepcopy(flow)  # same values, separate (hence stopped) parameters

    def base():
        return module.Independent(module.Normal(torch.zeros(3), 1.0), 1)

    q = module.TransformedDistribution(base(), [flow])
    z = q.rsample([5])
    parts = split_log_prob(q, z)

    q_frozen = module.TransformedDistribution(base(), [frozen])
    ref_path = q_frozen.log_prob(z)
    ref_score = q.log_prob(z.detach().clone())
    ref_full = ref_score + ref_path - ref_path.detach()  # d/dphi = score part + pathwise part
    for part, ref in zip(parts, (ref_full, ref_score, ref_path)):
        torch.testing.assert_close(part, ref, rtol=1e-4, atol=1e-4)
        _assert_close(_grads(part.sum(), params), _grads(ref.sum(), params))
    # the cached (Pyro's usual) log_prob has the same total derivative as our log_prob
    _assert_close(_grads(parts.log_prob.sum(), params), _grads(q.log_prob(z).sum(), params))


def test_gradient_wrt_value_only_in_pathwise_and_log_prob():
    loc = torch.tensor([0.3, -1.0], requires_grad=True)
    q = dist.Normal(loc, 2.0)
    v = torch.tensor([1.0, 2.0], requires_grad=True)
    lp, score, path = split_log_prob(q, v)
    # the three parts share one graph: like any shared graph, retain it between backward calls
    assert torch.autograd.grad(score.sum(), v, allow_unused=True, retain_graph=True)[0] is None
    assert torch.autograd.grad(path.sum(), loc, allow_unused=True, retain_graph=True)[0] is None
    expected = -(v - loc).detach() / 4.0
    torch.testing.assert_close(torch.autograd.grad(path.sum(), v, retain_graph=True)[0], expected)
    torch.testing.assert_close(torch.autograd.grad(lp.sum(), v)[0], expected)


def test_value_broadcast_against_batch_shape():
    loc = torch.randn(5, 3, requires_grad=True)
    q = dist.Normal(loc, 1.0)
    v = torch.randn(3, requires_grad=True)
    w = torch.randn(5, 3)
    _, _, path = split_log_prob(q, v)
    ref = dist.Normal(loc.detach(), 1.0).log_prob(v)
    torch.testing.assert_close(
        torch.autograd.grad((w * path).sum(), v)[0], torch.autograd.grad((w * ref).sum(), v)[0]
    )


@pytest.mark.parametrize("name", ["normal", "mvn", "transformed", "dirichlet"])
def test_log_prob_is_evaluated_once(name, monkeypatch):
    make, shapes = FAMILIES[name]
    q = make(_params(shapes))
    z = q.rsample()
    calls = []
    original = type(q).log_prob

    def counting(self, value):
        calls.append(1)
        return original(self, value)

    monkeypatch.setattr(type(q), "log_prob", counting)
    parts = split_log_prob(q, z)
    (parts.log_prob.sum() + parts.score.sum() + parts.pathwise.sum()).backward()
    assert len(calls) == 1


def test_second_backward_and_retain_graph():
    loc = torch.tensor(0.2, requires_grad=True)
    q = dist.Normal(loc, 1.0)
    z = q.rsample([3])
    lp, _, path = split_log_prob(q, z)
    (lp.sum() + path.sum()).backward()  # both share one graph: no "backward twice" error
    assert loc.grad is not None


def test_no_grad_value_and_no_grad_mode():
    loc = torch.tensor(0.2, requires_grad=True)
    lp, score, path = split_log_prob(dist.Normal(loc, 1.0), torch.tensor(1.0))
    assert lp.requires_grad and score.requires_grad and not path.requires_grad
    with torch.no_grad():
        parts = split_log_prob(dist.Normal(loc, 1.0), torch.tensor(1.0, requires_grad=True))
    assert not any(p.requires_grad for p in parts)


def test_bad_input():
    with pytest.raises(TypeError, match="Distribution"):
        split_log_prob("normal", torch.tensor(0.0))
    with pytest.raises(TypeError, match="tensor"):
        split_log_prob(dist.Normal(0.0, 1.0), 0.5)
    with pytest.raises(TypeError, match=r"upstream\[0\] is a float, not a tensor"):
        split_log_prob(dist.Normal(0.0, 1.0), torch.tensor(0.5), upstream=[1.0])
    with pytest.raises(TypeError, match="upstream must be a sequence of tensors"):
        split_log_prob(dist.Normal(0.0, 1.0), torch.tensor(0.5), upstream=torch.ones(2))


def test_delta_base_unwraps():
    d = dist.Delta(torch.zeros(3), event_dim=1)
    assert delta_base(d) is d
    assert isinstance(delta_base(d.expand([2, 3]).mask(True)), dist.Delta)
    assert delta_base(dist.Delta(torch.zeros(3)).to_event(1)) is not None
    assert delta_base(dist.Normal(0.0, 1.0)) is None


def test_upstream_path_is_kept_in_pathwise():
    a = torch.tensor(0.4, requires_grad=True)
    c = torch.tensor(0.5, requires_grad=True)
    s2 = torch.tensor(0.7, requires_grad=True)
    z1 = a + torch.randn(3)  # an upstream sample depending on a
    q2 = dist.Normal(c * z1, s2)
    z2 = q2.rsample()
    other = torch.randn(3, requires_grad=True)  # not on q2's graph: ignored
    parts = split_log_prob(q2, z2, upstream=[z1, other])
    ref_path = dist.Normal(c.detach() * z1, s2.detach()).log_prob(z2)  # stop phi, keep z1 and z2
    ref_full = q2.log_prob(z2)
    params = {"a": a, "c": c, "s2": s2}
    _assert_close(_grads(parts.pathwise.sum(), params), _grads(ref_path.sum(), params))
    _assert_close(_grads(parts.log_prob.sum(), params), _grads(ref_full.sum(), params))
    # score keeps fn's whole graph (z1 included) with the sample stopped
    ref_score = dist.Normal(c * z1, s2).log_prob(z2.detach())
    _assert_close(_grads(parts.score.sum(), params), _grads(ref_score.sum(), params))


def test_batched_split_equals_one_at_a_time():
    from pyro_gradroute.distributions import split_log_probs

    a = torch.tensor(0.4, requires_grad=True)
    s = torch.tensor(0.8, requires_grad=True)
    q1 = dist.Normal(a, s)
    z1 = q1.rsample([3])
    q2 = dist.Normal(2 * z1, s)
    z2 = q2.rsample()
    q3 = dist.Gamma(s.exp(), 1.0)
    z3 = q3.rsample([2])
    items = [(q1, z1, []), (q2, z2, [z1]), (q3, z3, [z1, z2])]
    batched = split_log_probs(items)
    single = [split_log_prob(*it) for it in items]
    w = [torch.randn(3), torch.randn(3), torch.randn(2)]
    for part in range(3):
        yb = sum((wi * b[part]).sum() for wi, b in zip(w, batched))
        ys = sum((wi * o[part]).sum() for wi, o in zip(w, single))
        _assert_close(_grads(yb, {"a": a, "s": s}), _grads(ys, {"a": a, "s": s}))
    # mixed: log_prob of one site and pathwise of another, in one backward
    yb = (w[0] * batched[0].log_prob).sum() + (w[1] * batched[1].pathwise).sum()
    ys = (w[0] * single[0].log_prob).sum() + (w[1] * single[1].pathwise).sum()
    _assert_close(_grads(yb, {"a": a, "s": s}), _grads(ys, {"a": a, "s": s}))
    # both parts of a site with an upstream path, in one backward
    yb = (w[1] * batched[1].log_prob).sum() + (w[1] * batched[1].pathwise).sum()
    ys = (w[1] * single[1].log_prob).sum() + (w[1] * single[1].pathwise).sum()
    _assert_close(_grads(yb, {"a": a, "s": s}), _grads(ys, {"a": a, "s": s}))


def test_transform_without_inverse_is_a_clear_error():
    from pyro_gradroute.distributions import SplitNotSupported
    from tests.infer.test_stl import _NoRuleNoInverse

    s = torch.tensor(0.5, requires_grad=True)
    q = dist.TransformedDistribution(
        dist.Normal(torch.zeros(2), 1.0).to_event(1), [_NoRuleNoInverse(s)]
    )
    z = q.rsample()
    with pytest.raises(SplitNotSupported, match="without an inverse"):
        split_log_prob(q, z)


def test_dependent_upstream_refusal_names_the_way_out():
    from pyro_gradroute.distributions import split_log_probs

    loc = torch.tensor(0.3, requires_grad=True)
    z1 = dist.Normal(loc, 1.0).rsample()
    z2 = dist.Normal(z1, 1.0).rsample()
    q3 = dist.Normal(z1 + z2, 1.0)
    with pytest.raises(ValueError, match="depends on another one.*stick_the_landing"):
        split_log_probs([(q3, q3.rsample(), [z1, z2])])
