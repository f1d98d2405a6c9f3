"""The GPU check's closing table: the measured figures against the project's goals.

Reads the JSON results that bench/gpu_check.sh wrote (each file's last line is one benchmark's
JSON: bench/step_time.py, bench/memory.py --measure-cuda, bench/gpu_refresh_time.py or
bench/capacity.py) and prints one row per figure: its value, the goal, and ``met``, ``MISSED``
or ``n/a`` with the reason a figure is missing (a phase failed, a source was not measured).
Nothing is estimated: a figure that is not in the results is ``n/a``.

Goals:
  * each Asteria variant's spike ratio (max / median step) <= 1.15;
  * Asteria-SOAP's median step <= 1.10x AdamW's;
  * Asteria's device optimizer memory <= 0.75x native SOAP's (measured, max_memory_allocated);
  * energy per step of each Asteria variant <= 1.10x AdamW's (NVML; RAPL for a CPU run);
  * with ``--time-to-target``: the best Asteria variant reaches AdamW's final validation loss in
    <= 0.7x AdamW's time on every seed (issue 24's goal), per preset.
Figures without a goal (the native variants, KL-Shampoo's memory, the refresh capacity per
factor size or job, each variant's time and step against AdamW's) are listed as ``info``.

Last line: JSON with the rows and the counts ``met``, ``missed``, ``unmeasured``. The exit code
is 0 whether or not goals are met (a missed goal is a result, not a failure); 2 on bad arguments.
Usage: ``python bench/gpu_summary.py [--step-time F] [--memory F] [--capacity F]
[--time-to-target F]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit_json  # noqa: E402

SPIKE_GOAL = 1.15
SOAP_STEP_GOAL = 1.10
MEMORY_GOAL = 0.75
ENERGY_GOAL = 1.10
TIME_GOAL = 0.7  # issue 24: the best Asteria variant's time to AdamW's loss, every seed
ASTERIA_VARIANTS = ("soap_asteria", "kl_shampoo_asteria")
NATIVE_VARIANTS = ("soap_native", "kl_shampoo_native")
#: Asteria's modes in bench/step_time.py beside auto placement (issue 50: gpu_check's stage 2
#: runs the window forced and the bases on the device instead): their rows come where run.
TIER_MODES = ("window", "device")


def _asteria_variants(step: dict | None) -> list[str]:
    """``*_asteria``, and each optimizer's ``*_window`` / ``*_device`` present in ``step``."""
    out = list(ASTERIA_VARIANTS)
    results = _get(step, "results") or {}
    for base in ASTERIA_VARIANTS:
        name = base.rsplit("_", 1)[0]
        for mode in TIER_MODES:
            if f"{name}_{mode}" in results:
                out.append(f"{name}_{mode}")
    if any(v in results for v in out[len(ASTERIA_VARIANTS) :]):  # only the tiers that ran
        out = [v for v in out if v in results]
    return out


