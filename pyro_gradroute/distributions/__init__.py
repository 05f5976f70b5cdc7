"""Log-density terms: a site's log-density split once into ordinary, score and pathwise parts."""

from .detached import is_delta
from .split import (
    Relay,
    RelayGroup,
    SplitLogProb,
    SplitNotSupported,
    split_log_prob,
    split_log_probs,
)

__all__ = [
    "Relay",
    "RelayGroup",
    "SplitLogProb",
    "SplitNotSupported",
    "is_delta",
    "split_log_prob",
    "split_log_probs",
]
