"""The plan of a step: every refresh decision of a parameter group's blocks at their step.

Owns: ``Plan``, what ``Runtime.plan`` carries out once per parameter group and step (Note [One
plan per step]): which blocks are due (the optimizer's schedule, schedule.py's slots and room,
the lead and the urgency: decided here and nowhere else), which refresh in flight is installed,
coalesced or waited for, which is requested (all of a plan's together); the age of the basis
each update reads; the error kept for the step's end (Note [All-or-nothing steps]); the
decisions a step that raised skipped (Note [Interrupted steps]); the blocks continuous refresh
may request; the reset of every block at a load.

Must not: submit, wait or install itself (refreshes.py does), know how a snapshot is taken or
where a basis lives, or take the runtime's lock (the facade holds it around every call).
"""

from __future__ import annotations

import time
from typing import Any

from asteria.optim.groups import BlockGroup
from asteria.optim.refresher import BlockKey, RefreshFailedError
from asteria.runtime.refreshes import Refreshes
from asteria.runtime.registry import Registry, StalenessTimeoutError
from asteria.runtime.schedule import Pacer, Schedule

__all__ = ["Plan"]


class Plan:
    """The step plans of one runtime (see module docstring). ``error``: a step's decisions'
    exception, raised at its end; ``in_step``: a step began and has not ended; ``waiting``: the
    waited-for refreshes not installed yet; ``requests``: the plan's requests not made yet."""

    def __init__(
        self, schedule: Schedule, refreshes: Refreshes, registry: Registry, pacer: Pacer
    ) -> None:
        self.schedule = schedule
        self.refreshes = refreshes
        self.registry = registry
        self.pacer = pacer
        self.optimizer = refreshes.optimizer
        self.bases_field = refreshes.optimizer.bases_field
        self.error: BaseException | None = None
        self.in_step = False
        #: per block: (refresh due, frequency, betas, refresh_urgent's answer): ``urgent``
        self._urgency: dict[BlockKey, tuple] = {}
        #: the blocks seen without a basis (no version) since the last reset: nothing but an
        #: install (a version) or a load (``reset``) gives them one (Note [One plan per step])
        self._bare: set[BlockKey] = set()
        self.waiting: list[tuple] = []  # (key, entry, step, block, frequency), in plan order
        #: the plan's requests not made yet: (key, entry, block, group, step, wait, replicated)
        self.requests: list[tuple] = []
        s = schedule
        #: the lead of a refresh and of a block's urgent one (Notes [Refresh lead], [First
        #: roots]): only an optimizer whose update reads its own step's refresh requests ahead
        lead = s.lead if s.precedes_update else 0
        self.lead, self.first_lead = lead, 0 if s.wait_first else lead

    def begin(self) -> None:
        """A step begins (after :meth:`finish_interrupted`)."""
        self.in_step = True
        self.error = None

    def end(self) -> None:
        """The step ended: raise the first error of its plans (Note [All-or-nothing steps]:
        the step was applied in full)."""
        self.in_step = False
        error, self.error = self.error, None
        if error is not None:
            raise error

    # -- one plan ----------------------------------------------------------------------------

    def step(self, groups: list[BlockGroup], hp: dict[str, Any]) -> None:
        """Note [One plan per step]: the decisions of every block of ``groups`` at its step."""
        schedule, entries, opt = self.schedule, self.registry.entries, self.optimizer
        freq, lead, first_lead = hp["precondition_frequency"], self.lead, self.first_lead
        staggered = schedule.staggered and self.refreshes.coherence is None
        decide_all = schedule.continuous or (schedule.staggered and not staggered)
        phases, budget = schedule.phases, schedule.budget
        bound = max(freq, budget) + budget  # (``basis_age_bound``, inline)
        installs_seen, hist, bare = schedule.installs_seen, schedule.age_histogram, self._bare
        urgency, betas, field = self._urgency, hp.get("betas"), self.bases_field
        ages: list[tuple] = []  # the blocks installed since their last age: measured together
        dues: dict[int, tuple[bool, bool]] = {}  # per step: (due ahead, due now)
        for g in groups:
            step = g.step
            due = dues.get(step)
            if due is None:
                due_ahead = opt.refresh_due(step + lead, hp)
                due_now = due_ahead if lead == first_lead else opt.refresh_due(step, hp)
                due = dues[step] = (due_ahead, due_now)
            due_ahead, due_now = due
            deciding = []  # (``decide``'s items, in the group's order)
            if decide_all or (due_now and due_ahead):  # every block decides
                for k, b in zip(g.keys, g.blocks):
                    deciding.append((k, b, entries.get(k), None, due_ahead, due_now))
                self.decide(deciding, hp, step)
                continue
            mixed = due_now != due_ahead  # the lead or a block's urgency decides (``decide``)
            due_at, slot = -(-step // freq) * freq, step % freq
            asked = None  # ``urgent``'s answer for the group: its blocks' shapes are one
            for key, block in zip(g.keys, g.blocks):
                e = entries.get(key)
                due, urgent = due_ahead, None
                if mixed:
                    bases = block[field]
                    seen = urgency.get(key)
                    if bases.count(None) == len(bases):
                        due = due_now  # (a first refresh: no lead)
                    elif (
                        seen is not None
                        and seen[1:3] == (freq, betas)
                        and (seen[0] == due_at or (not seen[3] and seen[0] < due_at))
                    ):  # (kept for the interval; once not urgent, never again)
                        urgent = seen[3]
                        due = due_now if urgent else due_ahead
                    else:
                        if asked is None:
                            asked = self.urgent(key, block, step, hp)
                        urgent = asked
                        urgency[key] = (due_at, freq, betas, urgent)
                        due = due_now if urgent else due_ahead
                if due or e is None or e.owed or e.pending is not None:
                    deciding.append((key, block, e, urgent, due_ahead, due_now))
                    continue
                version = e.version
                if version is None:  # no basis: only an install gives it one
                    if key in bare:
                        e.boundary_step = step
                        continue
                    deciding.append((key, block, e, None, False, False))
                    continue
                if staggered and (
                    step - version >= freq
                    or (step - version >= 1 and phases.get(e.name, slot) == slot)
                ):
                    deciding.append((key, block, e, None, False, False))  # slot or interval
                    continue
                seen = installs_seen.get(e.name)
                if seen is None or seen[0] != e.installs:
                    ages.append((e, step, freq))  # (an install since: its interval)
                else:  # the age of a quiet block: ``Schedule.record_ages``, inline
                    age = step - version
                    e.age = age
                    if age > e.max_age:
                        e.max_age = age
                    if e.bound != bound:
                        e.bound = bound
                    hist[age] += 1
                e.boundary_step = step
            if deciding:
                self.decide(deciding, hp, step)
        if ages:
            schedule.record_ages(ages)
        if self.requests:
            self._request()
        if self.waiting:
            self.install_waited()

    def decide(self, items: list[tuple], hp: dict, step: int, forced: bool = False) -> None:
        """Note [Staleness contract] (schedule.py) for the blocks of ``items`` at ``step``, each
        ``(key, block state, entry or None, urgency or None, due ahead, due now)``: install what
        is due, then request (with the plan's others: ``_request``) or coalesce; measure the age
        of the basis. ``forced``: an interrupted step's skipped decisions, due."""
        schedule, refreshes, field = self.schedule, self.refreshes, self.bases_field
        freq, wait_first = hp["precondition_frequency"], schedule.wait_first
        no_lead, precedes = self.lead == self.first_lead, schedule.precedes_update
        for key, block, e, urgent, due_ahead, due_now in items:
            if e is None:
                e = refreshes.entry(key)
            replicated = refreshes.coherence is not None and refreshes.replicated(key)
            exact = schedule.fixed or replicated
            # Notes [First roots], [Rank-deficient factors]: as natively, at its step
            if urgent is None:
                urgent = wait_first and self.urgent(key, block, step, hp)
            else:
                urgent = wait_first and urgent
            bases = block.get(field, ())
            has_bases = bases.count(None) != len(bases)
            if forced:
                due = True
            elif no_lead:
                due = due_ahead
            else:
                due = due_now if urgent or not has_bases else due_ahead
            if not urgent:  # Notes [Continuous refresh], [Staggered refresh] in schedule.py
                if e.version is not None and (
                    schedule.continuous or (schedule.staggered and not exact)
                ):
                    cost = lambda b=block: _refresh_cost(b)  # noqa: E731 (asked once a block)
                    due = schedule.due(e, step, freq, due, exact, cost)
            elif due and e.pending is not None:
                self._install(key, e, step, block, replicated)  # older than this request
            first = e.version is None and not has_bases  # (its first refresh)
            if e.version is None:
                if has_bases:
                    e.version = schedule.initial_version(step, freq)  # a basis made before us
                else:
                    self._bare.add(key)  # until a refresh installs
            # Notes [First roots], [Rank-deficient factors]: a first refresh or an urgent one is
            # waited for and installed at once
            wait = due and wait_first and e.pending is None and (first or urgent)
            schedule.urgent_waits += wait and urgent and e.version is not None
            if not precedes:
                schedule.record_ages([(e, step, freq)])  # the update of this step read it
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
                self.requests.append((key, e, block, hp, step, wait, replicated))
                if replicated:  # (its install, a collective, keeps its place in the plan)
                    self._request()
                continue  # the rest of its decision runs with the plan's requests (``_request``)
            if precedes:
                schedule.record_ages([(e, step, freq)])  # installed above, read by this step
            e.boundary_step = step

    def _request(self) -> None:
        """The plan's requests, made together (``Refreshes.request_many``), then the rest of their
        decisions: a waited-for refresh installed with the plan's others (``install_waited``; a
        replicated one at once), the age measured (Note [Interrupted steps])."""
        queued, self.requests = self.requests, []
        self.refreshes.request_many(queued)
        schedule, ages = self.schedule, []
        for key, e, block, hp, step, wait, replicated in queued:
            freq = hp["precondition_frequency"]
            if e.pending is not None and (schedule.budget == 0 or wait):
                if not replicated:
                    self.waiting.append((key, e, step, block, freq))
                    e.boundary_step = step
                    continue
                self._install(key, e, step, block, replicated)
            if schedule.precedes_update:
                ages.append((e, step, freq))  # installed above, read by this step
            e.boundary_step = step
        if ages:
            schedule.record_ages(ages)

    def install_waited(self) -> None:
        """Install the refreshes the plan waits for as one batch, after running the jobs queued up
        to the last of them on this thread (``Refreshes.help``), within one barrier (Note [Helping
        within the deadline] in refreshes.py); an interrupted one is left for
        ``finish_interrupted``."""
        waiting = self.waiting
        refreshes, schedule = self.refreshes, self.schedule
        since = time.perf_counter()
        refreshes.help(waiting[-1][1], since + refreshes.config.barrier_timeout_s)
        refreshes.barrier_since = since
        try:
            batch = []
            for key, e, step, block, _ in waiting:
                pending = e.pending
                if pending is None:
                    continue  # (installed before an interruption)
                finished = not pending.copies  # (inline: a finished one needs no wait)
                for f in pending.futures:
                    finished = finished and (f is None or f.done())
                try:
                    if not finished:
                        refreshes.wait(e, step)
                except StalenessTimeoutError as err:
                    self._dropped(e, err)
                    continue
                batch.append((key, e, step, block))
            try:
                refreshes.install_many(batch)  # (one batch: Note [Grouped install copies])
            except RefreshFailedError as err:
                self.error = self.error or err
            if schedule.precedes_update:  # installed above, read by this step
                schedule.record_ages([(e, step, freq) for _, e, step, _, freq in waiting])
            waiting.clear()
        finally:
            refreshes.barrier_since = None

    def urgent(self, key: BlockKey, block: dict, step: int, hp: dict) -> bool:
        """``optimizer.refresh_urgent(block, step, hp)``, kept for the block's refresh interval:
        its answer depends on the block's shapes, the refresh due at or after ``step`` and the
        group's betas and frequency only, and once ``False`` it stays so."""
        freq = hp["precondition_frequency"]
        due_at = -(-step // freq) * freq
        seen = self._urgency.get(key)
        if seen is not None and seen[1:3] == (freq, hp.get("betas")):
            if seen[0] == due_at or (not seen[3] and seen[0] < due_at):
                return seen[3]
        urgent = self.optimizer.refresh_urgent(block, step, hp)
        self._urgency[key] = (due_at, freq, hp.get("betas"), urgent)
        return urgent

    def _install(self, key: BlockKey, e: Any, step: int, block: dict, replicated: bool) -> None:
        """Install ``e``'s refresh in flight; a refresh failure past the limit or a barrier
        timeout is kept for the step's end, so that every block of the step is updated (Note
        [All-or-nothing steps]). A timed-out refresh is dropped: the block keeps its basis."""
        try:
            self.refreshes.install_now(key, e, step, block, replicated)
        except RefreshFailedError as err:
            self.error = self.error or err
        except StalenessTimeoutError as err:
            self._dropped(e, err)

    def _dropped(self, e: Any, err: StalenessTimeoutError) -> None:
        """A refresh not ready at the barrier: dropped (the block keeps its basis and what it
        owes), the error kept for the step's end."""
        if e.pending is not None:
            owed = e.owed
            self.refreshes.drop(e)
            e.owed = owed
        self.error = self.error or err

    # -- around the steps ------------------------------------------------------------------------

    def candidates(self) -> list[tuple[int, BlockKey]]:
        """The blocks a continuous refresh may request this step, with the version they will
        have: none in flight, or a finished one (installed at their next decision)."""
        out = []
        for key, e in self.registry.entries.items():
            p = e.pending
            if e.version is not None and (p is None or (p.owner is None and p.done())):
                out.append((e.version if p is None else p.requested, key))
        return out

    def finish_interrupted(self) -> None:
        """Note [Interrupted steps]: after a step that raised before its end, run its skipped
        decisions now, at the blocks' steps, as due ones."""
        coherence = self.refreshes.coherence
        if coherence is not None and coherence.replicates:
            if self.in_step:  # Note [A fault on one rank] in distributed.py: no repair
                coherence.fail(
                    f"rank {coherence.rank}'s step stopped before its end (an exception or a "
                    "KeyboardInterrupt inside optimizer.step()), with its replicated blocks' "
                    "syncs left out of step with the other ranks'"
                )
            coherence.check()
        if self.waiting:  # installs of a step interrupted before its update read them
            self.install_waited()
        if not self.in_step:
            return
        refreshes = self.refreshes
        self.requests.clear()  # (their decisions did not end: made again below)
        for key, e in sorted(self.registry.entries.items()):
            step = refreshes.current_step(key)
            if step > e.boundary_step:  # its decision of that step did not run to its end
                hp = refreshes.group_of(key)
                item = (key, refreshes.block_state(key), e, None, True, True)
                self.decide([item], hp, step, forced=True)
        if self.requests:
            self._request()
        if self.waiting:
            self.install_waited()
        self.end()

    def reset(self) -> None:
        """The optimizer loaded a state: no step is under way, and every block's version is
        taken from the loaded state at its next decision (Note [Transactional loads] in
        asteria/optim/state_io.py)."""
        self.in_step, self.error = False, None
        self.waiting.clear()
        self.requests.clear()
        self._urgency.clear()
        self._bare.clear()
        for e in self.registry.entries.values():
            e.version, e.owed, e.consecutive_failures = None, False, 0
            e.boundary_step = -1


def _refresh_cost(block: dict) -> float:
    """About what a block's refresh costs: an eigendecomposition (or root) of each factor,
    ``d^3`` for a ``d x d`` one (Note [Staggered refresh] in schedule.py)."""
    return float(sum(f.shape[0] ** 3 for f in block.get("factors", ()) if f is not None))


# Note [One plan per step]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# The runtime decides a step's refreshes once per parameter group (``Plan.step``), not in a
# callback per block: most blocks decide nothing, and for them the plan measures the age of the
# basis inline, with no Python call. A block decides (``decide``) where its step is due (the
# schedule, the lead), it has a refresh in flight or owes one, its slot or interval comes, under
# continuous refresh, and before its first basis; urgency is asked once per shape group. The
# plan's requests are made together (``_request``: one snapshot, one submission loop), and the
# refreshes the step waits for (``B = 0``, first roots, urgent ones) installed as one batch after
# the training thread ran the jobs queued up to them (``install_waited``; Note [Helping
# waiters] in csrc/core/worker_pool.cpp): the same results, versions and ages as one by one
# (tests/unit/test_deferred_installs.py). A replicated block requests and installs at its
# decision (its install is a collective, in an order every rank shares).

# Note [All-or-nothing steps]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# What an exception inside ``optimizer.step()`` leaves, with a runtime attached: a refresh
# failing ``max_consecutive_failures`` times in a row (or crashing), a barrier timeout: the step
# runs to its end with the bases it has (a timed-out refresh is dropped; later barriers of the
# step do not wait) and ``end`` raises the first such error (natively too: Note [Refresh
# failures] in asteria/optim/refresher.py); a block whose statistics failed on the lane: every
# later ``step()`` raises ``StatisticsLaneError`` before it changes anything; anything else (a
# KeyboardInterrupt, a split update's error): the step stops where it was, and the next one is
# complete (Note [Interrupted steps]) rather than a rollback of every tensor at every step. The
# runtime's own invariants are asserted where its state changes (``Registry.record_installs``).
# tests/unit/test_all_or_nothing_steps.py draws every fault of issue 22 at every point of a step.

# Note [Interrupted steps]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A step that raised before its end (``Plan.in_step`` still set) may have skipped decisions,
# among them an install due at its deadline. Every entry keeps the step whose decision last ran
# to its end (``boundary_step``); before anything else changes (a step, ``state_dict``,
# ``close``, a signal's install), ``Plan.finish_interrupted`` runs the skipped ones as due: what
# is at its deadline installed, a request made (or coalesced) from the same step. Requests and
# installs are atomic against interruption: a refresh is in flight once its jobs are submitted
# (or its snapshot taken), and stays so until its results are installed, so an interrupted one is
# installed again, never twice, never half. An interrupted lane wait keeps its work.
