"""Shared benchmark harness: environment header, timing, tables, and the one-line JSON summary.

Owns: how every benchmark under bench/ reports (an environment header first, a readable table,
and as the LAST line of output one JSON object with absolute figures and ratios against named
baselines). Must not: know what is being benchmarked.

Ratios are ``ours / theirs`` of a time, so a value below 1 means ours is faster.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from asteria.train.env import environment


def set_threads(threads: int) -> None:
    """Use ``threads`` intra-op threads (and one inter-op thread where still allowed)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)


def env_header(title: str, *packages: str) -> dict[str, Any]:
    """Print the environment block that opens every benchmark's output; return it as a dict."""
    env = environment(*packages)
    print(f"== {title}")
    for key, value in env.items():
        print(f"   {key}: {value}")
    sys.stdout.flush()
    return env


def device_tag(name: str) -> str:
    """A results-file suffix from a device name: lower-cased, the vendor prefix dropped, runs of
    other characters than ``[a-z0-9]`` as one ``_`` (``"NVIDIA H200"`` -> ``"h200"``)."""
    tag = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    tag = re.sub(r"^nvidia_", "", tag)
    return tag or "unknown"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of one call of ``fn`` in milliseconds, with the device drained before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return 1e3 * (time.perf_counter() - start)


def median(values: Iterable[float]) -> float | None:
    """The median, or None for no values."""
    values = list(values)
    return statistics.median(values) if values else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """``ours / theirs``, or None when either is missing or ``theirs`` is not positive."""
    if ours is None or theirs is None or not theirs > 0:
        return None
    return ours / theirs


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if math.isfinite(value) else str(value)
    return str(value)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain aligned text table: first column left-aligned, the rest right-aligned."""
    cells = [list(headers)] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        line = "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        )
        print(line)
        if n == 0:
            print("  ".join("-" * w for w in widths))


def emit_json(payload: dict[str, Any]) -> None:
    """Print ``payload`` as one JSON line (non-finite floats become null). Call it last."""

    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    sys.stdout.flush()
    print(json.dumps(clean(payload), allow_nan=False), flush=True)
