"""What the runtime reports: ``Runtime.stats()`` and ``Runtime.memory_report()``.

Owns: the keys of both reports and how each figure is gathered from the runtime's parts (the
registry, the schedule, the refreshes, the strategies, the spill tier, the pool, the lane), and
the rule that ``memory_report`` counts a storage shared by several kinds once, under the first.

Must not: change anything it reads (no waits, no installs), or hold a reference to the runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from asteria.memory.tiers import KINDS, TIERS, Arch, Placement

if TYPE_CHECKING:
    from asteria.runtime.bases import BasesAccess
    from asteria.runtime.distributed import Coherence
    from asteria.runtime.lane import StatisticsLane
    from asteria.runtime.refreshes import Refreshes
    from asteria.runtime.schedule import Schedule

__all__ = ["memory_report", "stats"]


def stats(
    refreshes: Refreshes,
    schedule: Schedule,
    per_step: dict[str, list[float]],
    lane: StatisticsLane | None,
    coherence: Coherence | None,
    hooks: int,
) -> dict[str, Any]:
    """``Runtime.stats()`` (docs/runtime.md, "Runtime.stats()")."""
    registry = refreshes.registry
    pool = dict(refreshes.pool.stats())
    hist = dict(sorted(registry.histogram.items()))
    return {
        "steps": len(per_step["step_ms"]),
        "step_ms": list(per_step["step_ms"]),
        "barrier_wait_ms": list(per_step["barrier_wait_ms"]),
        "jobs": {
            "submitted": refreshes.submitted,
            "completed": int(pool.get("completed", 0)),
            "cancelled": refreshes.cancelled,
            "failed": refreshes.failed,
            "coalesced_requests": schedule.coalesced,
            "urgent_waits": schedule.urgent_waits,
            # jobs run while waiting: Note [Helping within the deadline] in refreshes.py
            "helped": refreshes.helped,
            "in_flight": registry.pending_count(),
        },
        "pool": pool,
        "staleness_histogram": hist,
        "max_staleness": max(hist) if hist else 0,
        # the age of the basis every step read (Note [Staleness contract] in schedule.py)
        "basis_age": schedule.report(list(registry.entries.values())),
        # steps between each block's installs (Note [Continuous refresh] in schedule.py)
        "refresh": schedule.interval_report(),
        # where the refreshes ran (Note [Refresh placement] in placement.py)
        "placement": refreshes.pool.report(),
        "installs": sum(hist.values()),
        "blocks": registry.snapshot(),
        # updates skipped for NaN/Inf gradients (Note [Non-finite gradients], optim/overflow.py)
        "nonfinite_grads": refreshes.optimizer.nonfinite_grads,
        "statistics_lane": None
        if lane is None
        else {"updates": lane.submitted, "wait_ms": lane.wait_s * 1e3, "pending": lane.pending()},
        # how snapshots reach the pool (snapshots.py), and the module hooks registered
        "snapshots": refreshes.snapshots.stats(),
        "hooks": hooks,
        # this rank's figures under torch.distributed (Note [Distributed coherence])
        "distributed": None if coherence is None else coherence.stats(),
    }


def memory_report(
    refreshes: Refreshes, bases: BasesAccess, placement: Placement, arch: Arch
) -> dict[str, Any]:
    """``Runtime.memory_report()``: bytes per tier per kind, measured on the tensors that exist
    now (docs/memory.md); the caller holds the runtime's lock."""
    report = {tier: dict.fromkeys(KINDS, 0) for tier in TIERS}
    seen: set[tuple[int, int]] = set()

    def add(tier: str, kind: str, value: Any) -> None:
        if isinstance(value, (list, tuple)):
            for v in value:
                add(tier, kind, v)
            return
        if not isinstance(value, torch.Tensor) or value.nbytes == 0:
            return
        ident = (value.data_ptr(), value.nbytes)
        if ident in seen:
            return
        seen.add(ident)
        report[tier][kind] += value.nbytes

    bases_tier = placement.tiers["bases"]

    def where(t: Any) -> str:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            return "host" if bases.is_mapped(t) else "device"
        return "host" if arch.cuda else bases_tier

    optimizer = refreshes.optimizer
    for p in refreshes.params():
        for name, value in optimizer.state.get(p, {}).items():
            if name != "blocks":
                add("device", "moments", value)
                continue
            for block in value:
                for field, v in block.items():
                    if field == "factors":
                        add("device", "factors", v)
                    elif field == bases.field:
                        for q in v:
                            add(where(q), "bases", q)
                    else:
                        add("device", "moments", v)
    spill = refreshes.spill
    for e in refreshes.registry.entries.values():
        pending = e.pending
        if pending is None:
            continue
        for f in pending.futures:
            if f is not None and f.done():
                try:
                    add("host", "results", f.result())
                except Exception:
                    pass
        if spill is not None:
            for kind, tensors in spill.host_tensors(pending).items():
                add("host", kind, tensors)
            for kind, (stored, paged) in spill.stored_bytes(pending).items():
                report["nvme"][kind] += stored
                report["host"][kind] += paged
    report["host"]["staging"] += refreshes.snapshots.staging_bytes()  # the staging ring
    add("device", "bases", bases.buffers())
    report["planned"] = {tier: dict(kinds) for tier, kinds in placement.bytes.items()}
    report["placement"] = {
        "tiers": dict(placement.tiers),
        "spilled_blocks": sorted(placement.spilled),
        "bases_access": placement.bases_access,
        "notes": list(placement.notes),
        "window": bases.stats(),
    }
    report["spill"] = None if spill is None else spill.stats()
    return report
