r"""Gradient routing engine (plain PyTorch): named loss terms, each kept from chosen parameters.

Given scalar terms :math:`L_1, \dots, L_n` and, for each, a set :math:`B_i` of blocked
parameters, the routed gradient of a parameter :math:`\theta` is

.. math::

    g(\theta) = \sum_{i \,:\, \theta \notin B_i} \frac{\partial L_i}{\partial \theta},

exactly what the naive computation gives (one forward per term, each blocked term
differentiated with its blocked parameters detached), but from **one** forward pass.

How the passes are planned (only when some block is *effective*, i.e. a term reaches
a parameter it is blocked from; otherwise one plain ``backward`` with no overhead):

* the autograd graph of the terms is walked once (``grad_fn.next_functions``; leaves
  are ``AccumulateGrad`` nodes) to find which parameters each term reaches;
* plan **by parameters**: parameters are grouped by the set of terms allowed to reach
  them, one ``backward(inputs=group)`` per distinct set (for ``y = B(A(x))`` with
  ``loss2`` blocked from ``B``: ``loss1 + loss2`` w.r.t. ``A``, then ``loss1`` w.r.t.
  ``B``, the second pass pruned at ``B``'s input);
* plan **by terms**: the unblocked terms in one plain pass, each blocked group in a
  pass with ``inputs`` = its reachable parameters minus its blocked ones;
* the plan whose passes traverse fewer autograd nodes is run (a pass traverses the
  nodes lying on a path from its roots to its inputs).

Public API: :func:`backward` (accumulate into ``.grad``), :func:`grad` (return
gradients) and :func:`gate` (a tensor equal to a term whose backward skips chosen
parameters, for code that must hand a single loss tensor to someone else).
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Iterable, Mapping, Sequence

import torch
from torch import nn

__all__ = ["backward", "grad", "gate", "reachable_leaves"]

BlockEntry = nn.Module | torch.Tensor | Mapping[str, torch.Tensor]
Block = Mapping[Hashable, Iterable[BlockEntry] | Mapping[str, torch.Tensor]]


# ----------------------------------------------------------------------------- resolution
def _resolve(entries, key) -> dict[torch.Tensor, str]:
    """Blocked leaf tensors (hashed by identity) -> a readable name."""
    if isinstance(entries, (nn.Module, torch.Tensor)):
        entries = [entries]
    out: dict[torch.Tensor, str] = {}
    items = entries.items() if isinstance(entries, Mapping) else ((None, e) for e in entries)
    for name, entry in items:
        if isinstance(entry, nn.Module):
            prefix = type(entry).__name__
            for pname, p in entry.named_parameters():
                out.setdefault(p, f"{prefix}.{pname}")
        elif isinstance(entry, Mapping):
            out.update({t: n for n, t in entry.items() if t not in out})
        elif torch.is_tensor(entry):
            if not entry.is_leaf:
                raise TypeError(
                    f"block[{key!r}] holds a non-leaf tensor (shape {tuple(entry.shape)}); "
                    "block parameters (leaf tensors) or nn.Modules, not intermediate values."
                )
            out.setdefault(entry, name or f"tensor{tuple(entry.shape)}")
        else:
            raise TypeError(
                f"block[{key!r}] entries must be nn.Module, leaf tensors or a mapping "
                f"name -> tensor; got {type(entry).__name__}"
            )
    return out


def _check_keys(terms: Mapping, block: Block | None, strict: bool) -> None:
    unknown = [k for k in (block or {}) if k not in terms]
    if strict and unknown:
        raise KeyError(
            f"block names no term: {unknown}; the terms are {list(terms)}. Fix the key, or "
            "pass strict=False if blocks for absent terms are expected."
        )


def _differentiable(terms: Mapping[Hashable, torch.Tensor]) -> dict[Hashable, torch.Tensor]:
    out = {}
    for k, t in terms.items():
        if not torch.is_tensor(t):
            continue
        if t.numel() != 1:
            raise ValueError(f"term {k!r} must be a scalar, got shape {tuple(t.shape)}")
        if t.requires_grad:
            out[k] = t
    return out


# ----------------------------------------------------------------------------- graph walk
class _Graph:
    """The autograd graph below some tensors: children of each node, leaf tensor of each leaf."""

    def __init__(self, tensors: Iterable[torch.Tensor]):
        self.children: dict = {}
        self.leaf: dict = {}
        stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
        roots = [t for t in tensors if t.grad_fn is None and t.requires_grad]
        for t in roots:  # a term that *is* a leaf
            self.leaf[t] = t
            self.children[t] = ()
        while stack:
            node = stack.pop()
            if node in self.children:
                continue
            kids = tuple(n for n, _ in node.next_functions if n is not None)
            self.children[node] = kids
            var = getattr(node, "variable", None)
            if var is not None:
                self.leaf[node] = var
            stack.extend(k for k in kids if k not in self.children)

    @staticmethod
    def root(t: torch.Tensor):
        return t.grad_fn if t.grad_fn is not None else t

    def reach(self, tensors: Iterable[torch.Tensor]) -> set:
        seen: set = set()
        stack = [self.root(t) for t in tensors]
        while stack:
            node = stack.pop()
            if node not in seen:
                seen.add(node)
                stack.extend(self.children[node])
        return seen

    def leaves(self, nodes: set) -> dict[torch.Tensor, object]:
        return {self.leaf[n]: n for n in nodes if n in self.leaf}

    def coreach(self, leaf_nodes: Iterable) -> set:
        """Nodes from which some node of ``leaf_nodes`` can be reached."""
        if not hasattr(self, "_parents"):
            self._parents: dict = {}
            for n, kids in self.children.items():
                for k in kids:
                    self._parents.setdefault(k, []).append(n)
        seen: set = set()
        stack = list(leaf_nodes)
        while stack:
            node = stack.pop()
            if node not in seen:
                seen.add(node)
                stack.extend(self._parents.get(node, ()))
        return seen


def reachable_leaves(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors (requiring grad) that ``tensor``'s backward would accumulate into.

    Example::

        >>> w = torch.ones(2, requires_grad=True)
        >>> reachable_leaves((w * 3).sum())[0] is w
        True
    """
    g = _Graph([tensor])
    return list(g.leaves(set(g.children)))


