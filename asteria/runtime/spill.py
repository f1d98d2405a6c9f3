"""Refresh results (and their inputs) in the NVMe spill store, for the runtime.

Owns: ``SpillTier``: a finished refresh waiting for its install step (``fixed_delay`` >= 2) of a
block the tier policy spills has its results written under ``{block}/v{version}/r{dim}.{j}`` and
its inputs under ``.../s{dim}.{j}`` (host copies dropped once written), is paged back ahead of
use (``page_in``) and read back, checksum-verified, at install (``results``). A failed write
keeps the refresh in host memory (one warning); a failed read (``SpillLost``) recomputes it from
its inputs (the same result, at the same step) or, lost too, from the block's current factors.
``Spiller`` is the protocol with ``asteria.memory.SpillStore`` underneath.

Must not: decide what to spill (``asteria.memory.tiers``) or install anything (``refreshes.py``).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from asteria.memory.nvme import SpillChecksumError, SpillFuture, SpillIOError, SpillStore
from asteria.memory.tiers import BlockSizes, Placement

__all__ = ["SpillLost", "SpillTier", "SpilledRefresh", "Spiller", "open_spill"]


class SpillLost(RuntimeError):
    """A spilled refresh could not be read back intact (checksum mismatch or I/O error)."""


class SpilledRefresh:
    """Per dim: ``None``, a tensor or a tuple of tensors/None, kept in the spill store; ``host``
    holds the values while their writes are in flight (for good where one failed: ``failed``);
    ``paged``: the reads were started ahead of use."""

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


def open_spill(
    nvme_path: Any, fixed_delay: int | None, placement: Placement, sizes: list[BlockSizes]
) -> SpillTier | None:
    """The spill tier where the placement spills blocks and results wait for their install
    across a step boundary (``fixed_delay >= 2``), else None; sized for every spilled block's
    results and inputs (ValueError: the directory is too small or unusable)."""
    if not placement.spilled or fixed_delay is None or fixed_delay < 2:
        return None
    path = os.fspath(nvme_path)
    spilled = [b for b in sizes if b.name in placement.spilled]
    # every slot is rounded up to 4 KiB: at most 4 tensors per dim, 4 dims per block
    capacity = sum(b.results + b.snapshots for b in spilled) + len(spilled) * 64 * 4096
    capacity += 1 << 20
    free = shutil.disk_usage(path).free
    if capacity > free:
        raise ValueError(
            f"nvme_path {path!r} has {free} bytes free, the spill file needs {capacity}; "
            "free space there, pick another directory, or raise host_budget_bytes"
        )
    try:
        spiller = Spiller(path, capacity)
    except (ValueError, OSError) as err:
        raise ValueError(f"nvme_path {path!r}: cannot create the spill file: {err}") from err
    return SpillTier(spiller, placement.spilled, fixed_delay)


class SpillTier:
    """The runtime's side of the spill store: what a pending refresh of a spilled block keeps there
    (its ``spilled`` and ``inputs`` fields), and how its results come back."""

    def __init__(self, spiller: Spiller, spilled: Iterable[str], fixed_delay: int) -> None:
        self.spiller = spiller
        self._spilled = frozenset(spilled)
        self._fixed_delay = fixed_delay

    @property
    def store(self) -> SpillStore:
        """The spill store underneath (its file, its slots)."""
        return self.spiller.store

    def spills(self, name: str) -> bool:
        """Whether the tier policy spills block ``name``."""
        return name in self._spilled

    def stats(self) -> dict[str, Any]:
        return self.spiller.stats()

    def close(self) -> None:
        """Close the store and delete its file."""
        self.spiller.close()

    # -- a refresh's inputs, kept for an exact recompute --------------------------------------

    def inputs_record(self, name: str, version: int, dims: int) -> SpilledRefresh | None:
        """A record for the inputs of block ``name``'s refresh ``version``, if it spills."""
        return SpilledRefresh(f"{name}/v{version}/s", dims) if self.spills(name) else None

    def keep_inputs(self, pending: Any, dim: int, factor: Any, basis: Any) -> None:
        """Write dim ``dim``'s inputs of ``pending`` (copies of live state) to the store."""
        self.spiller.add(pending.inputs, dim, (factor, basis), clone=True)
        self.spiller.counts["snapshots"] += 1

    # -- results waiting for their install --------------------------------------------------

    def maybe_spill(self, name: str, pending: Any) -> bool:
        """Write a finished refresh that waits for its install step to the store when the
        policy spills its block; a failed job stays put (its install reports it). True when it
        was spilled (its futures, the only owners of the results' host memory, are dropped)."""
        if pending.spilled is not None or not self.spills(name) or not pending.done():
            return False
        try:
            results = pending.results()
        except Exception:
            return False
        rec = SpilledRefresh(f"{name}/v{pending.requested}/r", len(results))
        for dim, r in enumerate(results):
            self.spiller.add(rec, dim, tuple(r) if isinstance(r, tuple) else r)
        self.spiller.counts["spilled_refreshes"] += 1
        pending.spilled = rec
        pending.futures = [None] * len(results)
        return True

    def page_in(self, pending: Iterable[tuple[Any, int]]) -> None:
        """Settle finished writes; start reading, in the given (access) order, the spilled
        refreshes that the next step installs. ``pending``: each refresh in flight with the
        current step of its block."""
        due = []
        for p, step in pending:
            if p.inputs is not None:
                self.spiller.poll(p.inputs)
            if p.spilled is None:
                continue
            self.spiller.poll(p.spilled)
            if p.requested + self._fixed_delay <= step + 1:
                due.append(p.spilled)
        self.spiller.prefetch(due)

    def settle(self, pending: Any) -> None:
        """Wait until every write of ``pending``'s records is settled (tests, benchmarks)."""
        for rec in (pending.spilled, pending.inputs):
            if rec is not None:
                self.spiller.poll(rec, wait=True)

    def discard(self, pending: Any) -> None:
        """Forget what ``pending`` keeps in the store."""
        self.spiller.discard(pending.spilled)
        self.spiller.discard(pending.inputs)

    # -- reading back ------------------------------------------------------------------------

    def results(
        self,
        pending: Any,
        name: str,
        recompute: Callable[[Any, list[Any] | None], list[Any]],
        consume: bool = True,
    ) -> list[Any]:
        """``pending``'s results: from its futures, or read back from the store; a lost slot is
        recomputed (``recompute(pending, inputs)``: its inputs where intact, else None). ``consume``
        (an install) discards what the store keeps of it; a checkpoint reads without consuming."""
        if pending.spilled is None:
            results = pending.results()
            if consume:
                self.spiller.discard(pending.inputs)
            return results
        try:
            return self.spiller.load(pending.spilled)
        except SpillLost as err:
            inputs = None
            source = "the current factors (its inputs were lost too)"
            if pending.inputs is not None:
                try:
                    inputs = self.spiller.load(pending.inputs)
                    source = "its spilled inputs (same result)"
                except SpillLost:
                    inputs = None
            kind = "recomputed_from_factors" if inputs is None else "recomputed_from_snapshot"
            self.spiller.counts[kind] += 1
            warnings.warn(
                f"Asteria: the spilled refresh of block '{name}' (version {pending.requested}) "
                f"could not be read back ({err}); recomputed from {source}",
                RuntimeWarning,
                stacklevel=6,
            )
            return recompute(pending, inputs)
        finally:
            if consume:
                self.discard(pending)

    # -- accounting ------------------------------------------------------------------------

    def host_tensors(self, pending: Any) -> dict[str, list[torch.Tensor]]:
        """By kind (``results``, ``snapshots``): what ``pending``'s records hold in host memory."""
        return {
            kind: [] if rec is None else rec.host_tensors()
            for kind, rec in (("results", pending.spilled), ("snapshots", pending.inputs))
        }

    def stored_bytes(self, pending: Any) -> dict[str, tuple[int, int]]:
        """By kind: (bytes in the store, bytes paged back into host memory ahead of use)."""
        return {
            kind: (self.spiller.nvme_bytes(rec), self.spiller.paged_bytes(rec))
            for kind, rec in (("results", pending.spilled), ("snapshots", pending.inputs))
        }
