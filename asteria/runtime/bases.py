"""How the optimizer reaches the bases in use: one strategy per runtime, chosen at attach time.

Owns: where a block's bases (SOAP's and KL-Shampoo's eigenbases, Shampoo's inverse roots) live
while the runtime is attached, how an install puts new ones there, and what the optimizer reads
(``Refresher.bases``). ``attach.choose_bases`` picks one from the tier policy's
``bases_access``:

* ``DeviceBases`` (``direct``): in the block's own tensors, on the parameters' device, as in
  native mode. On CPU with the statistics lane, an install that computes (SOAP's rotation of
  ``m``) is queued on the lane, and the block's next read of its state waits for it
  (``settle``; Note [Statistics lane] in lane.py);
* ``MappedBases`` (``mapped``, unified-memory GPUs): in pinned host memory, read by the device
  through mapped views (``asteria.memory.device_view``);
* ``WindowBases`` (``window``, discrete GPUs): in pinned host memory; the optimizer reads
  device copies from a ring of buffers filled just before use, the next block's copy
  overlapping the current block's kernels (Note [Bases window] in asteria/memory/window.py).

Every strategy hands back, at ``close()``, the bases as native mode keeps them (on the
parameters' device).

Note [Bases made by a step]: the host strategies move a block's bases to host memory when an
install makes them, and at a step's end the bases the step itself made (the optimizer's first
step of a block). Looking for those at every step end would visit every block at every step, a
host cost that grows with the blocks (issue 37); the look stops once a step end moved nothing
and every parameter has its state (no block can be made later), and starts again when the
optimizer loads a state (``state_replaced``).

Note [Grouped install copies]: a refresh result is host memory (the C++ pool's), pageable, and
a blocking copy from it to a GPU synchronizes the training stream. ``install_many`` moves every
result of a batch (a step's finished refreshes, installed at the first module signal) to the
device at once: per device and dtype, one pinned buffer filled by one ``torch._foreach_copy_``
and one non-blocking copy to the device, the results becoming views of it with their own
layouts; the window then copies the new bases back to host memory in one ``to_host`` (one
event). A step's installs thus cost a constant number of copies, not a few per block.

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

Must not: decide what to install or when (refreshes.py, schedule.py), change the optimizer's
math (``install_refresh`` carries state over), or place anything the tier policy did not.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from asteria.memory.host import (
    device_view,
    host_copy,
    host_empty,
    is_host_tensor,
    release_host_cache,
)
from asteria.memory.window import BasesWindow, view_like
from asteria.optim.base import BlockKey, KroneckerOptimizer
from asteria.optim.batched import pieces
from asteria.runtime.lane import StatisticsLane

__all__ = ["BasesAccess", "DeviceBases", "MappedBases", "WindowBases"]


class BasesAccess:
    """The interface of every strategy (see module docstring)."""

    #: Whether what ``read`` returns stays valid until the step ends (``Refresher.bases_stable``).
    stable = True
    #: Whether an install that computes runs off the training thread (it then costs the step
    #: nothing: Note [Paced installs] in schedule.py).
    installs_off_thread = False

    def __init__(self, optimizer: KroneckerOptimizer) -> None:
        self.optimizer = optimizer
        self.field = optimizer.bases_field

    def read(self, key: BlockKey, block: dict) -> list:
        """What the update that follows reads as ``block``'s bases (``Refresher.bases``)."""
        return block[self.field]

    def settle(self, key: BlockKey) -> None:
        """Wait for ``key``'s install if one runs elsewhere (before a request reads the basis)."""

    #: Bytes of bases ``read_many`` can hand out at once (``Refresher.bases_room``; None: no
    #: limit).
    room: int | None = None

    def read_many(self, keys: list[BlockKey], blocks: list[dict]) -> list[list]:
        """What the update that follows reads as each block's bases, valid together until the
        next ``read``/``read_many`` or the step's end (``Refresher.bases_many``)."""
        return [self.read(k, b) for k, b in zip(keys, blocks)]

    def install(self, key: BlockKey, block: dict, results: list[Any]) -> None:
        """``install_refresh`` of ``results`` into ``block``, where this strategy keeps bases."""
        self.install_many([(key, block, results)])

    def install_many(self, items: list[tuple[BlockKey, dict, list[Any]]]) -> None:
        """``install`` of each ``(key, block, results)``, the results moved to the device in
        grouped copies (``to_device_many``)."""
        moved = to_device_many([r for _, _, r in items], [b for _, b, _ in items])
        for (key, block, _), results in zip(items, moved):
            self._install_one(key, block, results)

    def _install_one(self, key: BlockKey, block: dict, results: list[Any]) -> None:
        """``install_refresh`` of ``results`` (on the block's device already)."""
        self.optimizer.install_refresh(block, results)

    def state_replaced(self) -> None:
        """The optimizer loaded a state: its blocks' bases are new (Note [Bases made by a
        step])."""

    def host_sync(self) -> None:
        """Wait for the copies of bases to host memory still in flight (before the host reads
        the block's bases: ``Runtime.sync``; Note [Host writes] in asteria/memory/copies.py)."""

    def step_end(self) -> None:
        """The step's last block is updated."""

    def close(self) -> None:
        """Back to native mode: the bases in the parameters' device memory."""

    def is_mapped(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a mapped view of host memory (``memory_report``: a host byte)."""
        return False

    def buffers(self) -> list[torch.Tensor]:
        """Device memory the strategy itself holds for bases (the window's slots)."""
        return []

    def stats(self) -> dict[str, int] | None:
        """The window's counters, or None."""
        return None


class DeviceBases(BasesAccess):
    """The block's own tensors; installs that compute on the statistics lane where it runs."""

    def __init__(
        self,
        optimizer: KroneckerOptimizer,
        lane: StatisticsLane | None = None,
        install_flops: Callable[[BlockKey, dict | None], float] | None = None,
    ) -> None:
        super().__init__(optimizer)
        # installs go to the lane for optimizers that read their bases (and the state installs
        # rewrite) only after ``Refresher.bases``
        self._lane = lane if optimizer.reads_bases_through_refresher else None
        self._flops = install_flops
        self.installs_off_thread = self._lane is not None
        self._queued: set[BlockKey] = set()  # blocks with an install queued on the lane

    def read(self, key: BlockKey, block: dict) -> list:
        if self._queued:
            self.settle(key)  # the update reads the bases, then m and v
        return block[self.field]

    def settle(self, key: BlockKey) -> None:
        if key in self._queued:
            self._queued.discard(key)
            self._lane.wait(key)

    def read_many(self, keys: list[BlockKey], blocks: list[dict]) -> list[list]:
        if self._queued:
            for key in keys:
                self.settle(key)
        field = self.field
        return [b[field] for b in blocks]

    def _install_one(self, key: BlockKey, block: dict, results: list[Any]) -> None:
        if self._lane is not None and self._flops(key, block) > 0:
            # an install that computes (SOAP's rotation of m) runs on the statistics lane; the
            # block's next read of its state waits for it (``settle``)
            self._lane.submit(key, _install_weakly, weakref.ref(self.optimizer), block, results)
            self._queued.add(key)
            return
        self.optimizer.install_refresh(block, results)


def _install_weakly(opt: weakref.ref, block: dict, results: list[Any]) -> None:
    """On the statistics lane: ``install_refresh``, unless the optimizer is gone."""
    optimizer = opt()
    if optimizer is not None:
        optimizer.install_refresh(block, results)


class MappedBases(BasesAccess):
    """Pinned host memory, read by the GPU through mapped views (unified-memory GPUs)."""

    def __init__(self, optimizer: KroneckerOptimizer) -> None:
        super().__init__(optimizer)
        self._mapped: set[int] = set()  # data_ptr of bases read through mapped views
        self._unmapped_may_exist = True  # Note [Bases made by a step]

    def _install_one(self, key: BlockKey, block: dict, results: list[Any]) -> None:
        super()._install_one(key, block, results)
        self._map(block)

    def step_end(self) -> None:
        if not self._unmapped_may_exist:
            return  # Note [Bases made by a step]
        before = len(self._mapped)
        for _, _, block, _ in self.optimizer.blocks():  # bases a first step made
            self._map(block)
        self._unmapped_may_exist = len(self._mapped) != before or not _all_made(self.optimizer)

    def state_replaced(self) -> None:
        self._unmapped_may_exist = True

    def _map(self, block: dict) -> None:
        """Move a block's bases in use to pinned host memory, read by the GPU through views."""
        bases = block[self.field]
        for i, q in enumerate(bases):
            if q is None or not q.is_cuda or q.data_ptr() in self._mapped:
                continue
            view = device_view(host_copy(q, pinned=True), q.device)
            self._mapped.add(view.data_ptr())
            bases[i] = view

    def close(self) -> None:
        if not self._mapped:
            return
        for _, _, block, _ in self.optimizer.blocks():
            bases = block[self.field]
            for i, q in enumerate(bases):
                if q is not None and q.data_ptr() in self._mapped:
                    bases[i] = q.clone()
        self._mapped.clear()

    def is_mapped(self, t: torch.Tensor) -> bool:
        return t.data_ptr() in self._mapped


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
        self._group_blocks: dict[tuple, list[dict]] = {}  # the blocks of each group read
        self._unhosted_may_exist = True  # Note [Bases made by a step]
        self._unhosted: list[dict] = []  # blocks installed since the last copy to host memory

    @property
    def room(self) -> int:
        """A group read at once shares one slot (``read_many``)."""
        return self.window.slot_bytes

    def read(self, key: BlockKey, block: dict) -> list:
        if self._unhosted:
            self._host_installed()
        return self._use(key, block, prefetch=True)

    def read_many(self, keys: list[BlockKey], blocks: list[dict]) -> list[list]:
        """The group's bases packed into one slot: one grouped copy and one event for the
        group (a group too big for a slot grows the window through ``fit``)."""
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

    def step_end(self) -> None:
        """The last block's kernels are issued; bases made this step (first steps) go to host
        memory (Note [Bases made by a step]); the order the step read the blocks in becomes
        the prefetch order."""
        self.window.finish()
        self._host_installed()
        if self._unhosted_may_exist:
            blocks = [block for _, _, block, _ in self.optimizer.blocks()]
            moved = self._host_bases_many(blocks, count=True)
            self._unhosted_may_exist = moved > 0 or not _all_made(self.optimizer)
        seen = self._seen
        if seen:
            self._next = {k: seen[(i + 1) % len(seen)] for i, k in enumerate(seen)}
            self._seen = []
            groups = self._group_blocks  # only the groups read this step stay prefetchable
            self._group_blocks = {k: groups[k] for k in self._next if k in groups}

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

    def _use_srcs(self, key: Any, srcs: list[Any], prefetch: bool) -> list[Any]:
        """``_use`` of the host tensors ``srcs`` of ``key``: a block, or a group of blocks read
        together (a tuple of keys)."""
        if all(q is None for q in srcs):
            return list(srcs)  # nothing to read yet (Shampoo before its first roots, 1-D SOAP)
        upcoming = None
        if prefetch:
            self._seen.append(key)
            nxt = self._next.get(key)
            nsrcs = None if nxt is None else self._srcs_or_none(nxt)
            if nsrcs is not None and (
                not self._unhosted_may_exist or all(q is None or is_host_tensor(q) for q in nsrcs)
            ):
                upcoming = (nxt, nsrcs)
        if not self.window.holds(key, srcs):
            need = BasesWindow.bytes_of(srcs)
            if need > self.window.slot_bytes:
                self._fit(key, need, self.window)
        return self.window.use(key, srcs, upcoming)

    def _srcs_or_none(self, key: Any) -> list[Any] | None:
        """The bases of block ``key``, or of the group ``key`` (all its blocks' in order)."""
        if isinstance(key[0], tuple):
            blocks = self._group_blocks.get(key)
            return None if blocks is None else [q for b in blocks for q in b[self.field]]
        block = self._block_or_none(key)
        return None if block is None else block[self.field]

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


def _all_made(optimizer: KroneckerOptimizer) -> bool:
    """Whether every parameter of ``optimizer`` has its state (no block is made later)."""
    return len(optimizer.state) >= sum(len(g["params"]) for g in optimizer.param_groups)


def to_device_many(results: list[list[Any]], blocks: list[dict]) -> list[list[Any]]:
    """``to_device`` of each block's ``results`` (a list per block), in grouped copies: the
    host tensors bound for one CUDA device go, per dtype, through one pinned buffer and one
    copy (Note [Grouped install copies]); elsewhere each is moved as ``to_device`` moves it."""
    out = [list(r) for r in results]
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[list, int, int | None]]] = {}
    for rs, block in zip(out, blocks):
        device = _device_of(block)
        for i, r in enumerate(rs):
            for j, t in _tensors_of(r):
                if device.type == "cuda" and t.device.type == "cpu":
                    groups.setdefault((device, t.dtype), []).append((rs, i, j))
                else:
                    _put(rs, i, j, t.to(device))
    for (device, dtype), where in groups.items():
        _grouped_to(device, dtype, where)
    return out