# ----------------------------------------------------------------------------- planning
class _Group:
    """Terms sharing one effective block set."""

    def __init__(self, tensors: list[torch.Tensor], blocked: frozenset, graph: _Graph):
        self.tensors = tensors
        self.nodes = graph.reach(tensors)
        self.leaves = graph.leaves(self.nodes)
        self.blocked = frozenset(p for p in blocked if p in self.leaves)


def _candidate_plans(groups: list[_Group]) -> dict[str, list[tuple[list[_Group], list | None]]]:
    """The two plans, each a list of passes (groups summed, inputs or None = all leaves)."""
    by_params: dict[frozenset, list] = {}
    for p in set().union(*(g.leaves for g in groups)):
        allowed = frozenset(i for i, g in enumerate(groups) if p in g.leaves and p not in g.blocked)
        if allowed:
            by_params.setdefault(allowed, []).append(p)
    by_terms: list = []
    for g in groups:
        if not g.blocked:
            by_terms.append(([g], None))
        elif len(g.leaves) > len(g.blocked):
            by_terms.append(([g], [p for p in g.leaves if p not in g.blocked]))
    return {
        "by_terms": by_terms,
        "by_params": [([groups[i] for i in sorted(s)], ps) for s, ps in by_params.items()],
    }


def _pass_cost(gs: list[_Group], inputs: list | None, graph: _Graph) -> int:
    """Autograd nodes a pass traverses: those on a path from its roots to its inputs."""
    nodes = set().union(*(g.nodes for g in gs))
    if inputs is not None:
        wanted = set(inputs)
        nodes &= graph.coreach(n for g in gs for p, n in g.leaves.items() if p in wanted)
    return len(nodes)


def _plan(groups: list[_Group], graph: _Graph) -> list[tuple[list[_Group], list | None]]:
    """The candidate plan whose passes traverse the fewest nodes (ties: fewer passes).

    Passes run cheapest first: all but the last retain the graph, and the last (the
    largest) frees saved tensors as it goes, as a plain backward does.
    """
    plans = []
    for plan in _candidate_plans(groups).values():
        costs = [_pass_cost(gs, inputs, graph) for gs, inputs in plan]
        order = sorted(range(len(plan)), key=costs.__getitem__)
        plans.append((sum(costs), len(plan), [plan[i] for i in order]))
    return min(plans, key=lambda c: c[:2])[2]


