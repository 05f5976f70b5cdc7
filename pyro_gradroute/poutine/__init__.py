"""Effect handlers: gradient routes (:func:`block_grad`) and sticking the landing (:func:`stick_the_landing`)."""

from .block_grad_messenger import BlockGradMessenger, block_grad
from .stick_the_landing_messenger import StickTheLandingMessenger, stick_the_landing

__all__ = ["BlockGradMessenger", "StickTheLandingMessenger", "block_grad", "stick_the_landing"]