def load_result(path: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """The JSON on the last non-empty line of ``path``, or None and why not."""
    if not path:
        return None, "not given"
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
    except OSError as err:
        return None, f"{os.path.basename(path)}: {err.strerror or err}"
    if not lines:
        return None, f"{os.path.basename(path)} is empty"
    try:
        payload = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None, f"{os.path.basename(path)}: last line is not JSON"
    if not isinstance(payload, dict):
        return None, f"{os.path.basename(path)}: last line is not a JSON object"
    return payload, None


def _row(figure: str, value: float | None, goal: float | None, why: str | None = None) -> dict:
    if value is None:
        status = "n/a"
    elif goal is None:
        status = "info"
    else:
        status = "met" if value <= goal else "MISSED"
    return {"figure": figure, "value": value, "goal": goal, "status": status, "note": why}


def _get(payload: dict | None, *keys: str) -> Any:
    for key in keys:
        if not isinstance(payload, dict):
            return None
        payload = payload.get(key)
    return payload


def step_rows(step: dict | None, why: str | None) -> list[dict]:
    rows = []
    asteria = _asteria_variants(step)
    if step is not None and why is None:
        missing = [v for v in ("adamw", *asteria) if _get(step, "results", v) is None]
        why = f"not in step_time results: {', '.join(missing)}" if missing else None
    for v in asteria:
        spike = _get(step, "results", v, "spike_ratio")
        rows.append(
            _row(f"{v} spike (max/median)", spike, SPIKE_GOAL, why if spike is None else None)
        )
    for v in NATIVE_VARIANTS:
        spike = _get(step, "results", v, "spike_ratio")
        rows.append(_row(f"{v} spike (max/median)", spike, None, why if spike is None else None))
    for v in (*asteria, *NATIVE_VARIANTS):
        value = _get(step, "ratios", f"{v}_vs_adamw_median")
        goal = SOAP_STEP_GOAL if v.startswith("soap_") and not v.endswith("_native") else None
        rows.append(_row(f"{v} median step / AdamW", value, goal, why if value is None else None))
    for v in asteria:
        value = _get(step, "ratios", f"{v}_vs_adamw_energy_per_step")
        note = why
        if value is None and note is None:
            unavailable = _get(step, "results", v, "energy_unavailable") or {}
            if _get(step, "config", "energy") is not True:
                note = "step_time ran without --energy"
            else:
                source = "nvml" if _get(step, "config", "device") != "cpu" else "rapl"
                note = (
                    f"{source}: {unavailable[source]}"
                    if source in unavailable
                    else f"no {source} energy for AdamW or this variant"
                )
        rows.append(_row(f"{v} energy per step / AdamW", value, ENERGY_GOAL, note))
    return rows


def memory_rows(memory: dict | None, why: str | None) -> list[dict]:
    if memory is not None and why is None:
        if memory.get("skipped"):
            why = f"memory --measure-cuda skipped: {memory['skipped']}"
        elif memory.get("mode") != "measure_cuda":
            why = "memory result is not the measured (--measure-cuda) mode"
    rows = []
    for name, goal in (("soap", MEMORY_GOAL), ("kl_shampoo", None)):
        # the window forced where measured (issue 50: auto keeps an H100/H200's bases on the
        # device, where the memory goal cannot be met by construction), and auto placement
        if _get(memory, "measured", name, "window_ratio") is not None or _get(
            memory, "runs", name, "window"
        ):
            kinds = [("window_ratio", " (window)", goal), ("ratio", " (auto)", None)]
        else:
            kinds = [("ratio", "", goal)]
        for key, label, row_goal in kinds:
            value = None if why else _get(memory, "measured", name, key)
            note = why
            if value is None and note is None:
                errors = (memory.get("errors") or {}).items()
                failed = {k: v for k, v in errors if k.startswith(name)}
                note = "; ".join(f"{k}: {v}" for k, v in failed.items()) or (
                    f"no measured {name} {key}"
                )
            rows.append(
                _row(f"{name} device optimizer memory / native{label}", value, row_goal, note)
            )
    return rows


def capacity_rows(capacity: dict | None, why: str | None) -> list[dict]:
    if capacity is None:
        return [_row("refresh capacity (pool / device)", None, None, why)]
    if isinstance(capacity.get("job_s"), dict):  # bench/capacity.py: one core against the device
        device = capacity.get("device_job_s") or {}
        rows = [
            _row(
                f"{job} one core / device time",
                core / device[job] if device.get(job) else None,
                None,
                None if device.get(job) else "no device time (capacity ran without CUDA)",
            )  # fmt: skip
            for job, core in capacity["job_s"].items()
        ]
        return rows or [_row("refresh capacity (pool / device)", None, None, "no jobs timed")]
    sizes = capacity.get("sizes")
    if not isinstance(sizes, list) or not all(isinstance(s, dict) for s in sizes):
        return [_row("refresh capacity (pool / device)", None, None, "no per-size figures")]
    rows = []
    for s in sizes:
        for kind in ("eigh", "qr"):
            value = s.get(f"{kind}_capacity")
            if value is not None:
                rows.append(
                    _row(f"n={s.get('n')} {kind} capacity (pool/s / device/s)", value, None)
                )
    for n in capacity.get("not_measured") or []:
        rows.append(_row(f"n={n} capacity", None, None, "over the capacity run's time budget"))
    return rows or [_row("refresh capacity (pool / device)", None, None, "no per-size figures")]


def time_to_target_rows(ttt: dict | None, why: str | None) -> list[dict]:
    """bench/time_to_target.py --device cuda: per preset, the best Asteria variant's worst time
    to AdamW's loss as a ratio to AdamW's (the issue's goal: <= 0.7), and each variant's median
    ratio and training step against AdamW's (info)."""
    best = "time to AdamW's loss, best Asteria / AdamW (worst seed)"
    presets = _get(ttt, "presets")
    if not isinstance(presets, dict) or not presets:
        return [_row(best, None, TIME_GOAL, why or "no presets in time_to_target's result")]
    rows = []
    for preset, p in presets.items():
        worst = _get(p, "goals", "best_asteria_worst_ratio")
        note = None if worst is not None else "no Asteria variant reached it on every seed"
        rows.append(_row(f"{preset}: {best}", worst, TIME_GOAL, note))
        for variant, r in (_get(p, "runs") or {}).items():
            if variant == "adamw":
                continue
            ratio = _get(r, "ratio_to_reference", "median")
            rows.append(
                _row(f"{preset}: {variant} time to AdamW's loss / AdamW (median)", ratio, None,
                     None if ratio is not None else "did not reach it on most seeds")
            )  # fmt: skip
            step = _get(r, "step_time_vs_reference", "median")
            rows.append(_row(f"{preset}: {variant} median step / AdamW", step, None))
    return rows


def build_summary(
    step: tuple[dict | None, str | None],
    memory: tuple[dict | None, str | None],
    capacity: tuple[dict | None, str | None],
    time_to_target: tuple[dict | None, str | None] | None = None,
) -> dict[str, Any]:
    """Every row, and how many goals were met, missed, or could not be judged; the
    time-to-target rows only where that result was asked for."""
    rows = step_rows(*step) + memory_rows(*memory) + capacity_rows(*capacity)
    if time_to_target is not None:
        rows += time_to_target_rows(*time_to_target)
    goals = [r for r in rows if r["goal"] is not None]
    return {
        "rows": rows,
        "met": sum(r["status"] == "met" for r in goals),
        "missed": sum(r["status"] == "MISSED" for r in goals),
        "unmeasured": sum(r["status"] == "n/a" for r in goals),
    }


def print_summary(summary: dict[str, Any]) -> None:
    """The rows as an aligned table, the note (free text) last and left-aligned."""
    cells = [["figure", "value", "goal", "status", "note"]]
    for r in summary["rows"]:
        value = "-" if r["value"] is None else f"{r['value']:.3f}"
        goal = "-" if r["goal"] is None else f"<= {r['goal']:.2f}"
        cells.append([r["figure"], value, goal, r["status"], r["note"] or ""])
    widths = [max(len(row[i]) for row in cells) for i in range(4)]
    for n, row in enumerate(cells):
        head = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:4], widths[1:])]
        print("  ".join(head + [row[4]]).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths) + "  ----")
    print(
        f"goals: {summary['met']} met, {summary['missed']} missed, "
        f"{summary['unmeasured']} not measured"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--step-time", help="bench/step_time.py's JSON")
    parser.add_argument("--memory", help="bench/memory.py --measure-cuda's JSON")
    parser.add_argument("--capacity", help="bench/gpu_refresh_time.py's or capacity.py's JSON")
    parser.add_argument("--time-to-target", help="bench/time_to_target.py's JSON (optional)")
    parser.add_argument("--device-name", default=None, help="shown in the heading")
    args = parser.parse_args(argv)
    summary = build_summary(
        load_result(args.step_time),
        load_result(args.memory),
        load_result(args.capacity),
        None if args.time_to_target is None else load_result(args.time_to_target),
    )
    print(f"== asteria GPU check summary{f' ({args.device_name})' if args.device_name else ''}")
    print_summary(summary)
    emit_json(
        {
            "benchmark": "gpu_summary",
            "device": args.device_name,
            "inputs": {"step_time": args.step_time, "memory": args.memory,
                       "capacity": args.capacity, "time_to_target": args.time_to_target},
            **summary,
        }
    )  # fmt: skip


if __name__ == "__main__":
    main()
