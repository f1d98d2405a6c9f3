"""The schedule: when a block's refresh is requested and installed, and the bound that keeps.

Owns: the staleness contract (Note [Staleness contract]) in one place: the decision taken at
each block boundary (install the refresh in flight, request a new one, coalesce a due request
into the one in flight), the budget ``B`` that bounds every install, the bound on the age of
the basis in use, and the per-block measurement of that age.

Must not: submit, wait or install (the runtime does, on this module's decisions); know how a
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

Two things take a block outside the bound, and both are visible: a refresh that fails (the
previous basis stays in use; counted, and ``max_consecutive_failures`` in a row raise) and a
barrier that times out (``StalenessTimeoutError``). ``Runtime.stats()["basis_age"]`` reports the
age of every step's basis (max, histogram, per block) next to the install staleness, and whether
every block stayed within its bound; tests/unit/test_staleness_contract.py checks the bound at
every step over optimizer x frequency x budget x ``fixed_delay`` x pool speed x lane x hooks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["Schedule", "basis_age_bound"]


def basis_age_bound(frequency: int, budget: int) -> int:
    """The largest age of a block's basis in use (Note [Staleness contract])."""
    return max(frequency, budget) + budget


class Schedule:
    """The decisions of Note [Staleness contract] and the measured ages of the bases in use.

    ``budget`` is ``B``; ``fixed`` says installs happen exactly at ``t + B`` (``fixed_delay``);
    ``precedes_update`` is the optimizer's ``refresh_precedes_update`` (Shampoo: a boundary's
    install is read by the same step's update, so its age is taken after the install).
    """

    def __init__(self, budget: int, fixed: bool, precedes_update: bool) -> None:
        self.budget = budget
        self.fixed = fixed
        self.precedes_update = precedes_update
        self.coalesced = 0  # due requests folded into the refresh in flight
        self.age_histogram: Counter[int] = Counter()

    def bound(self, frequency: int) -> int:
        return basis_age_bound(frequency, self.budget)

    def install_now(
        self,
        pending: Any,
        step: int,
        due: bool,
        exact: bool,
        paced: Callable[[], bool],
    ) -> bool:
        """Whether the refresh in flight ``pending`` is installed at this boundary (waiting for
        it if it is not ready): at its deadline always; before it (never where installs are
        ``exact``: ``fixed_delay``, replicated blocks) when it is ready and either a newer
        request waits for it (``due``: coalesced) or the install pacing allows (``paced``)."""
        age = step - pending.requested
        if exact:
            return age >= self.budget
        if age >= self.budget:
            return True
        return pending.done() and (due or paced())

    def initial_version(self, step: int, frequency: int) -> int:
        """The version of a basis that existed before the runtime first saw its block at
        ``step``: the native schedule's last refresh (the first step's, 0, at the latest)."""
        return max(0, frequency * ((step - 1) // frequency))

    def record_age(self, entry: Any, step: int, frequency: int) -> None:
        """Measure the age of the basis ``entry``'s block reads in ``step``."""
        if entry.version is None:
            return  # no basis yet (Shampoo before its first roots)
        age = step - entry.version
        entry.age = age
        entry.max_age = max(entry.max_age, age)
        entry.bound = self.bound(frequency)
        self.age_histogram[age] += 1

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
