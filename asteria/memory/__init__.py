"""Asteria's memory tiers: host staging for snapshots (staging.py); more tiers come with issue 4."""

from asteria.memory.staging import StagingSlots

__all__ = ["StagingSlots"]
