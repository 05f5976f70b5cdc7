"""Effect handlers that mark sites for gradient routing: :func:`block_grad`."""

from .block_grad_messenger import BlockGradMessenger, block_grad
from .collect import collect_blocks
from .gated_distribution import GatedDistribution, unwrap_gates

__all__ = [
    "BlockGradMessenger",
    "GatedDistribution",
    "block_grad",
    "collect_blocks",
    "unwrap_gates",
]
