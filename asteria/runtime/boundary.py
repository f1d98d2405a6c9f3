"""The block boundary: the schedule's decision at the end of a block's step, carried out.

Owns: ``Boundaries``, what happens at each block boundary (``Runtime.block_boundary``): it asks
the schedule (schedule.py) for the block's entry (registry.py) and tells the refreshes
(refreshes.py) to install, spill or request; the error of a boundary kept for the step's end
(Note [All-or-nothing steps]); the boundaries a step that raised before its end skipped, finished
before anything else changes (Note [Interrupted steps]); the blocks a continuous refresh may
request (Note [Continuous refresh] in schedule.py); the reset of every block when the optimizer
loads a state.

Must not: decide when (the schedule does), submit, wait or install itself (the refreshes do),
know how a snapshot is taken or where a basis lives, or take the runtime's lock (the facade,
runtime.py, holds it around every call).
"""

from __future__ import annotations

import time
from typing import Any

from asteria.optim.base import BlockKey
from asteria.runtime.refreshes import Refreshes
from asteria.runtime.registry import RefreshFailedError, Registry, StalenessTimeoutError
from asteria.runtime.schedule import Pacer, Schedule

__all__ = ["Boundaries"]


class Boundaries:
    """The block boundaries of one runtime (see module docstring).

    ``error``: an exception of a step's block boundary, raised at the step's end (Note
    [All-or-nothing steps]); ``in_step``: whether a step began and has not ended.
    """

    def __init__(
        self,
        schedule: Schedule,
        refreshes: Refreshes,
        registry: Registry,
        pacer: Pacer,
        bases_field: str,
    ) -> None:
        self.schedule = schedule
        self.refreshes = refreshes
        self.registry = registry
        self.pacer = pacer
        self.bases_field = bases_field
        self.error: BaseException | None = None
        self.in_step = False
        # per block: (refresh due, frequency, betas, refresh_urgent's answer): ``_urgent``
        self._urgency: dict[BlockKey, tuple] = {}
        # Note [Quiet boundaries]: the blocks seen without a basis (no version) since the last
        # reset, and whether a block with a version and nothing in flight, owed or due has only
        # its age measured (no schedule of its own that may make it due: interval refresh)
        self._bare: set[BlockKey] = set()
        self.quiet_versions = not schedule.continuous and not schedule.staggered
        #: Note [Deferred installs]: the installs this step's update reads, left for ``flush``
        #: (key, entry, step, block, frequency), in boundary order
        self.deferred: list[tuple] = []

    def begin(self) -> None:
        """A step begins (after :meth:`finish_interrupted`)."""
        self.in_step = True
        self.error = None

    def end(self) -> None:
        """The step ended: raise the first error of its boundaries (Note [All-or-nothing
        steps]: the step was applied in full)."""
        self.in_step = False
        error, self.error = self.error, None
        if error is not None:
            raise error

    def run(self, key: BlockKey, block: dict, group: dict, step: int, due: bool) -> None:
        """Note [Staleness contract] (schedule.py): install what is due, then request or
        coalesce; measure the age of the basis this step's update reads."""
        e = self.registry.entries.get(key)
        if e is not None and not due and e.pending is None and not e.owed:
            # Note [Quiet boundaries]: nothing to install, request or decide
            if e.version is not None:
                if self.quiet_versions:
                    self.schedule.record_age(e, step, group["precondition_frequency"])
                    e.boundary_step = step
                    return
            elif key in self._bare:
                e.boundary_step = step
                return
        schedule, refreshes = self.schedule, self.refreshes
        freq = group["precondition_frequency"]
        # Note [Boundary work per block]: the sub-decisions that cannot change the outcome
        # at this boundary are skipped, not computed
        if e is None:
            e = refreshes.entry(key)
        replicated = refreshes.coherence is not None and refreshes.replicated(key)
        exact = schedule.fixed or replicated
        # Note [Rank-deficient factors] in schedule.py: as natively, waited for at its step
        urgent = False
        if schedule.wait_first:  # ``_urgent``'s answer for this interval, where it was asked
            seen, due_at = self._urgency.get(key), -(-step // freq) * freq
            if seen is not None and seen[:3] == (due_at, freq, group.get("betas")):
                urgent = seen[3]
            else:
                urgent = self._urgent(key, block, step, group, due_at)
        if not urgent:  # Notes [Continuous refresh], [Staggered refresh] in schedule.py
            if e.version is not None and (
                schedule.continuous or (schedule.staggered and not exact)
            ):
                cost = lambda: _refresh_cost(block)  # noqa: E731 (asked once per block)
                due = schedule.due(e, step, freq, due, exact, cost)
        elif due and e.pending is not None:
            self._install(key, e, step, block, replicated)  # older than this step's request
        if e.version is None:
            has_bases = _has_bases(block, self.bases_field)
            if has_bases:
                e.version = schedule.initial_version(step, freq)  # a basis made before us
            else:
                self._bare.add(key)  # until a refresh installs (Note [Quiet boundaries])
        else:
            has_bases = True  # (what ``waits_for`` reads it for: a first refresh)
        # Note [First roots]
        wait = due and schedule.wait_first and schedule.waits_for(e, due, has_bases, urgent)
        schedule.urgent_waits += wait and urgent and e.version is not None
        if not schedule.precedes_update:
            schedule.record_age(e, step, freq)  # the update of this step read it already
        if e.pending is not None and schedule.install_now(
            e.pending, step, due or e.owed, exact, self.pacer, key
        ):
            self._install(key, e, step, block, replicated)
        elif e.pending is not None and schedule.fixed and not replicated:
            refreshes.maybe_spill(e)  # a finished refresh waiting for its install step
        if due and e.pending is not None:
            if not e.owed:
                schedule.coalesced += 1
            e.owed = True  # requested where the refresh in flight is installed
        elif (
            due
            or (e.owed and e.pending is None)
            or (not urgent and schedule.continuous and schedule.wants(key, e, exact))
        ):
            e.owed = False
            refreshes.request(key, e, block, group, step)
            if e.pending is not None and (schedule.budget == 0 or wait):
                if schedule.precedes_update and not replicated:  # Note [Deferred installs]
                    self.deferred.append((key, e, step, block, freq))
                    e.boundary_step = step
                    return
                self._install(key, e, step, block, replicated)
        if schedule.precedes_update:
            schedule.record_age(e, step, freq)  # installed above, read by this step
        e.boundary_step = step

    def flush(self) -> None:
        """Note [Deferred installs]: install the refreshes this step's boundaries requested and
        its update reads, in boundary order, after running the jobs queued up to the last of
        them on this thread (``Refreshes.help``). One left by an interruption stays for the
        next flush (``finish_interrupted``)."""
        deferred = self.deferred
        if not deferred:
            return
        refreshes = self.refreshes
        since = time.perf_counter()  # one barrier for them all (Note [Helping within the deadline])
        refreshes.help(deferred[-1][1], since + refreshes.config.barrier_timeout_s)
        schedule = self.schedule
        refreshes.barrier_since = since
        try:
            while deferred:
                key, e, step, block, freq = deferred[0]
                if e.pending is not None:
                    self._install(key, e, step, block, False)
                schedule.record_age(e, step, freq)  # installed above, read by this step
                del deferred[0]
        finally:
            refreshes.barrier_since = None

    def _urgent(self, key: BlockKey, block: dict, step: int, group: dict, due_at: int) -> bool:
        """``optimizer.refresh_urgent(block, step, group)``, kept for the block's refresh
        interval (``run`` reads it back): its answer depends on the block's shapes, the refresh
        due at or after ``step`` and the group's betas and frequency only (Note [Boundary work
        per block])."""
        urgent = self.refreshes.optimizer.refresh_urgent(block, step, group)
        freq = group["precondition_frequency"]
        self._urgency[key] = (due_at, freq, group.get("betas"), urgent)
        return urgent

    def _install(self, key: BlockKey, e: Any, step: int, block: dict, replicated: bool) -> None:
        """Install ``e``'s refresh in flight; a refresh failure past the limit or a barrier
        timeout is kept for the step's end, so that every block of the step is updated (Note
        [All-or-nothing steps]). A timed-out refresh is dropped: the block keeps its basis."""
        try:
            self.refreshes.install_now(key, e, step, block, replicated)
        except (RefreshFailedError, StalenessTimeoutError) as err:
            if isinstance(err, StalenessTimeoutError) and e.pending is not None:
                owed = e.owed
                self.refreshes.drop(e)
                e.owed = owed
            if self.error is None:
                self.error = err

    def candidates(self) -> list[tuple[int, BlockKey]]:
        """The blocks a continuous refresh may request this step, with the version they will
        have: none in flight, or a finished one (installed at their boundary)."""
        out = []
        for key, e in self.registry.entries.items():
            p = e.pending
            if e.version is not None and (p is None or (p.owner is None and p.done())):
                out.append((e.version if p is None else p.requested, key))
        return out

    def finish_interrupted(self) -> None:
        """Note [Interrupted steps]: after a step that raised before its end (a KeyboardInterrupt,
        an error of the model's code in a closure-less step, ...), finish what its skipped block
        boundaries owed: each runs now, at the block's step, as a due one (a refresh at its
        deadline installed, a new one requested or coalesced)."""
        coherence = self.refreshes.coherence
        if coherence is not None and coherence.replicates:
            if self.in_step:  # Note [A fault on one rank] in distributed.py: no repair
                coherence.fail(
                    f"rank {coherence.rank}'s step stopped before its end (an exception or a "
                    "KeyboardInterrupt inside optimizer.step()), with its replicated blocks' "
                    "syncs left out of step with the other ranks'"
                )
            coherence.check()
        self.flush()  # installs of a step interrupted before its update read them
        if not self.in_step:
            return
        refreshes = self.refreshes
        for key, e in sorted(self.registry.entries.items()):
            step = refreshes.current_step(key)
            if step > e.boundary_step:  # its boundary of that step did not run to its end
                group = refreshes.group_of(key)
                self.run(key, refreshes.block_state(key), group, step, True)
        self.end()

    def reset(self) -> None:
        """The optimizer loaded a state: no step is under way, and every block's version is
        taken from the loaded state at its next boundary (Note [Transactional loads] in
        asteria/optim/state_io.py)."""
        self.in_step, self.error = False, None
        self.deferred.clear()
        self._urgency.clear()
        self._bare.clear()
        for e in self.registry.entries.values():
            e.version, e.owed, e.consecutive_failures = None, False, 0
            e.boundary_step = -1


def _has_bases(block: dict, field: str) -> bool:
    return any(q is not None for q in block.get(field, ()))


def _refresh_cost(block: dict) -> float:
    """About what a block's refresh costs: an eigendecomposition (or root) of each factor,
    ``d^3`` for a ``d x d`` one (Note [Staggered refresh] in schedule.py)."""
    return float(sum(f.shape[0] ** 3 for f in block.get("factors", ()) if f is not None))


# Note [Boundary work per block]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``run`` is called at every block of every step: on a GPU its Python is paid per block before
# the kernels of the next step are launched (issue 37: Shampoo's boundaries made 1.33-1.39x
# native's Python calls per step). So it asks only what can change its outcome: the schedule's
# ``due`` only where the schedule decides (continuous or staggered refresh, a block with a
# version), the block's bases only while it has no version (``waits_for`` and the initial
# version read them for a first refresh only), ``wants`` only under continuous refresh, the
# coherence only where there is one, and ``refresh_urgent`` once per block and refresh
# interval (its answer holds over the interval: ``Shampoo.refresh_urgent``; ``_urgent`` keys it
# by the due step, the frequency and the betas). The decisions are the same as asking every
# time: tests/unit/test_staleness_contract.py and test_rank_deficient_refresh.py; the count,
# tests/unit/test_host_work.py.

# Note [Deferred installs]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Where a boundary's install is read by the same step's update (Shampoo,
# ``refresh_precedes_update``), the refreshes it waits for at once (the first roots and the
# urgent ones, Note [Rank-deficient factors] in schedule.py; every refresh at ``B = 0``) are the
# step's spike: installed at each boundary in turn, each was requested, then waited for, so the
# pool computed one at a time while the training thread idled, and the spike was native's (the
# same roots, one after another) plus a hand-over per block. Shampoo ends every block of a
# group before it updates any (shampoo_step.py), so ``run`` only requests them and keeps the
# install for ``flush``, which the runtime calls before the step's first read of bases
# (``bases``, ``bases_many``), at the step's end (blocks the update does not read) and before
# anything else after an interrupted step (``finish_interrupted``). ``flush`` first runs the
# jobs queued up to the last of them on the training thread (Note [Helping waiters] in
# csrc/core/worker_pool.cpp) while the workers take the others, then installs each in boundary
# order, at the step it was requested: the same results, versions and ages as installing at the
# boundary (the update reads them after both), with every worker and the training thread
# computing them together. A replicated block installs at its boundary as before (its install
# is a collective, in an order every rank shares). Measured by bench/step_time.py (Shampoo at
# ``tiny``: the spikes of steps 10 to 40); tests/unit/test_deferred_installs.py checks the
# results and ages against installing at the boundary.

# Note [Quiet boundaries]
# ~~~~~~~~~~~~~~~~~~~~~~~
# Most boundaries of a step decide nothing: the block is not due, has no refresh in flight and
# owes no request. ``run`` returns for them after measuring the age (issue 37: a call or two per
# block, not the whole decision's six to ten), in two cases where the full decision is known to
# do nothing else:
#   * a block with a version under interval refresh (``quiet_versions``): without a schedule of
#     its own (continuous, staggered) and with ``due`` False, urgency changes nothing (it only
#     chooses between the optimizer's ``due`` and the schedule's), no install, no request;
#   * a block without a version that an earlier boundary found without a basis (``_bare``): it
#     gets one only through an install, which gives it a version, or a loaded state, which
#     ``reset`` follows by clearing ``_bare``; the full decision would find no basis again,
#     measure no age (none without a version) and request nothing (not due, not owed).
# What the full decision keeps besides (``_urgency``, asked where a boundary decides) is asked
# again at the block's next boundary that decides. tests/unit/test_host_work.py counts the
# calls; test_staleness_contract.py and test_properties.py check the decisions are unchanged.

# Note [All-or-nothing steps]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# What an exception inside ``optimizer.step()`` leaves, with a runtime attached:
#   * a refresh failing ``max_consecutive_failures`` times in a row (or crashing in a worker), a
#     barrier timeout: the step runs to its end, every parameter updated with the bases it has
#     (a timed-out refresh is dropped, the block keeps its basis and requests again at its next
#     due boundary; later barriers of that step do not wait), and ``step_end`` raises the first
#     such error: the step is complete, the next ``step()`` is an ordinary one. Native mode does
#     the same for refresh failures (Note [Refresh failures] in asteria/optim/refresher.py);
#   * a block whose statistics failed on the lane: every later ``step()`` raises
#     ``StatisticsLaneError`` at its start, before it changes anything (``StatisticsLane.check``);
#     the step that was running when the lane failed stops at the failed block's first wait;
#   * anything else (a KeyboardInterrupt, an error of a split update): the step stops where it
#     was, some parameters updated and some not, and the next step is a complete one (Note
#     [Interrupted steps]). A rollback of every parameter and state tensor would cost a copy of
#     all of them at every step, to undo what the user chose to interrupt.
# The runtime's own invariants are checked where its state changes (``Registry.record_install``:
# an install outside ``[t, t + B]`` is a bug of the runtime, an AssertionError the tests find);
# no fault of the user's or of the machine reaches one. tests/unit/test_all_or_nothing_steps.py
# has every fault of issue 22 (hypothesis over optimizer x runtime x fault x the step and the
# point at which it strikes), each ending in a clear error with the state unchanged, or in a run
# that keeps the staleness contract, with no thread left after ``close()``.

# Note [Interrupted steps]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A step that raised before ``step_end`` (``Boundaries.in_step`` still set) may have updated a
# block without running its boundary, where a refresh at its deadline was due to be installed:
# left so, the next boundary would install it a step past its budget. Every block's entry keeps
# the step whose boundary last ran to its end (``boundary_step``); before the next step changes
# anything (and before ``state_dict``, ``close``, or a module signal installs), the facade calls
# ``Boundaries.finish_interrupted``, which finishes the skipped boundaries: a refresh whose
# deadline is the block's step is installed there (waiting for it, as the boundary would have),
# and a refresh is requested (or coalesced into the one in flight) as if that boundary were due:
# the request it may have owed, from the same step, so that the age of the basis stays within
# its bound. Requests and installs are atomic against interruption: a refresh is in flight once
# all its jobs are submitted, and stays in flight until its results are installed
# (refreshes.py), so an interrupted one is installed again, never twice, and never half. A
# statistics lane wait that is interrupted keeps its work for the next wait.
