"""The schedule: when a block's refresh is requested and installed, and the bound that keeps.

Owns: the staleness contract (Note [Staleness contract]) in one place: the decision taken at
each block boundary (install the refresh in flight, request a new one, coalesce a due request
into the one in flight), the budget ``B`` that bounds every install, how far ahead an optimizer
that uses its own step's refresh requests it (Note [Refresh lead]) and waits for its first one
(Note [First roots]), the pacing of installs that finished early (Note [Paced installs]), the
bound on the age of the basis in use, and the per-block measurement of that age.

Must not: submit, wait or install (``refreshes.py`` does, on this module's decisions); know how a
snapshot is taken or where a basis lives.

Note [Staleness contract]
~~~~~~~~~~~~~~~~~~~~~~~~~
Let ``f`` be a group's ``precondition_frequency`` and ``B`` the budget: ``fixed_delay`` when set,
else ``staleness`` (``S``); under torch.distributed, replicated blocks use the same ``B``. A
block's refresh requested at (the block's optimizer) step ``t`` is *version* ``t``: it reads the
factors of step ``t``.

1. *Installs are bounded*: version ``t`` is installed at a step ``s`` with ``t <= s <= t + B``
   (exactly ``t + B`` under ``fixed_delay`` and for replicated blocks); at ``t + B`` the step
   waits for it (the bounded barrier).
2. *No request starves another*: a refresh that becomes due while one is in flight is
   *coalesced* into it: the one in flight is installed first (at once if it is ready, else at
   its own deadline, never later), and the due request is made at that same boundary, from the
   factors of that step. Nothing in flight is ever cancelled by a newer request, so every block
   installs at least once every ``max(f, B)`` steps.
3. *The basis in use is fresh*: the *age* of a step's basis is the step minus the version it
   reads. After a block's first basis exists (SOAP and KL-Shampoo: from its first step; Shampoo:
   from its first roots), every step's age is at most::

       bound(f, B) = max(f, B) + B

   For ``B <= f`` (the usual ``f = 10``, ``S = 5``) that is ``f + B``: the native schedule's
   ``f`` plus the budget. ``B = 0`` is native mode (``bound = f``), bit for bit. Under
   ``fixed_delay = d > f`` refreshes run every ``d`` steps instead of every ``f``: each is
   installed exactly ``d`` steps after its request, and the next is requested there.
   Proof sketch: version ``t`` is installed by ``t + a`` (``a <= B``); the next request is at
   ``t' = t + f`` when ``a <= f`` (the due step) and at ``t' = t + a`` otherwise (coalesced),
   so ``t' - t <= max(f, B)``; ``t'`` is in use by ``t' + B``.

Under continuous refresh (Note [Continuous refresh]) the same bound holds: ``f`` is then the
longest interval between a block's requests instead of the only one, and a request in between
only makes the next version newer (the proof above, with ``t' - t <= max(f, B)`` still).

Two things take a block outside the bound, and both are visible: a refresh that fails (the
previous basis stays in use; counted, and ``max_consecutive_failures`` in a row raise) and a
barrier that times out (``StalenessTimeoutError``). ``Runtime.stats()["basis_age"]`` reports the
age of every step's basis (max, histogram, per block) next to the install staleness, and whether
every block stayed within its bound; tests/unit/test_staleness_contract.py checks the bound at
every step over optimizer x frequency x budget x ``fixed_delay`` x pool speed x lane x hooks.

Note [Staggered refresh]
~~~~~~~~~~~~~~~~~~~~~~~~
The default (``RuntimeConfig(refresh="staggered")``). Natively every block of a group refreshes
at the same step, every ``f``, and a pool that has a few blocks' work per step gets the whole
round at once, so the round's last blocks install late. Staggered refresh keeps each block's
interval, ``f``, and gives every block its own *slot* of it (``step % f``): a block is requested
when its last request is ``f`` steps old, or earlier, once, at its slot, so that the pool gets
about ``1/f`` of the round at every step. Slots are given at a block's first decision with a
basis, greedily: the least loaded slot by refresh cost (``d^3`` per ``d x d`` factor), ties to
the one that keeps the longest first interval. The early request is made only where nothing of
the block is in flight or it is ready to install (it never waits nor coalesces). The bound of
Note [Staleness contract] holds: every interval between requests is at most ``f``. Where
installs happen at fixed steps (``fixed_delay``, replicated blocks) the optimizer's schedule
stays, and ``B = 0`` is native mode, bit for bit. ``refresh="interval"`` keeps the native
phase. What it bought, measured: docs/benchmarks.md, "The schedule's rules".

Note [Continuous refresh]
~~~~~~~~~~~~~~~~~~~~~~~~~
``RuntimeConfig(refresh="continuous")`` spends idle executor time on freshness. A block is
requested again as soon as its previous refresh is installed and the executors have room
(``placement.Executors.has_room``: at most ``min(2, B)`` steps of predicted work queued per pool
worker and device stream, or nothing queued at all). At each step's beginning the blocks
without a refresh in flight (or with a finished one) are taken oldest version first, and each is
granted room in that order until the room runs out (``pick``). ``f`` stays the longest interval
allowed: a block whose last request is ``f`` steps old (``f - 1`` with the refresh lead) is due
whatever the room, and coalesced as in Note [Staleness contract] if its refresh is still in
flight; the optimizer's own due steps count only before a block's first basis. Where installs
happen at fixed steps there is no room to measure: a block is requested again at each install,
every ``B`` steps, the same on every rank and at any pool speed. ``B = 0`` is native mode.

Note [Refresh lead]
~~~~~~~~~~~~~~~~~~~
Native Shampoo computes a due root inside the step that first uses it (the roots of L_t
precondition step t). A runtime cannot hand back a result in the step that requests it (unless
B = 0), so with a budget of at least one step an optimizer whose step plans before its update
(``refresh_precedes_update``) requests the refresh one step ahead, at step t-1, from L_{t-1}:
the job runs during step t's forward and backward, and step t installs it when it is ready (at
the latest at t-1+B). Every step of the interval then uses roots one gradient older than
native's, none f steps older. A block's first roots are the exception (Note [First roots]).
B = 0 keeps the native schedule, bit for bit; SOAP and KL-Shampoo read the bases of an earlier
refresh natively and keep their schedule. The plan (plan.py) decides the lead, nowhere else.

Note [First roots]
~~~~~~~~~~~~~~~~~~
With the lead a block's first roots would be one gradient short at the start, where a sum
factor holds the fewest gradients and one more moves the roots most: most of Asteria Shampoo's
gap to native once (docs/benchmarks.md). So, where the budget is at least one step
(``RuntimeConfig.wait_first_refresh``, on by default except under ``fixed_delay``;
``Schedule.wait_first``), a block's first refresh comes without the lead: the plan requests it
at its own step, from that step's factors, and waits for it (``Plan.decide``), as native
mode does, once per block. Under ``fixed_delay`` the first roots keep the fixed delay unless
``wait_first_refresh=True``.

Note [Rank-deficient factors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A Shampoo factor of a block of ``n`` elements gains at most ``n / d`` dims of rank a step, so it
is rank-deficient for its first ``d^2 / n`` steps. The root of such a factor scales the
directions outside its range far above those inside it, so applied to a first moment that holds
a newer gradient it returns almost only that gradient's part outside the range, which the
grafting then gives the block's whole step: roots one gradient short cost several percent of
loss (docs/benchmarks.md). So a block the optimizer calls urgent (``refresh_urgent``: from its
shape and step alone, the same on every rank) is refreshed as natively wherever first roots are
waited for: the plan keeps the optimizer's schedule for it (not the staggered slot or
continuous room), installs what may still be in flight, then requests from this step's factors
and waits (``urgent_waits`` in ``stats()``). ``B = 0`` is untouched. SOAP and KL-Shampoo are
never urgent.

Note [Young factors]
~~~~~~~~~~~~~~~~~~~~
A full-rank factor is still young while the last interval brought a large share of its
statistics (``Shampoo.new_mass_share``: at ``betas[1] = 1`` the refresh of step ``t`` adds ``f /
t`` of ``L_t``). So ``Shampoo.refresh_urgent`` also holds while that share is at least
``YOUNG_SHARE`` (1/4): the refreshes of ``2f``, ``3f`` and ``4f`` at ``b2 = 1``. The share is
predicted from the group's betas and frequency, not read from the factor (a device sync per
block). Both rules are judged at the due step at or after the step asked about, so their answer
holds over an interval and a request made ahead and one made at its step never both pass a due
step by.

Note [Paced installs]
~~~~~~~~~~~~~~~~~~~~~
Refreshes requested at the same step tend to finish together, and an install that computes
(SOAP rotates its first moment into the new basis) would then put all of them on one step. The
budget allows installing any of them at any step up to the deadline, so the schedule spreads
them: each step gets an allowance, the sum over the finished refreshes of install cost / steps
left before its deadline, and a finished refresh is installed while the step has spent less (at
least one per step). The deadline still forces an install (charged to the allowance). Costs
are the optimizer's ``install_cost``; a free install, or one the statistics lane runs, is never
held back. ``fixed_delay``, ``staleness=0`` and replicated blocks do not pace. Opt-in
(``pace_installs``): the spread costs staleness.
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

    ``budget`` is ``B``; ``fixed`` says installs happen exactly at ``t + B`` (``fixed_delay``);
    ``precedes_update`` is the optimizer's ``refresh_precedes_update`` (Shampoo: a boundary's
    install is read by the same step's update, so its age is taken after the install);
    ``refresh_lead`` allows such an optimizer to request one step ahead (Note [Refresh lead]).
    """

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
        """Whether the refresh in flight ``pending`` of block ``key`` is installed at this
        boundary (waiting for it if it is not ready): at its deadline always; before it (never
        where installs are ``exact``: ``fixed_delay``, replicated blocks) when it is ready and
        either a newer request waits for it (``due``: coalesced) or ``pacer`` allows it."""
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
        """Whether ``e``'s block is due at ``step``: the optimizer's ``due`` under interval
        refresh; under continuous refresh, once its last request is ``frequency`` steps old
        (Note [Continuous refresh]); under staggered refresh, at its own slot of the interval
        (Note [Staggered refresh]; ``cost()``: its refresh's, asked once, where the block gets
        its slot; ``exact``: installs at fixed steps, which keep the optimizer's schedule)."""
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
