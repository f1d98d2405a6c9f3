"""The schedule: when a block's refresh is requested and installed, and the bound that keeps.

Owns: the staleness contract (Note [Staleness contract]) in one place: the rules of each block's
decision at its plan (install the refresh in flight, request, coalesce a due request into the
one in flight), the budget ``B``, the lead and first-refresh rules, the pacing of installs, and
the measured age of the basis in use against its bound. docs/runtime.md tells each rule at
length, with its measurements and the tests that check it.

Must not: submit, wait or install (``refreshes.py`` does, on this module's decisions); know how a
snapshot is taken or where a basis lives.

Note [Staleness contract]
~~~~~~~~~~~~~~~~~~~~~~~~~
``f``: a group's ``precondition_frequency``; ``B``: ``fixed_delay`` when set, else ``S``. A
refresh requested at a block's step ``t`` (version ``t``) is installed in ``[t, t + B]`` (exactly
``t + B`` under ``fixed_delay`` and for replicated blocks), the step ``t + B`` waiting for it; a
refresh due while one is in flight is coalesced (that one installed first, the request made
then), so every step reads a basis at most ``bound(f, B) = max(f, B) + B`` steps old (``f`` at
``B = 0``: native mode, bit for bit). docs/runtime.md, "The staleness contract", has the proof;
tests/unit/test_staleness_contract.py checks it at every step.

Note [Staggered refresh]
~~~~~~~~~~~~~~~~~~~~~~~~
The default: each block keeps its interval ``f`` and its own slot of it (``step % f``, the least
loaded by cost ``d^3`` at its first decision with a basis), requested there once early, then
every ``f`` steps: the pool gets about ``1/f`` of a round each step (docs/runtime.md).

Note [Continuous refresh]
~~~~~~~~~~~~~~~~~~~~~~~~~
``refresh="continuous"``: a block is requested again once installed where the executors have
room (``pick``, ``placement.Executors.has_room``), oldest first; ``f`` stays the longest interval.
Where installs are fixed, at each install (docs/runtime.md).

Note [Refresh lead]
~~~~~~~~~~~~~~~~~~~
With a budget, an optimizer whose roots of step ``t`` precondition step ``t``
(``refresh_precedes_update``: Shampoo) requests a due refresh at ``t - 1``, so that it can arrive
for ``t``. The plan (plan.py) decides the lead, nowhere else.

Note [First roots]
~~~~~~~~~~~~~~~~~~
A block's first refresh (``wait_first_refresh``: on with a budget, unless ``fixed_delay``;
``Schedule.wait_first``) is requested at its own step, without the lead, and waited for
(``Plan.decide``), as natively, once per block.

Note [Rank-deficient factors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A block the optimizer calls urgent (``refresh_urgent``: from its shapes and step, the same on
every rank and for a whole shape group; Shampoo's factors that may be rank-deficient, whose late
roots cost several percent of loss: docs/benchmarks.md) is refreshed as natively wherever first
roots are waited for: at its step, waited for (``urgent_waits``).

Note [Young factors]
~~~~~~~~~~~~~~~~~~~~
``refresh_urgent`` also holds while the last interval brought at least ``YOUNG_SHARE`` of a
factor's statistics (``Shampoo.new_mass_share``, predicted, not read). Judged at the due step at
or after the step asked: constant over an interval, and once false, false.

Note [Paced installs]
~~~~~~~~~~~~~~~~~~~~~
With ``pace_installs``, each step's allowance is the sum over the finished refreshes of install
cost / steps left to its deadline, and a finished one is installed while the step has spent less
(at least one a step; the deadline forces it). Free installs, or the lane's, are never held.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

__all__ = ["InstallCosts", "Pacer", "Schedule", "basis_age_bound"]


def basis_age_bound(frequency: int, budget: int) -> int:
    """The largest age of a block's basis in use (Note [Staleness contract])."""
    return max(frequency, budget) + budget


