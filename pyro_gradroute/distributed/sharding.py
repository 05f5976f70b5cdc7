"""Each rank's minibatch of a global data set, and the plate that scales it:
:class:`ShardedPlate`."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pyro
import torch
import torch.distributed as dist


class ShardedPlate:
    r"""This rank's minibatch indices of a global data set, and the plate that scales them right.

    Each epoch, :class:`torch.utils.data.DistributedSampler` deals the :math:`N` indices
    to the :math:`R` ranks (each gets :math:`\lceil N/R \rceil`, padded by repeating
    indices, or :math:`\lfloor N/R \rfloor` with ``drop_last=True``); iterating yields
    this rank's minibatches of ``batch_size`` indices (the same count on every rank at
    every step). The plate must carry the **global** size :math:`N`:

    .. math::

        \text{pyro.plate}(\text{name}, N, \text{subsample}=i_r)
        \;\Rightarrow\; \text{scale} = \frac{N}{b}, \qquad
        \frac1R \sum_{r=1}^{R} \frac{N}{b} \sum_{i \in i_r} \nabla \log p(x_i \mid \theta)
        = \frac{N}{Rb} \sum_{i \in i_1 \cup \dots \cup i_R} \nabla \log p(x_i \mid \theta),

    i.e. averaging the ranks' gradients (:class:`DistributedOptimizer`) gives exactly the
    gradient of one process on the union of the shards. A plate of the shard's size
    would scale the likelihood by :math:`R` too little relative to the prior.

    :param name: the plate's name (as in the model).
    :param size: global data size :math:`N`.
    :param batch_size: per-rank minibatch size :math:`b` (the global batch is :math:`Rb`).
    :param num_replicas: number of ranks (default: the world size, 1 without a process group).
    :param rank: this rank (default: the process group's rank, 0 without one).
    :param shuffle: reshuffle each epoch (seeded by ``seed + epoch``: same on all ranks).
    :param seed: shuffling seed, identical on all ranks.
    :param drop_last: drop the tail instead of padding it with repeated indices.
    :param dim: the plate's ``dim``.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro_gradroute.distributed import ShardedPlate
        >>> data = torch.randn(10)
        >>> shard = ShardedPlate("data", size=10, batch_size=4, num_replicas=2, rank=1)
        >>> def model(data, idx):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with shard.plate(idx):
        ...         pyro.sample("x", dist.Normal(mu, 1.0), obs=data[idx])
        >>> shard.set_epoch(0)
        >>> [len(idx) for idx in shard]  # 5 indices for rank 1: batches of 4 and 1
        [4, 1]
        >>> tr = pyro.poutine.trace(model).get_trace(data, next(iter(shard)))
        >>> tr.nodes["x"]["scale"]  # N / b = 10 / 4
        2.5
    """

    def __init__(
        self,
        name: str,
        size: int,
        batch_size: int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        dim: int | None = None,
    ):
        from torch.utils.data import DistributedSampler

        initialized = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialized else 1
        if rank is None:
            rank = dist.get_rank() if initialized else 0
        if batch_size < 1:
            raise ValueError(f"ShardedPlate: batch_size must be >= 1, got {batch_size}.")
        if drop_last and size < num_replicas:
            raise ValueError(
                f"ShardedPlate: {size} data points cannot be dealt to {num_replicas} ranks "
                "with drop_last=True; use drop_last=False (pads by repeating) or fewer ranks."
            )
        self.name, self.size, self.batch_size, self.dim = name, size, batch_size, dim
        self.num_replicas, self.rank = num_replicas, rank
        self.sampler = DistributedSampler(
            range(size),
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (call it on every rank with the same value)."""
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Minibatches per epoch (the same on every rank)."""
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        indices = torch.tensor(list(self.sampler), dtype=torch.long)
        yield from indices.split(self.batch_size)

    def plate(self, idx: torch.Tensor) -> pyro.plate:
        """``pyro.plate(name, size=N, subsample=idx, dim=dim)``: likelihood scale ``N / len(idx)``."""
        return pyro.plate(self.name, self.size, subsample=idx, dim=self.dim)
