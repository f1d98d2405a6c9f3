"""How a refresh's inputs are snapshotted and handed to the pool: one strategy per runtime.

Owns: the three ways a job's inputs (a block's factor and, for a QR refresh, its current basis)
reach the C++ refresh pool, each as a class with the same interface, chosen once when the
runtime attaches (``parts.choose_snapshots``) from where the parameters live:

* ``DirectSnapshots`` (CPU parameters, no statistics lane): the pool copies the inputs at
  submission, on the training thread; nothing is deferred;
* ``LaneSnapshots`` (CPU parameters with the statistics lane): the submission is queued on the
  lane behind the block's statistics of this step, which it must see (Note [Statistics lane] in
  lane.py); the training thread never waits for the lane at a refresh step;
* ``StagedSnapshots`` (device parameters): an asynchronous copy into a slot of the pinned
  staging ring (``asteria.memory.StagingRing``) on the copy stream
  (``asteria.memory.copies``, the one the bases window uses too), submitted once it has landed
  (Note [Staged snapshots]); the copies and their fences are ``asteria.memory.staging.snapshot``,
  the staging path ``asteria.lowlevel`` offers too.

A strategy turns a block's submissions (placement.py's ``Submission``, one per dim) into a
*ticket* (``take``); ``ready(ticket)`` says whether the snapshot can be submitted without
waiting, and ``finish(ticket)`` waits for it and returns the futures of jobs it submitted
already (the lane's) or None, and the submissions with the inputs it copied (what the pool is
to copy, and what a spilled block keeps). The runtime keeps a ticket in ``PendingRefresh.copies``
while it is ``deferred`` and never looks inside one.

Note [Staged snapshots]: the ring has one slot per tensor a refresh of the attach-time blocks
copies (a factor, and the basis a QR refresh starts from), each as large as the largest, so a
snapshot never waits for a slot: a block has at most one refresh in flight, and its slots are
free again once its jobs are submitted (the pool copies them at submission; the views that pin
the slots are dropped then). A copy waits (on the device) for an event the main stream records
at the request, so it sees every statistics update issued before it; the main stream never waits
for it then. The factors are written again by the next step's statistics, so the next step
begins by making the main stream wait for this step's copies (a device-side wait, long satisfied
by then): a copy never reads a factor the next step already overwrites. Each slot's fence is the
copy's completion on the copy stream, so a slot is never refilled under a copy still writing it,
even when a refresh is dropped. A tensor with no slot (a parameter added after attaching, a
larger state) is handed to the pool as it is, which copies it synchronously (``unstaged``).

Must not: decide when a refresh is requested or submitted (schedule.py, refreshes.py), count
or name jobs (refreshes.py), or keep a reference to the runtime or the optimizer in what it
queues on the lane (the runtime stays collectable without ``close()``:
tests/unit/test_shutdown.py).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from asteria._ext import load_extension
from asteria.memory.copies import Copies
from asteria.memory.host import StagingRing
from asteria.memory.staging import Snapshot, snapshot
from asteria.optim.matrix_functions import check_matrix
from asteria.runtime.lane import StatisticsLane
from asteria.runtime.placement import Submission
from asteria.runtime.registry import Resolved

__all__ = ["DirectSnapshots", "LaneSnapshots", "Snapshots", "StagedSnapshots", "pool_submit"]

Subs = list[Submission | None]  # a block's submissions, per dim (None: no factor)


def pool_submit(pool: Any, sub: Submission) -> Any:
    """``sub`` on ``pool`` (the runtime's ``placement.Executors``, which copies the inputs at
    submission). A complex or non-square input is refused here (the pool would drop an
    imaginary part): the future raises the ``ValueError``, which reaches the step as a crashed
    refresh of the block."""
    try:
        check_matrix(f"{sub.name}: factor", sub.factor)
        if sub.basis is not None:
            check_matrix(f"{sub.name}: basis", sub.basis)
    except ValueError as err:
        return Resolved(error=err)
    return pool.submit(sub)


class Snapshots:
    """The interface every strategy has (see module docstring); also ``DirectSnapshots``."""

    #: A short name, reported in ``Runtime.stats()["snapshots"]``.
    name = "direct"
    #: Whether a ticket waits in ``PendingRefresh.copies`` (else it is finished at once).
    deferred = False

    def take(self, key: Hashable, subs: Subs, keep: bool) -> Any:
        """Start the snapshot of the inputs of block ``key``'s ``subs``; ``keep``: the inputs
        are also wanted as host tensors afterwards (a spilled block's)."""
        return subs

    def ready(self, ticket: Any) -> bool:
        return True

    def finish(self, ticket: Any) -> tuple[list | None, Subs]:
        """Wait for the snapshot (raising its error); the futures of the jobs it submitted (or
        None), and the submissions with their inputs."""
        return None, ticket

    def staging_bytes(self) -> int:
        """Host memory the strategy holds for snapshots (``memory_report``'s staging)."""
        return 0

    def step_begin(self) -> None:
        """A step begins (before it writes any factor)."""

    def stats(self) -> dict[str, Any]:
        return {"strategy": self.name}

    def clear(self) -> None:
        """Wait for every snapshot in flight and let go of the strategy's buffers (close)."""


class DirectSnapshots(Snapshots):
    """The pool copies the inputs at submission (CPU tensors, on the training thread)."""


class LaneSnapshots(Snapshots):
    """The submission runs on the statistics lane, behind the block's statistics."""

    name = "lane"
    deferred = True

    def __init__(self, lane: StatisticsLane, pool: Any) -> None:
        self._lane = lane
        self._pool = pool

    def take(self, key, subs, keep):
        # the factors are what this step's statistics, still on the lane, write: the jobs are
        # submitted from the lane, behind them (what the lane runs holds the pool and the
        # submissions only, no reference to the runtime or the optimizer)
        return self._lane.call(key, _lane_submit, self._pool, subs, keep), subs

    def ready(self, ticket: Any) -> bool:
        return ticket[0].query()

    def finish(self, ticket: Any) -> tuple[list | None, Subs]:
        ticket[0].synchronize()  # a failed statistics update of the block before it raises here
        return ticket[0].value, ticket[1]


def _lane_submit(pool: Any, subs: Subs, keep: bool) -> list[Any]:
    """On the statistics lane, behind the block's statistics: submit the jobs (the pool copies
    the factors and bases as they are now), the inputs kept as copies for a spilled block
    (``keep``)."""
    for sub in subs:
        if keep and sub is not None:
            sub.factor = sub.factor.clone()
            sub.basis = None if sub.basis is None else sub.basis.clone()
    return [None if sub is None else pool_submit(pool, sub) for sub in subs]


class StagedSnapshots(Snapshots):
    """Device-to-host copies into slots of a staging ring on the copy stream (Note [Staged
    snapshots]); ``ring`` None: every tensor is unstaged."""

    name = "staged"
    deferred = True

    def __init__(self, copies: Copies, ring: StagingRing | None) -> None:
        self._copies = copies
        self._ring = ring
        self._issued: list[Snapshot] = []  # this step's copies (``step_begin`` of the next)
        self.staged = 0
        self.unstaged = 0
        self._timeout = load_extension().WaitTimeoutError

    def take(self, key, subs, keep):
        srcs = [
            t for sub in subs if sub is not None for t in (sub.factor, sub.basis) if t is not None
        ]
        snap = self._snapshot(srcs)
        if snap is None:  # the pool reads the basis on the host: a window's copy of it first
            self._copies.host_sync()  # (Note [Host writes] in asteria/memory/copies.py)
            self.unstaged += len(srcs)
            return None, subs
        snap.release()  # the slots are free again once the copies landed and the views are gone
        self._issued.append(snap)
        self.staged += len(srcs)
        copied = iter(snap.tensors)
        for sub in subs:  # the submissions read the snapshot, in the order of ``srcs``
            if sub is not None:
                sub.factor = next(copied)
                sub.basis = None if sub.basis is None else next(copied)
        return snap, subs

    def _snapshot(self, srcs: list[torch.Tensor]) -> Snapshot | None:
        """The copies of ``srcs`` into free slots (``asteria.memory.staging``, Note [Snapshot
        fences]), or None when a tensor has no slot (then none is held)."""
        ring = self._ring
        if ring is None or any(t.nbytes > ring.slot_bytes for t in srcs):
            return None
        try:
            return snapshot(srcs, ring, self._copies, timeout=0.0)
        except self._timeout:
            return None

    def ready(self, ticket: Any) -> bool:
        return ticket[0] is None or ticket[0].ready()

    def finish(self, ticket: Any) -> tuple[list | None, Subs]:
        if ticket[0] is not None:
            ticket[0].wait()  # (landed already unless waited for)
        return None, ticket[1]

    def step_begin(self) -> None:
        for snap in self._issued:
            snap.fence()  # on the device: no copy reads what this step writes
        self._issued.clear()

    def staging_bytes(self) -> int:
        return 0 if self._ring is None else self._ring.slots * self._ring.slot_bytes

    def stats(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "staged": self.staged,
            "unstaged": self.unstaged,
            # times the host waited for copies to host before reading a host basis (Note [Host
            # sources of a snapshot] in asteria/memory/staging.py), the window's reads included
            "host_waits": getattr(self._copies, "host_waits", 0),
            "ring": None if self._ring is None else self._ring.stats(),
        }

    def clear(self) -> None:
        self._issued.clear()
        self._copies.synchronize()
        self._ring = None
