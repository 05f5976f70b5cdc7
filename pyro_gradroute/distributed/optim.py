"""A Pyro optimizer that averages gradients across ranks before stepping:
:class:`DistributedOptimizer`."""

from __future__ import annotations

import pyro
import pyro.optim

from .gradients import _collective_errors, _param_names, average_gradients
from .setup import DEFAULT_BUCKET_CAP_MB


class DistributedOptimizer(pyro.optim.PyroOptim):
    r"""Average gradients across ``torch.distributed`` ranks, then step a Pyro optimizer.

    The counterpart of :class:`pyro.optim.HorovodOptimizer` on ``torch.distributed``.
    Each call (SVI calls it once per step with the parameters the trace touched)

    1. sorts the parameters by param-store name, so all ranks agree on the order;
    2. replaces every gradient by the rank average
       :math:`\bar g = \frac1R \sum_r g_r` (:func:`average_gradients`: bucketed
       ``all_reduce``; ``None`` counts as zero unless it is ``None`` on every rank;
       a clear error if the ranks' parameters differ);
    3. calls the wrapped optimizer, whose gradient clipping therefore acts on
       :math:`\bar g`, identically on every rank.

    Starting from identical parameters (:func:`broadcast_param_store`), the ranks stay
    identical. Only ``.grad`` is read and written, so any ELBO works. The wrapped
    optimizer keeps its own state: :meth:`get_state`, :meth:`set_state`, :meth:`save`,
    :meth:`load`, and e.g. ``step()`` of a :class:`pyro.optim.PyroLRScheduler`, are
    passed through.

    :param pyro_optim: any :class:`pyro.optim.PyroOptim` (``Adam``, ``ClippedAdam``,
        a ``PyroLRScheduler``, ...).
    :param group: process group (default: the world).
    :param bucket_cap_mb: size of the ``all_reduce`` buckets in megabytes.
    :param check_params: check every step that the ranks' parameters agree (one small
        extra collective; see :func:`average_gradients`).

    Attributes ``comm_seconds`` (time spent in collectives) and ``num_steps`` accumulate
    over calls, for profiling.

    Example (one process here; under ``torchrun`` every rank runs the same code)::

        >>> import torch, pyro, pyro.distributions as dist, torch.distributed as tdist
        >>> from pyro.infer import SVI
        >>> from pyro.infer.autoguide import AutoNormal
        >>> from pyro_gradroute.infer import TraceSTL_ELBO
        >>> from pyro_gradroute.distributed import (
        ...     DistributedOptimizer, broadcast_param_store, init_distributed)
        >>> device = init_distributed()
        >>> def model(x):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", len(x)):
        ...         pyro.sample("x", dist.Normal(mu, 1.0), obs=x)
        >>> pyro.clear_param_store()
        >>> guide = AutoNormal(model)
        >>> optim = DistributedOptimizer(pyro.optim.Adam({"lr": 0.01}))
        >>> svi = SVI(model, guide, optim, TraceSTL_ELBO())
        >>> x = torch.randn(10)
        >>> loss = svi.evaluate_loss(x)  # creates the params, no step ...
        >>> broadcast_param_store(src=0)  # ... then make all ranks identical
        >>> loss = svi.step(x)
        >>> tdist.destroy_process_group()
    """

    def __init__(
        self,
        pyro_optim: pyro.optim.PyroOptim,
        *,
        group=None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        check_params: bool = True,
    ):
        if not isinstance(pyro_optim, pyro.optim.PyroOptim):
            raise TypeError(
                f"DistributedOptimizer wraps a pyro.optim optimizer (e.g. pyro.optim.Adam"
                f"({{'lr': 1e-3}})), got {type(pyro_optim).__name__}. For a torch.optim "
                "optimizer, call average_gradients(params) before its step()."
            )
        if isinstance(pyro_optim, DistributedOptimizer):
            raise TypeError("DistributedOptimizer is already distributed; do not wrap it twice.")
        # No PyroOptim.__init__: the wrapped optimizer holds all optimizer state.
        self.optim = pyro_optim
        self.group = group
        self.bucket_cap_mb = bucket_cap_mb
        self.check_params = check_params
        self.comm_seconds = 0.0
        self.num_steps = 0

    def __call__(self, params, *args, **kwargs) -> None:
        params = [p for _, p in _param_names(params)]
        with _collective_errors("DistributedOptimizer (gradient all_reduce)"):
            self.comm_seconds += average_gradients(
                params,
                group=self.group,
                bucket_cap_mb=self.bucket_cap_mb,
                check_params=self.check_params,
            )
        self.num_steps += 1
        self.optim(params, *args, **kwargs)

    def get_state(self) -> dict:
        """The wrapped optimizer's state (identical on every rank)."""
        return self.optim.get_state()

    def set_state(self, state_dict: dict) -> None:
        """Set the wrapped optimizer's state (load the same state on every rank)."""
        self.optim.set_state(state_dict)

    def __getattr__(self, name: str):
        # Only called for attributes not found normally: pass through to the wrapped optimizer
        # (optim_objs, pt_optim_args, step() of schedulers, ...).
        if name == "optim":
            raise AttributeError(name)
        return getattr(self.optim, name)
