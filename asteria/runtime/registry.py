"""The coherence registry: per block, which version is in use and how stale it may get.

Owns: one ``BlockEntry`` per block (name, version in use, request and install steps, refresh in
flight, failure counts), the staleness histogram, and the check of the bound. Must not: submit
or wait (``refreshes.py`` does both); this module is bookkeeping.

Note [Staleness bound]: a refresh requested at step ``t`` (version ``t``) is installed at ``s``
with ``t <= s <= t + S`` (when ready, at ``t + S`` waiting for it: ``Refreshes.wait``), after
``s``'s update, where native mode installs one requested at ``s``: staleness ``s - t``. Where the
refresh precedes the update (Shampoo), an install between ``s`` and ``s + 1`` counts as at
``s + 1``, and a budget moves the request ahead (Note [Refresh lead] in schedule.py).

Note [In-flight index]: ``Registry.in_flight`` holds exactly the entries whose ``pending`` is
not None, kept by ``BlockEntry.pending``'s setter and, for a plan's requests and an install batch,
by the registry in one call (``start``, ``record_installs``). Reading ``pending`` is C only; the
other attributes are plain. Looking for finished refreshes reads the index: its cost follows the
refreshes in flight, not the blocks.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol, runtime_checkable

from asteria.optim.refresher import RefreshFailedError

__all__ = [
    "BlockEntry",
    "RefreshFuture",
    "BlockView",
    "PendingRefresh",
    "Registry",
    "Resolved",
    "StalenessTimeoutError",
    "RefreshFailedError",
]


class StalenessTimeoutError(RuntimeError):
    """A step waited at the barrier for longer than ``barrier_timeout_s``."""


@runtime_checkable
class RefreshFuture(Protocol):
    """Note [One future protocol]: what a refresh in flight holds per dim, whoever computes
    it: the C++ pool's ``asteria._C.Future``, the device stream's (placement.py), ``Resolved``
    (a refusal at submission, a result restored from a checkpoint), a test's slowed future
    (testing.py). The runtime polls them only through ``PendingRefresh.done``,
    reads them only through ``PendingRefresh.results``, and waits for them only at the barrier
    (``Refreshes.wait``, in slices so that Ctrl-C is seen, after running the jobs queued up to
    them: ``run_ahead``) and in a recompute; nothing else
    asks a future's type (tests/unit/test_host_work.py checks every kind against this)."""

    def done(self) -> bool:
        """Whether the result (or the error) is there: never blocks."""
        ...

    def cancelled(self) -> bool:
        """Whether the job was cancelled before it ran (superseded, shut down)."""
        ...

    def result(self, timeout_s: float | None = None) -> Any:
        """The result, waiting up to ``timeout_s`` (None: as long as it takes); raises the
        job's error, or the executor's timeout error."""
        ...

    def run_ahead(self) -> bool:
        """While no worker has started the job, run its executor's first queued job (this one
        or one queued before it) on the calling thread; whether one ran. False where the
        executor cannot be helped (Note [Helping waiters] in csrc/core/worker_pool.cpp)."""
        ...


class Resolved:
    """A future that has resolved already: its ``value``, or its ``error`` (an exception, or the
    message of a refresh failure restored from a checkpoint) raised by ``result``."""

    def __init__(self, value: Any = None, error: BaseException | str | None = None) -> None:
        self._value, self._error = value, error

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def result(self, timeout_s: float | None = None) -> Any:
        if isinstance(self._error, str):
            from asteria.optim.matrix_functions import MatrixFunctionError

            raise MatrixFunctionError(self._error)
        if self._error is not None:
            raise self._error
        return self._value

    def run_ahead(self) -> bool:
        return False


class PendingRefresh(SimpleNamespace):
    """A refresh in flight, made by keyword (a constructor in C: no Python call a request):
    ``requested`` (its version), ``futures`` (one per dim, None: a dim without a factor),
    ``copies`` (its snapshot in flight: CUDA, lane), ``jobs`` (per dim, None: no factor); where
    set, ``group`` (the parameter group: a recompute needs it), ``spilled`` (a
    spill.SpilledRefresh once the results went to the spill store), ``inputs`` (one of the job
    inputs, for an exact recompute), ``owner`` (distributed: the rank computing it)."""

    requested: int
    futures: list[RefreshFuture | None]
    copies: list[Any]
    jobs: list[Any]
    group: dict | None = None
    spilled: Any = None
    inputs: Any = None
    owner: int | None = None

    def done(self) -> bool:
        """Whether every snapshot landed and every job finished (polls, never waits)."""
        return not self.copies and all(f is None or f.done() for f in self.futures)

    def results(self) -> list[Any]:
        """Every dim's result (None without a factor), waiting for any not finished; raises the
        first job's error (Note [One future protocol])."""
        return [None if f is None else f.result() for f in self.futures]


