"""Host staging slots for device snapshots, reused only after the copy that last filled them.

Owns: one host buffer per snapshot key (a block's factor or basis), pinned on CUDA builds
(``ShadowStream.host_buffer_like``), and the rule that a slot is refilled only once the event of
its previous copy has completed; otherwise a fresh buffer is taken, so an in-flight copy is never
overwritten. Copies run on the shadow stream (``asteria._C.ShadowStream.copy_to_host``): it waits
for an event recorded on the current stream, so the snapshot sees every write issued before it,
and the current stream never waits for the copy.

Must not: decide what to snapshot or when (the runtime does), or free a buffer a copy still uses
(the ``CopyEvent`` keeps its source and destination alive until it is dropped).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

__all__ = ["StagingSlots"]


class StagingSlots:
    """Host slots keyed by snapshot, fenced by the event of their last copy."""

    def __init__(self, shadow: Any) -> None:
        self._shadow = shadow
        self._slots: dict[Hashable, tuple[torch.Tensor, Any]] = {}
        self.allocations = 0
        self.reuses = 0

    def copy(self, key: Hashable, src: torch.Tensor) -> Any:
        """Start copying ``src`` into ``key``'s slot; the returned event has ``.host``."""
        slot = self._slots.get(key)
        reusable = (
            slot is not None
            and slot[0].shape == src.shape
            and slot[0].dtype == src.dtype
            and slot[1].query()
        )
        if reusable:
            buf = slot[0]
            self.reuses += 1
        else:
            buf = self._shadow.host_buffer_like(src)
            self.allocations += 1
        event = self._shadow.copy_to_host(src, buf)
        self._slots[key] = (buf, event)
        return event

    def buffers(self) -> list[torch.Tensor]:
        """The slots' host buffers."""
        return [buf for buf, _ in self._slots.values()]

    def nbytes(self) -> int:
        """Bytes held by the slots (pinned host memory on CUDA)."""
        return sum(buf.numel() * buf.element_size() for buf, _ in self._slots.values())

    def clear(self) -> None:
        for _, event in self._slots.values():
            event.synchronize()
        self._slots.clear()
