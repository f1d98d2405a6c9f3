"""Snapshots of device tensors into the staging ring, on the copy stream, fenced.

Owns: ``Snapshot`` and ``snapshot()``: host copies of a few tensors taken asynchronously on a copy
stream into slots of a ``StagingRing``, with their three fences (Note [Snapshot fences]): the
runtime's staged snapshots, and a caller's own.

Note [Snapshot fences]: reader: the copies wait on the device for an event the main stream
records when the snapshot is taken; slot: each slot is fenced with its copy's completion, handed
out again only once it landed (and its views are gone); writer: ``fence()`` makes the main
stream's later kernels wait for the copies, before the sources are written again. The CPU
stand-in completes every fence at once.

Note [Host sources of a snapshot]: a host source (a basis behind the window) is copied by the
host at once, past the copy stream's waits, and may be the destination of a ``to_host`` still
queued (Note [Host writes] in asteria/memory/copies.py): so ``snapshot`` waits for those first
(``host_sync``), else a refresh started from stale pinned memory (issue 50). A host source is
also kept alive here with its copy's event until that completes.

Must not: decide what to snapshot or when.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch

from asteria import _C
from asteria.memory.copies import Copies
from asteria.memory.host import StagingRing

__all__ = ["Snapshot", "snapshot"]

#: How often ``Snapshot.wait`` polls a released snapshot's copy (no fence left to block on).
_POLL_S = 0.0005

# Guards every ``Copies.kept`` (snapshots of one copy stream may be taken from two threads).
_kept_lock = threading.Lock()


def _retire_landed(copies: Copies, done: Any = None, keep: tuple[torch.Tensor, ...] = ()) -> None:
    """Drop the host sources of ``copies`` whose copies landed; keep ``keep`` (host memory that
    ``record_stream`` cannot protect: a CPU tensor, a device view of a host block) alive until
    ``done``, not complete, completes. They are the copy stream's (``Copies.kept``), so what a
    copy that never ran holds goes with its stream (the CPU stand-in's, closed with a runtime)."""
    in_flight = copies.kept
    with _kept_lock:
        if in_flight:
            in_flight[:] = [(e, kept) for e, kept in in_flight if not e.query()]
        if keep:
            in_flight.append((done, keep))


class Snapshot:
    """Host copies of tensors in flight on a copy stream (``snapshot()`` makes one): ``tensors``,
    CPU tensors over the ring's slots with the sources' shapes and dtypes, to read once ``ready()``
    (or after ``wait()``); the slots leased until ``release()`` (or a ``with`` block's end) and busy
    while a view of them lives; ``landed``: the copies are known to have landed."""

    def __init__(
        self,
        copies: Copies,
        done: Any,
        leases: list[Any],
        tensors: tuple[torch.Tensor, ...],
        landed: bool = False,
    ) -> None:
        self._copies = copies
        self._done = done
        self._leases = leases
        self.tensors = tensors
        self.landed = landed

    def ready(self) -> bool:
        """Whether every copy has landed (no wait)."""
        self.landed = self.landed or bool(self._done.query())
        return self.landed

    def wait(self, timeout: float | None = None) -> tuple[torch.Tensor, ...]:
        """Wait for the copies and return ``tensors``: with ``timeout`` None until they landed
        (the copy stream's event), else for up to ``timeout`` seconds (GIL released on the slots'
        fences while they are leased), then ``WaitTimeoutError`` (a ``TimeoutError``). The CPU
        stand-in cannot wait for a copy queued behind an event not complete: RuntimeError."""
        if timeout is None:
            self._done.synchronize()
            _retire_landed(self._copies)
            self.landed = True
            return self.tensors
        end = time.monotonic() + timeout
        for lease in self._leases:
            if not lease.released:
                lease.wait(max(0.0, end - time.monotonic()))
        while not self._done.query():
            if time.monotonic() >= end:
                raise _C.WaitTimeoutError(
                    f"snapshot: {len(self.tensors)} copies not landed after {timeout} s"
                )
            time.sleep(_POLL_S)
        _retire_landed(self._copies)
        self.landed = True
        return self.tensors

    def fence(self) -> None:
        """Make the main stream's later kernels wait for the copies (the writer fence of Note
        [Snapshot fences]): call it before writing the sources again."""
        self._copies.wait(self._done)

    def release(self) -> None:
        """Give the slots back to the ring (idempotent): each is reused once its copy has landed
        and ``tensors`` are gone."""
        for lease in self._leases:
            lease.release()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "ready" if self.ready() else "in flight"
        return f"Snapshot({len(self.tensors)} tensors, {state})"


def snapshot(
    tensors: Sequence[torch.Tensor],
    ring: StagingRing,
    copies: Copies,
    timeout: float | None = None,
    release: bool = False,
) -> Snapshot:
    """Start host copies of ``tensors`` (on ``copies``' device) into one slot of ``ring`` each,
    after the work issued so far on the current stream (Note [Snapshot fences]). Waits up to
    ``timeout`` s for slots, then ``WaitTimeoutError`` (none kept); ValueError for a tensor larger
    than a slot. ``release``: the slots are given back at once (reused once the copies landed and
    the tensors are gone)."""
    srcs = list(tensors)
    limit, info = ring._ring.slot_bytes, _C.host_tensor_info
    hosted, keep = False, []
    for i, t in enumerate(srcs):  # (no Python call per tensor)
        if t.nbytes > limit:
            raise ValueError(
                f"snapshot: tensor {i} has {t.nbytes} bytes, more than a slot of the ring "
                f"({limit} bytes)"
            )
        if not t.is_cuda:
            keep.append(t)
            hosted = hosted or info(t) is not None
        elif info(t) is not None:
            keep.append(t)
    if hosted:
        copies.host_sync()  # Note [Host sources of a snapshot]
    acquire, leases = ring._ring.acquire, []
    try:
        for _ in srcs:
            leases.append(acquire(timeout))
    except BaseException:
        for lease in leases:
            lease.release()
        raise
    ready = copies.record()  # the reader fence: after every kernel that wrote the sources
    dsts = []
    for lease, t in zip(leases, srcs):
        dsts.append(lease.view(t.shape, t.dtype))
    dsts = tuple(dsts)
    done = copies.copy(dsts, srcs, [ready])
    landed = bool(done.query())
    if (keep and not landed) or copies.kept:  # host memory that record_stream cannot protect
        _retire_landed(copies, done, () if landed else tuple(keep))
    stream = copies.stream  # the slot fence: the copy's completion
    handle, device = (0, -1) if stream is None else (stream.cuda_stream, stream.device.index)
    for lease in leases:
        lease.record(handle, device)
        if release:
            lease.release()
    return Snapshot(copies, done, leases, dsts, landed)