def _tensors_of(result: Any) -> list[tuple[int | None, torch.Tensor]]:
    if result is None:
        return []
    if isinstance(result, tuple):
        return [(j, t) for j, t in enumerate(result) if t is not None]
    return [(None, result)]


def _get(rs: list, i: int, j: int | None) -> torch.Tensor:
    return rs[i] if j is None else rs[i][j]


def _put(rs: list, i: int, j: int | None, t: torch.Tensor) -> None:
    if j is None:
        rs[i] = t
    else:
        rs[i] = rs[i][:j] + (t,) + rs[i][j + 1 :]


def _grouped_to(device: torch.device, dtype: torch.dtype, where: list) -> None:
    """Note [Grouped install copies]: the host tensors ``where`` points at (all ``dtype``)
    packed into one pinned buffer (one ``_foreach_copy_``), copied to ``device`` in one
    non-blocking copy, and replaced by views of it with their own layouts (the same
    arithmetic). torch's pinned-memory cache keeps the buffer until the copy has run."""
    srcs = [_get(rs, i, j) for rs, i, j in where]
    total = sum(t.numel() for t in srcs)
    flat = torch.empty(total, dtype=dtype, pin_memory=True)
    views, offset = [], 0
    for t in srcs:
        views.append(view_like(flat[offset : offset + t.numel()], t))
        offset += t.numel()
    torch._foreach_copy_(views, srcs)
    dev = flat.to(device, non_blocking=True)
    offset = 0
    for (rs, i, j), t in zip(where, srcs):
        _put(rs, i, j, view_like(dev[offset : offset + t.numel()], t))
        offset += t.numel()


def _device_of(block: dict) -> torch.device:
    return next(t for t in block["factors"] if t is not None).device
