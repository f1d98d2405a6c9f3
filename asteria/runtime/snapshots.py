"""How a refresh's inputs are snapshotted and handed to the pool: one strategy per runtime.

Owns: three ways a job's inputs reach the C++ pool, chosen at attach (``parts.choose_snapshots``):
``DirectSnapshots`` (CPU parameters: the pool copies at submission), ``LaneSnapshots`` (CPU with
the lane: submitted on the lane behind the block's statistics) and ``StagedSnapshots`` (device
parameters: copies into the pinned staging ring, submitted once landed: Note [Staged
snapshots]). A strategy turns a plan's requests into one ticket (``take``, which says whether it
may go at once); ``ready`` says whether it can go without waiting, and ``finish`` returns the
futures of jobs it submitted (the lane's) or None, and the requests with their copied inputs.

Note [Staged snapshots]: the ring has a slot for every tensor a refresh of the attach-time blocks
copies, so a snapshot never waits for one (a block has one refresh in flight, its slots free once
its jobs are submitted). A copy waits on the device for an event recorded at the request, and the
next step begins by making the main stream wait for the copies (``step_begin``), so no copy reads
a factor the next step overwrites; a slot's fence is its copy's completion. A tensor without a
slot goes to the pool as it is (``unstaged``).

Must not: decide when a refresh is requested or submitted, count or name jobs, or queue on the
lane anything that references the runtime or the optimizer (tests/unit/test_shutdown.py).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from asteria._ext import load_extension
from asteria.memory.copies import Copies
from asteria.memory.host import StagingRing
from asteria.memory.staging import Snapshot, snapshot
from asteria.runtime.lane import StatisticsLane
from asteria.runtime.placement import Submission

__all__ = ["DirectSnapshots", "LaneSnapshots", "Snapshots", "StagedSnapshots"]

#: A plan's requests: per block, its key, its submissions and whether its inputs are kept
Batch = list[tuple[Hashable, list[Submission], bool]]


class Snapshots:
    """The interface every strategy has (see module docstring); also ``DirectSnapshots``."""

    #: A short name, reported in ``Runtime.stats()["snapshots"]``.
    name = "direct"
    #: Whether a ticket waits in ``PendingRefresh.copies`` (else it is finished at once).
    deferred = False
    #: The snapshots of the last step whose fences the next one issues (``step_begin``)
    issued: Any = ()

    def take(self, batch: Batch) -> tuple[Any, bool]:
        """Start the snapshot of the inputs of a plan's requests, ``batch``: per block its key,
        its submissions and whether its inputs are also wanted as host tensors afterwards (a
        spilled block's). The ticket, and whether it may be submitted now (``ready``)."""
        return batch, True

    def ready(self, ticket: Any) -> bool:
        return True

    def finish(self, ticket: Any) -> tuple[list | None, Batch]:
        """Wait for the snapshot (raising its error); the futures of the jobs it submitted (or
        None), in the order of the batch's submissions, and the batch with their inputs."""
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
    """The submission runs on the statistics lane, behind each block's statistics."""

    name = "lane"
    deferred = True

    def __init__(self, lane: StatisticsLane, pool: Any) -> None:
        self._lane = lane
        self._pool = pool

    def take(self, batch):
        # the factors are what this step's statistics, still on the lane, write: the jobs are
        # submitted from the lane, behind them (what the lane runs holds the pool and the
        # submissions only, no reference to the runtime or the optimizer)
        call, pool = self._lane.call, self._pool
        ticket = [call(key, _lane_submit, pool, subs, keep) for key, subs, keep in batch], batch
        return ticket, self.ready(ticket)

    def ready(self, ticket: Any) -> bool:
        return all(work.query() for work in ticket[0])

    def finish(self, ticket: Any) -> tuple[list | None, Batch]:
        futures = []
        for work in ticket[0]:
            work.synchronize()  # a failed statistics update of the block before it raises here
            futures += work.value
        return futures, ticket[1]


def _lane_submit(pool: Any, subs: list[Submission], keep: bool) -> list[Any]:
    """On the statistics lane, behind the block's statistics: submit the jobs (the pool copies
    the factors and bases as they are now), the inputs kept as copies for a spilled block
    (``keep``)."""
    if keep:  # (in place: the runtime keeps the batch's inputs)
        for k, sub in enumerate(subs):
            basis = None if sub.basis is None else sub.basis.clone()
            subs[k] = sub.with_inputs(sub.factor.clone(), basis)
    return pool.submit_many(subs)


class StagedSnapshots(Snapshots):
    """Device-to-host copies into slots of a staging ring on the copy stream (Note [Staged
    snapshots]); ``ring`` None: every tensor is unstaged."""

    name = "staged"
    deferred = True

    def __init__(self, copies: Copies, ring: StagingRing | None) -> None:
        self._copies = copies
        self._ring = ring
        self._limit = 0 if ring is None else ring.slot_bytes  # (a tensor larger: unstaged)
        self.issued: list[Snapshot] = []  # this step's copies (``step_begin`` of the next)
        self.staged = 0
        self.unstaged = 0
        self._timeout = load_extension().WaitTimeoutError

    def take(self, batch):
        limit, srcs, staged, left = self._limit, [], [], 0
        for _, subs, _ in batch:
            for k, sub in enumerate(subs):
                factor, basis = sub[4], sub[5]
                if factor.nbytes > limit or (basis is not None and basis.nbytes > limit):
                    left += 1 if basis is None else 2  # no slot: the pool copies it
                    continue
                staged.append((subs, k))
                srcs.append(factor)
                if basis is not None:
                    srcs.append(basis)
        snap = None
        if srcs:
            try:  # the slots are free again once the copies landed and the views are gone
                snap = snapshot(srcs, self._ring, self._copies, timeout=0.0, release=True)
            except self._timeout:
                left += len(srcs)
        if left:  # the pool reads a basis on the host: a window's copy of it first
            self._copies.host_sync()  # (Note [Host writes] in asteria/memory/copies.py)
            self.unstaged += left
        if snap is None:
            return (None, batch), True
        self.issued.append(snap)
        self.staged += len(srcs)
        copied, new = iter(snap.tensors), tuple.__new__
        for subs, k in staged:  # the submissions read the snapshot, in the order of ``srcs``
            sub = subs[k]
            factor = next(copied)
            basis = None if sub[5] is None else next(copied)
            subs[k] = new(Submission, (*sub[:4], factor, basis))
        return (snap, batch), snap.landed

    def ready(self, ticket: Any) -> bool:
        snap = ticket[0]
        return snap is None or snap.landed or snap.ready()

    def finish(self, ticket: Any) -> tuple[list | None, Batch]:
        snap = ticket[0]
        if snap is not None and not snap.landed:
            snap.wait()
        return None, ticket[1]

    def step_begin(self) -> None:
        for snap in self.issued:
            snap.fence()  # on the device: no copy reads what this step writes
        self.issued.clear()

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
        self.issued.clear()
        self._copies.synchronize()
        self._ring, self._limit = None, 0
