"""How a refresh's inputs are snapshotted and handed to the pool: one strategy per runtime.

Owns: the three ways a job's inputs (a block's factor and, for a QR refresh, its current basis)
reach the C++ refresh pool, each as a class with the same interface, chosen once when the
runtime attaches (``attach.choose_snapshots``) from where the parameters live:

* ``DirectSnapshots`` (CPU parameters, no statistics lane): the pool copies the inputs at
  submission, on the training thread; nothing is deferred;
* ``LaneSnapshots`` (CPU parameters with the statistics lane): the submission is queued on the
  lane behind the block's statistics of this step, which it must see (Note [Statistics lane] in
  lane.py); the training thread never waits for the lane at a refresh step;
* ``StagedSnapshots`` (device parameters): an asynchronous copy into a pinned host staging slot
  on the low-priority copy stream (``asteria.memory.staging``), submitted once it has landed.

A strategy turns a job into a *ticket* (``take``); ``ready(ticket)`` says whether the snapshot
can be submitted without waiting, and ``finish(ticket)`` waits for it and returns either the
future of a job it already submitted (the lane's) or the host tensors the pool is to copy. The
runtime keeps tickets in ``PendingRefresh.copies`` while they are ``deferred`` and never looks
inside one.

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
from asteria.memory.staging import StagingSlots
from asteria.optim.base import RefreshJob
from asteria.runtime import testing
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
    """One job on the pool (it copies ``factor`` and ``basis`` at submission); slower under
    ``asteria.runtime.testing.slow_pool``."""
    if job.kind == "qr":
        future = pool.submit_qr_refresh(name, version, deadline, factor, basis, job.sort, job.dtype)
    else:
        future = pool.submit_inverse_root(
            name, version, deadline, factor, job.root, job.epsilon, job.dtype
        )
    return testing.delayed(future, load_extension().FutureTimeoutError)


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

    def buffers(self) -> list[torch.Tensor]:
        """Host memory the strategy holds for snapshots (``memory_report``'s staging)."""
        return []

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
    """Asynchronous device-to-host copies into reused staging slots (``StagingSlots``)."""

    name = "staged"
    deferred = True

    def __init__(self, staging: StagingSlots) -> None:
        self.staging = staging

    def take(self, key, dim, name, version, deadline, job, keep):
        copies = [self.staging.copy((key, dim, "factor"), job.factor)]
        if job.basis is not None:
            copies.append(self.staging.copy((key, dim, "basis"), job.basis))
        return copies

    def ready(self, ticket: Any) -> bool:
        return all(copy.query() for copy in ticket)

    def finish(self, ticket: Any) -> Finished:
        for copy in ticket:
            copy.synchronize()  # (done already unless waited for) raises a failed copy's error
        return None, ticket[0].host, ticket[1].host if len(ticket) > 1 else None

    def buffers(self) -> list[torch.Tensor]:
        return self.staging.buffers()

    def stats(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "allocations": self.staging.allocations,
            "reuses": self.staging.reuses,
        }

    def clear(self) -> None:
        self.staging.clear()