def _warn_never_trained(groups: list[_Group], names: dict[torch.Tensor, str]) -> None:
    never = [
        names.get(p, f"tensor{tuple(p.shape)}")
        for p in set().union(*(g.blocked for g in groups))
        if all(p in g.blocked for g in groups if p in g.leaves)
    ]
    if never:
        warnings.warn(
            f"parameter(s) {sorted(never)} are blocked from every term that reaches them, so "
            "they will never receive a gradient (never train). Unblock them from at least one "
            "term, or drop them from the optimizer.",
            stacklevel=3,
        )


def _groups(terms, block) -> tuple[list[_Group], _Graph, dict]:
    """Group differentiable terms by effective blocked set (walks the graph once)."""
    names: dict[torch.Tensor, str] = {}
    by_block: dict[frozenset, list] = {}
    for k, t in terms.items():
        resolved = _resolve(block[k], k) if block.get(k) else {}
        names.update(resolved)
        by_block.setdefault(frozenset(resolved), []).append(t)
    for k, t in terms.items():
        if bool(torch.isnan(t.detach()).any()):
            warnings.warn(f"routing: term {k!r} is NaN", stacklevel=3)
    graph = _Graph(terms.values())
    raw = [_Group(ts, b, graph) for b, ts in by_block.items()]
    merged: dict[frozenset, list] = {}
    for g in raw:
        merged.setdefault(g.blocked, []).append(g)
    groups = []
    for b, gs in merged.items():
        if len(gs) == 1:
            groups.append(gs[0])
        else:
            groups.append(_Group([t for g in gs for t in g.tensors], b, graph))
    return groups, graph, names


def _total(groups: Sequence[_Group]) -> torch.Tensor:
    tensors = [t for g in groups for t in g.tensors]
    return sum(tensors[1:], tensors[0])


# ----------------------------------------------------------------------------- public API
def backward(
    terms: Mapping[Hashable, torch.Tensor],
    block: Block | None = None,
    *,
    retain_graph: bool | None = None,
    strict: bool = True,
) -> None:
    r"""Accumulate into ``.grad`` the routed gradient of ``sum(terms.values())``.

    .. math::

        \theta.\text{grad} \mathrel{+}= \sum_{k \,:\, \theta \notin \text{block}[k]}
        \partial\, \text{terms}[k] / \partial \theta

    Equal (up to float summation order) to the naive two-pass computation, from the
    one forward pass that built ``terms``; see the module docstring for the plan.

    Example (the seed: ``loss1`` trains ``A`` and ``B``, ``loss2`` trains ``A`` only)::

        >>> import torch
        >>> from torch import nn
        >>> from pyro_gradroute import routing
        >>> A, B = nn.Linear(3, 3), nn.Linear(3, 1)
        >>> y = B(A(torch.randn(5, 3)))
        >>> routing.backward({"loss1": y.pow(2).mean(), "loss2": y.mean()}, block={"loss2": [B]})

    :param terms: named scalar loss terms (non-differentiable ones are skipped).
    :param block: term name -> what that term must not send gradient to: an iterable of
        ``nn.Module``\ s and/or leaf tensors, or a mapping ``name -> tensor`` (names
        are used in messages). Blocking a parameter a term does not reach is a no-op.
    :param retain_graph: as in :meth:`torch.Tensor.backward` (for the last pass).
    :param strict: raise ``KeyError`` for a ``block`` key that names no term (a typo would
        silently drop the route). The ELBOs pass ``False``: their blocks name every marked
        site, also those whose log-density has no gradient (and hence no term).
    :warns UserWarning: if a parameter is blocked from every term that reaches it.
    """
    _check_keys(terms, block, strict)
    terms = _differentiable(terms)
    if not terms:
        return
    if not block or not any(block.get(k) for k in terms):
        sum(terms.values()).backward(retain_graph=retain_graph)
        return
    groups, graph, names = _groups(terms, block)
    if not any(g.blocked for g in groups):
        _total(groups).backward(retain_graph=retain_graph)
        return
    _warn_never_trained(groups, names)
    plan = _plan(groups, graph)
    for i, (gs, inputs) in enumerate(plan):
        last = i == len(plan) - 1
        torch.autograd.backward(
            _total(gs), inputs=inputs, retain_graph=retain_graph if last else True
        )


