"""Run outputs of `asteria.train`: metrics.jsonl, summary.json, report.md and the PNG plots.

Owns: the output folder's layout and formats. Must not: train, or read anything but the records
and summaries it is given. Non-finite numbers (a diverged run) are written as JSON ``null``.

* ``metrics.jsonl``: one JSON object per optimizer step (fields: loop.py's module doc).
* ``summary.json``: {"env": ..., "energy": ..., "runs": {label: summary}}.
* ``report.md``: the setup, a table of final losses, times, memory and energy, the efficiency
  figure where energy was measured, the runtime's staleness, and the plots.
* ``loss.png``: training loss (EMA) and validation loss per step, one colour per run.
* ``loss_time.png``: the same against wall-clock seconds.
* ``step_time.png``: every step's time (refresh steps marked): spikes vs. flat.
* ``memory.png``: peak optimizer-state memory per run, stacked by tier.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any

from asteria.train.energy import efficiency

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
REPORT = "report.md"
PLOT = "loss.png"
PLOT_TIME = "loss_time.png"
PLOT_STEPS = "step_time.png"
PLOT_MEMORY = "memory.png"
PLOTS = (PLOT, PLOT_TIME, PLOT_STEPS, PLOT_MEMORY)
ENERGY_SOURCES = ("nvml", "rapl")  # preferred first for the efficiency figure
NOT_MEASURED = "not measured on this machine"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class MetricsWriter:
    """Writes one JSON line per record to ``out/metrics.jsonl``, flushed as it goes (the file is
    started afresh: on ``--resume`` the records kept in the checkpoints are written again)."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / METRICS
        self._file: IO[str] = self.path.open("w", encoding="utf-8")

    def __call__(self, record: dict) -> None:
        self._file.write(json.dumps(_finite(record), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def add_efficiency(runs: dict[str, dict], vocab_size: int) -> str | None:
    """Add ``efficiency`` to each run where energy was measured for it and for AdamW; returns
    the energy source used, or None (not measured, or no AdamW run to compare with)."""
    base = runs.get("adamw")
    if base is None:
        return None
    for source in ENERGY_SOURCES:
        base_j = base.get("energy_j", {}).get(source)
        if not base_j:
            continue
        for s in runs.values():
            loss = s["final_val_loss"] if s["final_val_loss"] is not None else s["final_loss"]
            e = s.get("energy_j", {}).get(source)
            if e and loss is not None and math.isfinite(loss):
                s["efficiency"] = efficiency(vocab_size, loss, e, base_j)
                s["efficiency_source"] = source
        return source
    return None


def write_summary(out: Path, env: dict, runs: dict[str, dict], energy: dict | None = None) -> Path:
    path = out / SUMMARY
    payload = {"env": env, "energy": energy or {}, "runs": runs}
    path.write_text(json.dumps(_finite(payload), indent=2, allow_nan=False) + "\n", "utf-8")
    return path


def _ema(values: list[float], beta: float = 0.9) -> list[float]:
    out, acc = [], values[0] if values else 0.0
    for i, v in enumerate(values):
        acc = v if i == 0 or not math.isfinite(acc) else beta * acc + (1 - beta) * v
        out.append(acc)
    return out


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


def plot_losses(out: Path, records: dict[str, list[dict]], unit: str = "byte") -> Path:
    """Training loss (EMA 0.9) as lines, validation loss as markers, one colour per run."""
    return _plot_loss(out / PLOT, records, "step", "step", unit)


def plot_losses_time(out: Path, records: dict[str, list[dict]], unit: str = "byte") -> Path:
    return _plot_loss(out / PLOT_TIME, records, "elapsed_s", "wall-clock seconds", unit)


def _plot_loss(path: Path, records: dict[str, list[dict]], x: str, xlabel: str, unit: str):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for i, (name, recs) in enumerate(records.items()):
        color = f"C{i}"
        xs = [r[x] for r in recs]
        ax.plot(xs, _ema([r["loss"] for r in recs]), color=color, label=f"{name} train (EMA)")
        val = [(r[x], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
        if val:
            ax.plot(*zip(*val), "o--", color=color, label=f"{name} validation", markersize=4)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"loss (nats per {unit})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_step_times(out: Path, records: dict[str, list[dict]]) -> Path:
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
    return _save(fig, path=out / PLOT_STEPS)


def plot_memory(out: Path, runs: dict[str, dict]) -> Path:
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
    if tiers:
        ax.legend(title="tier", fontsize=8)
    return _save(fig, out / PLOT_MEMORY)


def write_plots(out: Path, records: dict[str, list[dict]], runs: dict[str, dict], unit: str):
    plot_losses(out, records, unit)
    plot_losses_time(out, records, unit)
    plot_step_times(out, records)
    plot_memory(out, runs)


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def _mib(tiers: dict[str, int]) -> str:
    if not tiers:
        return "-"
    return ", ".join(f"{t} {b / 2**20:.1f}" for t, b in tiers.items())


def write_report(
    out: Path,
    env: dict,
    runs: dict[str, dict],
    title: str,
    energy: dict | None = None,
    vocab_size: int | None = None,
) -> Path:
    """The Markdown report: setup, results table, energy and efficiency, staleness, plots."""
    energy = energy or {}
    first = next(iter(runs.values()))["config"]
    measured = bool(energy.get("sources"))
    lines = [
        f"# {title}",
        "",
        (
            f"Model `{first['model']}`, {first['steps']} steps of batch {first['batch_size']} x "
            f"{first['seq_len']} tokens, seed {first['seed']}, data {env.get('data', '?')} "
            f"(vocab {vocab_size}); torch {env['torch']}, {env['torch_threads']} threads, "
            f"{env['cpu']}{', GPU ' + str(env['cuda']) if env.get('cuda') else ''}"
            f"{', ' + str(env['distributed']) if env.get('distributed') else ''}."
        ),
        "",
        *([env["threads_note"], ""] if env.get("threads_note") else []),
        (
            "| run | lr | final loss (mean of last 10) | final val loss | median step ms "
            "| p95 step ms | max step ms | median opt ms | barrier wait s | tokens/s "
            "| opt state MiB (peak) | wall s | energy J |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for name, s in runs.items():
        status = "" if s["status"] == "finished" else f" ({s['status']} at {s['steps_done']})"
        wait = s.get("barrier_wait_ms_total")
        e = s.get("energy_j") or {}
        e_txt = ", ".join(f"{k} {v:.0f}" for k, v in e.items()) if e else "-"
        lines.append(
            f"| {name}{status} | {s['lr']:g} "
            f"| {_fmt(s['final_loss_mean10'], '.4f')} | {_fmt(s['final_val_loss'], '.4f')} "
            f"| {_fmt(s['median_step_ms'], '.1f')} | {_fmt(s['p95_step_ms'], '.1f')} "
            f"| {_fmt(s['max_step_ms'], '.1f')} | {_fmt(s['median_opt_ms'], '.1f')} "
            f"| {_fmt(None if wait is None else wait / 1e3, '.2f')} "
            f"| {_fmt(s['median_tokens_per_s'], '.0f')} | {_mib(s.get('peak_memory_bytes', {}))} "
            f"| {_fmt(s['wall_s'], '.1f')} | {e_txt} |"
        )
    lines += ["", "## Energy", ""]
    if measured:
        lines.append(
            f"Measured with {', '.join(energy['sources'])} (RAPL: the whole CPU package, other "
            "processes included; NVML: the whole GPU)."
        )
        eff = [(n, s) for n, s in runs.items() if "efficiency" in s]
        if eff:
            lines += [
                "",
                "Efficiency, (ln(vocab) - final loss) / (energy / AdamW's energy), final loss = "
                f"final validation loss, energy from {eff[0][1]['efficiency_source']}:",
                "",
                "| run | efficiency |",
                "|---|---:|",
            ]
            lines += [f"| {n} | {s['efficiency']:.4f} |" for n, s in eff]
        else:
            lines.append("No efficiency figure: it needs an `adamw` run in the comparison.")
    else:
        lines.append(f"Energy: {NOT_MEASURED}.")
        for source, why in energy.get("unavailable", {}).items():
            lines.append(f"- {source}: {why}")
    staleness = [(n, s["runtime"]) for n, s in runs.items() if "runtime" in s]
    if staleness:
        lines += ["", "## Asteria runtime", ""]
        lines += [
            "Staleness: steps from a refresh's request to its install (at most the budget). "
            "Basis age: steps from the factors a basis was computed from to the step that read "
            "it, at most max(f, B) + B (docs/runtime.md#the-staleness-contract).",
            "",
            "| run | installs | max staleness | staleness histogram | max basis age (bound) "
            "| basis age histogram | jobs |",
            "|---|---:|---:|---|---:|---|---|",
        ]
        for n, r in staleness:
            hist = ", ".join(f"{k}: {v}" for k, v in r["staleness_histogram"].items()) or "-"
            jobs = ", ".join(f"{k} {v}" for k, v in r["jobs"].items())
            age = r.get("basis_age")
            if age is None:  # a summary written before basis ages were measured
                age_cell, age_hist = "-", "-"
            else:
                flag = "" if age["within_bound"] else " **over**"
                age_cell = f"{age['max']} ({age['bound']}){flag}"
                age_hist = ", ".join(f"{k}: {v}" for k, v in age["histogram"].items()) or "-"
            lines.append(
                f"| {n} | {r['installs']} | {r['max_staleness']} | {hist} | {age_cell} "
                f"| {age_hist} | {jobs} |"
            )
    lines += [
        "",
        "## Plots",
        "",
        f"![loss vs step]({PLOT})",
        "",
        f"![loss vs wall clock]({PLOT_TIME})",
        "",
        f"![step time]({PLOT_STEPS})",
        "",
        f"![memory by tier]({PLOT_MEMORY})",
        "",
    ]
    path = out / REPORT
    path.write_text("\n".join(lines), "utf-8")
    return path
