"""Resolve a ``block_grad`` spec (module / param names, globs, predicates) to the param store's
unconstrained leaves (what the optimizer updates). ``pyro.module("decoder", net)`` registers
``"decoder$$$<param>"``; a ``PyroModule`` named ``decoder`` dotted names ``"decoder.<param>"``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .._compat import param_store_leaves

ParamSpec = str | Callable[[str], bool] | torch.Tensor
ModuleSpec = str | nn.Module


@dataclass(frozen=True, eq=False)
class BlockSpec:
    """What one ``block_grad`` handler blocks: its sites, from its modules and params."""

    sites: frozenset[str]
    modules: tuple[ModuleSpec, ...]
    params: tuple[ParamSpec, ...]


def _module_roots(names: Iterable[str]) -> list[str]:
    roots = {n.split("$$$")[0] if "$$$" in n else n.rsplit(".", 1)[0] for n in names}
    return sorted(r for r in roots if r)


def _no_match(kind: str, spec, store: dict) -> ValueError:
    avail = _module_roots(store) if kind == "module" else sorted(store)
    return ValueError(
        f"block_grad: {kind} {spec!r} matches no parameter in the param store. "
        f"Available {kind} names: {avail or '(param store is empty)'}. "
        + (
            "Use the name given to pyro.module(name, net) or the PyroModule's name, "
            "or pass the nn.Module object."
            if kind == "module"
            else "Use a param-store name, a glob such as 'decoder$$$*', or a predicate."
        )
    )


def _match_module(spec: ModuleSpec, store: dict) -> dict[str, torch.Tensor]:
    if isinstance(spec, nn.Module):
        by_id = {id(t): n for n, t in store.items()}
        out = {
            by_id.get(id(p), f"{type(spec).__name__}.{n}"): p for n, p in spec.named_parameters()
        }
    else:
        out = {
            n: t
            for n, t in store.items()
            if n.startswith(spec + "$$$") or n.startswith(spec + ".") or n == spec
        }
    if not out:
        raise _no_match("module", spec, store)
    return out


def _match_param(spec: ParamSpec, store: dict) -> dict[str, torch.Tensor]:
    if torch.is_tensor(spec):
        if not spec.is_leaf:
            raise ValueError(
                f"block_grad: params= got a non-leaf tensor of shape {tuple(spec.shape)} (the "
                "constrained value pyro.param returns?). Pass the param-store name instead; "
                f"available names: {sorted(store)}"
            )
        by_id = {id(t): n for n, t in store.items()}
        return {by_id.get(id(spec), f"tensor{tuple(spec.shape)}"): spec}
    if callable(spec):
        out = {n: t for n, t in store.items() if spec(n)}
    elif any(c in spec for c in "*?["):
        out = {n: t for n, t in store.items() if fnmatch.fnmatchcase(n, spec)}
    else:
        out = {spec: store[spec]} if spec in store else {}
    if not out:
        raise _no_match("param", spec, store)
    return out


def resolve(specs: Iterable[BlockSpec]) -> dict[str, torch.Tensor]:
    """Param-store name -> unconstrained leaf tensor, for the union of ``specs``.

    :raises ValueError: naming a module/param spec that matches nothing and listing
        the available names.

    Example::

        >>> import pyro, torch
        >>> pyro.clear_param_store()
        >>> _ = pyro.module("decoder", torch.nn.Linear(2, 1))
        >>> sorted(resolve([BlockSpec(frozenset({"x"}), ("decoder",), ())]))
        ['decoder$$$bias', 'decoder$$$weight']
    """
    store = param_store_leaves()
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        for m in spec.modules:
            out.update(_match_module(m, store))
        for p in spec.params:
            out.update(_match_param(p, store))
    return out