def grad(
    terms: Mapping[Hashable, torch.Tensor],
    inputs: Sequence[torch.Tensor],
    block: Block | None = None,
    *,
    retain_graph: bool | None = None,
    strict: bool = True,
) -> tuple[torch.Tensor, ...]:
    r"""Routed gradients of ``sum(terms.values())`` w.r.t. ``inputs`` (nothing accumulated).

    ``result[j] = sum over terms k with inputs[j] not blocked for k of d terms[k] / d inputs[j]``;
    zeros where no allowed term reaches ``inputs[j]``. One ``torch.autograd.grad`` call per
    distinct set of allowed terms among ``inputs``.

    Example::

        >>> import torch
        >>> from pyro_gradroute import routing
        >>> a = torch.tensor(2.0, requires_grad=True)
        >>> b = torch.tensor(3.0, requires_grad=True)
        >>> y = a * b
        >>> routing.grad({"l1": y, "l2": 10 * y}, [a, b], block={"l2": [b]})
        (tensor(33.), tensor(2.))
    """
    inputs = list(inputs)
    _check_keys(terms, block, strict)
    terms = _differentiable(terms)
    resolved = {k: set(_resolve(block[k], k)) if block and block.get(k) else set() for k in terms}
    by_allowed: dict[tuple, list[int]] = {}
    for j, x in enumerate(inputs):
        allowed = tuple(k for k in terms if x not in resolved[k])
        by_allowed.setdefault(allowed, []).append(j)
    out: list = [None] * len(inputs)
    passes = [(a, js) for a, js in by_allowed.items() if a]
    for i, (allowed, js) in enumerate(passes):
        last = i == len(passes) - 1
        total = sum(terms[k] for k in allowed)
        gs = torch.autograd.grad(
            total,
            [inputs[j] for j in js],
            retain_graph=retain_graph if last else True,
            allow_unused=True,
        )
        for j, g in zip(js, gs):
            out[j] = g
    return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(inputs, out))


class _Gate(torch.autograd.Function):
    """Identity in value; backward sends ``grad_out * d term / d leaf`` to the allowed leaves only.

    The term (with its graph) travels in a tuple so autograd does not see it as an input:
    the gate's only graph edges go to the allowed leaves. On the CPU engine nodes run in
    decreasing creation order, so this node (created after the term's graph) runs before
    any shared upstream node frees its saved tensors.
    """

    @staticmethod
    def forward(ctx, value, graph, *leaves):  # type: ignore[override]
        ctx.term = graph[0]
        ctx.leaves = leaves
        return value.clone()

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        grads = torch.autograd.grad(
            ctx.term,
            ctx.leaves,
            grad_out,
            retain_graph=True,
            create_graph=torch.is_grad_enabled(),  # on under create_graph=True: higher orders
            allow_unused=True,
        )
        return (None, None, *grads)


def gate(
    term: torch.Tensor, blocked: Iterable[BlockEntry] | Mapping[str, torch.Tensor]
) -> torch.Tensor:
    r"""A tensor equal to ``term`` whose gradient reaches every leaf except ``blocked``.

    .. math::

        \frac{\partial\, \text{gate}(L)}{\partial \theta} =
        \begin{cases} \partial L / \partial \theta & \theta \notin \text{blocked} \\
        0 & \theta \in \text{blocked} \end{cases}

    Slower than :func:`backward` (the term's graph is traversed once more inside the
    gate's backward), but it is a single tensor: use it when a loss must be handed to
    code that calls ``.backward()`` itself. Works with ``retain_graph=False``.

    Example::

        >>> import torch
        >>> a = torch.tensor(2.0, requires_grad=True)
        >>> b = torch.tensor(3.0, requires_grad=True)
        >>> (a * b + gate(10 * a * b, [b])).backward()
        >>> a.grad, b.grad
        (tensor(33.), tensor(2.))
    """
    if not (torch.is_tensor(term) and term.requires_grad):
        return term
    blocked_set = set(_resolve(blocked, "gate"))
    leaves = reachable_leaves(term)
    allowed = [p for p in leaves if p not in blocked_set]
    if len(allowed) == len(leaves):
        return term
    if not allowed:
        return term.detach()
    return _Gate.apply(term.detach(), (term,), *allowed)
