"""Refresh results (and their inputs) in the NVMe spill store, for the runtime.

Owns: the protocol between the runtime and ``asteria.memory.SpillStore`` for the blocks the tier
policy spills: a finished refresh's results are written under ``{block}/v{version}/r{dim}.{j}``
and its inputs (the factor and basis snapshots taken at the request) under ``.../s{dim}.{j}``;
host copies are dropped only once their write succeeded; spilled results are paged back ahead of
use (``prefetch``, in access order) and read back, checksum-verified, at install.

Failures: a write that fails (ENOSPC, EIO, a full store) keeps that refresh in host memory and
warns once per runtime; nothing is lost. A read that fails or does not match its checksum raises
``SpillLost``; the runtime then recomputes the refresh from its snapshot (the same inputs, so the
same result) or, if the snapshot is lost too, from the block's current factors.

Must not: decide what to spill (``asteria.memory.tiers``) or install anything (``runtime.py``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from asteria.memory.nvme import SpillChecksumError, SpillFuture, SpillIOError, SpillStore

__all__ = ["SpillLost", "SpilledRefresh", "Spiller"]


class SpillLost(RuntimeError):
    """A spilled refresh could not be read back intact (checksum mismatch or I/O error)."""


class SpilledRefresh:
    """Per dim: ``None``, a tensor or a tuple of tensors/None, kept in the spill store.

    ``host`` holds the values while their writes are in flight, and for good when a write
    failed (``failed``); ``paged`` says the reads were started ahead of use.
    """

    def __init__(self, prefix: str, dims: int) -> None:
        self.prefix = prefix
        self.layout: list[Any] = [None] * dims  # per dim: None, key, or tuple of key/None
        self.host: list[Any] = [None] * dims
        self.writes: list[tuple[str, SpillFuture]] = []
        self.order: dict[str, tuple[int, ...]] = {}  # key -> dims to permute back (strides)
        self.failed = False
        self.settled = False
        self.paged = False

    def keys(self) -> list[str]:
        out: list[str] = []
        for entry in self.layout:
            if isinstance(entry, str):
                out.append(entry)
            elif isinstance(entry, tuple):
                out.extend(k for k in entry if k is not None)
        return out

    def host_tensors(self) -> list[torch.Tensor]:
        """The tensors this record keeps in host memory (in flight, or after a failure)."""
        out: list[torch.Tensor] = []
        for value in self.host:
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif isinstance(value, tuple):
                out.extend(t for t in value if isinstance(t, torch.Tensor))
        return out


def _memory_order(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """``t`` as a contiguous tensor in its memory order, and the permutation that gives ``t``'s
    strides back (None: already contiguous). LAPACK results are column-major, and matmuls round
    differently by layout, so a spilled tensor must come back with the strides it had."""
    if t.is_contiguous() or t.dim() < 2:
        return t, None
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    dense = t.permute(order)
    if not dense.is_contiguous():  # overlapping or gapped: no layout to keep
        return t.contiguous(), None
    back = [0] * t.dim()
    for i, d in enumerate(order):
        back[d] = i
    return dense, tuple(back)


class Spiller:
    """The runtime's spill store and its counters (``stats``)."""

    def __init__(self, path: str, capacity_bytes: int, io_threads: int = 2) -> None:
        self.store = SpillStore(path, capacity_bytes, io_threads=io_threads)
        self.warned = False
        self.counts = {
            "spilled_refreshes": 0,
            "snapshots": 0,
            "write_failures": 0,
            "read_failures": 0,
            "checksum_failures": 0,
            "recomputed_from_snapshot": 0,
            "recomputed_from_factors": 0,
            "paged_in": 0,
        }

    # -- writes ----------------------------------------------------------------------------------

    def add(self, rec: SpilledRefresh, dim: int, value: Any, clone: bool = False) -> None:
        """Write ``value`` (a tensor or a tuple of tensors/None) as ``rec``'s dim ``dim``."""
        if value is None:
            return
        if clone:  # live optimizer state: take a copy that the write may read at leisure
            value = tuple(
                None if t is None else t.detach().to("cpu", copy=True).contiguous() for t in value
            )
        rec.host[dim] = value
        rec.settled = False
        if rec.failed:
            return
        tensors = value if isinstance(value, tuple) else (value,)
        keys = []
        for j, t in enumerate(tensors):
            if t is None:
                keys.append(None)
                continue
            key = f"{rec.prefix}{dim}.{j}"
            dense, back = _memory_order(t)
            if back is not None:
                rec.order[key] = back
            try:
                rec.writes.append((key, self.store.put(key, dense)))
            except SpillIOError as err:  # the store is full: refused at once
                self._write_failed(rec, err)
                break
            keys.append(key)
        keys += [None] * (len(tensors) - len(keys))
        rec.layout[dim] = tuple(keys) if isinstance(value, tuple) else keys[0]

    def poll(self, rec: SpilledRefresh, wait: bool = False) -> bool:
        """Settle finished writes: drop host copies once all succeeded, keep them on a failure.
        Returns whether every write is settled."""
        remaining = []
        for key, future in rec.writes:
            if not wait and not future.done():
                remaining.append((key, future))
                continue
            try:
                future.result()
            except SpillIOError as err:
                self._write_failed(rec, err)
        rec.writes = remaining
        if remaining:
            return False
        if not rec.settled:
            if rec.failed:  # keep every value in host memory; free what did get written
                for key in rec.keys():
                    self.store.delete(key)
                rec.layout = [None] * len(rec.layout)
            else:
                rec.host = [None] * len(rec.host)
        rec.settled = True
        return True

    def _write_failed(self, rec: SpilledRefresh, err: OSError) -> None:
        self.counts["write_failures"] += 1
        rec.failed = True
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"Asteria: writing refresh state to the spill file {self.store.path} failed "
                f"({err}); keeping it in host memory instead. Training continues and nothing is "
                "lost; later spill failures are counted in Runtime.memory_report()['spill'], "
                "not warned about again. Free space on the drive or raise host_budget_bytes.",
                RuntimeWarning,
                stacklevel=4,
            )

    # -- reads -----------------------------------------------------------------------------------

    def prefetch(self, recs: list[SpilledRefresh]) -> None:
        """Start reading ``recs`` (in this order) ahead of their use."""
        keys: list[str] = []
        for rec in recs:
            if rec.paged or not self.poll(rec) or rec.failed:
                continue
            rec.paged = True
            keys.extend(rec.keys())
        if keys:
            self.counts["paged_in"] += self.store.prefetch(keys)

    def load(self, rec: SpilledRefresh) -> list[Any]:
        """``rec``'s values, read back and checksum-verified; ``SpillLost`` when they are not."""
        self.poll(rec, wait=True)
        if rec.failed:
            return list(rec.host)
        out: list[Any] = []

        def get(key: str | None) -> torch.Tensor | None:
            if key is None:
                return None
            t = self.store.get(key)
            back = rec.order.get(key)
            return t if back is None else t.permute(back)

        try:
            for entry in rec.layout:
                if entry is None or isinstance(entry, str):
                    out.append(get(entry))
                else:
                    out.append(tuple(get(k) for k in entry))
        except SpillChecksumError as err:
            self.counts["checksum_failures"] += 1
            raise SpillLost(str(err)) from err
        except SpillIOError as err:
            self.counts["read_failures"] += 1
            raise SpillLost(str(err)) from err
        return out

    def discard(self, rec: SpilledRefresh | None) -> None:
        """Forget ``rec``: its writes are settled first, then its slots are freed."""
        if rec is None:
            return
        self.poll(rec, wait=True)
        for key in rec.keys():
            self.store.delete(key)
        rec.layout = [None] * len(rec.layout)
        rec.host = [None] * len(rec.host)

    # -- accounting ------------------------------------------------------------------------------

    def nvme_bytes(self, rec: SpilledRefresh | None) -> int:
        if rec is None:
            return 0
        return sum(self.store.nbytes(k) for k in rec.keys() if k in self.store)

    def paged_bytes(self, rec: SpilledRefresh | None) -> int:
        """Host bytes of reads started ahead of use and not yet taken by ``load``."""
        return self.nvme_bytes(rec) if rec is not None and rec.paged else 0

    def stats(self) -> dict[str, Any]:
        s = self.store.stats()
        return {
            **self.counts,
            "path": s["path"],
            "mode": s["mode"],
            "used_bytes": int(s["used_bytes"]),
            "capacity_bytes": int(s["capacity_bytes"]),
            "prefetch_hits": int(s["prefetch_hits"]),
        }

    def close(self) -> None:
        self.store.close()
