"""Gradient routing engine (plain PyTorch). Minimal version; see issue 3."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

import torch


def backward(
    terms: Mapping[Hashable, torch.Tensor],
    block: Mapping[Hashable, Iterable] | None = None,
    *,
    retain_graph: bool | None = None,
) -> None:
    """Accumulate into ``.grad`` the gradient of ``sum(terms)``, each term blocked from its params."""
    if block:
        raise NotImplementedError("routing with blocks is not implemented yet")
    total = sum(t for t in terms.values() if t.requires_grad)
    if torch.is_tensor(total):
        total.backward(retain_graph=retain_graph)
