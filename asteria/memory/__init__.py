"""Asteria's memory tiers below the device: host memory it owns (aligned, pinned and mapped where a
GPU is visible) with the staging ring that device snapshots go through and device views
(host.py), and the NVMe spill store (nvme.py). The placement policy is tiers.py (pure) and the
state sizes it is fed come from accounting.py; the copy stream is copies.py and the
device window the runtime reads host bases through on discrete GPUs is window.py; import them
from there."""

from asteria.memory.host import (
    StagingRing,
    StagingSlot,
    device_view,
    host_copy,
    host_empty,
    host_empty_like,
    host_memory_stats,
    host_tensor_info,
    is_host_tensor,
    release_host_cache,
)
from asteria.memory.nvme import SpillChecksumError, SpillFuture, SpillIOError, SpillStore

__all__ = [
    "SpillChecksumError",
    "SpillFuture",
    "SpillIOError",
    "SpillStore",
    "StagingRing",
    "StagingSlot",
    "device_view",
    "host_copy",
    "host_empty",
    "host_empty_like",
    "host_memory_stats",
    "host_tensor_info",
    "is_host_tensor",
    "release_host_cache",
]
