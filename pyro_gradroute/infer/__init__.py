"""Estimators: ELBOs built from one trace per particle and named, routable terms."""

from .elbo import RoutedELBO
from .schedule import ScheduleConfig
from .trace_adaptive_dreg_elbo import TraceAdaptiveDReG_ELBO
from .trace_adaptive_elbo import TraceAdaptiveSTL_ELBO, TraceEnumAdaptiveSTL_ELBO
from .trace_dreg_elbo import ReweightedWakeSleepDReG, TraceDReG_ELBO
from .trace_elbo import Trace_ELBO, TraceSTL_ELBO

__all__ = [
    "ReweightedWakeSleepDReG",
    "RoutedELBO",
    "ScheduleConfig",
    "TraceAdaptiveDReG_ELBO",
    "TraceAdaptiveSTL_ELBO",
    "TraceEnumAdaptiveSTL_ELBO",
    "TraceDReG_ELBO",
    "Trace_ELBO",
    "TraceSTL_ELBO",
]
