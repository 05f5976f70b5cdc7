"""routing.backward / grad / gate against the naive two-pass computation (plain PyTorch)."""

import pytest
import torch
from torch import nn

from pyro_gradroute import routing

from .reference import assert_rel_close, naive_grads


def mlp(n, w):
    return nn.Sequential(*[m for _ in range(n) for m in (nn.Linear(w, w), nn.Tanh())])


@pytest.fixture
def seed_net():
    torch.manual_seed(0)
    A, B, C = mlp(2, 6), mlp(2, 6), nn.Linear(6, 1)
    x = torch.randn(5, 6)

    def forward():
        h = A(x)
        y = B(h)
        return {"loss1": y.pow(2).mean(), "loss2": y.sin().mean(), "aux": C(h).pow(2).mean()}

    return A, B, C, forward


def params_of(*mods):
    return [p for m in mods for p in m.parameters()]


def routed_grads(forward, params, block, **kw):
    for p in params:
        p.grad = None
    routing.backward(forward(), block=block, **kw)
    return {p: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params}


def check_equal(forward, params, block, engine_block=None):
    got = routed_grads(forward, params, engine_block or block)
    want = naive_grads(forward, params, {k: list(v) for k, v in block.items()})
    for i, p in enumerate(params):
        assert_rel_close(got[p], want[p], what=f"param {i}")
    return got, want


@pytest.mark.parametrize(
    "block",
    [
        "seed",  # loss2 -> A only
        "aux_unreached",  # aux never reaches B: blocking B is a no-op
        "aux_blocked_A",  # aux blocked from A: only C trains on aux
        "two_groups",
    ],
)
@pytest.mark.parametrize("plan", ["auto", "by_terms", "by_params"])
def test_backward_equals_naive(seed_net, block, plan, monkeypatch):
    A, B, C, forward = seed_net
    blocks = {
        "seed": {"loss2": params_of(B)},
        "aux_unreached": {"aux": params_of(B)},
        "aux_blocked_A": {"aux": params_of(A)},
        "two_groups": {"loss2": params_of(B), "aux": params_of(A)},
    }[block]
    if plan != "auto":
        monkeypatch.setattr(routing, "_plan", lambda gs, g: routing._candidate_plans(gs)[plan])
    got, _ = check_equal(forward, params_of(A, B, C), blocks)
    if block == "seed":  # the route matters: unrouted gradients differ on B
        unrouted = routed_grads(forward, params_of(A, B, C), None)
        assert not torch.allclose(unrouted[B[0].weight], got[B[0].weight])


def test_module_and_mapping_entries_equal_tensor_entries(seed_net):
    A, B, C, forward = seed_net
    ps = params_of(A, B, C)
    by_module = routed_grads(forward, ps, {"loss2": [B]})
    by_mapping = routed_grads(forward, ps, {"loss2": dict(B.named_parameters())})
    for p in ps:
        assert torch.equal(by_module[p], by_mapping[p])


def test_seed_plan_is_by_params_and_pruned(seed_net, monkeypatch):
    A, B, C, forward = seed_net
    calls = []
    real = torch.autograd.backward
    monkeypatch.setattr(
        torch.autograd,
        "backward",
        lambda t, inputs=None, **kw: calls.append(inputs) or real(t, inputs=inputs, **kw),
    )
    routing.backward(forward(), block={"loss2": [B]})
    assert sorted(len(i) for i in calls) == [len(params_of(B)), len(params_of(A, C))]


def test_unreached_block_is_one_plain_pass(seed_net, monkeypatch):
    A, B, C, forward = seed_net
    calls = []
    real = torch.Tensor.backward
    monkeypatch.setattr(torch.Tensor, "backward", lambda t, **kw: calls.append(1) or real(t, **kw))
    routing.backward(forward(), block={"aux": [B]})
    assert calls == [1]


def test_no_block_does_not_walk_the_graph(seed_net, monkeypatch):
    A, B, C, forward = seed_net

    def boom(*a):
        raise AssertionError("graph walked without blocks")

    monkeypatch.setattr(routing, "_Graph", boom)
    routing.backward(forward())
    routing.backward(forward(), block={"loss2": []})
    assert A[0].weight.grad is not None


def test_retain_graph(seed_net):
    A, B, C, forward = seed_net
    terms = forward()
    routing.backward(terms, block={"loss2": [B]}, retain_graph=True)
    routing.backward(terms, block={"loss2": [B]})
    with pytest.raises(RuntimeError, match="second time"):
        routing.backward(terms, block={"loss2": [B]})


def test_grad_equals_naive_and_accumulates_nothing(seed_net):
    A, B, C, forward = seed_net
    ps = params_of(A, B, C)
    block = {"loss2": params_of(B), "aux": params_of(A)}
    gs = routing.grad(forward(), ps, block=block)
    assert all(p.grad is None for p in ps)
    want = naive_grads(forward, ps, block)
    for g, p in zip(gs, ps):
        assert_rel_close(g, want[p])


