"""The naive reference: one forward per term, each term differentiated w.r.t. its allowed params."""

from __future__ import annotations

import torch


def naive_grads(forward, params, block):
    """``forward() -> {name: scalar}``; returns {param: grad} summed over terms, two-pass style.

    Every term gets its own fresh forward pass, and its gradient is taken only with respect
    to the parameters it is not blocked from.
    """
    out = {p: torch.zeros_like(p) for p in params}
    names = list(forward())
    for name in names:
        term = forward()[name]
        blocked = {id(p) for p in block.get(name, ())}
        allowed = [p for p in params if id(p) not in blocked]
        grads = torch.autograd.grad(term, allowed, allow_unused=True)
        for p, g in zip(allowed, grads):
            if g is not None:
                out[p] += g
    return out


def assert_rel_close(actual, expected, rtol=1e-5, what=""):
    """``|actual - expected| <= rtol * |expected|`` in norm (plus a tiny floor for zeros)."""
    err = (actual - expected).norm().item()
    scale = expected.norm().item()
    assert err <= rtol * scale + 1e-9, f"{what}: relative error {err / max(scale, 1e-30):.2e}"
