"""The window strategy of the bases: pinned host memory behind a device window (discrete GPUs).

Owns: ``WindowBases``, the ``window`` bases strategy of bases.py (its interface, the other
strategies and Notes [Bases made by a step] and [Grouped install copies] are there): which host
tensors a block's bases are, which of them a read hands to the ring of
asteria/memory/window.py and in what slots' worths (a block, a shape group, a piece of the step
read together: Note [Reads together] there), how an install reads the bases it replaces and
when its new bases are copied back to host memory, and the process-wide count of open windows
that frees the cache of reused host blocks.

Note [Host copies of a step's installs]: the window keeps the bases in host memory, so the new
bases an install leaves on the device are copied there. A block whose refresh reaches its
deadline is installed at its boundary, one ``install_many`` a block, and a copy to host per
install made a step with many such installs pay a copy (and its event) per block. The copies
wait instead: ``install_many`` lists its blocks, and one ``to_host`` moves the bases of every
block listed at the first of the step's end, the next ``read``/``read_many`` and ``host_sync``
(``Runtime.sync``: before the host reads the state). Until then the block's bases are device
tensors, as ``DeviceBases`` keeps them: what a request at the same boundary reads (the next
refresh's input) and what ``close`` keeps. An install that reads the bases it replaces (SOAP's
rotation of ``m``) takes their device copies from the slot that holds them where one does (the
block's shape group, just updated by the step: ``BasesWindow.part``) instead of a fill.

Note [Pieces read together]: the optimizers cut a step's blocks into pieces of ``room`` bytes
of bases (``bases_room``), and each piece completes its update while its bases are valid, so a
piece costs its fill and one set of the update's elementwise ops (SOAP's nine ``_foreach`` ops).
A slot holds the largest shape group's bases (Note [Window by shape group] in
asteria/memory/tiers.py), so a step of two shape groups was two pieces, though the two-slot
ring held both: `tiny`'s SOAP step, 83 ATen ops against native's 74. So the window learns, at
each step's end, the slots' worths the step read (``_learn_runs``); where they were at least
two and at most the ring's slots, the next step's ``room`` is the whole ring, and a piece up to
it is read in those slots' worths, each in its slot, together (``BasesWindow.use(...,
together=True)``, Note [Reads together] in window.py): a quiet step then fills nothing and runs
the update as one piece, as native mode does. A piece with blocks the last step did not read
(a parameter's first steps) is read into a spare buffer of its own (``BasesWindow.spare``), and
the next step's room is a slot again. The device memory stays the ring's; a step whose shape
groups outnumber the slots (OLMo-150m's widths: three groups) reads a slot at a time as before.

Must not: decide what to install or when (refreshes.py, schedule.py), change the optimizer's
math (``install_refresh`` carries state over), size the window (the tier policy and the
runtime's ``fit`` do) or order its copies (window.py does).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from asteria.memory.host import host_empty, is_host_tensor, release_host_cache
from asteria.memory.window import BasesWindow, view_like
from asteria.optim.base import BlockKey, KroneckerOptimizer
from asteria.optim.batched import pieces
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


class WindowBases(BasesAccess):
    """Pinned host memory behind a device window (Note [Bases window]). ``fit(key, need)``
    is called before a block's bases of ``need`` bytes go through slots that are too small;
    it grows the window or raises (the budgets are the runtime's)."""

    stable = False  # a window slot is reused two blocks later

    def __init__(
        self,
        optimizer: KroneckerOptimizer,
        window: BasesWindow,
        fit: Callable[[BlockKey, int, BasesWindow], None],
    ) -> None:
        global _open_windows
        super().__init__(optimizer)
        self.window = window
        self._fit = fit
        with _open_windows_lock:
            _open_windows += 1
        self._gone = weakref.finalize(self, _window_gone)  # runs once: close() or collection
        self._gone.atexit = False  # the cache outlives the process's CUDA runtime (the Note)
        self._seen: list[BlockKey] = []  # blocks in the order this step read their bases
        self._next: dict[Any, Any] = {}  # the block (or group) read after each, last step
        # the last two steps' reads in order, each with the next other read after each, and
        # whether this step's reads so far are theirs (Note [Prefetch by position])
        self._orders: list[tuple[list, list]] = []
        self._alike = [True, True]
        self._group_blocks: dict[tuple, list[dict]] = {}  # the blocks of each group read
        self._unhosted_may_exist = True  # Note [Bases made by a step]
        self._unhosted: list[dict] = []  # blocks installed since the last copy to host memory
        self._run_of: dict[Any, int] = {}  # block -> the slot's worth it was read in, last step
        self._together = False  # whether last step's reads fitted the ring at once
        self._spared = False  # whether this step read a piece outside the ring

    @property
    def room(self) -> int:
        """A group read at once shares one slot (``read_many``); the whole ring where the last
        step's reads fitted it at once (Note [Reads together] in asteria/memory/window.py)."""
        if self._together:
            return self.window.slot_bytes * self.window.slots
        return self.window.slot_bytes

    def read(self, key: BlockKey, block: dict) -> list:
        if self._unhosted:
            self._host_installed()
        return self._use(key, block, prefetch=True)

    def read_many(self, keys: list[BlockKey], blocks: list[dict]) -> list[list]:
        """The group's bases packed into one slot: one grouped copy and one event for the
        group (a group too big for a slot grows the window through ``fit``); while the ring
        holds a step's reads at once, a piece up to the ring in several slots, handed out
        together (``_read_together``, Note [Pieces read together])."""
        if len(keys) == 1:
            return [self.read(keys[0], blocks[0])]
        if self._unhosted:
            self._host_installed()
        group = tuple(keys)
        self._group_blocks[group] = list(blocks)
        hosted = (
            self._host_bases_many(blocks)
            if self._unhosted_may_exist
            else [b[self.field] for b in blocks]
        )  # (every basis is in host memory: Note [Bases made by a step])
        if self._together:
            return self._read_together(keys, blocks, hosted)
        flat = [q for bases in hosted for q in bases]
        views = self._use_srcs(group, flat, prefetch=True)
        out, i = [], 0
        for bases in hosted:
            out.append(views[i : i + len(bases)])
            i += len(bases)
        return out

    def install_many(self, items: list[tuple[BlockKey, dict, list[Any]]]) -> None:
        """The new bases go to pinned host memory (Note [Host copies of a step's installs]). An
        install that reads the current bases (SOAP's rotation of ``m``) reads their device
        copies where a slot holds them already (the shape group the step just updated:
        ``BasesWindow.part``), else from the window, the rest of the batch in pieces of a slot
        each, one fill and one event a piece (Note [Window by shape group] in
        asteria/memory/tiers.py), not one a block."""
        moved = to_device_many([r for _, _, r in items], [b for _, b, _ in items])
        blocks = [b for _, b, _ in items]
        hosted = [list(h) for h in self._host_bases_many(blocks)]  # (keys: one item a block)
        reads = self.optimizer.install_reads_bases
        missing = []
        for i, h in enumerate(hosted):
            if not reads or all(q is None for q in h):
                self.optimizer.install_refresh(blocks[i], moved[i])
                continue
            views = self.window.part(h)
            if views is None:
                missing.append(i)
            else:
                self._install_reading(blocks[i], h, views, moved[i])
        room = self.window.slot_bytes
        for piece in pieces(missing, lambda i: 0, lambda i: BasesWindow.bytes_of(hosted[i]), room):
            keys = tuple(items[i][0] for i in piece)
            flat = [q for i in piece for q in hosted[i]]
            views = self._use_srcs(keys if len(keys) > 1 else keys[0], flat, prefetch=False)
            at = 0
            for i in piece:  # the views are valid until the next fill: install the piece now
                n = len(hosted[i])
                self._install_reading(blocks[i], hosted[i], views[at : at + n], moved[i])
                at += n
        self._unhosted.extend(blocks)  # copied to host memory once, before the next read

    def _host_installed(self) -> None:
        """The copy to host memory of the bases the installs since the last one made (Note
        [Host copies of a step's installs]): one ``to_host`` for them all."""
        if self._unhosted:
            self._host_bases_many(self._unhosted)
            self._unhosted = []

    def _install_reading(
        self, block: dict, hosted: list[Any], handed: list[Any], results: list[Any]
    ) -> None:
        """``install_refresh`` of ``results`` into ``block`` with its bases read from the window's
        device copies ``handed`` (of its host tensors ``hosted``)."""
        bases = block[self.field]
        bases[:] = handed
        self.optimizer.install_refresh(block, results)
        bases = block[self.field]
        for i, q in enumerate(handed):  # a dim the refresh left alone keeps its host tensor
            if q is not None and bases[i] is q:
                bases[i] = hosted[i]

    def state_replaced(self) -> None:
        self._unhosted_may_exist = True
        self._unhosted = []  # the loaded blocks replace them (and are looked at: the flag)
        self._together, self._run_of = False, {}  # their sizes are learnt again (a slot's room)

    def step_end(self) -> None:
        """The last block's kernels are issued; bases made this step (first steps) go to host
        memory (Note [Bases made by a step]); the order the step read the blocks in becomes
        the prefetch order."""
        self.window.finish()
        self._host_installed()
        if self._unhosted_may_exist:
            blocks = [block for _, _, block, _ in self.optimizer.blocks()]
            moved = self._host_bases_many(blocks, count=True)
            self._unhosted_may_exist = moved > 0 or not all_made(self.optimizer)
        seen = self._seen
        self._learn_runs(seen)
        if seen:
            before = self._orders[0][0] if self._orders else []
            after = _next_others(seen)
            self._orders = [(seen, after), (before, _next_others(before + seen)[: len(before)])]
            self._next = dict(zip(seen, after))
            self._seen = []
            self._alike = [True, True]
            groups = self._group_blocks  # only the groups read this step stay prefetchable
            self._group_blocks = {k: groups[k] for k in self._next if k in groups}

    def _learn_runs(self, seen: list[Any]) -> None:
        """The slots' worths this step read (``seen``: blocks and groups of blocks), kept as the
        next step's split of a read together where the ring holds them all at once (Note
        [Reads together] in asteria/memory/window.py)."""
        runs = list(dict.fromkeys(seen))
        spared, self._spared = self._spared, False
        self._together = not spared and 2 <= len(runs) <= self.window.slots
        if not self._together:
            self._run_of = {}
            return
        self._run_of = {
            k: r
            for r, run in enumerate(runs)
            for k in (run if isinstance(run[0], tuple) else [run])
        }

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

    def _use(self, key: BlockKey, block: dict, prefetch: bool) -> list[Any]:
        """Device copies of ``key``'s bases from the window; with ``prefetch``, also start the
        copy of the block (or group) read after it last step."""
        return self._use_srcs(key, self._host_bases(block), prefetch)

    def _read_together(self, keys: list[BlockKey], blocks: list[dict], hosted: list) -> list:
        """``read_many`` of a piece up to the ring's size (``room`` while ``_together``): its
        blocks in the slots' worths the last step read them in, each in a slot (a hit where the
        ring still holds it), handed out together (Note [Reads together]); a piece that does
        not split so (new blocks) is read into a spare buffer, and the next step's room is a
        slot again."""
        runs: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            if hosted[i].count(None) == len(hosted[i]):
                continue  # no bases to read (1-D SOAP blocks, Shampoo before its roots)
            run = self._run_of.get(key)
            if run is None:
                runs = {}
                break
            runs.setdefault(run, []).append(i)
        out: list[list] = [list(h) for h in hosted]
        flats = [[q for i in idx for q in hosted[i]] for idx in runs.values()]
        room = self.window.slot_bytes  # (a run over it would resize the ring under the others)
        if (
            not runs
            or len(runs) > self.window.slots
            or max(map(BasesWindow.bytes_of, flats)) > room
        ):
            if any(q is not None for h in hosted for q in h):
                self._spared = True
                views = self.window.spare([q for h in hosted for q in h])
                at = 0
                for i, h in enumerate(hosted):
                    out[i] = views[at : at + len(h)]
                    at += len(h)
            return out
        for j, (idx, flat) in enumerate(zip(runs.values(), flats)):
            key = tuple(keys[i] for i in idx) if len(idx) > 1 else keys[idx[0]]
            if len(idx) > 1:
                self._group_blocks[key] = [blocks[i] for i in idx]
            views = self._use_srcs(key, flat, prefetch=True, together=j > 0)
            at = 0
            for i in idx:
                out[i] = views[at : at + len(hosted[i])]
                at += len(hosted[i])
        return out

    def _use_srcs(
        self, key: Any, srcs: list[Any], prefetch: bool, together: bool = False
    ) -> list[Any]:
        """``_use`` of the host tensors ``srcs`` of ``key``: a block, or a group of blocks read
        together (a tuple of keys)."""
        if srcs.count(None) == len(srcs):
            return list(srcs)  # nothing to read yet (Shampoo before its first roots, 1-D SOAP)
        upcoming = None
        if prefetch:
            nxt = self._read_after(len(self._seen), key)  # Note [Prefetch by position]
            self._seen.append(key)
            nsrcs = None if nxt is None else self._srcs_or_none(nxt)
            if nsrcs is not None and (
                not self._unhosted_may_exist or all(q is None or is_host_tensor(q) for q in nsrcs)
            ):
                upcoming = (nxt, nsrcs)
        return self.window.use(
            key, srcs, upcoming, together, lambda need: self._fit(key, need, self.window)
        )

    def _read_after(self, at: int, key: Any) -> Any:
        """The read expected after this step's read number ``at``, of ``key``: from the last
        step whose reads this step's have been so far, else the read after ``key``'s last read
        last step (None: none)."""
        found = None
        for i, (order, after) in enumerate(self._orders):
            self._alike[i] = self._alike[i] and at < len(order) and order[at] == key
            if self._alike[i] and found is None:
                found = after[at]
        return self._next.get(key) if found is None else found

    def _srcs_or_none(self, key: Any) -> list[Any] | None:
        """The bases of block ``key``, or of the group ``key`` (all its blocks' in order)."""
        if isinstance(key[0], tuple):
            blocks = self._group_blocks.get(key)
            return None if blocks is None else [q for b in blocks for q in b[self.field]]
        block = self._block_or_none(key)
        return None if block is None else block[self.field]

    def settle(self, key: BlockKey) -> None:
        """A refresh's job reads the block's bases as its input: where they are host tensors,
        the copies to host that write them must have landed (Note [Host sources of a snapshot]
        in asteria/memory/staging.py; free once they have)."""
        block = self._block_or_none(key)
        if block is not None and any(
            q is not None and not q.is_cuda and is_host_tensor(q) for q in block[self.field]
        ):
            self.window.copies.host_sync()

    def host_sync(self) -> None:
        self._host_installed()
        self.window.copies.host_sync()

    def _host_bases(self, block: dict) -> list[Any]:
        """Move ``block``'s bases that are not in Asteria host memory there (pinned on CUDA, in
        their own layout). The copies are not waited for (Note [Host writes] in
        asteria/memory/copies.py): the window's fills wait for them on the device, and the
        host's readers through ``host_sync``. The blocks are reused (Note [Reused host blocks] in
        csrc/memory/host_block.cpp): an install replaces a block's bases, and registering fresh
        pinned memory each time cost milliseconds per install."""
        return self._host_bases_many([block])[0]

    def _host_bases_many(self, blocks: list[dict], count: bool = False) -> Any:
        """``_host_bases`` of every block in ``blocks``, with one copy to host memory for them
        all; with ``count``, the number of tensors moved instead of the bases."""
        field = self.field
        moved = []
        for block in blocks:
            bases = block[field]
            for i, q in enumerate(bases):
                if q is not None and not is_host_tensor(q):  # q's layout: the same arithmetic
                    h = view_like(host_empty(q.numel(), q.dtype, pinned=q.is_cuda, reuse=True), q)
                    moved.append((bases, i, h))
        if moved:  # a block takes its host tensors only once their copies are issued
            self.window.copies.to_host([h for _, _, h in moved], [b[i] for b, i, _ in moved])
            for bases, i, h in moved:
                bases[i] = h
        return len(moved) if count else [block[field] for block in blocks]

    def _block_or_none(self, key: BlockKey) -> dict | None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = self.optimizer.state.get(params[key[0]]) if key[0] < len(params) else None
        blocks = None if state is None else state.get("blocks")
        return None if blocks is None or key[1] >= len(blocks) else blocks[key[1]]


def _next_others(order: list[Any]) -> list[Any]:
    """Per read of ``order`` (a step's reads, cyclic: the next step reads them again), the next
    read of another block or group; the read itself where every read is of it."""
    n = len(order)
    out = []
    for i, key in enumerate(order):
        j = i + 1
        while j < i + n and order[j % n] == key:
            j += 1
        out.append(order[j % n])
    return out


# Note [Prefetch by position]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A read prefetches what comes after it in the order the blocks were read at an earlier step.
# A step that reads a piece twice (SOAP over more pieces than the ring has slots: Note [Two
# passes over the pieces] in asteria/optim/soap_step.py, reads P0 P1 P2 P1 P0) follows a
# piece by different pieces at its two reads, so "the read after" is looked up by the read's
# position, and skips reads of the same piece (the next step's P0 after this one's): at P1 of
# the first pass, P2 (into the slot of P0, the least recently used); at P2, P1, which the
# ring holds, so nothing; at P1 of the second pass, P0. A step that reads its pieces in turns
# (Shampoo: Note [Reads in turns] in asteria/optim/shampoo_step.py, P0 P1 P2 then P2 P1 P0)
# reads as the step before the last, and what comes after its last read is the next step's
# second: so the window keeps the last two steps' orders, the older one's "after" taken over
# both, and follows the first whose reads this step's have been so far; a step unlike both
# falls back to the read after the block's last read last step. On OLMo-150m's widths a quiet
# SOAP step then fills two slots and a Shampoo step one, each prefetched.
