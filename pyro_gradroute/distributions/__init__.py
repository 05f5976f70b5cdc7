"""Log-density terms: a site's log-density split once into ordinary, score and pathwise parts."""

from .split import SplitLogProb, SplitNotSupported, split_log_prob, split_log_probs

__all__ = ["SplitLogProb", "SplitNotSupported", "split_log_prob", "split_log_probs"]
