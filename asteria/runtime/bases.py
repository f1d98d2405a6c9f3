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

    def install(self, key: BlockKey, block: dict, results: list[Any]) -> None:
        """``install_refresh`` of ``results`` into ``block``, where this strategy keeps bases."""
        self.optimizer.install_refresh(block, [to_device(r, block) for r in results])

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

    def install(self, key: BlockKey, block: dict, results: list[Any]) -> None:
        results = [to_device(r, block) for r in results]
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

    def install(self, key: BlockKey, block: dict, results: list[Any]) -> None:
        super().install(key, block, results)
        self._map(block)

    def step_end(self) -> None:
        for _, _, block, _ in self.optimizer.blocks():  # bases a first step made
            self._map(block)

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
        self._next: dict[BlockKey, BlockKey] = {}  # the block read after each, last step

    def read(self, key: BlockKey, block: dict) -> list:
        return self._use(key, block, prefetch=True)

    def install(self, key: BlockKey, block: dict, results: list[Any]) -> None:
        """The new bases are copied to pinned host memory right away; an install that reads
        the current bases (SOAP's rotation of ``m``) reads device copies from the window."""
        results = [to_device(r, block) for r in results]
        bases = self._host_bases(block)
        handed: list[Any] = []
        if self.optimizer.install_reads_bases and any(q is not None for q in bases):
            hosted = list(bases)
            handed = bases[:] = self._use(key, block, prefetch=False)
        self.optimizer.install_refresh(block, results)
        bases = block[self.field]
        for i, q in enumerate(handed):  # a dim the refresh left alone keeps its host tensor
            if q is not None and bases[i] is q:
                bases[i] = hosted[i]
        self._host_bases(block)

    def step_end(self) -> None:
        """The last block's kernels are issued; bases made this step (first steps) go to host
        memory; the order the step read the blocks in becomes the prefetch order."""
        self.window.finish()
        for _, _, block, _ in self.optimizer.blocks():
            self._host_bases(block)
        seen = self._seen
        if seen:
            self._next = {k: seen[(i + 1) % len(seen)] for i, k in enumerate(seen)}
            self._seen = []

    def close(self) -> None:
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
        copy of the block read after it last step."""
        srcs = self._host_bases(block)
        if all(q is None for q in srcs):
            return list(srcs)  # nothing to read yet (Shampoo before its first roots, 1-D SOAP)
        upcoming = None
        if prefetch:
            self._seen.append(key)
            nxt = self._next.get(key)
            nblock = None if nxt is None else self._block_or_none(nxt)
            if nblock is not None:
                nsrcs = nblock[self.field]
                if all(q is None or is_host_tensor(q) for q in nsrcs):
                    upcoming = (nxt, nsrcs)
        need = BasesWindow.bytes_of(srcs)
        if need > self.window.slot_bytes:
            self._fit(key, need, self.window)
        return self.window.use(key, srcs, upcoming)

    def host_sync(self) -> None:
        self.window.copies.host_sync()

    def _host_bases(self, block: dict) -> list[Any]:
        """Move ``block``'s bases that are not in Asteria host memory there (pinned on CUDA, in
        their own layout). The copies are not waited for (Note [Host writes] in
        asteria/memory/copies.py): the window's fills wait for them on the device, and the
        host's readers through ``host_sync``. The blocks are reused (Note [Reused host blocks] in
        csrc/memory/host_block.cpp): an install replaces a block's bases, and registering fresh
        pinned memory each time cost milliseconds per install."""
        bases = block[self.field]
        moved = {
            i: view_like(host_empty(q.numel(), q.dtype, pinned=q.is_cuda, reuse=True), q)
            for i, q in enumerate(bases)
            if q is not None and not is_host_tensor(q)
        }  # q's layout: the same arithmetic
        if moved:  # the block takes the host tensors only once their copies are issued
            self.window.copies.to_host(list(moved.values()), [bases[i] for i in moved])
            for i, h in moved.items():
                bases[i] = h
        return bases

    def _block_or_none(self, key: BlockKey) -> dict | None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = self.optimizer.state.get(params[key[0]]) if key[0] < len(params) else None
        blocks = None if state is None else state.get("blocks")
        return None if blocks is None or key[1] >= len(blocks) else blocks[key[1]]


def to_device(result: Any, block: dict) -> Any:
    """A refresh result (a tensor, or a tuple of tensors/None) on ``block``'s device."""
    if result is None:
        return None
    device = next(t for t in block["factors"] if t is not None).device
    if isinstance(result, tuple):
        return tuple(None if r is None else _moved(r, device) for r in result)
    return _moved(result, device)


def _moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``. A pool result is pageable host memory, and torch's blocking copy from
    it to a GPU synchronizes the training stream: the host would wait at every install for the
    GPU to drain (a likely part of why the H200's ``tiny`` steps doubled under the runtime,
    docs/gpu.md; not yet measured). Through pinned memory the copy is queued on the stream like
    a kernel (torch's pinned-memory cache keeps the buffer until the copy has run). The window's
    copy of new bases back to host memory does not wait either (``WindowBases._host_bases``)."""
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    if t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
