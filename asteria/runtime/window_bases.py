"""The window strategy of the bases: pinned host memory behind a device window (discrete GPUs).

Owns: ``WindowBases`` (bases.py has the interface and its Notes): which host tensors a block's
bases are, how a step's groups are cut into the pieces the ring hands out, in what order and with
what prefetched (Note [Pieces of the window]), how an install reads the bases it replaces and
when new bases go to host memory, and the count of open windows that frees the cache of reused
host blocks. Must not: decide what to install or when, change the optimizer's math, size the
window or order its copies (window.py does).

Note [Host copies of a step's installs]: one ``to_host`` moves an install batch's new bases to
host memory at the first of the step's end, the next read and ``host_sync``; until then they are
device tensors. An install that reads the bases it replaces (SOAP's) takes them from the slots
that hold them (``BasesWindow.parts``), else from fills of a slot each, and installs the blocks
read together at once.

Note [Pieces of the window]: a slot holds the largest shape group's bases (Note [Window by shape
group] in asteria/memory/tiers.py), so ``pieces`` cuts the groups into runs of a slot
(``groups.pack``): one piece read together where the ring holds every run (a quiet step fills
nothing), else a piece a run, those the ring holds first, most recently used first (``n - k``
fills a step of ``n`` pieces in ``k`` slots; ``2 (n - k)`` for SOAP's two passes, Note [Two
passes] in asteria/optim/kernels/soap.py). Each read prefetches the next of the known sequence.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from asteria import _C
from asteria.memory.host import release_host_cache
from asteria.memory.window import BasesWindow, view_like
from asteria.optim.base import KroneckerOptimizer
from asteria.optim.groups import BlockGroup, pack
from asteria.optim.refresher import BlockKey, Piece
from asteria.runtime.bases import BasesAccess, all_made, to_device_many

__all__ = ["WindowBases"]


# The windows open in this process: the cache of reused host blocks is process-wide, so the last
# window to close (or to be collected unclosed) frees it, not the first: another runtime's window
# still reuses its blocks.
_open_windows = 0
_open_windows_lock = threading.Lock()


def _window_gone() -> None:
    """A window closed: free the cache of reused host blocks (the host bases just dropped, Note
    [Reused host blocks]) once no other window of this process reuses it."""
    global _open_windows
    with _open_windows_lock:
        _open_windows -= 1
        last = _open_windows == 0
    if last:
        release_host_cache()


class _Read(Piece):
    """A piece of the window: its groups, and the runs of a slot each they are read in, each
    with the window's key of the run and its host tensors (made once a step, without a Python
    call: ``WindowBases.pieces``), of ``_owner``'s window."""

    __slots__ = ("runs", "_owner", "_out")

    def bases(self) -> list:
        """The bases of the piece from the ring, each run in a slot, handed out together; the
        next read of the sequence prefetched (a second read of the last piece: what the first
        handed out, still valid)."""
        w = self._owner  # (its read here, not through ``Piece._read``: a call less a read)
        with w._lock:
            if w._unhosted:
                w._host_installed()
            seq, at = w._sequence, w._at
            if at > 0 and seq[at - 1] is self and self._out is not None:
                return self._out
            w._at = at + 1
            upcoming = None
            if at + 1 < len(seq) and seq[at + 1] is not self:
                _, key, srcs = seq[at + 1].runs[0]
                upcoming = (key, srcs)
            out, use, field, last = [], w.window.use, w.field, len(self.runs) - 1
            for j, (run, key, srcs) in enumerate(self.runs):
                first = run[0].keys[0]  # (the block a message names)
                fit = lambda need, first=first: w._fit(first, need, w.window)  # noqa: E731
                views = use(key, srcs, upcoming if j == last else None, j > 0, fit)
                at = 0
                for g in run:
                    cut = []
                    for b in g.blocks:
                        n = len(b[field])
                        cut.append(views[at : at + n])
                        at += n
                    out.append(cut)
            self._out = out
            return out


