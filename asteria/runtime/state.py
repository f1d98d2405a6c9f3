"""The runtime's part of a checkpoint: its refreshes in flight, finished and saved with results.

Owns: ``save`` and ``load`` (``Runtime.state_dict`` / ``load_state_dict``) and the format of
what they write (``format`` 1: a list of refreshes in flight, each with its block, request step,
results or error, job options and, under torch.distributed, the rank expected to send it).

Note [Checkpoints with work in flight]: a refresh requested at step ``t`` and not yet installed
is waited for (the barrier, bounded by ``barrier_timeout_s``) and saved with its request step
and results, not re-submitted on load: its inputs were the factors of step ``t``, which the
checkpoint no longer holds. After ``load`` it is installed at the step it would have been
(``t + fixed_delay``, or as soon as possible within the budget), so a ``fixed_delay`` run
resumed from a checkpoint follows the uninterrupted run bit for bit
(tests/unit/test_checkpoint.py). Saved next to ``optimizer.state_dict()`` (taken at the same
step boundary), and loaded after it; ``optimizer.state_dict()`` also carries it (Note [Runtime
state in the optimizer's checkpoint] in asteria/optim/base.py). Under torch.distributed the
state is this rank's and involves no collective: a replicated block's refresh in flight is
saved with its results by its owner, and as "expected from rank ``r``" by the other replicas,
with the job options the sync needs; after loading on the same ranks, the sync at its deadline
proceeds as it would have (tests/distributed).

Must not: install, submit or decide anything (the schedule and the refreshes take the restored
refreshes from there as from any others).
"""

from __future__ import annotations

from typing import Any

from asteria.optim.base import RefreshJob
from asteria.runtime.refreshes import Refreshes, Restored
from asteria.runtime.registry import PendingRefresh

__all__ = ["FORMAT", "load", "save"]

#: The version of what ``save`` writes.
FORMAT = 1


def save(refreshes: Refreshes) -> dict[str, Any]:
    """Every refresh in flight, finished first (the caller holds the runtime's lock and has
    waited for the statistics lane)."""
    pending = []
    for key, e in sorted(refreshes.registry.entries.items()):
        p = e.pending
        if p is None:
            continue
        item: dict[str, Any] = {
            "key": key,
            "requested": p.requested,
            "results": None,
            "error": None,
            "jobs": [None if j is None else j.options() for j in p.jobs],
            "owner": p.owner,
        }
        if p.owner is None:  # computed here (a local block, or this rank owns it)
            refreshes.wait(e, refreshes.current_step(key))
            try:
                item["results"] = refreshes.results(key, e, p, None, consume=False)
            except refreshes.errors as err:
                item["error"] = str(err)
        pending.append(item)
    return {"format": FORMAT, "pending": pending}


def load(refreshes: Refreshes, state: dict[str, Any]) -> None:
    """Put the refreshes of ``save`` back in flight (after the optimizer's state is loaded)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"not a Runtime.state_dict() of this version (format {FORMAT})")
    known = {key for key, *_ in refreshes.optimizer.blocks()}
    coherence = refreshes.coherence
    for item in state["pending"]:
        key = tuple(item["key"])
        if key not in known:
            raise ValueError(
                f"the checkpoint has a refresh in flight for block {key}, which the "
                "optimizer does not have: load the optimizer's state_dict first"
            )
        e = refreshes.entry(key)
        jobs = [None if j is None else RefreshJob.from_options(j) for j in item.get("jobs", [])]
        owner = item.get("owner")
        if owner is not None and (coherence is None or coherence.owner(key) != owner):
            raise ValueError(
                f"the checkpoint expects block {key}'s refresh in flight from rank "
                f"{owner}, which does not own it here: load on the ranks that saved it"
            )
        if owner is not None:
            futures: list[Any] = [None] * len(jobs)
        elif item["error"] is not None:
            futures = [Restored(error=item["error"])]
        else:
            futures = [None if r is None else Restored(r) for r in item["results"]]
        e.pending = PendingRefresh(
            requested=int(item["requested"]), futures=futures, jobs=jobs, owner=owner
        )
