r"""Gradient routing engine (plain PyTorch): named loss terms, each kept from chosen parameters.

:func:`backward` and :func:`grad` give what the naive computation gives (one forward per term,
its blocked parameters detached) from **one** forward pass. Only when a term reaches a parameter
it is blocked from is the autograd graph walked, once, and the cheaper of two plans of pruned
``backward(inputs=...)`` passes run (:func:`_candidate_plans`); otherwise it is one plain
``backward``. :func:`gate` is a tensor equal to a term whose backward skips chosen parameters.
All three are first order (``gate`` raises under ``create_graph=True``): second derivatives
that hold the blocked parameters constant need a forward pass in which they are detached.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ._compat import AccumulateGrad, tensor_backward_hooks, vjp, will_engine_execute

__all__ = ["backward", "grad", "gate", "reachable_leaves", "taps"]

BlockEntry = nn.Module | torch.Tensor | Mapping[str, torch.Tensor]
Block = Mapping[Hashable, BlockEntry | Iterable[BlockEntry] | None]


# ----------------------------------------------------------------------------- resolution
def _resolve(entries, what: str) -> dict[torch.Tensor, str]:
    """Blocked leaf tensors (hashed by identity) -> a readable name; ``entries`` is a
    ``block`` value (see :func:`backward`), ``what`` names it in errors."""
    if entries is None:
        return {}
    if isinstance(entries, (nn.Module, torch.Tensor)):
        entries = [entries]
    elif isinstance(entries, (str, bytes)) or not isinstance(entries, Iterable):
        raise TypeError(
            f"{what} must be an nn.Module, a leaf tensor, a mapping name -> tensor or an "
            f"iterable of those; got {type(entries).__name__} {entries!r}"
        )
    out: dict[torch.Tensor, str] = {}
    items = entries.items() if isinstance(entries, Mapping) else ((None, e) for e in entries)
    for name, entry in items:
        if isinstance(entry, nn.Module):
            prefix = type(entry).__name__
            for pname, p in entry.named_parameters():
                out.setdefault(p, f"{prefix}.{pname}")
        elif isinstance(entry, Mapping):
            for n, t in _resolve(entry, what).items():
                out.setdefault(t, n)
        elif torch.is_tensor(entry):
            if not entry.is_leaf:
                raise TypeError(
                    f"{what} holds a non-leaf tensor (shape {tuple(entry.shape)}); "
                    "block parameters (leaf tensors) or nn.Modules, not intermediate values."
                )
            out.setdefault(entry, name or f"tensor{tuple(entry.shape)}")
        else:
            raise TypeError(
                f"{what} entries must be nn.Module, leaf tensors or a mapping "
                f"name -> tensor; got {type(entry).__name__}"
            )
    return out


def _resolve_block(terms: Mapping, block: Block | None) -> dict[Hashable, dict]:
    """Term name -> {blocked leaf: name}, for the ``terms`` that block something (tested by
    the resolved set's emptiness, never for truth: ``block={"l2": b}`` blocks the tensor b)."""
    resolved = {k: _resolve(block[k], f"block[{k!r}]") for k in terms if k in (block or {})}
    return {k: r for k, r in resolved.items() if r}


def _terms(terms: Mapping, block: Block | None, strict: bool) -> dict[Hashable, torch.Tensor]:
    """The differentiable ``terms`` (scalars), once ``terms`` and ``block`` are checked."""
    if not isinstance(terms, Mapping):
        raise TypeError(
            "terms must be a mapping name -> scalar tensor (e.g. {'recon': l1, 'kl': l2}), "
            f"got a {type(terms).__name__}; block's keys name those terms"
        )
    if block is not None and not isinstance(block, Mapping):
        raise TypeError(
            "block must be a mapping term name -> parameters it must not reach, got a "
            f"{type(block).__name__}"
        )
    unknown = [k for k in (block or {}) if k not in terms]
    if strict and unknown:
        raise KeyError(
            f"block names no term: {unknown}; the terms are {list(terms)}. Fix the key, or "
            "pass strict=False if blocks for absent terms are expected."
        )
    out = {}
    for k, t in terms.items():
        if not torch.is_tensor(t):
            continue
        if t.numel() != 1:
            raise ValueError(f"term {k!r} must be a scalar, got shape {tuple(t.shape)}")
        if t.requires_grad:
            out[k] = t
    return out


# ----------------------------------------------------------------------------- graph walks
def _next(node) -> list:
    """The autograd nodes below ``node`` (a leaf's is its ``AccumulateGrad`` node)."""
    return [f for f, _ in node.next_functions if f is not None]


def _roots(tensors: Iterable[torch.Tensor]) -> list:
    return [t.grad_fn for t in tensors if t.grad_fn is not None]


def _walk(roots: Iterable, children=_next, stop=()) -> Iterator:
    """Every node reachable from ``roots`` through ``children``, once, depth-first, never
    entering a ``stop`` node (unless it is a root); ``children(node)`` runs after the yield."""
    stack = list(dict.fromkeys(roots))
    seen = set(stack)
    while stack:
        node = stack.pop()
        yield node
        for k in children(node):
            if k not in seen and k not in stop:
                seen.add(k)
                stack.append(k)


class _Graph:
    """The autograd graph below some tensors: children of each node, leaf tensor of each leaf."""

    def __init__(self, tensors: Iterable[torch.Tensor]):
        tensors = list(tensors)
        # a term that *is* a leaf is its own node
        self.children: dict = {t: () for t in tensors if t.grad_fn is None and t.requires_grad}
        self.leaf: dict = {t: t for t in self.children}

        def kids(node):
            self.children[node] = out = _next(node)
            return out

        for node in _walk(_roots(tensors), kids):
            var = getattr(node, "variable", None)
            if var is not None:
                self.leaf[node] = var

    def reach(self, tensors: Iterable[torch.Tensor]) -> set:
        roots = (t if t.grad_fn is None else t.grad_fn for t in tensors)  # a leaf term is a node
        return set(_walk(roots, self.children.__getitem__))

    def leaves(self, nodes: set) -> dict[torch.Tensor, object]:
        return {self.leaf[n]: n for n in nodes if n in self.leaf}

    def coreach(self, leaf_nodes: Iterable) -> set:
        """Nodes from which some node of ``leaf_nodes`` can be reached."""
        if not hasattr(self, "_parents"):
            self._parents: dict = {}
            for n, kids in self.children.items():
                for k in kids:
                    self._parents.setdefault(k, []).append(n)
        return set(_walk(leaf_nodes, lambda n: self._parents.get(n, ())))


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
    """Two plans of passes ``(groups summed, inputs or None = all leaves)``: by parameters (one
    pass per distinct set of groups allowed to reach a parameter), and by terms (each group,
    inputs = its reachable parameters minus its blocked ones; plain if none is blocked)."""
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
    """The candidate plan whose passes traverse the fewest nodes (ties: fewer passes), cheapest
    pass first (the last, largest, frees saved tensors as it goes, as a plain backward does)."""
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


def _groups(terms, resolved_block: dict) -> tuple[list[_Group], _Graph, dict]:
    """Group differentiable terms by effective blocked set (walks the graph once);
    ``resolved_block`` as :func:`_resolve_block` returns it."""
    names: dict[torch.Tensor, str] = {}
    by_block: dict[frozenset, list] = {}
    for k, t in terms.items():
        resolved = resolved_block.get(k, {})
        names.update(resolved)
        by_block.setdefault(frozenset(resolved), []).append(t)
        if bool(torch.isnan(t.detach()).any()):
            warnings.warn(f"routing: term {k!r} is NaN", stacklevel=3)
    graph = _Graph(terms.values())
    raw = [_Group(ts, b, graph) for b, ts in by_block.items()]
    merged: dict[frozenset, list] = {}
    for g in raw:
        merged.setdefault(g.blocked, []).append(g)
    groups = [
        gs[0] if len(gs) == 1 else _Group([t for g in gs for t in g.tensors], b, graph)
        for b, gs in merged.items()
    ]
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
    :param block: term name -> what that term must not send gradient to: one
        ``nn.Module`` or leaf tensor, an iterable of ``nn.Module``\ s and/or leaf tensors,
        or a mapping ``name -> tensor`` (names are used in messages); ``None`` or an empty
        iterable blocks nothing. Blocking a parameter a term does not reach is a no-op.
    :param retain_graph: as in :meth:`torch.Tensor.backward` (for the last pass).
    :param strict: raise ``KeyError`` for a ``block`` key that names no term (a typo would
        silently drop the route). The ELBOs pass ``False``: their blocks name every marked
        site, also those whose log-density has no gradient (and hence no term).
    :raises TypeError: if ``terms`` (or ``block``) is not a mapping.
    :warns UserWarning: if a parameter is blocked from every term that reaches it.
    """
    terms = _terms(terms, block, strict)
    if not terms:
        return
    resolved = _resolve_block(terms, block)  # none: no graph walk
    groups, graph, names = _groups(terms, resolved) if resolved else ([], None, {})
    if not any(g.blocked for g in groups):
        sum(terms.values()).backward(retain_graph=retain_graph)
        return
    _warn_never_trained(groups, names)
    plan = _plan(groups, graph)
    for i, (gs, inputs) in enumerate(plan):
        last = i == len(plan) - 1
        torch.autograd.backward(
            _total(gs), inputs=inputs, retain_graph=retain_graph if last else True
        )


def _as_inputs(inputs) -> list[torch.Tensor]:
    """``inputs`` as torch.autograd.grad takes them: one tensor, or an iterable of tensors."""
    if torch.is_tensor(inputs):
        return [inputs]
    ok = isinstance(inputs, Iterable) and not isinstance(inputs, (str, bytes, Mapping))
    out = list(inputs) if ok else [inputs]
    bad = [f"{j}: {type(x).__name__}" for j, x in enumerate(out) if not torch.is_tensor(x)]
    if bad:
        raise TypeError(f"routing.grad: inputs must be a tensor or a sequence of tensors; {bad}")
    return out


def grad(
    terms: Mapping[Hashable, torch.Tensor],
    inputs: torch.Tensor | Sequence[torch.Tensor],
    block: Block | None = None,
    *,
    retain_graph: bool | None = None,
    strict: bool = True,
) -> tuple[torch.Tensor, ...]:
    r"""Routed gradients of ``sum(terms.values())`` w.r.t. ``inputs`` (nothing accumulated).

    ``result[j] = sum over terms k with inputs[j] not blocked for k of d terms[k] / d inputs[j]``;
    zeros where no allowed term reaches ``inputs[j]``. One ``torch.autograd.grad`` call per
    distinct set of allowed terms among ``inputs``. As in ``torch.autograd.grad``,
    ``inputs`` may be a single tensor (the result is then a tuple of one); anything else
    that is not an iterable of tensors raises ``TypeError``.

    First order, as :func:`backward`: the gradients carry no graph (see the module docstring).

    Example::

        >>> import torch
        >>> from pyro_gradroute import routing
        >>> a = torch.tensor(2.0, requires_grad=True)
        >>> b = torch.tensor(3.0, requires_grad=True)
        >>> y = a * b
        >>> routing.grad({"l1": y, "l2": 10 * y}, [a, b], block={"l2": [b]})
        (tensor(33.), tensor(2.))
    """
    inputs = _as_inputs(inputs)
    terms = _terms(terms, block, strict)
    resolved = _resolve_block(terms, block)
    by_allowed: dict[tuple, list[int]] = {}
    for j, x in enumerate(inputs):
        allowed = tuple(k for k in terms if x not in resolved.get(k, ()))
        by_allowed.setdefault(allowed, []).append(j)
    out: list = [None] * len(inputs)
    passes = [(a, js) for a, js in by_allowed.items() if a]
    for i, (allowed, js) in enumerate(passes):
        last = i == len(passes) - 1
        total = sum(terms[k] for k in allowed)
        keep = bool(retain_graph) if last else True
        gs = vjp([total], [inputs[j] for j in js], [torch.ones_like(total)], keep)
        for j, g in zip(js, gs):
            out[j] = g
    return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(inputs, out))


def _no_grad_in_no_grad_out(grad_inputs, grad_outputs):
    """Node post-hook: a custom Function sent no gradient sends none (not materialized zeros)."""
    if all(g is None for g in grad_outputs):
        return tuple(None for _ in grad_inputs)
    return None


_HOOKED = "_gradroute_no_grad_hook"


def _skip_none_in_term_hooks(term: torch.Tensor) -> None:
    """Hooks on the term itself are not called when no gradient reaches it (a full backward
    sends none into the term's graph; e.g. Pyro's NaN-check hooks do not accept ``None``)."""
    hooks = tensor_backward_hooks(term) or {}
    for key, hook in list(hooks.items()):
        if getattr(hook, _HOOKED, False):
            continue

        def safe(g, _hook=hook):
            return None if g is None else _hook(g)

        setattr(safe, _HOOKED, True)
        hooks[key] = safe


def _check_no_intermediate_captured(g: _Graph) -> None:
    """Raise if this pass captures a non-leaf tensor of the term's graph (see :func:`gate`)."""
    if all(will_engine_execute(n) for n in g.leaf):  # a full backward: no captures
        return
    for node, kids in g.children.items():
        if node in g.leaf or not will_engine_execute(node):
            continue
        if not any(will_engine_execute(k) for k in kids):
            raise RuntimeError(
                "routing.gate: this backward pass asks both for a blocked leaf and for an "
                f"intermediate (non-leaf) tensor of the gated term (at {type(node).__name__}). "
                "One pass cannot give the intermediate dL/dh while keeping the term from the "
                "blocked leaf. Ask for the intermediate in a separate torch.autograd.grad "
                "call that does not include the blocked leaves, or use routing.grad."
            )


class _Gate(torch.autograd.Function):
    """Identity in value, with the term as a real input. Backward: a pass that reaches no
    blocked leaf sends the seed on into the term's graph; any other sends ``seed * dterm/dleaf``
    to the allowed leaves it needs (one re-entrant ``autograd.grad``) and nothing into the graph."""

    @staticmethod
    def forward(ctx, plan, term, *leaves):  # type: ignore[override]
        # plan: the term's _Graph, [(allowed leaf, its AccumulateGrad node)], blocked leaves' nodes
        (ctx.graph, ctx.allowed, ctx.blocked_nodes), ctx.term = plan, term
        ctx.set_materialize_grads(False)
        return term.detach().clone()

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        allowed = ctx.allowed
        out: list = [None] * len(allowed)
        if grad_out is None:  # nothing flows in (an outer gate cut this path)
            return (None, None, *out)
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "routing.gate is first-order only: under create_graph=True the gated term's "
                "second derivatives would include the blocked parameters' mixed partials "
                "(gate(L, [b]) means L with b held constant). For first-order routed "
                "gradients use routing.backward / routing.grad; for higher derivatives, "
                "differentiate a forward pass with the blocked parameters detached, or use "
                "plain autograd without routes."
            )
        if not any(will_engine_execute(n) for n in ctx.blocked_nodes):
            return (None, grad_out, *out)
        _check_no_intermediate_captured(ctx.graph)
        wanted = [j for j, (_, n) in enumerate(allowed) if will_engine_execute(n)]
        if wanted:
            gs = vjp([ctx.term], [allowed[j][0] for j in wanted], [grad_out])
            for j, g in zip(wanted, gs):
                out[j] = g
        return (None, None, *out)


