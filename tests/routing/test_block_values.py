"""A block value may be a bare tensor or module, not only a list: it is tested for being
given, never for truth (a scalar parameter equal to 0 is still blocked; a matrix does not
raise "Boolean value of Tensor ... ambiguous"). Reference: one autograd call per term."""

import pytest
import torch
from torch import nn

from pyro_gradroute import routing

from .reference import assert_rel_close, naive_grads


def _scalar_case():
    a = torch.tensor(2.0, requires_grad=True)
    b = torch.tensor(0.0, requires_grad=True)

    def forward():
        y = a * b + a
        return {"l1": y, "l2": 10 * y}

    return a, b, forward


def test_backward_blocks_a_bare_scalar_equal_to_zero():
    a, b, forward = _scalar_case()
    ref = naive_grads(forward, [a, b], {"l2": [b]})
    routing.backward(forward(), block={"l2": b})
    assert b.grad.item() == pytest.approx(ref[b].item())  # 2, not 22
    assert a.grad.item() == pytest.approx(ref[a].item())


def test_grad_blocks_a_bare_scalar_equal_to_zero():
    a, b, forward = _scalar_case()
    ref = naive_grads(forward, [a, b], {"l2": [b]})
    ga, gb = routing.grad(forward(), [a, b], block={"l2": b})
    assert gb.item() == pytest.approx(ref[b].item())
    assert ga.item() == pytest.approx(ref[a].item())


@pytest.mark.parametrize("api", ["backward", "grad"])
def test_a_bare_matrix_and_a_bare_module_are_blocked(api):
    torch.manual_seed(0)
    A, B = nn.Linear(3, 3), nn.Linear(3, 1)
    x = torch.randn(5, 3)
    W = torch.randn(3, 3, requires_grad=True)

    def forward():
        y = B(A(x) @ W)
        return {"l1": y.pow(2).mean(), "l2": y.mean(), "l3": (A(x) @ W).sin().sum()}

    params = [*A.parameters(), *B.parameters(), W]
    ref = naive_grads(forward, params, {"l2": list(B.parameters()), "l3": [W]})
    block = {"l2": B, "l3": W}
    if api == "backward":
        routing.backward(forward(), block=block)
        got = [p.grad for p in params]
    else:
        got = routing.grad(forward(), params, block=block)
    for p, g in zip(params, got):
        assert_rel_close(g, ref[p], what=f"param {tuple(p.shape)}")


def test_none_and_empty_block_values_block_nothing():
    a, b, forward = _scalar_case()
    ref = naive_grads(forward, [a, b], {})
    routing.backward(forward(), block={"l1": None, "l2": []})
    assert (a.grad.item(), b.grad.item()) == pytest.approx((ref[a].item(), ref[b].item()))


@pytest.mark.parametrize("bad", [3, "b", 2.5])
def test_gate_names_the_argument_for_a_value_that_is_no_block(bad):
    a = torch.tensor(2.0, requires_grad=True)
    with pytest.raises(TypeError, match=r"routing\.gate: blocked must be"):
        routing.gate(a * 3, bad)


@pytest.mark.parametrize("api", ["backward", "grad"])
def test_backward_and_grad_name_the_block_key_for_a_value_that_is_no_block(api):
    a, b, forward = _scalar_case()
    with pytest.raises(TypeError, match=r"block\['l2'\] must be"):
        if api == "backward":
            routing.backward(forward(), block={"l2": 3})
        else:
            routing.grad(forward(), [a, b], block={"l2": 3})


def test_gate_blocks_a_bare_scalar_equal_to_zero():
    a, b, forward = _scalar_case()
    ref = naive_grads(forward, [a, b], {"l2": [b]})
    t = forward()
    (t["l1"] + routing.gate(t["l2"], b)).backward()
    assert (a.grad.item(), b.grad.item()) == pytest.approx((ref[a].item(), ref[b].item()))
