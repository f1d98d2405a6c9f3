"""Shared benchmark harness: environment header, timing, tables, and the one-line JSON summary.

Owns: how every benchmark under bench/ reports (an environment header first, a readable table,
and as the LAST line of output one JSON object with absolute figures and ratios against named
baselines), and what every such JSON records of its run (``recorded``: Note [Recorded runs]).
Must not: know what is being benchmarked.

Ratios are ``ours / theirs`` of a time, so a value below 1 means ours is faster.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from asteria.train.env import environment

ROOT = Path(__file__).resolve().parent.parent


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


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The language-model loss of ``tokens`` (forward only), in bf16 autocast on a GPU: how every
    benchmark's training step runs its model."""
    if tokens.device.type == "cuda":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(input_ids=tokens, labels=tokens).loss
    return model(input_ids=tokens, labels=tokens).loss


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


def git_commit() -> str | None:
    """The commit the code ran at, ``+dirty`` when tracked files differ from it; ``ASTERIA_COMMIT``
    where set (a copy of the tree without its ``.git``); None where neither tells."""
    if os.environ.get("ASTERIA_COMMIT"):
        return os.environ["ASTERIA_COMMIT"]
    try:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except OSError:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


#: The commit when the benchmark started (this module is imported before it runs): the code it
#: ran, whatever is committed while it runs (its own results and plots included).
_COMMIT_AT_START = git_commit()


def recorded() -> dict[str, Any]:
    """When, at which commit, with which torch and on what machine a run measured.

    Note [Recorded runs]: every benchmark's JSON carries, under ``recorded``, the UTC date and
    time of the run, the commit (``git_commit``, taken when the benchmark started, so that
    commits made while it runs do not show), the torch version, and the machine (CPU model
    and count, memory, accelerator, platform): ``emit_json`` adds it, so no bench can leave it
    out, and bench/results/*.json are those lines. The files committed before this existed got
    the date and commit of the commit that added their figures from git history, the torch
    version from their own ``env``, and the machine as README.md records it (``"source"`` says
    so)."""
    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        memory_gib = None
    env = environment()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": os.environ.get("ASTERIA_COMMIT") or _COMMIT_AT_START,
        "torch": torch.__version__,
        "machine": {
            "cpu": env["cpu"],
            "cpu_count": env["cpu_count"],
            "memory_gib": memory_gib,
            "accelerator": env["cuda"],
            "platform": env["platform"],
        },
    }


def emit_json(payload: dict[str, Any]) -> None:
    """Print ``payload`` with ``recorded`` (Note [Recorded runs]) as one JSON line (non-finite
    floats become null). Call it last."""
    payload = {**payload, "recorded": recorded()}

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


def partial_json(payload: dict[str, Any]) -> None:
    """Write ``payload`` (with ``recorded`` and ``"partial": true``) to the file named by
    ``$BENCH_PARTIAL_JSON``, replacing it atomically; nothing where it is unset. A bench calls it
    after each finished unit (a variant, a run), so that a run cut by its time box still leaves
    what it measured (bench/gpu_check.sh keeps that file when the last line is not the JSON)."""
    path = os.environ.get("BENCH_PARTIAL_JSON")
    if not path:
        return
    payload = {**payload, "partial": True, "recorded": recorded()}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, default=str)
        f.write("\n")
    os.replace(tmp, path)
