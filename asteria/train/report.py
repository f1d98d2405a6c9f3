"""Run outputs of `asteria.train`: metrics.jsonl, summary.json and report.md (plots: plots.py).

Owns: the output folder's layout and formats (``metrics.jsonl``: a record a step, loop.py's
fields; ``summary.json``: env, energy, runs by label, ``label@seedN`` over ``--seeds``, and the
time to target; ``report.md``: setup, final losses, times, memory, energy, time to target,
efficiency, staleness and the plots). Non-finite numbers (a diverged run) are JSON ``null``.
Must not: train, compute the figures it writes (targets.py), or read anything but its inputs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any

from asteria.train.energy import efficiency
from asteria.train.plots import PLOT, PLOT_MEMORY, PLOT_STEPS, PLOT_TIME, PLOTS, write_plots

__all__ = ["PLOTS", "MetricsWriter", "add_efficiency", "write_plots", "write_report",
           "write_summary"]  # fmt: skip

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
REPORT = "report.md"
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


def write_summary(
    out: Path,
    env: dict,
    runs: dict[str, dict],
    energy: dict | None = None,
    time_to_target: dict | None = None,
) -> Path:
    path = out / SUMMARY
    payload = {"env": env, "energy": energy or {}, "runs": runs}
    if time_to_target is not None:
        payload["time_to_target"] = time_to_target
    path.write_text(json.dumps(_finite(payload), indent=2, allow_nan=False) + "\n", "utf-8")
    return path


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def _mib(tiers: dict[str, int]) -> str:
    if not tiers:
        return "-"
    return ", ".join(f"{t} {b / 2**20:.1f}" for t, b in tiers.items())


def _seeds_text(seeds: list[int]) -> str:
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"seeds {seeds[0]}-{seeds[-1]}"
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, seeds))


def _per_seed(values: dict[str, float | None], spec: str) -> str:
    return ", ".join(_fmt(v, spec) for v in values.values())


def time_to_target_lines(t: dict) -> list[str]:
    """The report's section on the time to the target loss (targets.time_to_target's dict)."""
    ref, seeds = t["reference"], t["seeds"]
    lines = ["", "## Time to target", ""]
    if t["target"] is None:
        return [*lines, f"No target: {ref} ended without a validation loss.", ""]
    where = (
        "given by --target-loss"
        if t["target_source"] == "given"
        else f"{ref}'s final validation loss"
        + (f", the mean over {_seeds_text(seeds)}" if len(seeds) > 1 else "")
    )
    lines += [
        f"Target: validation loss {t['target']:.4f}, {where}. Time is training time (the steps' "
        "forward, backward and optimizer, validation excluded) to the first validation at or "
        "under the target, interpolated between validations (Note [Time to target] in "
        f"asteria/train/targets.py). Ratio: a run's time over {ref}'s on the same seed ({ref}'s "
        "whole training time where it does not reach the target); below 1 is faster. "
        + (f"Per-seed columns list {_seeds_text(seeds)} in order." if len(seeds) > 1 else ""),
        "",
        f"| run | lr | final val loss mean ± std (min-max) | steps to target | "
        f"seconds to target | time / {ref}'s: median (min-max) | reached | median step ms "
        f"| step time / {ref}'s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in t["runs"].items():
        f, q, st = r["final_val_loss"], r["ratio_to_reference"], r["step_time_vs_reference"]
        span = "" if len(seeds) == 1 else f" ± {_fmt(f['std'], '.4f')} "
        span += "" if len(seeds) == 1 else f"({_fmt(f['min'], '.4f')}-{_fmt(f['max'], '.4f')})"
        ratio = _fmt(q["median"], ".2f")
        if len(seeds) > 1 and q["median"] is not None:
            ratio += f" ({q['min']:.2f}-{q['max']:.2f})"
        lr = "-" if r.get("lr") is None else format(r["lr"], "g")
        lines.append(
            f"| {label} | {lr} | {_fmt(f['mean'], '.4f')}{span} "
            f"| {_per_seed(r['steps_to_target'], '.1f')} "
            f"| {_per_seed(r['seconds_to_target'], '.1f')} | {ratio} "
            f"| {r['reached']}/{r['of_seeds']} | {_fmt(r['median_step_ms']['median'], '.1f')} "
            f"| {_fmt(st['median'], '.2f')} |"
        )
    return lines


def _runtime_warnings(runs: dict[str, dict]) -> list[str]:
    """The runtime's attach-time warnings (Note [No spare core]), each once, with its runs."""
    by_text: dict[str, list[str]] = {}
    for name, s in runs.items():
        for text in (s.get("runtime") or {}).get("warnings", ()):
            by_text.setdefault(text, []).append(name)
    return [
        line
        for text, names in by_text.items()
        for line in (f"**Warning** ({', '.join(names)}): {text}", "")
    ]


def write_report(
    out: Path,
    env: dict,
    runs: dict[str, dict],
    title: str,
    energy: dict | None = None,
    vocab_size: int | None = None,
    time_to_target: dict | None = None,
) -> Path:
    """The Markdown report: setup, results table, time to target, energy and efficiency,
    staleness, plots."""
    energy = energy or {}
    first = next(iter(runs.values()))["config"]
    seeds = sorted({s["config"]["seed"] for s in runs.values()})
    measured = bool(energy.get("sources"))
    lines = [
        f"# {title}",
        "",
        (
            f"Model `{first['model']}`, {first['steps']} steps of batch {first['batch_size']} x "
            f"{first['seq_len']} tokens, {_seeds_text(seeds)}, data {env.get('data', '?')} "
            f"(vocab {vocab_size}, sha256 {env.get('data_sha256', '?')}); torch {env['torch']}, "
            f"{env['torch_threads']} threads, "
            f"{env['cpu']}{', GPU ' + str(env['cuda']) if env.get('cuda') else ''}"
            f"{', ' + str(env['distributed']) if env.get('distributed') else ''}."
        ),
        "",
        *([env["threads_note"], ""] if env.get("threads_note") else []),
        *_runtime_warnings(runs),
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
    if time_to_target is not None:
        lines += time_to_target_lines(time_to_target)
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
            "| basis age histogram | jobs | steps between installs (mean, max) | jobs ran on |",
            "|---|---:|---:|---|---:|---|---|---|---|",
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
                f"| {age_hist} | {jobs} | {_intervals(r)} | {_ran_on(r)} |"
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


def _intervals(runtime: dict) -> str:
    """A block's steps between installs, mean and max over the blocks (Note [Continuous
    refresh]); "-" for a summary without them."""
    r = runtime.get("refresh") or {}
    if r.get("interval_mean") is None:
        return "-"
    return f"{r['interval_mean']:.1f}, {r['interval_max']} ({r.get('mode', 'interval')})"


def _ran_on(runtime: dict) -> str:
    """Jobs per executor (Note [Refresh placement]); "-" for a summary without them."""
    jobs = (runtime.get("placement") or {}).get("jobs") or {}
    return ", ".join(f"{k} {v}" for k, v in sorted(jobs.items())) or "-"
