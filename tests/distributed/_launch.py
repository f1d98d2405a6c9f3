"""Launch a scenario of ``_workers.py`` on ``world`` local processes (env:// rendezvous, gloo)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_env(tmp_path: Path) -> dict[str, str]:
    """The environment of one launch's ranks for ``init_gloo``: a rendezvous file of its own,
    plus torchrun's ``MASTER_ADDR``/``MASTER_PORT`` for code that reads them. A port found free
    here may be taken before rank 0 binds it (gloo's own connections take ephemeral ports too), so
    the rendezvous itself does not use it."""
    fd, name = tempfile.mkstemp(prefix="rendezvous-", dir=tmp_path)
    os.close(fd)
    os.unlink(name)  # torch's FileStore creates it, and removes it when the last rank leaves
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "ASTERIA_TEST_RENDEZVOUS": name,
    }


def init_gloo(timeout_s: float = 60.0) -> None:
    """``init_process_group("gloo")`` for a rank started by a test: through the launch's file
    (``rendezvous_env``), or env:// where none is set (torchrun)."""
    from datetime import timedelta

    import torch.distributed as dist

    path = os.environ.get("ASTERIA_TEST_RENDEZVOUS")
    timeout = timedelta(seconds=timeout_s)
    if path is None:
        dist.init_process_group("gloo", timeout=timeout)
        return
    dist.init_process_group(
        "gloo",
        init_method=f"file://{path}",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )


def launch(
    scenario: str, tmp_path: Path, world: int = 2, timeout_s: float = 90.0
) -> tuple[list[int | None], list[dict[str, Any] | None], str, float]:
    """Run ``scenario`` on ``world`` ranks; per rank its exit code (None: killed at the timeout)
    and its JSON (None: none written), the ranks' stderr, and the wall time."""
    rendezvous = rendezvous_env(tmp_path)
    procs = []
    env_path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    t0 = time.perf_counter()
    for rank in range(world):
        env = dict(
            os.environ,
            **rendezvous,
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
