"""The bounded walk that decides a plain guide site without routing's walkers agrees with them."""

import pytest
import torch

from pyro_gradroute.distributions.detached import short_walk
from pyro_gradroute.routing import reached_nodes, reaches_leaf_directly


def _graphs():
    phi = torch.tensor(0.5, requires_grad=True)
    psi = torch.tensor(-0.3, requires_grad=True)
    z0 = phi * 2.0 + torch.randn(())  # an earlier sample
    z1 = z0.exp() + psi
    deep = phi
    for _ in range(40):  # past the walk's limit: it must defer (None)
        deep = deep * 1.01
    return {z0.grad_fn: 0, z1.grad_fn: 1}, {
        "leaf param": phi,
        "softplus of a leaf": torch.nn.functional.softplus(psi),
        "reads z0 only": -z0 + 0.0,
        "reads z1 and a leaf": 3.0 * z1 + phi,
        "a sample itself, times 2": 2.0 * z1,
        "deep": deep,
    }


@pytest.mark.parametrize("case", list(_graphs()[1]))
def test_short_walk_agrees_with_the_full_walkers(case):
    nodes, graphs = _graphs()
    t = graphs[case]
    walk = short_walk([t.grad_fn], nodes) if t.grad_fn is not None else (set(), t.requires_grad)
    if case == "deep":
        assert walk is None
        return
    assert walk == (set(reached_nodes([t], nodes)), reaches_leaf_directly(t, stop_nodes=nodes))
