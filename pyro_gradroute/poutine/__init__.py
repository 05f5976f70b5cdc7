"""Effect handlers: gradient routes (:func:`block_grad`) and sticking the landing (:func:`stick_the_landing`)."""

from .block_grad_messenger import BlockGradMessenger, block_grad
from .collect import collect_blocks
from .gated_distribution import GatedDistribution, unwrap_gates
from .stick_the_landing_messenger import StickTheLandingMessenger, stick_the_landing

__all__ = [
    "BlockGradMessenger",
    "GatedDistribution",
    "StickTheLandingMessenger",
    "block_grad",
    "collect_blocks",
    "stick_the_landing",
    "unwrap_gates",
]
