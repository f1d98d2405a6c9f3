"""How the optimizer reaches the bases in use: one strategy per runtime, chosen at attach time.

Owns: where a block's bases live while the runtime is attached, how an install puts new ones
there, and the pieces a step's groups are read in (``Refresher.pieces``): ``DeviceBases``
(``direct``: the blocks' own tensors; with the lane a computing install is queued there and the
block's next read waits, ``settle``), ``MappedBases`` (unified-memory GPUs: pinned host memory
through mapped views) or ``WindowBases`` (discrete GPUs, window_bases.py). Each hands back, at
``close()``, the bases as native mode keeps them. Must not: decide what to install or when,
change the optimizer's math, or place anything the tier policy did not.

Note [Bases made by a step]: the host strategies move new bases to host memory at installs, and
at a step's end those the step made (first steps); that look stops once a step end moved nothing
and every parameter has its state, until a load (``state_replaced``).

Note [Grouped install copies]: results are pageable host memory, and a blocking copy to a GPU
syncs the training stream. ``install_many`` moves a batch's results at once: per device and
dtype one pinned buffer (one ``_foreach_copy_``) and one non-blocking copy, the results views of
it in their own layouts; a constant number of copies a step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from asteria.memory.host import device_view, host_copy
from asteria.memory.window import view_like
from asteria.optim.base import KroneckerOptimizer
from asteria.optim.groups import BlockGroup, keys_of
from asteria.optim.refresher import BlockKey, Piece
from asteria.runtime.lane import StatisticsLane

__all__ = ["BasesAccess", "DeviceBases", "MappedBases", "all_made", "to_device_many"]


class BasesAccess:
    """The interface of every strategy (see module docstring)."""

    #: Whether an install that computes runs off the training thread (it then costs the step
    #: nothing: Note [Paced installs] in schedule.py).
    installs_off_thread = False
    #: Whether a request waits for something first (``settle``)
    settles = False

    def __init__(self, optimizer: KroneckerOptimizer) -> None:
        self.optimizer = optimizer
        self.field = optimizer.bases_field

    def pieces(self, groups: list[BlockGroup], passes: int = 1) -> list[Piece]:
        """``Refresher.pieces``: the step's groups as one piece, read from the blocks."""
        return [Piece(groups, self._read)]

    def _read(self, piece: Piece) -> list:
        field = self.field
        return [[b[field] for b in g.blocks] for g in piece.groups]

    def settle(self, keys: list[BlockKey], blocks: list[dict]) -> None:
        """Wait for the installs of ``keys`` that run elsewhere (before their requests read the
        bases)."""

    def install_many(self, items: list[tuple[BlockKey, dict, list[Any]]]) -> None:
        """``install_refresh`` of each ``(key, block, results)``, the results moved to the
        device in grouped copies (``to_device_many``), the blocks installed together
        (``install_refresh_many``: SOAP's per shape group)."""
        blocks = [b for _, b, _ in items]
        moved = to_device_many([r for _, _, r in items], blocks)
        self._install([k for k, _, _ in items], blocks, moved)

    def _install(self, keys: list[BlockKey], blocks: list[dict], results: list) -> None:
        self.optimizer.install_refresh_many(blocks, results)

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
        # installs that compute go to the lane: the update reads the bases (and the state an
        # install rewrites) only through ``Refresher.pieces``, which waits for them
        self._lane = lane
        self._flops = install_flops
        self.installs_off_thread = self.settles = self._lane is not None
        self._queued: set[BlockKey] = set()  # blocks with an install queued on the lane

    def _read(self, piece: Piece) -> list:
        if self._queued:  # the update reads the bases, then m and v: their installs first
            self.settle(keys_of(piece.groups), [])
        return super()._read(piece)

    def settle(self, keys: list[BlockKey], blocks: list[dict]) -> None:
        queued = self._queued
        if queued:
            for key in keys:
                if key in queued:
                    queued.discard(key)
                    self._lane.wait(key)

    def _install(self, keys: list[BlockKey], blocks: list[dict], results: list) -> None:
        if self._lane is None:
            self.optimizer.install_refresh_many(blocks, results)
            return
        opt = weakref.ref(self.optimizer)
        for key, block, result in zip(keys, blocks, results):
            if self._flops(key, block) > 0:
                # an install that computes (SOAP's rotation of m) runs on the statistics lane;
                # the block's next read of its state waits for it (``settle``)
                self._lane.submit(key, _install_weakly, opt, block, result)
                self._queued.add(key)
            else:
                self.optimizer.install_refresh(block, result)


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

    def _install(self, keys: list[BlockKey], blocks: list[dict], results: list) -> None:
        super()._install(keys, blocks, results)
        for block in blocks:
            self._map(block)

    def step_end(self) -> None:
        if not self._unmapped_may_exist:
            return  # Note [Bases made by a step]
        before = len(self._mapped)
        for _, _, block, _ in self.optimizer.blocks():  # bases a first step made
            self._map(block)
        self._unmapped_may_exist = len(self._mapped) != before or not all_made(self.optimizer)

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


def all_made(optimizer: KroneckerOptimizer) -> bool:
    """Whether every parameter of ``optimizer`` has its state (no block is made later)."""
    return len(optimizer.state) >= sum(len(g["params"]) for g in optimizer.param_groups)


def to_device_many(results: list[list[Any]], blocks: list[dict]) -> list[list[Any]]:
    """``to_device`` of each block's ``results``: host tensors bound for a CUDA device go, per
    dtype, through one pinned buffer and one copy (Note [Grouped install copies]); a CPU block's
    stay as they are. No Python call per block."""
    out = []
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[list, int, int | None]]] = {}
    for rs, block in zip(results, blocks):
        rs = list(rs)
        out.append(rs)
        device = None
        for f in block["factors"]:
            if f is not None:
                device = f.device
                break
        if device is None or device.type != "cuda":
            continue  # (the pool's results are CPU tensors)
        for i, r in enumerate(rs):
            if r is None:
                continue
            for j, t in enumerate(r) if isinstance(r, tuple) else ((None, r),):
                if t is None:
                    continue
                if t.device.type == "cpu":
                    groups.setdefault((device, t.dtype), []).append((rs, i, j))
                else:
                    _put(rs, i, j, t.to(device))
    for (device, dtype), where in groups.items():
        _grouped_to(device, dtype, where)
    return out


def _get(rs: list, i: int, j: int | None) -> torch.Tensor:
    return rs[i] if j is None else rs[i][j]


def _put(rs: list, i: int, j: int | None, t: torch.Tensor) -> None:
    if j is None:
        rs[i] = t
    else:
        rs[i] = rs[i][:j] + (t,) + rs[i][j + 1 :]


def _grouped_to(device: torch.device, dtype: torch.dtype, where: list) -> None:
    """Note [Grouped install copies]: the host tensors ``where`` points at packed into one pinned
    buffer, copied to ``device`` in one non-blocking copy, and replaced by views of it in their own
    layouts (torch's pinned cache keeps the buffer until the copy ran)."""
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
