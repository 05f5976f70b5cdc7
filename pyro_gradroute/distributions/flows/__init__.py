r"""Forward-carried pathwise gradients of normalizing flows: one rule per transform class.

A flow samples :math:`y = T(x)`, :math:`x \sim q_0`. The pathwise part of the score/pathwise
split needs :math:`g_y = \nabla_y \log q(y)` with the parameters held fixed; instead of running
:math:`T^{-1}`, it is carried *forward* with the sample (Vaitl et al. 2024, "fast path
gradients"), one layer at a time (:func:`flow_grad` has the math), by one *rule* per transform
class (:func:`register_flow_rule`, :data:`RULES_TABLE`; triangular Jacobians:
:func:`solve_settings`, :class:`FlowSolveError`). Trailing parameter-free transforms need no rule
(:class:`FlowPath`); a transform with no rule makes the split fall back to the inverse.
``docs/split.md`` has the table and the costs.

Example (Planar layers have no inverse; the gradient is carried forward)::

    >>> import torch, pyro.distributions as dist, pyro.distributions.transforms as T
    >>> from pyro_gradroute.distributions import flows
    >>> q = dist.TransformedDistribution(dist.Normal(torch.zeros(3), 1.0).to_event(1),
    ...                                  [T.planar(3), T.planar(3)])
    >>> y, g = flows.flow_grad(q, torch.randn(3))
    >>> g.shape, flows.supported(q)
    (torch.Size([3]), True)
"""

# also reached as ``flows.<name>`` (by split.py, detached.py, poutine/pathwise.py and the tests)
from .path import FlowLayer, FlowPath, flow_grad
from .path import _flatten as _flatten
from .path import cached_path as cached_path
from .path import caches_hold as caches_hold
from .path import forward_path as forward_path
from .path import holds_params as holds_params
from .path import normal_base_grad as normal_base_grad
from .path import pathwise_log_prob as pathwise_log_prob
from .path import supported as supported
from .rules import _RULES as _RULES
from .rules import RULES_TABLE, flow_rule, register_flow_rule
from .triangular import _SETTINGS as _SETTINGS
from .triangular import FlowSolveError, SolveRecord, record_solves, solve_settings, triangular_solve

__all__ = [
    "FlowLayer",
    "FlowPath",
    "FlowSolveError",
    "RULES_TABLE",
    "SolveRecord",
    "flow_grad",
    "flow_rule",
    "record_solves",
    "register_flow_rule",
    "solve_settings",
    "triangular_solve",
]
