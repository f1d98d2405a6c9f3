"""Run outputs of `asteria.train`: metrics.jsonl, summary.json, report.md and loss.png.

Owns: the output folder's layout and formats. Must not: train, or read anything but the records
and summaries it is given. Non-finite numbers (a diverged run) are written as JSON ``null``.

* ``metrics.jsonl``: one JSON object per optimizer step (optimizer, step, loss, lr, step_ms,
  opt_ms, refresh when the optimizer reports it, val_loss at validation steps).
* ``summary.json``: {"env": ..., "runs": {optimizer: summary}}.
* ``report.md``: a table of final losses and times, and the plot.
* ``loss.png``: training loss (smoothed) and validation loss per step, one line per optimizer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
REPORT = "report.md"
PLOT = "loss.png"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class MetricsWriter:
    """Appends one JSON line per record to ``out/metrics.jsonl``, flushed as it goes."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / METRICS
        self._file: IO[str] = self.path.open("w", encoding="utf-8")

    def __call__(self, record: dict) -> None:
        self._file.write(json.dumps(_finite(record), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_summary(out: Path, env: dict, runs: dict[str, dict]) -> Path:
    path = out / SUMMARY
    payload = {"env": env, "runs": runs}
    path.write_text(json.dumps(_finite(payload), indent=2, allow_nan=False) + "\n", "utf-8")
    return path


def _ema(values: list[float], beta: float = 0.9) -> list[float]:
    out, acc = [], values[0] if values else 0.0
    for i, v in enumerate(values):
        acc = v if i == 0 else beta * acc + (1 - beta) * v
        out.append(acc)
    return out


def plot_losses(out: Path, records: dict[str, list[dict]]) -> Path:
    """Training loss (EMA 0.9) as lines, validation loss as markers, one colour per optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for i, (name, recs) in enumerate(records.items()):
        color = f"C{i}"
        steps = [r["step"] for r in recs]
        ax.plot(steps, _ema([r["loss"] for r in recs]), color=color, label=f"{name} train (EMA)")
        val = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
        if val:
            ax.plot(*zip(*val), "o--", color=color, label=f"{name} validation", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / PLOT
    fig.savefig(path)
    plt.close(fig)
    return path


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def write_report(out: Path, env: dict, runs: dict[str, dict], title: str) -> Path:
    """A short Markdown report: setup line, result table, plot."""
    first = next(iter(runs.values()))["config"]
    lines = [
        f"# {title}",
        "",
        (
            f"Model `{first['model']}`, {first['steps']} steps of batch {first['batch_size']} x "
            f"{first['seq_len']} bytes, seed {first['seed']}; torch {env['torch']}, "
            f"{env['torch_threads']} threads, {env['cpu']}."
        ),
        "",
        (
            "| optimizer | lr | final loss (mean of last 10) | final val loss "
            "| median step ms | median opt ms | refresh opt ms | wall s |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in runs.items():
        lines.append(
            f"| {name}{' (diverged)' if s['diverged'] else ''} | {s['lr']:g} "
            f"| {_fmt(s['final_loss_mean10'], '.4f')} | {_fmt(s['final_val_loss'], '.4f')} "
            f"| {_fmt(s['median_step_ms'], '.1f')} | {_fmt(s['median_opt_ms'], '.1f')} "
            f"| {_fmt(s['median_refresh_opt_ms'], '.1f')} | {_fmt(s['wall_s'], '.1f')} |"
        )
    lines += ["", f"![loss]({PLOT})", ""]
    path = out / REPORT
    path.write_text("\n".join(lines), "utf-8")
    return path
