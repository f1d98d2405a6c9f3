"""Asteria's runtime: refreshes on C++ CPU workers, bounded staleness, hooks as signals.

``Runtime(model, optimizer, RuntimeConfig(...))`` switches an Asteria optimizer to orchestrated
mode; ``close()`` (or leaving a ``with`` block) switches it back.
"""

from asteria.runtime.attach import NoSpareCoreWarning
from asteria.runtime.config import RuntimeConfig
from asteria.runtime.distributed import CoherenceBrokenError, CoherenceTimeoutError
from asteria.runtime.lane import StatisticsLaneError
from asteria.runtime.registry import RefreshFailedError, StalenessTimeoutError
from asteria.runtime.runtime import Runtime
from asteria.runtime.streams import training_stream

__all__ = [
    "CoherenceBrokenError",
    "CoherenceTimeoutError",
    "NoSpareCoreWarning",
    "RefreshFailedError",
    "Runtime",
    "RuntimeConfig",
    "StalenessTimeoutError",
    "StatisticsLaneError",
    "training_stream",
]
