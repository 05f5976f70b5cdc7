r"""Data-parallel SVI on ``torch.distributed``: gradient averaging, param broadcast, sharded plates.

Each of :math:`R` ranks (processes, launched e.g. by ``torchrun``) runs the same SVI
loop on its own shard of every minibatch. With a likelihood scaled by the *global*
data size (``pyro.plate(name, N, subsample=idx)``, see :class:`ShardedPlate`), rank
:math:`r`'s loss gradient :math:`g_r` is an unbiased estimate of the full-data
gradient, and the average

.. math::

    \bar g = \frac{1}{R} \sum_{r=1}^{R} g_r

is the gradient of the union of the shards (for equal shard sizes :math:`b`: the
minibatch of size :math:`Rb`, scaled by :math:`N / (Rb)`). Three pieces:

* :class:`DistributedOptimizer` wraps any :mod:`pyro.optim` optimizer and replaces
  every ``.grad`` by :math:`\bar g` before the wrapped optimizer steps (bucketed
  ``all_reduce``: a few collectives per step, not one per parameter);
* :func:`broadcast_param_store` copies rank ``src``'s parameters to every rank, so all
  ranks start identical (call it once, after the first trace created the params);
* :class:`ShardedPlate` gives each rank its minibatch indices (through
  :class:`torch.utils.data.DistributedSampler`) and the correctly scaled plate.

Only ``.grad`` is touched, so every ELBO works, Pyro's and this package's. This is for ``SVI``
with :mod:`pyro.optim` and the param store; an ``ELBOModule`` with a ``torch.optim`` optimizer,
or PyTorch Lightning, uses ``DistributedDataParallel(loss_fn)`` instead (the Scale-out page).
"""

from .gradients import (
    DEFAULT_BUCKET_CAP_MB,
    DistributedOptimizer,
    ParameterMismatchError,
    average_gradients,
    broadcast_param_store,
    init_distributed,
)
from .sharding import ShardedPlate

__all__ = [
    "DistributedOptimizer",
    "ParameterMismatchError",
    "ShardedPlate",
    "average_gradients",
    "broadcast_param_store",
    "init_distributed",
    "DEFAULT_BUCKET_CAP_MB",
]
