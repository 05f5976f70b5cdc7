"""block_grad: one Module (ModuleDict, Sequential) or one leaf tensor is one spec; a class is an error.

Reference: the naive two-pass computation of :class:`tests.poutine.models.Seed`
(``model(detach={"B"})`` recomputes the blocked term with B's parameters detached).
"""

import pyro
import pytest
import torch
from pyro import infer as pinfer

from pyro_gradroute.poutine import block_grad

from ..routing.reference import assert_rel_close
from .models import Seed


def _grads(model, guide):
    for p in pyro.get_param_store().values():
        p.unconstrained().grad = None  # the modules' parameters outlive the store
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    pinfer.Trace_ELBO().loss_and_grads(model, guide)
    return {n: p.grad.clone() for n, p in pyro.get_param_store().named_parameters()}


def _naive(s):
    return _grads(lambda: s.model(detach={"B"}), s.guide)


@pytest.mark.parametrize(
    "wrap", [lambda B: B, lambda B: torch.nn.ModuleDict({"b": B})], ids=["Sequential", "ModuleDict"]
)
def test_one_module_is_one_module(wrap):
    s = Seed()
    want = _naive(s)
    got = _grads(block_grad(s.model, sites=["loss2"], modules=wrap(s.B)), s.guide)
    assert set(got) == set(want)
    for n in want:
        assert_rel_close(got[n], want[n], what=n)


def test_one_leaf_tensor_is_one_param():
    s = Seed()
    leaf = s.B[0].weight  # 2-D: iterating it would give its rows
    one = _grads(block_grad(s.model, sites=["loss2"], params=leaf), s.guide)
    listed = _grads(block_grad(s.model, sites=["loss2"], params=[leaf]), s.guide)
    plain = _grads(s.model, s.guide)
    for n in listed:
        torch.testing.assert_close(one[n], listed[n], rtol=0, atol=0)
    assert not torch.allclose(one["B$$$0.weight"], plain["B$$$0.weight"])


class _Net(torch.nn.Module):
    pass


def test_module_class_is_a_clear_error():
    s = Seed()
    with pytest.raises(
        TypeError, match="modules= expects .* got the class _Net; pass the module instance"
    ):
        block_grad(s.model, sites=["loss2"], modules=_Net)
    with pytest.raises(TypeError, match="modules= expects .* got the class _Net"):
        block_grad(s.model, sites=["loss2"], modules=["B", _Net])
    with pytest.raises(TypeError, match="params= expects"):
        block_grad(s.model, sites=["loss2"], params=[3])