@dataclass
class BlockEntry:
    name: str
    # the version of the basis in use (Note [Staleness contract] in schedule.py); None: no
    # basis yet, or not yet seen by the runtime
    version: int | None = None
    requested_step: int = 0
    installed_step: int = 0
    consecutive_failures: int = 0
    failures: int = 0
    installs: int = 0
    synced_step: int = -1  # distributed: the step its version was last synchronized
    owed: bool = False  # a due request coalesced into the refresh in flight (schedule.py)
    age: int = 0  # the age of the basis the block's last update read
    max_age: int = 0
    bound: int | None = None  # the bound on that age (None: not measured yet)
    # the step whose decision last ran to its end (Note [Interrupted steps] in plan.py)
    boundary_step: int = -1
    key: tuple[int, int] | None = None
    # the registry's index of the entries with a refresh in flight (Note [In-flight index])
    in_flight: dict | None = field(default=None, repr=False, compare=False)
    # the refresh in flight, read and set as ``pending`` (Note [In-flight index])
    _pending: PendingRefresh | None = None

    def _set_pending(self, value: PendingRefresh | None) -> None:
        self._pending = value
        index = self.in_flight
        if index is not None:
            if value is None:
                index.pop(self.key, None)
            else:
                index[self.key] = self

    #: The refresh in flight (None: none); setting it keeps the registry's index
    pending = property(operator.attrgetter("_pending"), _set_pending)


@dataclass(frozen=True)
class BlockView:
    """A block as ``Runtime.blocks()`` reports it: a copy of its entry's figures, taken when
    asked, and its refresh in flight (``pending``: its version ``requested``, its ``futures``,
    ``done()``; ``spilled`` once its results are in the spill store), to read, never change."""

    name: str
    version: int | None  # the version of the basis in use; None: none yet
    requested_step: int
    installed_step: int
    installs: int
    failures: int
    consecutive_failures: int
    owed: bool  # a due request coalesced into the refresh in flight
    pending: PendingRefresh | None


class Registry:
    """Per-block versions and the staleness histogram (see Note [Staleness bound])."""

    def __init__(self, staleness: int) -> None:
        self.staleness = staleness
        self.entries: dict[tuple[int, int], BlockEntry] = {}
        # The same entries by parameter index, for the module signals (a few per module).
        self.by_param: dict[int, list[tuple[tuple[int, int], BlockEntry]]] = {}
        self.histogram: Counter[int] = Counter()
        #: the entries with a refresh in flight, by key, kept by ``BlockEntry.pending``'s
        #: assignments (Note [In-flight index])
        self.in_flight: dict[tuple[int, int], BlockEntry] = {}

    def entry(self, key: tuple[int, int], name_of: Callable[[tuple[int, int]], str]) -> BlockEntry:
        """The block's entry, created on first use and named ``name_of(key)``."""
        e = self.entries.get(key)
        if e is None:
            e = BlockEntry(name=name_of(key), key=key, in_flight=self.in_flight)
            self.entries[key] = e
            self.by_param.setdefault(key[0], []).append((key, e))
        return e

    def start(self, made: list[tuple[BlockEntry, PendingRefresh]]) -> None:
        """Each ``(entry, refresh)`` of ``made`` in flight (``entry.pending = refresh``, in one
        call: Note [In-flight index])."""
        index = self.in_flight
        for e, pending in made:
            e._pending = pending
            index[e.key] = e

    def record_installs(self, installed: list[tuple[BlockEntry, int, int, Any]]) -> None:
        """Per ``(entry, requested, at, refresh)`` of ``installed``: version ``requested``
        installed at step ``at``; the refresh, where it is still the entry's in flight, no
        longer is (``entry.pending = None``, here: no call per block)."""
        index, histogram, bound = self.in_flight, self.histogram, self.staleness
        for e, requested, at, pending in installed:
            if e._pending is pending:
                e._pending = None
                index.pop(e.key, None)
            staleness = at - requested
            if not 0 <= staleness <= bound:  # an invariant of refreshes.py, not user input
                raise AssertionError(
                    f"block {e.name}: version {requested} installed at step {at} breaks the "
                    f"staleness bound {bound}"
                )
            e.version, e.requested_step, e.installed_step = requested, requested, at
            e.installs += 1
            e.consecutive_failures = 0
            histogram[staleness] += 1

    def views(self) -> dict[tuple[int, int], BlockView]:
        """Every block's ``BlockView``, by key."""
        return {
            key: BlockView(
                e.name,
                e.version,
                e.requested_step,
                e.installed_step,
                e.installs,
                e.failures,
                e.consecutive_failures,
                e.owed,
                e.pending,
            )
            for key, e in self.entries.items()
        }

    def pending_count(self) -> int:
        return len(self.in_flight)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Per block: version in use (-1: none yet), its request and install steps, failures,
        the age of the basis in use and its bound (Note [Staleness contract])."""
        return {
            e.name: {
                "version": -1 if e.version is None else e.version,
                "requested_step": e.requested_step,
                "installed_step": e.installed_step,
                "installs": e.installs,
                "failures": e.failures,
                "pending": e.pending.requested if e.pending is not None else -1,
                "synced_step": e.synced_step,
                "basis_age": e.age,
                "max_basis_age": e.max_age,
                "basis_age_bound": e.bound,
                "coalesced": e.owed,
            }
            for e in self.entries.values()
        }