class Schedule:
    """The decisions of Note [Staleness contract] and the measured ages of the bases in use.
    ``budget`` is ``B``; ``fixed``: installs exactly at ``t + B``; ``precedes_update``: the
    optimizer's ``refresh_precedes_update``; ``refresh_lead``: such an optimizer may request a step
    ahead (Note [Refresh lead])."""

    def __init__(
        self,
        budget: int,
        fixed: bool,
        precedes_update: bool,
        refresh_lead: bool = False,
        continuous: bool = False,
        staggered: bool = False,
        wait_first: bool = False,
    ) -> None:
        self.budget = budget
        self.fixed = fixed
        self.precedes_update = precedes_update
        #: steps ahead of its due step that a refresh is requested (Note [Refresh lead])
        self.lead = 1 if budget >= 1 and refresh_lead else 0
        #: Note [First roots] (never at B = 0)
        self.wait_first = wait_first and precedes_update and budget >= 1
        #: Note [Continuous refresh] (never at B = 0: native mode)
        self.continuous = continuous and budget >= 1
        #: Note [Staggered refresh] (never at B = 0, nor where installs are at fixed steps)
        self.staggered = staggered and budget >= 1 and not fixed and not self.continuous
        self.phases: dict[str, int] = {}  # block -> its slot, (step + lead) % frequency
        self._slot_load: dict[int, list[float]] = {}  # frequency -> refresh cost per slot
        self.coalesced = 0  # due requests folded into the refresh in flight
        self.urgent_waits = 0  # waited-for installs (Note [Rank-deficient factors])
        # (a defaultdict: a new age costs no Python call, Counter's __missing__ did)
        self.age_histogram: defaultdict[int, int] = defaultdict(int)
        self._picked: set[Any] = set()  # blocks granted room this step (continuous)
        # per block: the last install step seen, and the intervals between installs
        self.installs_seen: dict[str, tuple[int, int]] = {}  # name -> (installs, step)
        self.intervals: dict[str, list[int]] = {}  # name -> [count, sum, max]

    def bound(self, frequency: int) -> int:
        return basis_age_bound(frequency, self.budget)

    def install_now(
        self,
        pending: Any,
        step: int,
        due: bool,
        exact: bool,
        pacer: Pacer,
        key: Any,
    ) -> bool:
        """Whether ``pending`` of block ``key`` is installed now (waiting if need be): at its
        deadline always; before it (never where installs are ``exact``) when ready and a due request
        waits for it or ``pacer`` allows it."""
        age = step - pending.requested
        if exact:
            return age >= self.budget
        if age >= self.budget:
            return True
        return pending.done() and (due or pacer.allows(key, step))

    def due(
        self,
        e: Any,
        step: int,
        frequency: int,
        due: bool,
        exact: bool = False,
        cost: Callable[[], float] = lambda: 0.0,
    ) -> bool:
        """Whether ``e``'s block is due at ``step``: the optimizer's ``due`` under interval refresh,
        once ``frequency`` steps old under continuous refresh, at its own slot under staggered
        refresh (``cost()``: its refresh's, asked once; ``exact``: fixed installs keep the
        optimizer's schedule)."""
        if e.version is None or not (self.continuous or (self.staggered and not exact)):
            return due
        last = e.pending.requested if e.pending is not None else e.version
        if self.continuous:
            return step + self.lead - last >= frequency
        gap = step - last  # requests every ``frequency`` steps, each block at its own slot
        if frequency <= 1:
            return gap >= frequency
        slot = self.phases.get(e.name)
        if slot is None:
            slot = self.phases[e.name] = self._assign(frequency, cost(), last)
        if gap >= frequency:
            return True  # due, as under interval refresh (coalesced if still in flight)
        # early, onto its slot: only where nothing is in flight or it is ready to install
        idle = e.pending is None or (e.pending.owner is None and e.pending.done())
        return idle and gap >= 1 and step % frequency == slot

    def _assign(self, frequency: int, cost: float, anchor: int) -> int:
        """The slot (``step % frequency``) of a block of refresh cost ``cost``: the least
        loaded so far, ties going to the slot that keeps the longest first interval after
        ``anchor`` (its last request)."""
        load = self._slot_load.setdefault(frequency, [0.0] * frequency)
        home = anchor % frequency
        order = [(home - i) % frequency for i in range(frequency)]  # home, home - 1, ...
        slot = min(order, key=lambda s: load[s])
        load[slot] += cost
        return slot

    def pick(self, candidates: list[tuple[int, Any]], has_room: Callable[[Any], bool]) -> None:
        """At a step's beginning: grant room to ``candidates`` (``(version, key)``), oldest
        first, while ``has_room(key)`` (Note [Continuous refresh])."""
        self._picked.clear()
        for _, key in sorted(candidates):
            if not has_room(key):
                break
            self._picked.add(key)

    def wants(self, key: Any, e: Any, exact: bool) -> bool:
        """Whether a block without a refresh in flight is requested now under continuous
        refresh: at every install where installs are ``exact``, else when granted room."""
        if not self.continuous or e.pending is not None or e.version is None:
            return False
        if exact:
            return True
        if key in self._picked:
            self._picked.discard(key)
            return True
        return False

    def initial_version(self, step: int, frequency: int) -> int:
        """The version of a basis that existed before the runtime first saw its block at
        ``step``: the native schedule's last refresh (the first step's, 0, at the latest)."""
        return max(0, frequency * ((step - 1) // frequency))

    def record_ages(self, measured: list[tuple[Any, int, int]]) -> None:
        """Per ``(entry, step, frequency)`` of ``measured``: the age of the basis the entry's
        block reads in ``step`` (no call per block)."""
        seen_of, budget, hist = self.installs_seen, self.budget, self.age_histogram
        for entry, step, frequency in measured:
            if entry.version is None:
                continue  # no basis yet (Shampoo before its first roots)
            seen = seen_of.get(entry.name)
            if seen is None or seen[0] != entry.installs:
                if seen is not None and seen[0] > 0:  # steps since the block's previous install
                    gap = entry.installed_step - seen[1]
                    c = self.intervals.setdefault(entry.name, [0, 0, 0])
                    c[0], c[1], c[2] = c[0] + 1, c[1] + gap, max(c[2], gap)
                seen_of[entry.name] = (entry.installs, entry.installed_step)
            age = step - entry.version
            entry.age = age
            if age > entry.max_age:  # (per block and step: only what changed is written)
                entry.max_age = age
            bound = max(frequency, budget) + budget  # basis_age_bound, inline
            if entry.bound != bound:
                entry.bound = bound
            hist[age] += 1

    def report(self, entries: list[Any]) -> dict[str, Any]:
        """``Runtime.stats()["basis_age"]``: the ages measured so far."""
        hist = dict(sorted(self.age_histogram.items()))
        measured = [e for e in entries if e.bound is not None]
        return {
            "max": max(hist) if hist else 0,
            "histogram": hist,
            "bound": max((e.bound for e in measured), default=None),
            "within_bound": all(e.max_age <= e.bound for e in measured),
            "coalesced_requests": self.coalesced,
        }

    def interval_report(self) -> dict[str, Any]:
        """``Runtime.stats()["refresh"]``: how often the blocks installed, in steps between a
        block's installs (the effective refresh interval), over every block and per block."""
        count = sum(c[0] for c in self.intervals.values())
        return {
            "mode": "continuous"
            if self.continuous
            else ("staggered" if self.staggered else "interval"),
            "interval_mean": sum(c[1] for c in self.intervals.values()) / count if count else None,
            "interval_max": max((c[2] for c in self.intervals.values()), default=None),
            "blocks": {n: {"mean": c[1] / c[0], "max": c[2]} for n, c in self.intervals.items()},
        }


class InstallCosts:
    """The optimizer's ``install_cost`` of each block, computed once (its shapes never change);
    ``block_state(key)`` finds a block's state when the caller has none at hand."""

    def __init__(self, install_cost: Callable[[dict], float], block_state: Callable) -> None:
        self._install_cost = install_cost
        self._block_state = block_state
        self._costs: dict[Any, float] = {}

    def __call__(self, key: Any, block: dict | None = None) -> float:
        cost = self._costs.get(key)
        if cost is None:
            block = self._block_state(key) if block is None else block
            cost = self._costs[key] = float(self._install_cost(block))
        return cost


class Pacer:
    """The allowance of Note [Paced installs]; ``cost(key, block)`` is an install's cost on the
    training thread (0 where installs run elsewhere), ``entries`` the registry's entries."""

    def __init__(
        self,
        enabled: bool,
        staleness: int,
        entries: dict,
        cost: Callable[[Any, dict | None], float],
    ) -> None:
        self.enabled = enabled
        self._staleness = staleness
        self._entries = entries
        self._cost = cost
        self._step = 0  # steps ended so far
        self._period, self._budget, self._spent = -1, 0.0, 0.0

    def allows(self, key: Any, step: int) -> bool:
        """Whether a finished refresh of ``key`` may be installed in this step (``step``: the
        optimizer step whose boundary comes next) within its allowance."""
        if not self.enabled:
            return True
        cost = self._cost(key, None)
        if cost == 0.0:
            return True
        self._open(step)
        return self._spent == 0.0 or self._spent + cost <= self._budget

    def charge(self, key: Any, block: dict, step: int) -> None:
        """An install of ``key`` at ``step`` spends its cost (forced ones too)."""
        if self.enabled:
            self._open(step)
            self._spent += self._cost(key, block)

    def step_end(self) -> None:
        self._step += 1

    def _open(self, step: int) -> None:
        """This step's allowance, opened at its first install decision."""
        if self._period == self._step:
            return
        self._period, self._spent = self._step, 0.0
        budget = 0.0
        for key, e in self._entries.items():
            p = e.pending
            if p is not None and p.owner is None and p.done():
                left = p.requested + self._staleness - step + 1
                budget += self._cost(key, None) / max(1, left)
        self._budget = budget
