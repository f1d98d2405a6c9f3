"""The refreshes in flight: each block's refresh from its request to its install, drop or failure.

Owns: the life of a refresh once the schedule has decided (schedule.py): the request (the
optimizer's ``refresh_jobs``, snapshotted and submitted to the C++ refresh pool through the
snapshot strategy chosen at attach time, snapshots.py), the bounded barrier (Note [Staleness
bound] in registry.py), reading the results (from the futures, or through the spill tier,
spill.py), installing them through the bases strategy (bases.py) and recording the install,
counting a failure (a failed refresh keeps the previous basis; ``max_consecutive_failures`` in
a row raise ``RefreshFailedError``), dropping what is not installed, and the job counters and
the time a step waited (``Runtime.stats()``).

Must not: decide when a refresh is requested or installed (schedule.py), know how a snapshot is
taken or where a basis lives (the strategies do), issue collectives (distributed.py does, for
replicated blocks), or take the runtime's lock (the facade holds it around every call).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from asteria.optim.base import KroneckerOptimizer
from asteria.optim.matrix_functions import MatrixFunctionError
from asteria.optim.refresher import BlockKey, RefreshFailedError
from asteria.optim.tensors import AUTOCAST_DEVICES, no_autocast
from asteria.runtime.bases import BasesAccess
from asteria.runtime.config import RuntimeConfig
from asteria.runtime.distributed import CRASHED, FAILED, OK, Coherence
from asteria.runtime.lane import StatisticsLaneError
from asteria.runtime.placement import Submission
from asteria.runtime.registry import BlockEntry, PendingRefresh, Registry, StalenessTimeoutError
from asteria.runtime.schedule import Pacer
from asteria.runtime.snapshots import Snapshots
from asteria.runtime.spill import SpillTier

__all__ = ["Refreshes"]


class Refreshes:
    """The refreshes in flight of one runtime (see module docstring): ``submitted``, ``failed``,
    ``cancelled``: job counters; ``wait_s``: what the step waited; ``errors``: the exceptions of a
    refresh that failed in float32 and float64 (the block keeps its basis), not a crash;
    ``timeout_error``: the pool's ``FutureTimeoutError``."""

    def __init__(
        self,
        optimizer: KroneckerOptimizer,
        config: RuntimeConfig,
        registry: Registry,
        pool: Any,
        snapshots: Snapshots,
        bases: BasesAccess,
        pacer: Pacer,
        block_name: Callable[[BlockKey], str],
        spill: SpillTier | None = None,
        coherence: Coherence | None = None,
        errors: tuple[type[BaseException], ...] = (MatrixFunctionError,),
        timeout_error: type[BaseException] = TimeoutError,
    ) -> None:
        self.optimizer = optimizer
        self.config = config
        self.registry = registry
        self.pool = pool
        self.snapshots = snapshots
        self.bases = bases
        self.pacer = pacer
        self.block_name = block_name
        self.spill = spill
        self.coherence = coherence
        self.errors = errors
        self.timeout_error = timeout_error
        self.submitted = self.failed = self.cancelled = self.helped = 0
        #: the plans' snapshots not submitted yet (``request_many``, ``step_end``)
        self.deferred: list[list] = []
        self.wait_s = 0.0
        #: the longest job this thread ran while helping (Note [Helping within the deadline])
        self.longest_helped_s = 0.0
        #: where set (``Plan.install_waited``), the start of the barrier a plan's waited-for
        #: installs share: their waits together take at most ``barrier_timeout_s``
        self.barrier_since: float | None = None
        #: a barrier of this step timed out: later ones in the step do not wait (the facade
        #: resets it at ``begin``; Note [All-or-nothing steps] in plan.py)
        self.timed_out = False
        self._params: list[torch.Tensor] = []
        self._groups_seen = -1
        #: steps later than its parameter's a refresh installed between steps counts as
        #: installed at (Note [Staleness bound] in registry.py)
        self.late = int(optimizer.refresh_precedes_update)

    # -- where a block is --------------------------------------------------------------------

    def params(self) -> list[torch.Tensor]:
        """The optimizer's parameters, flattened (made again only when a group was added)."""
        groups = self.optimizer.param_groups
        if len(groups) != self._groups_seen:
            self._params = [p for g in groups for p in g["params"]]
            self._groups_seen = len(groups)
        return self._params

    def current_step(self, key: BlockKey) -> int:
        return int(self.optimizer.state[self.params()[key[0]]]["step"])

    def block_state(self, key: BlockKey) -> dict | None:
        """The state of block ``key`` (None: its parameter has no such block, or no state)."""
        params = self.params()
        state = self.optimizer.state.get(params[key[0]]) if key[0] < len(params) else None
        blocks = None if state is None else state.get("blocks")
        return None if blocks is None or key[1] >= len(blocks) else blocks[key[1]]

    def group_of(self, key: BlockKey) -> dict:
        """The parameter group of block ``key``'s parameter."""
        first = 0
        for group in self.optimizer.param_groups:
            first += len(group["params"])
            if key[0] < first:
                return group
        raise KeyError(key)

    def entry(self, key: BlockKey) -> BlockEntry:
        return self.registry.entry(key, self.block_name)

    def replicated(self, key: BlockKey) -> bool:
        """Whether ``key`` is installed on every rank of its replica group at its deadline."""
        return self.coherence is not None and self.coherence.replicated(key)

    # -- requests and submissions --------------------------------------------------------------

    def request_many(self, requests: list[tuple]) -> None:
        """Request a plan's refreshes (``requests``: ``(key, entry, block state, group, step,
        ...)``, version ``step``, deadline ``step + S``): the jobs made once (Note [One submission
        path] in placement.py), one snapshot of their inputs and one submission, now or once it has
        landed. A refresh is in flight once its snapshot is taken (or its jobs submitted)."""
        coherence, spill, S = self.coherence, self.spill, self.config.staleness
        new = tuple.__new__
        if self.bases.settles:  # the job input basis is the one its result replaces
            keys, blocks = [], []
            for r in requests:
                keys.append(r[0])
                blocks.append(r[2])
            self.bases.settle(keys, blocks)
        jobs_of = self.optimizer.refresh_jobs
        batch, owners, made = [], [], []
        for key, e, block, group, step, *_ in requests:
            jobs = jobs_of(block, group)
            if not any(jobs):
                continue  # nothing to refresh (e.g. SOAP's unfactored 1-D blocks)
            pending = PendingRefresh(
                requested=step, futures=[None] * len(jobs), copies=[], jobs=jobs, group=group
            )
            if coherence is not None and coherence.replicated(key) and not coherence.is_owner(key):
                pending.owner = coherence.owner(key)
                e.pending = pending
                continue  # the owner computes it; this rank receives it at the deadline
            if spill is not None:
                pending.inputs = spill.inputs_record(e.name, step, len(jobs))
            name, subs = e.name, []
            for dim, job in enumerate(jobs):  # (``Submission``s without a Python call)
                if job is not None:
                    sub = (job, f"{name}.dim{dim}", step, step + S, job.factor, job.basis)
                    subs.append(new(Submission, sub))
                    owners.append((e, pending, dim))
            batch.append((key, subs, pending.inputs is not None))
            made.append((e, pending))
        if not batch:
            return
        ticket, now = self.snapshots.take(batch)
        taken = [ticket, owners]  # (per submission, its owner)
        if now:
            self._submit(taken, fresh=True)
        else:
            for _, pending in made:
                pending.copies.append(taken)
            self.deferred.append(taken)
        self.registry.start(made)

    def _submit(self, taken: list, fresh: bool = False) -> None:
        """The submission of a finished snapshot (a spilled block's inputs kept too: an exact
        recompute); a block dropped since its request (unless ``fresh``: not in flight yet) is
        left out (its jobs counted as cancelled already: ``drop``)."""
        for i, t in enumerate(self.deferred):
            if t is taken:
                del self.deferred[i]
                break
        futures, batch = self.snapshots.finish(taken[0])
        subs, owners, live, k = [], [], [], 0
        for _, block_subs, _ in batch:
            for sub in block_subs:
                owner = taken[1][k]
                if fresh or owner[0].pending is owner[1]:  # (not dropped since)
                    subs.append(sub)
                    owners.append(owner)
                    live.append(k)
                k += 1
        if futures is not None and len(live) < k:
            futures = [futures[i] for i in live]
        if futures is None:
            futures = self.pool.submit_many(subs)
        for (_, pending, dim), sub, future in zip(owners, subs, futures):
            if pending.inputs is not None:
                self.spill.keep_inputs(pending, dim, sub.factor, sub.basis)
            pending.futures[dim] = future
        self.submitted += len(futures)
        for _, pending, _ in owners:
            pending.copies.clear()  # (an interrupted submission is made again, whole)

    def collect(self, e: BlockEntry, wait: bool) -> None:
        """Submit the snapshot ``e``'s refresh waits for if it has landed (when ``wait``, once
        it has): the plan's other blocks of that snapshot with it."""
        taken = e.pending.copies[0]
        if wait or self.snapshots.ready(taken[0]):
            self._submit(taken)

    def step_end(self) -> None:
        """Submit what landed this step; spill and page in (the spill tier)."""
        for taken in list(self.deferred):
            if self.snapshots.ready(taken[0]):
                self._submit(taken)
        if self.spill is not None:
            entries = self.registry.entries
            self.spill.page_in(
                (entries[key].pending, self.current_step(key))
                for key in sorted(entries)
                if entries[key].pending is not None
            )

    def maybe_spill(self, e: BlockEntry) -> None:
        """A finished refresh waiting for its install step goes to the spill store if the
        policy spills its block (its futures, the only owners of its results, are dropped)."""
        if self.spill is not None:
            self.spill.maybe_spill(e.name, e.pending)

    # -- the barrier and the results ---------------------------------------------------------

    def help(self, e: BlockEntry, deadline: float) -> None:
        """Submit what of ``e``'s refresh is still a snapshot, then run the jobs queued up to its
        last one on this thread (Note [Helping waiters] in csrc/core/worker_pool.cpp), each only
        where it fits before ``deadline`` (Note [Helping within the deadline]); not after a
        timed-out barrier."""
        pending = e.pending
        if pending is None:
            return
        if pending.copies:
            self.collect(e, wait=True)
        if self.timed_out:
            return
        last = None
        for f in pending.futures:
            last = last if f is None else f
        durations = getattr(self.pool, "durations", None)
        measured = (None if durations is None else durations.longest("pool")) or 0.0
        # each job only where one as long as the longest measured (by the placement's averages
        # or here) ends before ``deadline``
        while last is not None and deadline - time.perf_counter() > max(
            self.longest_helped_s, measured
        ):
            t0 = time.perf_counter()
            if not last.run_ahead():
                break
            self.longest_helped_s = max(self.longest_helped_s, time.perf_counter() - t0)
            self.helped += 1

    def wait(self, e: BlockEntry, step: int) -> None:
        """The bounded barrier: wait (GIL released) for every future of ``e``'s refresh, at most
        ``barrier_timeout_s`` from the barrier's start (``barrier_since`` where a flush set it),
        helping or not."""
        t0 = time.perf_counter()
        since = t0 if self.barrier_since is None else self.barrier_since
        limit = 0.0 if self.timed_out else self.config.barrier_timeout_s
        finished = not e.pending.copies
        for f in e.pending.futures:  # (inline: a finished one costs no more call)
            finished = finished and (f is None or f.done())
        if not finished:
            self.help(e, since + limit)
        timeout_error = self.timeout_error
        for f in e.pending.futures:
            if f is None or f.done():
                continue
            remaining = limit - (time.perf_counter() - since)
            try:
                interruptible_result(f, max(remaining, 0.0), timeout_error)
            except timeout_error:
                self.timed_out = True
                self.wait_s += time.perf_counter() - t0
                raise StalenessTimeoutError(
                    f"Asteria: the refresh of block '{e.name}' requested at step "
                    f"{e.pending.requested} was not ready at step {step} (staleness budget "
                    f"{self.config.staleness}) after waiting {limit:g} s at the barrier "
                    f"(barrier_timeout_s)"
                ) from None
            except Exception:  # failures are handled by install, which reads every result
                pass
        self.wait_s += time.perf_counter() - t0

    def results(
        self,
        key: BlockKey,
        e: BlockEntry,
        pending: PendingRefresh,
        block: dict | None,
        consume: bool = True,
    ) -> list[Any]:
        """A refresh's results, from its futures or through the spill tier (which recomputes
        a lost one). ``consume``: an install (the spill tier then forgets the refresh)."""
        if self.spill is None:
            return pending.results()

        def recompute(pending: PendingRefresh, inputs: list[Any] | None) -> list[Any]:
            return self._recompute(key, e, pending, block, inputs)

        return self.spill.results(pending, e.name, recompute, consume)

    def _recompute(
        self,
        key: BlockKey,
        e: BlockEntry,
        pending: PendingRefresh,
        block: dict | None,
        inputs: list[Any] | None,
    ) -> list[Any]:
        """Run a lost refresh again on the pool and wait for it (the install step is kept):
        from ``inputs`` (its snapshot, the same result), else from the block's current factors
        and basis."""
        if inputs is None:
            block = self.block_state(key) if block is None else block
            jobs = self.optimizer.refresh_jobs(block, pending.group)
            inputs = [None if j is None else (j.factor, j.basis) for j in jobs]
        version, deadline = pending.requested, pending.requested + self.config.staleness
        subs, dims = [], []
        for dim, (job, inp) in enumerate(zip(pending.jobs, inputs)):
            if job is not None and inp is not None:
                subs.append(Submission(job, f"{e.name}.dim{dim}", version, deadline, inp))
                dims.append(dim)
        futures: list[Any] = [None] * len(pending.jobs)
        for dim, future in zip(dims, self.pool.submit_many(subs)):
            futures[dim] = future
        self.submitted += len(subs)
        t0 = time.perf_counter()
        results = [
            None if f is None else f.result(timeout_s=self.config.barrier_timeout_s)
            for f in futures
        ]
        self.wait_s += time.perf_counter() - t0
        return results

    # -- installs, failures, drops -------------------------------------------------------------

    def install_now(
        self, key: BlockKey, e: BlockEntry, step: int, block: dict, replicated: bool
    ) -> None:
        """Install ``e``'s refresh in flight at this step, waiting for it: on every rank at once
        for a replicated block (Note [Distributed coherence] in distributed.py)."""
        if replicated:
            self.sync_replicated(key, e, step, block)
        else:
            self.wait(e, step)
            self.install_many([(key, e, step, block)])

    def install_many(self, batch: list[tuple], charge: bool = True) -> None:
        """The one install path: the finished refreshes of ``batch`` (``(key, entry, at, block state
        or None)``) read (a failure counted and skipped, keeping the previous version), installed in
        one call of the bases strategy with autocast off (Note [Autocast]), recorded, and charged to
        the pacer (``charge``). A refresh stays in flight until installed (Note [Interrupted steps]
        in plan.py); a failure past the limit or a crash raises once the rest are installed."""
        ready, spill, error = [], self.spill, None
        for key, e, step, block in batch:
            pending = e.pending
            block = self.block_state(key) if block is None else block
            try:
                if spill is None:  # (``results``, inline: no call per block)
                    results = []
                    for f in pending.futures:
                        results.append(None if f is None else f.result())
                else:
                    results = self.results(key, e, pending, block)
            except self.errors as err:
                e.pending = None
                try:
                    self.count_failure(e, "", str(err), cause=err)
                except RefreshFailedError as failed:
                    error = error or failed
                continue  # keep the previous version
            except Exception as err:
                e.pending = None
                self.failed += 1
                crash = RefreshFailedError(
                    f"Asteria: the refresh of block '{e.name}' (version {pending.requested}) "
                    f"failed in a worker: {err}"
                )
                crash.__cause__ = err
                error = error or crash
                continue
            ready.append((key, e, pending, block, step, results))
        self._installed(ready, charge)
        if error is not None:
            raise error

    def _installed(self, ready: list[tuple], charge: bool) -> None:
        if not ready:
            return
        items = [(key, block, res) for key, _, _, block, _, res in ready]
        for device_type in AUTOCAST_DEVICES:  # Note [Autocast]: a signal installs inside the
            if torch.is_autocast_enabled(device_type):  # model's forward
                with no_autocast():
                    self.bases.install_many(items)
                break
        else:
            self.bases.install_many(items)
        self.registry.record_installs([(e, p.requested, step, p) for _, e, p, _, step, _ in ready])
        if charge and self.pacer.enabled:
            for key, _, _, block, step, _ in ready:
                self.pacer.charge(key, block, step)

    def sync_replicated(self, key: BlockKey, e: BlockEntry, step: int, block: dict | None) -> None:
        """Install replicated block ``key``'s refresh in flight at ``step`` on every rank of its
        group (Note [Distributed coherence]): the owner waits for it and sends its outcome; every
        rank installs it, keeps its version (``FAILED``) or raises (``CRASHED``), alike."""
        coherence = self.coherence
        pending = e.pending
        if block is None:
            block = self.block_state(key)
        status, results, error = OK, None, ""
        if coherence.is_owner(key):
            self.wait(e, step)
            try:
                results = self.results(key, e, pending, block)
            except self.errors as err:
                status, error = FAILED, str(err)
            except Exception as err:
                status, error = CRASHED, f"{type(err).__name__}: {err}"
        e.pending = None
        factors = block["factors"]
        dims = [0 if f is None else int(f.shape[0]) for f in factors]
        dtype = next(f for f in factors if f is not None).dtype
        t0 = time.perf_counter()
        status, results = coherence.exchange(
            key, e.name, step, pending.jobs, dims, dtype, status, results
        )
        self.wait_s += time.perf_counter() - t0
        owner = coherence.owner(key)
        if status == FAILED:
            self.count_failure(e, f" (owner rank {owner})", error)
            return  # keep the previous version, on every rank
        if status != OK:
            self.failed += 1
            raise RefreshFailedError(
                f"Asteria: the refresh of block '{e.name}' (version {pending.requested}) failed "
                f"in a worker of its owner rank {owner}" + (f": {error}" if error else "")
            )
        self._installed([(key, e, pending, block, step, results)], True)
        e.synced_step = step

    def count_failure(
        self, e: BlockEntry, where: str, error: str, cause: BaseException | None = None
    ) -> None:
        """A refresh of ``e`` that failed (the previous version stays in use): counted, and a
        ``RefreshFailedError`` once ``max_consecutive_failures`` are in a row. ``where`` follows
        the block's name in the message (" (owner rank r)" under torch.distributed)."""
        self.failed += 1
        e.failures += 1
        e.consecutive_failures += 1
        if e.consecutive_failures >= self.config.max_consecutive_failures:
            raise RefreshFailedError(
                f"Asteria: the refresh of block '{e.name}'{where} failed "
                f"{e.consecutive_failures} times in a row"
                + (f"; last error: {error}" if error else "")
            ) from cause

    def drop(self, e: BlockEntry) -> None:
        """Forget ``e``'s refresh in flight: its unfinished jobs count as cancelled, its spilled
        data is discarded. A job still waiting for its snapshot was never submitted: it counts
        as cancelled too."""
        pending = e.pending
        self.cancelled += sum(f is not None and not f.done() for f in pending.futures)
        if pending.copies:  # (the snapshot's jobs were never submitted)
            self.cancelled += len(pending.jobs) - pending.jobs.count(None)
        if self.spill is not None:
            self.spill.discard(e.pending)
        e.pending = None
        e.owed = False

    def install_in_flight(self) -> None:
        """Install every refresh in flight (close); one not ready within the barrier timeout is
        dropped with a warning. Collective for replicated blocks: every rank closes."""
        broken = self.coherence is not None and self.coherence.broken is not None
        for key, e in sorted(self.registry.entries.items()):
            if e.pending is None:
                continue
            if self.replicated(key):
                if broken:  # no collective (Note [A fault on one rank] in distributed.py)
                    self.drop(e)
                else:
                    self.sync_replicated(key, e, self.current_step(key), None)
                continue
            try:
                self.wait(e, self.current_step(key))
            except StalenessTimeoutError as err:
                warnings.warn(f"{err}; dropped at close()", RuntimeWarning, stacklevel=4)
                e.pending = None
                continue
            except StatisticsLaneError:  # raised by a step already (close() waited for the lane)
                self.drop(e)
                continue
            self.install_many([(key, e, self.current_step(key), None)])

    def install_ready(self, signalled: frozenset[int]) -> int:
        """A step's first module signal (Note [One install batch per step] in runtime.py): install
        in one batch the finished refreshes of ``signalled`` parameters the pacing allows (looking
        at the refreshes in flight only); the number installed."""
        late, pacer, params, state = self.late, self.pacer, self.params(), self.optimizer.state
        batch: list[tuple] = []
        for key, e in list(self.registry.in_flight.items()):  # (no call per block but these)
            if key[0] not in signalled:
                continue
            pending = e.pending
            if pending.copies:
                self.collect(e, wait=False)
                if pending.copies:
                    continue
            finished = True
            for f in pending.futures:
                finished = finished and (f is None or f.done())
            if not finished:
                continue
            p_state = state[params[key[0]]]
            step = int(p_state["step"])
            # between steps `step` and `step + 1`; Shampoo, which refreshes before its update,
            # would have used it in step `step` already. Charged now, so that the batch stays
            # within the pacer's allowance.
            block = p_state["blocks"][key[1]]
            if pacer.enabled:
                if not pacer.allows(key, step + 1):
                    continue
                pacer.charge(key, block, step + late)
            batch.append((key, e, step + late, block))
        if batch:
            self.install_many(batch, charge=False)
        return len(batch)

    def drop_all(self) -> None:
        """Forget everything still in flight (close, after ``install_in_flight`` or without)."""
        for e in self.registry.entries.values():
            if e.pending is not None:
                self.drop(e)
        self.deferred.clear()


def interruptible_result(future: Any, timeout_s: float, timeout_error: type) -> Any:
    """``future.result(timeout_s)`` in slices of 0.1 s: between slices the interpreter runs, so
    Ctrl-C (SIGINT) raises KeyboardInterrupt promptly during a long barrier wait."""
    deadline = time.perf_counter() + timeout_s
    while True:
        try:
            return future.result(timeout_s=min(0.1, max(deadline - time.perf_counter(), 0.0)))
        except timeout_error:
            if time.perf_counter() >= deadline:
                raise


# Note [Helping within the deadline]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A barrier waits at most ``barrier_timeout_s`` (a plan's waited-for installs share one), and
# the error names the block, the step and the knob. The training thread helps meanwhile (Note
# [Helping waiters] in csrc/core/worker_pool.cpp), but a started job runs to its end: helping
# without a limit kept a barrier behind 60 slow jobs for the whole queue. So it takes a job only
# where one as long as the longest measured (the placement's averages, or its own) ends before
# the deadline, the first one unmeasured: a barrier passes its deadline by one job at most, once
# per runtime. tests/unit/test_deadlines.py checks every wait's deadline.