def test_grad_of_unreachable_input_is_zero(seed_net):
    A, B, C, forward = seed_net
    (g,) = routing.grad({"aux": forward()["aux"]}, [B[0].weight])
    assert torch.equal(g, torch.zeros_like(B[0].weight))


@pytest.mark.parametrize("retain", [None, True])
def test_gate_equals_naive(seed_net, retain):
    A, B, C, forward = seed_net
    ps = params_of(A, B, C)
    terms = forward()
    total = terms["loss1"] + routing.gate(terms["loss2"], [B]) + routing.gate(terms["aux"], [A])
    total.backward(retain_graph=retain)  # retain None: shared A nodes freed after the gates ran
    want = naive_grads(forward, ps, {"loss2": params_of(B), "aux": params_of(A)})
    for p in ps:
        assert_rel_close(p.grad, want[p])


def test_gate_passthrough_and_detach():
    a = torch.tensor(2.0, requires_grad=True)
    t = a * 3
    assert routing.gate(t, [torch.ones(1, requires_grad=True)]) is t
    (g,) = torch.autograd.grad(routing.gate(t, [a]), [t])  # fully blocked: still dL/dt
    assert g == 1.0 and a.grad is None
    c = torch.tensor(1.0)
    assert routing.gate(c, [a]) is c


def test_warns_when_param_never_trains(seed_net):
    A, B, C, forward = seed_net
    with pytest.warns(UserWarning, match=r"Linear\.weight.*never train"):
        routing.backward(forward(), block={"aux": [C]})


def test_blocking_unreached_param_is_silent(seed_net, recwarn):
    A, B, C, forward = seed_net
    routing.backward({"aux": forward()["aux"]}, block={"aux": [B]})
    routing.backward({"k": torch.tensor(1.0)}, block={"k": [B]})  # no gradient at all
    assert not [w for w in recwarn if "never" in str(w.message)]


def test_bad_block_entries(seed_net):
    A, B, C, forward = seed_net
    nonleaf = A[0].weight * 2
    with pytest.raises(TypeError, match="non-leaf"):
        routing.backward(forward(), block={"loss2": [nonleaf]})
    with pytest.raises(TypeError, match="nn.Module, leaf tensors"):
        routing.backward(forward(), block={"loss2": ["B"]})
    with pytest.raises(ValueError, match="scalar"):
        routing.backward({"v": A(torch.randn(2, 6))}, block={"v": [B]})


def test_terms_must_be_a_mapping(seed_net):
    A, B, C, forward = seed_net
    t = forward()
    with pytest.raises(TypeError, match="terms must be a mapping name -> scalar tensor.*list"):
        routing.backward([t["loss1"], t["loss2"]], block={1: [B]})
    with pytest.raises(TypeError, match="terms must be a mapping"):
        routing.grad([t["loss1"], t["loss2"]], [B[0].weight], block={1: [B]})
    with pytest.raises(TypeError, match="block must be a mapping term name"):
        routing.backward(t, block=[B])


def test_nan_term_warns(seed_net):
    A, B, C, forward = seed_net
    terms = forward()
    terms["loss2"] = terms["loss2"] * float("nan")
    with pytest.warns(UserWarning, match="'loss2' is NaN"):
        routing.backward(terms, block={"loss2": [B]})


def _chosen_plan(terms, block) -> str:
    terms = routing._terms(terms, block, strict=True)
    groups, graph, _ = routing._groups(terms, routing._resolve_block(terms, block))
    plan = routing._plan(groups, graph)
    return "by_terms" if any(inputs is None for _, inputs in plan) else "by_params"


def test_cost_estimate_picks_the_cheaper_plan():
    """Seed: by parameters. loss2 on its own branch C, blocked from A: by terms (C only)."""
    torch.manual_seed(0)
    A, B, C = mlp(3, 6), mlp(3, 6), mlp(3, 6)
    x = torch.randn(5, 6)

    def seed():
        y = B(A(x))
        return {"loss1": y.pow(2).mean(), "loss2": y.sin().mean()}

    def branch():
        h = A(x)
        return {"loss1": B(h).pow(2).mean(), "loss2": C(h).sin().mean()}

    assert _chosen_plan(seed(), {"loss2": [B]}) == "by_params"
    assert _chosen_plan(branch(), {"loss2": [A]}) == "by_terms"
    check_equal(branch, params_of(A, B, C), {"loss2": params_of(A)})


def test_block_key_naming_no_term_raises(seed_net):
    A, B, C, forward = seed_net
    with pytest.raises(KeyError, match=r"\['loss3'\].*'loss1', 'loss2', 'aux'"):
        routing.backward(forward(), block={"loss3": [B]})
    with pytest.raises(KeyError, match="loss3"):
        routing.grad(forward(), [B[0].weight], block={"loss3": [B]})
    routing.backward(forward(), block={"loss3": [B]}, strict=False)
