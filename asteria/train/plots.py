"""The PNG plots of `asteria.train` and bench/time_to_target.py.

Owns: drawing (``loss.png``: training loss, EMA 0.9, and validation loss per step;
``loss_time.png``: the same against training seconds; ``step_time.png``: every step's time,
refresh steps marked; ``memory.png``: peak optimizer state per run by tier). A label with several
seeds is drawn as their mean (or median) with a band from the lowest to the highest; a target
loss is a dotted line and a star marks each seed's first crossing (Note [Time to target] in
targets.py). Must not: train, compute figures, or write anything but the PNGs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from asteria.train.targets import Records, crossing, train_seconds, val_points

PLOT = "loss.png"
PLOT_TIME = "loss_time.png"
PLOT_STEPS = "step_time.png"
PLOT_MEMORY = "memory.png"
PLOTS = (PLOT, PLOT_TIME, PLOT_STEPS, PLOT_MEMORY)

BySeed = Mapping[str, Mapping[int, Records]]  # label -> seed -> records


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    _pyplot().close(fig)
    return path


def _ema(values: list[float], beta: float = 0.9) -> list[float]:
    out, acc = [], values[0] if values else 0.0
    for i, v in enumerate(values):
        acc = v if i == 0 or not math.isfinite(acc) else beta * acc + (1 - beta) * v
        out.append(acc)
    return out


def _xs(records: Records, time: bool) -> list[float]:
    return train_seconds(records) if time else [float(r["step"]) for r in records]


def _draw_run(
    ax,
    label: str,
    color: str,
    by_seed: Mapping[int, Records],
    time: bool,
    train: bool,
    center: str = "mean",
):
    """One run: its lines (one seed) or the mean (median) over seeds with a min-max band."""
    middle = statistics.median if center == "median" else statistics.fmean
    seeds = [recs for recs in by_seed.values() if recs]
    if not seeds:
        return
    if train:
        n = min(len(r) for r in seeds)
        xs = [statistics.fmean(_xs(r, time)[i] for r in seeds) for i in range(n)]
        emas = [_ema([float(x["loss"]) for x in r[:n]]) for r in seeds]
        ys = [statistics.fmean(e[i] for e in emas) for i in range(n)]
        ax.plot(xs, ys, color=color, lw=1, alpha=0.7, label=f"{label} train (EMA)")
    per_seed = [{s: (t, v) for s, t, v in val_points(r)} for r in seeds]
    steps = sorted(set.intersection(*(set(p) for p in per_seed)))
    if not steps:
        return
    if time:
        x = [middle([p[s][0] for p in per_seed]) for s in steps]
    else:
        x = [float(s) for s in steps]
    vals = [[p[s][1] for p in per_seed] for s in steps]
    mean = [middle(v) for v in vals]
    name = f"{label} validation" + (f" ({center} of {len(seeds)} seeds)" if len(seeds) > 1 else "")
    ax.plot(x, mean, "o--" if train else "o-", color=color, markersize=3, label=name)
    if len(seeds) > 1:
        ax.fill_between(x, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.18)


def _mark_crossings(ax, color: str, by_seed: Mapping[int, Records], target: float, time: bool):
    for recs in by_seed.values():
        hit = crossing(recs, target) if recs else None
        if hit is not None:
            x = hit.seconds if time else hit.step
            ax.plot([x], [target], "*", color=color, markersize=11, markeredgecolor="black",
                    markeredgewidth=0.5, zorder=5)  # fmt: skip


def plot_loss(
    path: Path,
    runs: BySeed,
    *,
    time: bool,
    unit: str = "byte",
    target: float | None = None,
    train: bool = True,
    title: str | None = None,
    center: str = "mean",
    more_targets: Mapping[str, float] | None = None,
) -> Path:
    """Loss against step (``time=False``) or training seconds, one colour per run; with a
    ``target``: its line and each seed's crossing. ``train=False`` draws validation only;
    ``center``: ``"mean"`` or ``"median"`` over the seeds; ``more_targets``: further losses drawn
    as dashed lines, by name."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=110)
    for i, (label, by_seed) in enumerate(runs.items()):
        _draw_run(ax, label, f"C{i}", by_seed, time, train, center)
        if target is not None:
            _mark_crossings(ax, f"C{i}", by_seed, target, time)
    for name, loss in (more_targets or {}).items():
        ax.axhline(loss, color="0.5", ls="--", lw=1, label=f"{name} {loss:.4f}")
    if target is not None:
        ax.axhline(target, color="0.3", ls=":", lw=1, label=f"target {target:.4f} (* reached)")
        points = [val_points(r) for by in runs.values() for r in by.values()]
        points = [p for p in points if p]
        if points:  # zoomed on the target and every run's end
            low = min(v for p in points for _, _, v in p)
            top = max(target + max(0.25, 3 * (target - low)), *(p[-1][2] + 0.05 for p in points))
            ax.set_ylim(low - 0.02, top)
    ax.set_xlabel("training seconds (validation excluded)" if time else "step")
    ax.set_ylabel(f"loss (nats per {unit})")
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_step_times(out: Path, records: Mapping[str, Records]) -> Path:
    """Every step's time per run; refresh steps (second-order) as x markers."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    for i, (name, recs) in enumerate(records.items()):
        color = f"C{i}"
        ax.plot(
            [r["step"] for r in recs], [r["step_ms"] for r in recs], color=color, lw=1, label=name
        )
        spikes = [(r["step"], r["step_ms"]) for r in recs if r.get("refresh")]
        if spikes:
            ax.plot(*zip(*spikes), "x", color=color, markersize=4)
    ax.set_xlabel("step (x: a refresh was due)")
    ax.set_ylabel("step time, ms (forward + backward + optimizer)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / PLOT_STEPS)


def plot_memory(out: Path, runs: Mapping[str, Mapping[str, Any]]) -> Path:
    """Peak optimizer-state memory per run, one stacked bar per run, one colour per tier."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    names = list(runs)
    tiers: list[str] = []
    for s in runs.values():
        tiers += [t for t in s.get("peak_memory_bytes", {}) if t not in tiers]
    bottom = [0.0] * len(names)
    for i, tier in enumerate(tiers):
        mib = [runs[n].get("peak_memory_bytes", {}).get(tier, 0) / 2**20 for n in names]
        ax.bar(names, mib, bottom=bottom, color=f"C{i}", label=tier)
        bottom = [b + m for b, m in zip(bottom, mib)]
    ax.set_ylabel("optimizer state, MiB (peak)")
    ax.grid(alpha=0.3, axis="y")
    if len(names) > 4:
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    if tiers:
        ax.legend(title="tier", fontsize=8)
    return _save(fig, out / PLOT_MEMORY)


def write_plots(
    out: Path,
    records: Mapping[str, Records],
    runs: Mapping[str, Mapping[str, Any]],
    unit: str,
    groups: Mapping[str, Mapping[int, str]] | None = None,
    target: float | None = None,
) -> None:
    """The four plots of a run folder. ``records``/``runs``: per run (key); ``groups``: label ->
    seed -> run key, where the runs repeat over seeds (default: every run its own label)."""
    groups = groups or {key: {0: key} for key in records}
    by_seed = {
        label: {seed: records[key] for seed, key in seeds.items() if key in records}
        for label, seeds in groups.items()
    }
    plot_loss(out / PLOT, by_seed, time=False, unit=unit)
    plot_loss(out / PLOT_TIME, by_seed, time=True, unit=unit, target=target)
    plot_step_times(out, records)
    plot_memory(out, runs)
