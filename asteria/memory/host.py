"""Host memory that Asteria owns: aligned tensors (pinned and mapped where a GPU is visible), the
staging ring, and zero-copy device views.

Owns: the Python face of ``csrc/memory``. ``host_empty`` makes tensors over 4 KiB aligned host
blocks (registered with CUDA in chunks of at most 256 MiB on a CUDA build with a GPU);
``StagingRing`` hands out reusable slots of one block, each again only once its copies completed
and no view of it lives; ``device_view`` aliases pinned memory as a CUDA tensor. Every tensor
owns its memory through its storage (``host_memory_stats`` counts the live blocks).

Must not: decide what lives in host memory or when, or hand out memory whose lifetime it does not
track. docs/memory.md shows their use from an optimizer of your own.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch

from asteria import _C

__all__ = [
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

Shape = int | Sequence[int] | torch.Size


def _sizes(shape: Shape) -> list[int]:
    if isinstance(shape, int):
        return [shape]
    return [int(s) for s in shape]


def _device_index(device: int | str | torch.device | None) -> int:
    """The CUDA device index that ``device`` names; the current device for None or bare 'cuda'."""
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else -1
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device_view needs a CUDA device, got {device}")
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else -1


def host_empty(
    shape: Shape,
    dtype: torch.dtype = torch.float32,
    pinned: bool | None = None,
    reuse: bool = False,
) -> torch.Tensor:
    """An uninitialized, contiguous CPU tensor over a fresh 4 KiB-aligned host block.

    ``pinned``: None pins (page-locked, mapped for the GPU) where a CUDA build sees a GPU, else
    pageable; True requires pinning (RuntimeError without); False never pins. Pinned memory makes
    ``non_blocking`` copies asynchronous and allows ``device_view``. ``reuse``: the block comes
    from, and goes back to (still pinned), the process's cache of blocks of its size and pinning,
    instead of being registered again: for memory replaced often (Note [Reused host blocks] in
    csrc/memory/host_block.cpp; at most 4 GiB, ``release_host_cache()`` frees it)."""
    return _C.host_empty(_sizes(shape), dtype, pinned, reuse)


def release_host_cache() -> int:
    """Free the blocks that ``host_empty(..., reuse=True)`` tensors left in the cache of reused
    blocks (unregistering the pinned ones); return the bytes freed."""
    return _C.release_host_cache()


def host_empty_like(tensor: torch.Tensor, pinned: bool | None = None) -> torch.Tensor:
    """``host_empty`` of ``tensor``'s shape and dtype."""
    return host_empty(tensor.shape, tensor.dtype, pinned)


def host_copy(tensor: torch.Tensor, pinned: bool | None = None) -> torch.Tensor:
    """A copy of ``tensor`` (from any device) in a fresh host block; synchronous."""
    return host_empty_like(tensor, pinned).copy_(tensor)


def host_memory_stats() -> dict[str, int]:
    """Process-wide counters of Asteria's host blocks: ``live_blocks``, ``live_bytes``,
    ``registered_blocks``, ``registered_bytes`` (pinned, cached blocks included),
    ``peak_bytes``, ``allocated_blocks`` (ever), ``cached_blocks`` and ``cached_bytes`` (in the
    cache of reused blocks, not live) and ``reused_blocks`` (allocations the cache served, ever).
    Bytes are allocated sizes (requests rounded up to 4 KiB)."""
    return dict(_C.host_memory_stats())


def host_tensor_info(tensor: torch.Tensor) -> dict[str, int | bool] | None:
    """Where ``tensor``'s memory lives if it comes from here, else None: ``block_bytes``,
    ``offset`` (of its storage in the block), ``pinned``, ``device_view``, ``staging_slot``."""
    info = _C.host_tensor_info(tensor)
    if info is None:
        return None
    keys = ("block_bytes", "offset", "pinned", "device_view", "staging_slot")
    return {key: getattr(info, key) for key in keys}


