"""Deprecated location: the policy lives with the handler (:mod:`.stick_the_landing_messenger`)."""

from .stick_the_landing_messenger import STLPolicy, check_elbo

__all__ = ["STLPolicy", "check_elbo"]
