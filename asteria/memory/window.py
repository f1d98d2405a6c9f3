"""The bases window: a ring of device buffers holding the bases of the blocks about to be used.

Owns: ``BasesWindow``, the ordering rules of the ring (Note [Bases window]), its copies going
through ``asteria.memory.copies`` (``CudaCopies``, or the stand-in ``HostCopies``, with which
tests/unit/test_window.py tests the ordering; on a GPU tests/gpu/test_window_gpu.py). Must not:
decide what lives in host memory, which block comes next or when a slot grows, or know an
optimizer.

Note [Bases window]: the device holds copies of a few blocks' host bases: ``slots`` buffers of
``slot_bytes``. ``use(key, srcs, upcoming)`` hands out the copies of ``srcs`` from the slot that
holds exactly these tensors (a hit, by identity: an install replaces them) or from one it fills
now, the main stream waiting for the copy; then it copies ``upcoming`` (the next read) into
another slot: the prefetch. A slot is refilled only after the event recorded after its last
reader (recorded by that refill, or ``finish``); the slot in use is never a prefetch's target.
A slot keeps its host sources alive until the copy that read them completed. ``parts(many)`` hands
out, as hits, copies of tensors a slot holds among its sources (an install reading the bases it
replaces), filling nothing.

Note [Reads together]: ``use(..., together=True)`` keeps what was handed out since the last
``finish`` valid (a piece whose runs the ring holds in as many slots): none of those slots is a
refill's or prefetch's victim, and ``finish`` records one event for all; more than the ring
holds raises.

Note [Slot views by layout]: a fill hands out views with the sources' shapes, dtypes and strides,
some five view ops a tensor; they depend on the layout alone, so a slot keeps the views it made
per layout (``_PACKED``) and a refill reuses them.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from asteria.memory.copies import Copies

__all__ = ["WINDOW_BLOCKS", "BasesWindow", "view_like"]

#: Slots of the window: the block in use and the next one (tiers.plan's ``window_blocks``).
WINDOW_BLOCKS = 2
#: Layouts whose views a slot keeps (Note [Slot views by layout]): a step's shape groups.
_PACKED = 16

Tensors = Sequence[torch.Tensor | None]


class BasesWindow:
    """A ring of ``slots`` device buffers of ``slot_bytes`` (Note [Bases window])."""

    def __init__(self, copies: Copies, slots: int, slot_bytes: int) -> None:
        if slots < 1:
            raise ValueError(f"a bases window needs at least one slot, got {slots}")
        if slot_bytes < 0:
            raise ValueError(f"slot_bytes must be >= 0, got {slot_bytes}")
        self.copies = copies
        self._slots = [_Slot(i) for i in range(slots)]
        self._slot_bytes = 0
        self._current: list[_Slot] = []  # the slots handed out since the last finish()
        self._read: list[_Slot] = []  # handed out before those, their reader event not recorded
        self._retired: list[tuple[Any, tuple]] = []
        self._clock = itertools.count(1)
        self.fills = self.hits = self.prefetches = self.prefetch_hits = self.part_hits = 0
        self.together = 0  # reads handed out together with the ones before (Note [Reads together])
        self.resize(slot_bytes)

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def slots(self) -> int:
        return len(self._slots)

    @staticmethod
    def bytes_of(srcs: Tensors) -> int:
        """Bytes a slot needs for ``srcs``, packed in order (each at a multiple of its itemsize)."""
        offset = 0
        for s in srcs:  # (inline: called for every fill, over a group's every tensor)
            if s is not None:
                k = s.element_size()
                offset = -(-offset // k) * k + s.numel() * k
        return offset

    def buffers(self) -> list[torch.Tensor]:
        """The device buffers (what the window allocates)."""
        return [s.buffer for s in self._slots if s.buffer is not None]

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers())

    def use(
        self,
        key: Hashable,
        srcs: Tensors,
        upcoming: tuple[Hashable, Tensors] | None = None,
        together: bool = False,
        fit: Callable[[int], None] | None = None,
    ) -> list[torch.Tensor | None]:
        """Device copies of ``srcs`` (block ``key``'s bases), ready for the main stream's next
        kernels; then start copying ``upcoming`` (``(key, srcs)``) into another slot. ``together``:
        the copies handed out since the last ``finish`` stay valid (Note [Reads together]).
        ``fit(need)`` runs before a fill larger than a slot (it resizes or raises); without it such
        a fill raises."""
        if not together:
            if self._current:  # (their reader event: recorded by a fill of one, or ``finish``)
                self._read += self._current
                self._current = []
        else:
            self.together += 1
        slot = None
        for held in self._slots:  # a hit fitted when it was filled (``_holding``, inline)
            h = held.srcs
            if held.key == key and h is not None and len(h) == len(srcs):
                if all(map(operator.is_, h, srcs)):
                    slot = held
                    break
        if slot is None:
            if srcs.count(None) == len(srcs):
                return list(srcs)
            need = self.bytes_of(srcs)
            if need > self._slot_bytes and fit is not None:
                fit(need)
            if need > self._slot_bytes:
                raise ValueError(
                    f"the bases of block {key!r} need {need} bytes, the window's slots have "
                    f"{self._slot_bytes}: resize() it first"
                )
            slot = self._victim(key, exclude=self._current)
            if slot is None:
                raise ValueError(
                    f"the window's {len(self._slots)} slots are all in use by the copies handed "
                    f"out together with block {key!r}'s"
                )
            self._fill(slot, key, srcs)
        else:
            self.hits += 1
            self.prefetch_hits += slot.prefetched
        slot.prefetched = False
        self.copies.wait(slot.copied)
        slot.used = next(self._clock)
        if slot not in self._current:
            self._current.append(slot)
        out = list(slot.views)
        if upcoming is None:
            return out
        key, srcs = upcoming  # the prefetch
        for held in self._slots:  # (``_holding``, inline)
            h = held.srcs
            if held.key == key and h is not None and len(h) == len(srcs):
                if all(map(operator.is_, h, srcs)):
                    return out
        need = 0
        for s in srcs:  # (``bytes_of``, inline)
            if s is not None:
                k = s.element_size()
                need = -(-need // k) * k + s.numel() * k
        if need == 0 or need > self._slot_bytes:
            return out
        victim, current = None, self._current
        for held in self._slots:  # (``_victim``, inline)
            if held in current:
                continue
            if held.key == key:
                victim = held
                break
            if victim is None or held.used < victim.used:
                victim = held
        if victim is not None:
            self._fill(victim, key, srcs)
            victim.prefetched = True
            victim.used = next(self._clock)  # the next block: not what a miss evicts first
            self.prefetches += 1
        return out

    def parts(self, many: list[Tensors]) -> list[list[torch.Tensor | None] | None]:
        """Per ``srcs`` of ``many``: device copies of ``srcs`` from a slot that holds each of
        them (compared by identity) among the tensors it was filled with, handed out as hits,
        all together (Note [Reads together]); None where no slot does. No Python call per
        ``srcs``."""
        out, hit = [], []
        for srcs in many:
            found = None
            if srcs.count(None) == len(srcs):
                found = list(srcs)
            for slot in self._slots if found is None else ():
                held, where, views = slot.srcs, slot.where, []
                if held is None:
                    continue
                for s in srcs:  # (``_part_of``, inline)
                    if s is None:
                        views.append(None)
                        continue
                    i = where.get(id(s))
                    if i is None or held[i] is not s:
                        views = None
                        break
                    views.append(slot.views[i])
                if views is not None:
                    found = views
                    self.part_hits += 1
                    if slot not in hit:
                        hit.append(slot)
                    break
            out.append(found)
        if hit:
            self.finish()
            for slot in hit:
                self.copies.wait(slot.copied)
                slot.used = next(self._clock)
            self._current = hit
        return out

    def holds(self, key: Hashable, srcs: Tensors) -> bool:
        """Whether a slot holds exactly ``srcs`` as ``key``'s (``use`` then hands it out)."""
        return self._holding(key, srcs) is not None

    def last_used(self, reads: list[tuple[Hashable, Tensors]]) -> list[int]:
        """Per ``(key, srcs)`` of ``reads``: when the slot that holds exactly ``srcs`` as
        ``key``'s was last handed out (a clock, larger is later), 0 where none holds them."""
        out = []
        for key, srcs in reads:  # (``_holding``, inline)
            used = 0
            for held in self._slots:
                h = held.srcs
                if held.key == key and h is not None and len(h) == len(srcs):
                    if all(map(operator.is_, h, srcs)):
                        used = held.used
                        break
            out.append(used)
        return out

    def finish(self) -> None:
        """The blocks handed out since the last ``finish`` are no longer read by kernels issued
        from now on: record the event their slots' next copies wait for."""
        if self._current or self._read:
            event = self.copies.record()
            for slot in self._current + self._read:
                slot.read = event
            self._current, self._read = [], []

    def resize(self, slot_bytes: int) -> None:
        """Every slot to ``slot_bytes`` bytes (waits for every copy and reader first)."""
        self.finish()
        self.copies.synchronize()
        self._retired.clear()
        for slot in self._slots:
            slot.reset()
            slot.buffer = self.copies.alloc(slot_bytes) if slot_bytes else None
        self._slot_bytes = slot_bytes

    def close(self) -> None:
        """Wait for every copy and reader, then free the buffers."""
        self.finish()
        self.copies.synchronize()
        self._retired.clear()
        for slot in self._slots:
            slot.reset()
            slot.buffer = None

    def stats(self) -> dict[str, int]:
        return {
            "slots": len(self._slots),
            "slot_bytes": self._slot_bytes,
            "fills": self.fills,
            "hits": self.hits,
            "prefetches": self.prefetches,
            "prefetch_hits": self.prefetch_hits,
            "part_hits": self.part_hits,
            "together": self.together,
        }

    # -- the ring ---------------------------------------------------------------------------------

    def _holding(self, key: Hashable, srcs: Tensors) -> _Slot | None:
        for slot in self._slots:  # (the same sources, by identity, inline: at every read)
            held = slot.srcs
            if (
                slot.key == key
                and held is not None
                and len(held) == len(srcs)
                and all(map(operator.is_, held, srcs))
            ):
                return slot
        return None

    def _victim(self, key: Hashable, exclude: Sequence[_Slot]) -> _Slot | None:
        """The slot to fill for ``key``: one holding an older copy of it, else the least
        recently used; never one of ``exclude`` (the slots in use)."""
        oldest = None
        for slot in self._slots:
            if slot in exclude:
                continue
            if slot.key == key:
                return slot
            if oldest is None or slot.used < oldest.used:
                oldest = slot
        return oldest

    def _fill(self, slot: _Slot, key: Hashable, srcs: Tensors) -> None:
        if self._read and slot in self._read:  # its readers' event, recorded now (their kernels
            event = self.copies.record()  # were issued before, on the same stream)
            for held in self._read:
                held.read = event
            self._read = []
        layout, dsts, copied, where = [], [], [], {}
        for i, s in enumerate(srcs):  # (loops: no call per tensor)
            if s is None:
                layout.append(None)
                continue
            layout.append((s.dtype, s.shape, s.stride()))
            copied.append(s)
            where[id(s)] = i
        layout = tuple(layout)  # Note [Slot views by layout]
        views = slot.packed.get(layout)
        if views is None:
            views = _pack(slot.buffer, srcs)
            if len(slot.packed) >= _PACKED:
                del slot.packed[next(iter(slot.packed))]
            slot.packed[layout] = views
        for v in views:
            if v is not None:
                dsts.append(v)
        event = self.copies.copy(dsts, copied, [] if slot.read is None else [slot.read])
        retired = self._retired
        if slot.srcs is not None and slot.copied is not None:
            retired.append((slot.copied, slot.srcs))
        if len(retired) > len(self._slots):  # (pruned now and then; the copies complete in
            if retired[-1][0].query():  # order, on one stream: the last done, all are)
                retired.clear()
        slot.key, slot.srcs, slot.views, slot.copied = key, tuple(srcs), views, event
        slot.where = where
        slot.read = None  # the new contents have no reader yet; later copies queue behind this one
        self.fills += 1


class _Slot:
    __slots__ = (
        "index",
        "buffer",
        "key",
        "srcs",
        "views",
        "where",
        "packed",
        "copied",
        "read",
        "used",
        "prefetched",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.buffer: torch.Tensor | None = None
        self.reset()

    def reset(self) -> None:
        """Empty, and the views of the buffer forgotten (a resize replaces the buffer)."""
        self.key: Hashable | None = None
        self.srcs: tuple | None = None
        self.views: list[torch.Tensor | None] = []
        self.where: dict[int, int] = {}  # id of each source -> its index in ``srcs``
        self.packed: dict[tuple, list[torch.Tensor | None]] = {}  # layout -> views
        self.copied: Any = None  # the event of the copy that filled it
        self.read: Any = None  # the event after the last kernel that read it
        self.used = 0
        self.prefetched = False


def _pack(buffer: torch.Tensor | None, srcs: Tensors) -> list[torch.Tensor | None]:
    """Views of ``buffer`` with ``srcs``' shapes and dtypes, packed as ``bytes_of`` counts."""
    views: list[torch.Tensor | None] = []
    offset = 0
    for s in srcs:
        if s is None:
            views.append(None)
            continue
        k = s.element_size()
        offset = -(-offset // k) * k
        n = s.numel() * k
        views.append(view_like(buffer[offset : offset + n].view(s.dtype), s))
        offset += n
    return views


def view_like(flat: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``flat`` (1-D, ``src.numel()`` elements) viewed with ``src``'s shape, and with its strides
    when ``src`` is dense (a permutation of a contiguous tensor, e.g. LAPACK's column-major
    results): kernels then read the copy with the layout they read the original with, which
    keeps their arithmetic, and so the run, bitwise the same."""
    strides = src.stride()  # (its dims by stride, largest first, in order among equals)
    order = sorted(range(len(strides)), key=strides.__getitem__, reverse=True)
    if src.permute(order).is_contiguous():
        return flat.as_strided(src.shape, strides)
    return flat.view(src.shape)
