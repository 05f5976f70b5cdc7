"""routing.gate: a real autograd input, exact leaf routing, non-leaf inputs, first order only."""

import pytest
import torch
from torch import nn

from pyro_gradroute import routing

from .reference import assert_rel_close, naive_grads


class _Square(torch.autograd.Function):
    """A custom Function (PyTorch calls it with materialized zeros when no gradient flows)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def _net():
    torch.manual_seed(0)
    A, B, C = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
    x = torch.randn(6, 4, dtype=torch.float64)
    return A.double(), B.double(), C.double(), x


def _params(*ms):
    return [p for m in ms for p in m.parameters()]


def test_term_is_a_real_input_of_the_gate():
    """The engine's dependency counting (not creation order) orders the gate first."""
    a = torch.tensor(2.0, requires_grad=True)
    b = torch.tensor(3.0, requires_grad=True)
    t = a * b
    g = routing.gate(t, [b])
    assert t.grad_fn in [n for n, _ in g.grad_fn.next_functions]


@pytest.mark.parametrize("custom", [False, True])
def test_shared_subgraph_retain_graph_false_equals_naive(custom):
    """A shared by a gated and an ungated term; B reached only by the gated one."""
    A, B, C, x = _net()

    def forward():
        h = torch.tanh(A(x))  # shared
        y = B(h)
        y = _Square.apply(y) if custom else y * y
        return {"ungated": C(h).pow(2).mean(), "gated": y.mean()}

    ps = _params(A, B, C)
    terms = forward()
    total = terms["ungated"] + routing.gate(terms["gated"], [B])
    total.backward()  # retain_graph=False: shared A nodes freed after the gate ran
    want = naive_grads(forward, ps, {"gated": _params(B)})
    for p in _params(A, C):
        assert_rel_close(p.grad, want[p], rtol=1e-12)
    for p in _params(B):  # blocked and reached by nothing else: no gradient at all
        assert p.grad is None


def test_blocked_leaf_shared_with_an_ungated_term_gets_exactly_its_gradient():
    a = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    (a.sin() * b + routing.gate((a * b).exp(), [b])).backward()
    assert b.grad == a.detach().sin()  # bitwise: no +x-x residue from the gated term
    assert a.grad == a.detach().cos() * 0.7 + 0.7 * (a * b).exp().detach()


def test_nested_gates():
    a, b, c = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (1.1, 0.3, 2.0))
    inner = routing.gate(a * b * c, [a])  # a blocked
    outer = routing.gate(inner + b * c, [b])  # b blocked too
    outer.backward()
    assert a.grad is None and b.grad is None
    assert c.grad == 1.1 * 0.3 + 0.3


@pytest.mark.parametrize("shared", [False, True])
def test_grad_wrt_intermediate_is_dL_dh(shared):
    a = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    h = a * b
    L = h.sin() * b
    total = routing.gate(L, [b]) + (h * 3 if shared else 0)
    (gh,) = torch.autograd.grad(total, h, allow_unused=True)
    assert gh == h.detach().cos() * 2.0 + (3 if shared else 0)


def test_grad_wrt_leaves_in_one_call():
    a = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    L = a**3 * b**2
    ga, gb = torch.autograd.grad(routing.gate(L, [b]) + a * b, [a, b])
    assert ga == 3 * 1.5**2 * 4 + 2 and gb == 1.5
    (ga,) = torch.autograd.grad(routing.gate(a**3 * b**2, [b]), [a])  # b not asked for
    assert ga == 3 * 1.5**2 * 4


def test_grad_wrt_intermediate_and_blocked_leaf_in_one_call_raises():
    a = torch.tensor(1.5, requires_grad=True)
    b = torch.tensor(2.0, requires_grad=True)
    h = a * 2
    with pytest.raises(RuntimeError, match="intermediate.*separate"):
        torch.autograd.grad(routing.gate(h.sin() * b, [b]), [h, b])


def test_backward_inputs_without_blocked_leaf():
    a = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    routing.gate(a**2 * b, [b]).backward(inputs=[a])
    assert a.grad == 2 * 1.5 * 2 and b.grad is None


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_second_derivatives_raise():
    """gate(a**3 b**2, [b]): the mixed partial must be 0; plain create_graph gives 27."""
    a = torch.tensor(1.5, requires_grad=True)
    b = torch.tensor(2.0, requires_grad=True)
    with pytest.raises(NotImplementedError, match="first-order only.*routing.grad"):
        torch.autograd.grad(routing.gate(a**3 * b**2, [b]), a, create_graph=True)
    with pytest.raises(NotImplementedError, match="first-order only"):
        routing.gate(a**3 * b**2, [b]).backward(create_graph=True)


def test_backward_and_grad_are_first_order():
    a = torch.tensor(1.5, requires_grad=True)
    b = torch.tensor(2.0, requires_grad=True)
    terms = {"l1": a**3 * b**2, "l2": a * b}
    ga, gb = routing.grad(terms, [a, b], block={"l1": [b]})
    assert not ga.requires_grad and not gb.requires_grad
    with pytest.raises(TypeError, match="create_graph"):
        routing.grad(terms, [a, b], block={"l1": [b]}, create_graph=True)
    with pytest.raises(TypeError, match="create_graph"):
        routing.backward(terms, block={"l1": [b]}, create_graph=True)


def test_grad_single_tensor_input():
    w = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, dtype=torch.float64, requires_grad=True)
    terms = {"l1": (w @ v).pow(2).sum(), "l2": (w @ v).sum()}
    want = torch.autograd.grad(terms["l1"] + terms["l2"], w, retain_graph=True)[0]
    got = routing.grad(terms, w, block={"l2": [v]})
    assert isinstance(got, tuple) and len(got) == 1
    assert_rel_close(got[0], want, rtol=1e-12)


@pytest.mark.parametrize("bad", ["w", {"w": 1}, 3, [torch.ones(1), "x"]])
def test_grad_bad_inputs(bad):
    w = torch.ones(2, requires_grad=True)
    with pytest.raises(TypeError, match="routing.grad: inputs"):
        routing.grad({"l": w.sum()}, bad)


def test_hooks_on_the_term_are_skipped_when_no_gradient_reaches_it():
    a = torch.tensor(1.5, requires_grad=True)
    b = torch.tensor(2.0, requires_grad=True)
    h = a * b
    L = h.sin() * b
    seen_L, seen_h = [], []
    L.register_hook(lambda g: seen_L.append(g))
    h.register_hook(lambda g: seen_h.append(g))
    (routing.gate(L, [b]) + a).backward()
    # the gate's own pass sees real gradients; the outer pass sends none into L's graph:
    # L's hook is skipped, PyTorch calls h's hook with None
    assert [g is None for g in seen_L] == [False]
    assert [g is None for g in seen_h] == [False, True]
    assert b.grad is None