def gate(term: torch.Tensor, blocked: BlockEntry | Iterable[BlockEntry] | None) -> torch.Tensor:
    r"""A tensor equal to ``term`` whose gradient reaches every leaf except ``blocked``.

    .. math::

        \frac{\partial\, \text{gate}(L)}{\partial \theta} =
        \begin{cases} \partial L / \partial \theta & \theta \notin \text{blocked} \\
        0 & \theta \in \text{blocked} \end{cases}
        \qquad
        \frac{\partial\, \text{gate}(L)}{\partial h} = \frac{\partial L}{\partial h}
        \quad (h \text{ a non-leaf tensor of } L\text{'s graph})

    i.e. :math:`L` with the blocked leaves held constant. Slower than :func:`backward`
    (the term's graph is traversed once more inside the gate's backward), but it is a
    single tensor: use it when a loss must be handed to code that calls ``.backward()``
    itself.

    * The term is a real autograd input of the gate: it relies on no engine schedule
      (CPU or CUDA) and works with ``retain_graph=False`` and with graphs shared with
      other terms.
    * A blocked leaf reached only through gated terms gets **no** gradient (``.grad``
      stays ``None``), not a zero or a round-off residue.
    * ``torch.autograd.grad`` with respect to non-leaf tensors gives ``dL/dh``; a single
      call that asks for both such a tensor and a blocked leaf raises ``RuntimeError``
      where it can tell (not when the tensor also lies on the path to an asked-for leaf).
    * In a full ``backward()`` no gradient enters the term's graph through the gate:
      ``retain_grad()`` intermediates below it do not include the gated term, hooks
      registered on ``term`` itself are skipped, and PyTorch calls hooks on tensors below
      it with ``None`` (as for any path that carries no gradient).
    * First order only: its backward raises ``NotImplementedError`` under
      ``create_graph=True``.
    * ``blocked`` is what a ``block`` value of :func:`backward` may be (one module or leaf
      tensor, an iterable or a mapping of them); anything else raises ``TypeError``
      naming ``blocked``.

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
    blocked_set = set(_resolve(blocked, "routing.gate: blocked"))
    if term.grad_fn is None:  # the term is a leaf
        return term.detach() if term in blocked_set else term
    graph = _Graph([term])
    leaves = graph.leaves(set(graph.children))
    blocked_nodes = [n for p, n in leaves.items() if p in blocked_set]
    if not blocked_nodes:
        return term
    allowed = [(p, n) for p, n in leaves.items() if p not in blocked_set]
    # PyTorch calls a custom Function with zeros where no gradient flows in: that would
    # hand blocked leaves a zero .grad. Such nodes above a blocked leaf send none instead.
    for node in graph.coreach(blocked_nodes):
        if isinstance(node, torch.autograd.function.BackwardCFunction) and not getattr(
            node, _HOOKED, False
        ):
            node.register_hook(_no_grad_in_no_grad_out)
            setattr(node, _HOOKED, True)
    _skip_none_in_term_hooks(term)
    return _Gate.apply((graph, allowed, blocked_nodes), term, *(p for p, _ in allowed))


# ----------------------------------------------------------------------------- taps
@contextmanager
def taps(entries: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> Iterator[list]:
    r"""Add a known tensor to the gradient that reaches each of some tensors, and record it.

    Inside the ``with`` block, a backward that reaches tensor :math:`t_i` with gradient
    :math:`g_i` sends :math:`g_i + \delta_i` on from there instead (to the leaves below
    :math:`t_i`); ``seen[i]`` is :math:`g_i`, the gradient before the addition (``None`` if
    the backward did not reach :math:`t_i`). A tensor listed twice gets one hook that adds
    both deltas, and both entries record the same :math:`g_i`. The hooks are removed on exit.

    For a leaf :math:`t_i` this changes what accumulates into ``t.grad``; for a non-leaf,
    what flows to the leaves it is computed from. The hook runs once the gradient at
    :math:`t_i` is complete, whatever order the engine runs the nodes in.

    Example::

        >>> import torch
        >>> w = torch.tensor(2.0, requires_grad=True)
        >>> h = 3.0 * w
        >>> with taps([(h, torch.tensor(1.0))]) as seen:
        ...     (h * h).backward()
        >>> seen[0].item(), w.grad.item()  # d(h^2)/dh = 2h = 12; (12 + 1) * 3
        (12.0, 39.0)
    """
    entries = list(entries)
    seen: list[torch.Tensor | None] = [None] * len(entries)
    by_tensor: dict[int, list[int]] = {}
    for i, (t, _) in enumerate(entries):
        by_tensor.setdefault(id(t), []).append(i)
    handles = []
    for idx in by_tensor.values():
        deltas = [entries[i][1] for i in idx if entries[i][1] is not None]

        def hook(g, idx=idx, deltas=deltas):
            for i in idx:
                seen[i] = g
            for d in deltas:
                g = g + d
            return g

        handles.append(entries[idx[0]][0].register_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- graph queries
def reached(tensor: torch.Tensor, candidates: Sequence[torch.Tensor]) -> list[int]:
    """Indices of the ``candidates`` whose autograd node lies on ``tensor``'s graph (the search
    does not look below candidate nodes)."""
    if tensor.grad_fn is None or not candidates:
        return []
    targets = {c.grad_fn: i for i, c in enumerate(candidates) if c.grad_fn is not None}
    return reached_nodes([tensor], targets)


def reached_nodes(tensors: Sequence[torch.Tensor], targets: dict) -> list[int]:
    """``targets[node]`` (sorted) of the target autograd nodes the tensors' graphs reach, in
    one walk that does not look below a target."""
    if not targets:
        return []
    # every conditional or flow site's walk, every step: a plain loop that skips leaves'
    # accumulators (a target is a sample's node, never a leaf's)
    hit: set[int] = set()
    stack = _roots(tensors)
    seen = set(stack)
    while stack:
        node = stack.pop()
        if node in targets:
            hit.add(targets[node])
            continue
        for f, _ in node.next_functions:
            if f is not None and type(f) is not AccumulateGrad and f not in seen:
                seen.add(f)
                stack.append(f)
    return sorted(hit)


#: autograd nodes of matrix products (a network layer: its output elements mix its inputs)
_PRODUCTS = ("MmBackward", "AddmmBackward", "BmmBackward", "BaddbmmBackward", "MvBackward",
             "AddmvBackward", "DotBackward", "ConvolutionBackward", "LinearBackward")  # fmt: skip


def passes_product(tensors: Sequence[torch.Tensor], stop_nodes=()) -> bool:
    """Whether the tensors' graphs hold a matrix product (a layer of a network, as in an
    amortized guide's encoder) above the ``stop_nodes``.

    Example::

        >>> import torch
        >>> w = torch.ones(2, 3, requires_grad=True)
        >>> passes_product([w.exp() + 1]), passes_product([torch.ones(4, 2) @ w])
        (False, True)
    """
    nodes = _walk(_roots(tensors), stop=stop_nodes)
    return any(type(n).__name__.startswith(_PRODUCTS) for n in nodes)


def reaches_leaf_directly(
    t: torch.Tensor, stops: Sequence[torch.Tensor] = (), stop_nodes=None
) -> bool:
    """Whether ``t``'s graph reaches a leaf that requires grad other than through ``stops``.

    ``stops`` are tensors (earlier samples, detached values) at which the search ends; or
    ``stop_nodes``, a container of their autograd nodes (non-leaf stops only).
    """
    if t.grad_fn is None:
        return t.requires_grad
    stop_leaves = {id(s) for s in stops if s.grad_fn is None}
    if stop_nodes is None:
        stop_nodes = set(_roots(stops))
    nodes = _walk([t.grad_fn], stop=stop_nodes)
    leaves = (n.variable for n in nodes if type(n) is AccumulateGrad)
    return any(id(v) not in stop_leaves for v in leaves)
