"""Time to a target loss: where each run first reaches it, and the figures over seeds.

Owns: the crossing of a run's validation curve with a target loss (steps and training seconds),
the reference a comparison measures against, and the per-run aggregates over seeds. Used by
asteria-train's report and bench/time_to_target.py. Must not: train, read files, or draw.

Note [Time to target]
~~~~~~~~~~~~~~~~~~~~~
Time is *training* time: the sum of ``step_ms`` up to the crossing (validation, checkpoints and
bookkeeping left out). The crossing is interpolated linearly between the last validation above
the target and the first at or below it (never reached: ``None``). The reference (asteria-train:
the first run; the benchmark: AdamW) has, per seed, its time to the target, else its whole
training time (the conservative figure where the default target, its mean final validation loss,
is above a seed's end). A run's ratio is its time over the reference's on the same seed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Records = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class Crossing:
    """Where a run first reaches the target: a (fractional) step and training seconds."""

    step: float
    seconds: float


def train_seconds(records: Records) -> list[float]:
    """Cumulative training seconds at the end of each record's step (Note [Time to target])."""
    out, total = [], 0.0
    for r in records:
        total += float(r["step_ms"]) / 1e3
        out.append(total)
    return out


def val_points(records: Records) -> list[tuple[int, float, float]]:
    """``(step, training seconds, validation loss)`` at every finite validation."""
    secs = train_seconds(records)
    return [
        (int(r["step"]), t, float(r["val_loss"]))
        for r, t in zip(records, secs)
        if r.get("val_loss") is not None and math.isfinite(r["val_loss"])
    ]


def final_val_loss(records: Records) -> float | None:
    """The last record's validation loss (None where the run ended without one)."""
    if not records:
        return None
    v = records[-1].get("val_loss")
    return float(v) if v is not None and math.isfinite(v) else None


def crossing(records: Records, target: float) -> Crossing | None:
    """The first point where the validation curve reaches ``target`` (interpolated), or None."""
    points = val_points(records)
    cum = [0.0, *train_seconds(records)]  # cum[k]: training seconds after step k (steps from 1)
    for i, (step, t, v) in enumerate(points):
        if v > target:
            continue
        if i == 0:
            return Crossing(float(step), t)
        s0, _, v0 = points[i - 1]
        at = s0 + (v0 - target) / (v0 - v) * (step - s0)
        lo = min(int(math.floor(at)), len(cum) - 1)
        hi = min(lo + 1, len(cum) - 1)
        t_at = cum[lo] + (at - lo) * (cum[hi] - cum[lo])
        return Crossing(at, t_at)
    return None


def spread(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, sample standard deviation (0 for one value), min and max; None for no values."""
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None}
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def _median_range(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _median_step_ms(records: Records) -> float | None:
    return statistics.median(float(r["step_ms"]) for r in records) if records else None


def time_to_target(
    runs: Mapping[str, Mapping[int, Records]],
    reference: str,
    target: float | None = None,
    extra: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The time-to-target figures of ``runs`` (label -> seed -> records) against ``reference``:
    ``target`` (None: the reference's mean final validation loss), ``extra`` (per-label fields to
    copy). JSON-ready; without a settable target, ``target`` is None and the runs carry their final
    losses only."""
    ref_runs = runs[reference]
    ref_finals = [v for r in ref_runs.values() if (v := final_val_loss(r)) is not None]
    source = "given" if target is not None else "reference"
    if target is None and ref_finals:
        target = statistics.fmean(ref_finals)
    ref_time: dict[int, float] = {}
    for seed, recs in ref_runs.items():
        hit = crossing(recs, target) if target is not None else None
        ref_time[seed] = hit.seconds if hit is not None else (train_seconds(recs) or [0.0])[-1]
    ref_step = {seed: _median_step_ms(recs) for seed, recs in ref_runs.items()}
    out: dict[str, Any] = {
        "target": target,
        "target_source": source,
        "reference": reference,
        "seeds": sorted({s for by_seed in runs.values() for s in by_seed}),
        "runs": {},
    }
    for label, by_seed in runs.items():
        finals = {s: final_val_loss(r) for s, r in by_seed.items()}
        hits = {s: crossing(r, target) if target is not None else None for s, r in by_seed.items()}
        ratios = {
            s: (h.seconds / ref_time[s] if h is not None and ref_time.get(s) else None)
            for s, h in hits.items()
        }
        step_ms = {s: _median_step_ms(r) for s, r in by_seed.items()}
        step_ratio = [ms / ref_step[s] for s, ms in step_ms.items() if ms and ref_step.get(s)]
        entry: dict[str, Any] = dict((extra or {}).get(label, {}))
        entry |= {
            "final_val_loss": {
                **spread([v for v in finals.values() if v is not None]),
                "per_seed": {str(s): v for s, v in finals.items()},
            },
            "steps_to_target": {str(s): (h.step if h else None) for s, h in hits.items()},
            "seconds_to_target": {str(s): (h.seconds if h else None) for s, h in hits.items()},
            "train_seconds": {str(s): (train_seconds(r) or [0.0])[-1] for s, r in by_seed.items()},
            "reached": sum(h is not None for h in hits.values()),
            "of_seeds": len(hits),
            "ratio_to_reference": {
                **_median_range([x for x in ratios.values() if x is not None]),
                "per_seed": {str(s): x for s, x in ratios.items()},
            },
            "median_step_ms": _median_range([x for x in step_ms.values() if x is not None]),
            "step_time_vs_reference": _median_range(step_ratio),
        }
        out["runs"][label] = entry
    return out