def is_host_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory is an Asteria host block (a device view of one included)."""
    return _C.host_tensor_info(tensor) is not None


def device_view(host: torch.Tensor, device: int | str | torch.device | None = None) -> torch.Tensor:
    """A CUDA tensor with ``host``'s shape, strides and dtype aliasing its pinned memory.

    Zero-copy: kernels read the host memory over the interconnect at every access (for data read
    once, or unified-memory machines). The view keeps the memory alive; keep it alive until its
    kernels completed. RuntimeError without a CUDA build or GPU; ValueError for memory not from
    ``host_empty``/a staging slot, not pinned, or a view spanning two 256 MiB registration chunks.
    """
    return _C.device_view(host, _device_index(device))


class StagingSlot:
    """A lease on one slot of a ``StagingRing``: the right to fill and read it until ``release()``
    (or a ``with`` block's end). The slot is handed out again only once every copy recorded on it
    (``record``) completed and every ``view`` is gone, so releasing early is safe."""

    def __init__(self, lease: _C.StagingSlot) -> None:
        self._lease = lease

    @property
    def index(self) -> int:
        return self._lease.index

    @property
    def nbytes(self) -> int:
        return self._lease.nbytes

    @property
    def released(self) -> bool:
        return self._lease.released

    def view(self, shape: Shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A contiguous CPU tensor over the start of the slot (ValueError if it does not fit).
        The slot stays busy while this tensor or any view of it is alive."""
        return self._lease.view(_sizes(shape), dtype)

    def record(self, stream: torch.cuda.Stream | None = None) -> None:
        """Fence the slot with the work queued so far on ``stream``: call it after issuing a
        ``non_blocking`` copy into or out of the slot. None means the current CUDA stream where a
        GPU is in use, and the CPU stand-in (complete at once) elsewhere."""
        if stream is None and _C.cuda_enabled() and torch.cuda.is_available():
            stream = torch.cuda.current_stream()
        if stream is None:
            self._lease.record(0, -1)
        else:
            self._lease.record(stream.cuda_stream, stream.device.index)

    def query(self) -> bool:
        """Whether every copy recorded on the slot has completed."""
        return self._lease.query()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait (GIL released) for the recorded copies; False if ``timeout`` seconds passed."""
        return self._lease.wait(timeout)

    def release(self) -> None:
        """Give the slot back (idempotent). Views made earlier stay valid."""
        self._lease.release()

    def __enter__(self) -> StagingSlot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"StagingSlot(index={self.index}, nbytes={self.nbytes}, {state})"


class StagingRing:
    """``slots`` reusable host slots of ``slot_bytes`` (rounded up to 4 KiB) in one block, pinned as
    in ``host_empty``. ``acquire`` leases the next free slot in ring order, waiting (GIL released)
    for its copies, views and lease; after ``timeout`` s a ``TimeoutError`` says what holds them."""

    def __init__(self, slots: int, slot_bytes: int, pinned: bool | None = None) -> None:
        self._ring = _C.StagingRing(slots, slot_bytes, pinned)

    @property
    def slots(self) -> int:
        return self._ring.slots

    @property
    def slot_bytes(self) -> int:
        return self._ring.slot_bytes

    def acquire(self, timeout: float | None = None) -> StagingSlot:
        return StagingSlot(self._ring.acquire(timeout))

    def stats(self) -> dict[str, Any]:
        """``slots``, ``slot_bytes``, ``leased``, ``held_by_views`` and ``pending_copies``
        (released slots not free yet, and why), ``acquires``, ``waited`` (acquires that had to
        wait), ``pinned``."""
        s = self._ring.stats()
        keys = (
            "slots",
            "slot_bytes",
            "leased",
            "held_by_views",
            "pending_copies",
            "acquires",
            "waited",
            "pinned",
        )
        return {key: getattr(s, key) for key in keys}

    def __repr__(self) -> str:
        return f"StagingRing(slots={self.slots}, slot_bytes={self.slot_bytes})"
