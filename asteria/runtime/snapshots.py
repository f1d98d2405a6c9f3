"""How a refresh's inputs are snapshotted and handed to the pool: one strategy per runtime.

Owns: the three ways a job's inputs (a block's factor and, for a QR refresh, its current basis)
reach the C++ refresh pool, each as a class with the same interface, chosen once when the
runtime attaches (``attach.choose_snapshots``) from where the parameters live:

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

A strategy turns a job into a *ticket* (``take``); ``ready(ticket)`` says whether the snapshot
can be submitted without waiting, and ``finish(ticket)`` waits for it and returns either the
future of a job it already submitted (the lane's) or the host tensors the pool is to copy. The
runtime keeps tickets in ``PendingRefresh.copies`` while they are ``deferred`` and never looks
inside one.

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
from typing import Any, NamedTuple

import torch

from asteria._ext import load_extension
from asteria.memory.copies import Copies
from asteria.memory.host import StagingRing
from asteria.memory.staging import Snapshot, snapshot
from asteria.optim.base import RefreshJob
from asteria.optim.matrix_functions import check_matrix
from asteria.runtime.lane import StatisticsLane

__all__ = ["DirectSnapshots", "LaneSnapshots", "Snapshots", "StagedSnapshots", "pool_submit"]

#: What ``finish`` returns: a future already submitted (or None), and the inputs to submit.
Finished = tuple[Any, torch.Tensor | None, torch.Tensor | None]


def pool_submit(
    pool: Any,
    name: str,
    version: int,
    deadline: int,
    job: RefreshJob,
    factor: torch.Tensor,
    basis: torch.Tensor | None,
) -> Any:
    """One job on ``pool`` (the runtime's ``placement.Executors``, which copies ``factor`` and
    ``basis`` at submission, or an ``asteria._C.WorkerPool``). A complex or non-square input
    is refused here (the pool would drop an imaginary part): the job's future raises the
    ``ValueError``, which reaches the step as a crashed refresh of the block."""
    try:
        check_matrix(f"{name}: factor", factor)
        if basis is not None:
            check_matrix(f"{name}: basis", basis)
    except ValueError as err:
        return Refused(err)
    submit = getattr(pool, "submit_job", None)  # Note [One submission path] in placement.py
    if submit is not None:
        return submit(job, name, version, deadline, factor, basis)
    return job.submit(pool, name, version, deadline, factor, basis)


class Refused:
    """The future of a job refused at submission: done, its result raises the refusal."""

    def __init__(self, error: BaseException) -> None:
        self._error = error

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def result(self, timeout_s: float | None = None) -> Any:
        raise self._error

    def run_ahead(self) -> bool:
        return False  # resolved already


class Snapshots:
    """The interface every strategy has (see module docstring); also ``DirectSnapshots``."""

    #: A short name, reported in ``Runtime.stats()["snapshots"]``.
    name = "direct"
    #: Whether a ticket waits in ``PendingRefresh.copies`` (else it is finished at once).
    deferred = False

    def take(
        self,
        key: Hashable,
        dim: int,
        name: str,
        version: int,
        deadline: int,
        job: RefreshJob,
        keep: bool,
    ) -> Any:
        """Start the snapshot of ``job``'s inputs (dim ``dim`` of block ``key``); ``keep``:
        the inputs are also wanted as host tensors afterwards (a spilled block's)."""
        return job.factor, job.basis

    def ready(self, ticket: Any) -> bool:
        return True

    def finish(self, ticket: Any) -> Finished:
        """Wait for the snapshot (raising its error); the future or the inputs to submit."""
        factor, basis = ticket
        return None, factor, basis

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

    def take(self, key, dim, name, version, deadline, job, keep):
        # the factors are what this step's statistics, still on the lane, write: the job is
        # submitted from the lane, behind them (what the lane runs holds the pool and the job
        # only, no reference to the runtime or the optimizer)
        return self._lane.call(key, _lane_submit, self._pool, name, version, deadline, job, keep)

    def ready(self, ticket: Any) -> bool:
        return ticket.query()

    def finish(self, ticket: Any) -> Finished:
        ticket.synchronize()  # a failed statistics update of the block before it raises here
        future, kept = ticket.value
        factor, basis = kept if kept is not None else (None, None)
        return future, factor, basis


def _lane_submit(
    pool: Any, name: str, version: int, deadline: int, job: RefreshJob, keep: bool
) -> tuple[Any, tuple | None]:
    """On the statistics lane, behind the block's statistics: submit the job (the pool copies
    the factor and basis as they are now), and keep copies of them for a spilled block
    (``keep``)."""
    kept = None
    if keep:
        kept = (job.factor.clone(), None if job.basis is None else job.basis.clone())
    return pool_submit(pool, name, version, deadline, job, job.factor, job.basis), kept


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

    def take(self, key, dim, name, version, deadline, job, keep):
        srcs = [t for t in (job.factor, job.basis) if t is not None]
        snap = self._snapshot(srcs)
        if snap is None:  # the pool reads the basis on the host: a window's copy of it first
            self._copies.host_sync()  # (Note [Host writes] in asteria/memory/copies.py)
            self.unstaged += len(srcs)
            return _Staged(None, job.factor, job.basis)
        snap.release()  # the slots are free again once the copies landed and the views are gone
        self._issued.append(snap)
        self.staged += len(srcs)
        dsts = snap.tensors
        return _Staged(snap, dsts[0], dsts[1] if len(dsts) > 1 else None)

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
        return ticket.snap is None or ticket.snap.ready()

    def finish(self, ticket: Any) -> Finished:
        if ticket.snap is not None:
            ticket.snap.wait()  # (landed already unless waited for)
        return None, ticket.factor, ticket.basis

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


class _Staged(NamedTuple):
    """A snapshot in flight (None: not staged) and the host tensors to submit."""

    snap: Snapshot | None
    factor: torch.Tensor | None
    basis: torch.Tensor | None
