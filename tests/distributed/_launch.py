"""Launch a scenario of ``_workers.py`` on ``world`` local processes (env:// rendezvous, gloo)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    scenario: str, tmp_path: Path, world: int = 2, timeout_s: float = 90.0
) -> tuple[list[int | None], list[dict[str, Any] | None], str, float]:
    """Run ``scenario`` on ``world`` ranks; per rank its exit code (None: killed at the timeout)
    and its JSON (None: none written), the ranks' stderr, and the wall time."""
    port = free_port()
    procs = []
    env_path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    t0 = time.perf_counter()
    for rank in range(world):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            OMP_NUM_THREADS="1",
            PYTHONPATH=env_path,
        )
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        cmd = [sys.executable, "-m", "tests.distributed._workers", scenario, str(tmp_path)]
        procs.append((subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=log), log))
    codes: list[int | None] = []
    deadline = time.perf_counter() + timeout_s
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=max(deadline - time.perf_counter(), 0.1)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            codes.append(None)
        log.close()
    wall = time.perf_counter() - t0
    results = []
    for rank in range(world):
        f = tmp_path / f"rank{rank}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    logs = "\n".join(
        f"--- rank {r} ---\n" + (tmp_path / f"rank{r}.log").read_text()[-3000:]
        for r in range(world)
    )
    return codes, results, logs, wall