class WindowBases(BasesAccess):
    """Pinned host memory behind a device window (Note [Bases window]). ``fit(key, need)`` grows the
    window before bases of ``need`` bytes go through smaller slots, or raises; ``lock`` (the
    runtime's) is held while the ring hands out copies."""

    settles = True

    def __init__(
        self,
        optimizer: KroneckerOptimizer,
        window: BasesWindow,
        fit: Callable[[BlockKey, int, BasesWindow], None],
        lock: Any,
    ) -> None:
        global _open_windows
        super().__init__(optimizer)
        self.window = window
        self._fit = fit
        self._lock = lock
        with _open_windows_lock:
            _open_windows += 1
        self._gone = weakref.finalize(self, _window_gone)  # runs once: close() or collection
        self._gone.atexit = False  # the cache outlives the process's CUDA runtime (the Note)
        self._unhosted_may_exist = True  # Note [Bases made by a step]
        self._unhosted: list[dict] = []  # blocks installed since the last copy to host memory
        self._sequence: list[_Read] = []  # the reads of the pieces handed out, in order
        self._at = 0  # reads of ``_sequence`` done

    def pieces(self, groups: list[BlockGroup], passes: int = 1) -> list[Piece]:
        """Note [Pieces of the window]: ``groups`` in runs of a slot, one piece where the ring
        holds them all, else a piece a run, those the ring holds first."""
        window, field = self.window, self.field
        with self._lock:  # (the host tensors read below are the ones the reads copy)
            if self._unhosted:
                self._host_installed()
            if self._unhosted_may_exist:
                self._host_bases_many([b for g in groups for b in g.blocks])
        sizes = {}
        for g in groups:  # (the bytes of a group's bases in a slot: ``bytes_of``, inline)
            n = 0
            for b in g.blocks:
                for q in b[field]:
                    if q is not None:
                        k = q.element_size()
                        n = -(-n // k) * k + q.numel() * k
            sizes[g] = n
        runs = []  # per run: its groups, its key in the window and its host tensors, in order
        for run in pack(groups, window.slot_bytes, _NO_LIMIT, sizes.__getitem__):
            keys, srcs = [], []
            for g in run:  # (loops: no call per block)
                keys += g.keys
                for b in g.blocks:
                    srcs += b[field]
            runs.append((run, tuple(keys), srcs))
        reads = [runs]
        if len(runs) > window.slots:
            used = window.last_used([(key, srcs) for _, key, srcs in runs])
            order = sorted(range(len(runs)), key=used.__getitem__, reverse=True)
            reads = [[runs[i]] for i in order]
        pieces, new = [], object.__new__
        for read in reads:
            piece = new(_Read)
            piece.groups, piece.runs, piece._owner, piece._out = [], read, self, None
            for run, _, _ in read:
                piece.groups += run
            pieces.append(piece)
        self._sequence = pieces + pieces[-2::-1] if passes == 2 else pieces
        self._at = 0
        return pieces

    def install_many(self, items: list[tuple[BlockKey, dict, list[Any]]]) -> None:
        """The new bases go to host memory (Note [Host copies of a step's installs]); an install
        that reads the current bases reads their copies from the slots that hold them
        (``BasesWindow.parts``), else from fills of a slot each, and the blocks read together are
        installed together (``install_refresh_many``)."""
        blocks = [b for _, b, _ in items]
        moved = to_device_many([r for _, _, r in items], blocks)
        hosted = [list(h) for h in self._host_bases_many(blocks)]  # (keys: one item a block)
        window = self.window
        if not self.optimizer.install_reads_bases:
            self.optimizer.install_refresh_many(blocks, moved)
            self._unhosted.extend(blocks)  # copied to host memory once, before the next read
            return
        handed, missing = [], []
        for i, views in enumerate(window.parts(hosted)):
            if views is None:
                missing.append(i)
            else:
                handed.append((i, views))
        self._install_reading(handed, hosted, blocks, moved)
        sizes = [window.bytes_of(hosted[i]) for i in missing]
        for piece in _runs(missing, sizes, window.slot_bytes):
            keys = tuple([items[i][0] for i in piece])
            key = keys if len(keys) > 1 else keys[0]
            flat = [q for i in piece for q in hosted[i]]
            fit = lambda need, first=keys[0]: self._fit(first, need, window)  # noqa: E731
            views, at, run = window.use(key, flat, None, False, fit), 0, []
            for i in piece:  # the views are valid until the next fill: install the piece now
                n = len(hosted[i])
                run.append((i, views[at : at + n]))
                at += n
            self._install_reading(run, hosted, blocks, moved)
        self._unhosted.extend(blocks)  # copied to host memory once, before the next read

    def _host_installed(self) -> None:
        """The copy to host memory of the bases the installs since the last one made (Note
        [Host copies of a step's installs]): one ``to_host`` for them all."""
        if self._unhosted:
            self._host_bases_many(self._unhosted)
            self._unhosted = []

    def _install_reading(
        self, handed: list[tuple[int, list]], hosted: list[list], blocks: list, moved: list
    ) -> None:
        """``install_refresh_many`` of the blocks ``i`` of ``handed`` (with ``moved[i]``), their
        bases read from the window's device copies handed out (of their host tensors
        ``hosted[i]``); a dim the refresh left alone keeps its host tensor."""
        if not handed:
            return
        field = self.field
        for i, views in handed:
            blocks[i][field][:] = views
        self.optimizer.install_refresh_many(
            [blocks[i] for i, _ in handed], [moved[i] for i, _ in handed]
        )
        for i, views in handed:
            bases = blocks[i][field]
            for d, q in enumerate(views):
                if q is not None and bases[d] is q:
                    bases[d] = hosted[i][d]

    def state_replaced(self) -> None:
        self._unhosted_may_exist = True
        self._unhosted = []  # the loaded blocks replace them (and are looked at: the flag)

    def step_end(self) -> None:
        """The last block's kernels are issued; bases made this step (first steps) go to host
        memory (Note [Bases made by a step])."""
        self.window.finish()
        self._host_installed()
        if self._unhosted_may_exist:
            blocks = [block for _, _, block, _ in self.optimizer.blocks()]
            moved = self._host_bases_many(blocks, count=True)
            self._unhosted_may_exist = moved > 0 or not all_made(self.optimizer)

    def close(self) -> None:
        self._unhosted = []  # (on the device already, where close() puts every basis)
        try:
            self.window.close()
            for _, p, block, _ in self.optimizer.blocks():
                bases = block[self.field]
                for i, q in enumerate(bases):
                    if q is not None and q.device != p.device:
                        bases[i] = q.to(p.device)
        finally:
            self._gone()

    def buffers(self) -> list[torch.Tensor]:
        return self.window.buffers()

    def stats(self) -> dict[str, int]:
        return self.window.stats()

    def settle(self, keys: list[BlockKey], blocks: list[dict]) -> None:
        """A refresh's job reads the block's bases as its input: where they are host tensors,
        the copies to host that write them must have landed (Note [Host sources of a snapshot]
        in asteria/memory/staging.py; free once they have)."""
        field, info = self.field, _C.host_tensor_info
        for block in blocks:
            for q in block[field]:
                if q is not None and not q.is_cuda and info(q) is not None:
                    self.window.copies.host_sync()
                    return

    def host_sync(self) -> None:
        self._host_installed()
        self.window.copies.host_sync()

    def _host_bases_many(self, blocks: list[dict], count: bool = False) -> Any:
        """Move the bases of ``blocks`` not in Asteria host memory there (pinned on CUDA, in their
        own layout) with one copy to host for all, not waited for (Note [Host writes] in
        asteria/memory/copies.py); return the bases (``count``: the number moved). The blocks are
        reused (Note [Reused host blocks] in csrc/memory/host_block.cpp): registering pinned memory
        at every install cost milliseconds."""
        field, info, empty = self.field, _C.host_tensor_info, _C.host_empty
        moved = []
        for block in blocks:  # (no Python call per block but ``view_like``'s per new basis)
            bases = block[field]
            for i, q in enumerate(bases):
                if q is not None and info(q) is None:  # q's layout: the same arithmetic
                    h = empty([q.numel()], q.dtype, q.is_cuda, True)
                    if q.dim() == 2 and (q.is_contiguous() or q.mT.is_contiguous()):
                        h = h.as_strided(q.shape, q.stride())  # (``view_like``, inline)
                    else:
                        h = view_like(h, q)
                    moved.append((bases, i, h))
        if moved:  # a block takes its host tensors only once their copies are issued
            self.window.copies.to_host([h for _, _, h in moved], [b[i] for b, i, _ in moved])
            for bases, i, h in moved:
                bases[i] = h
        return len(moved) if count else [block[field] for block in blocks]


#: No element limit on the window's runs (a batch's elements are bounded already).
_NO_LIMIT = 1 << 62


def _runs(items: list[int], nbytes: list[int], room: int) -> list[list[int]]:
    """``items`` in order, in runs of at most ``room`` bytes (an item over it alone)."""
    out: list[list[int]] = []
    used = 0
    for item, b in zip(items, nbytes):
        if not out or used + b > room:
            out.append([])
            used = 0
        out[-1].append(item)
        used += b
    return out
