r"""Data-parallel SVI on ``torch.distributed``: gradient averaging, param broadcast, sharded plates.

Each rank (a process launched e.g. by ``torchrun``) runs the same SVI loop on its own shard of
every minibatch; averaging the ranks' gradients gives the gradient of the union of the shards
(:class:`ShardedPlate` has the math). :class:`DistributedOptimizer` averages every ``.grad``
before the wrapped :mod:`pyro.optim` optimizer steps, :func:`broadcast_param_store` makes all
ranks start identical, and :class:`ShardedPlate` gives each rank its indices and scaled plate.

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
