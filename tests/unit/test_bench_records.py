"""Every benchmark result records its run (issue 23, item 4; Note [Recorded runs] in
bench/_common.py): the date, the commit, the torch version and the machine, in each committed
bench/results/*.json and in every JSON line a bench prints."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch

from bench import _common

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "bench" / "results").glob("*.json"))
COMMIT = re.compile(r"^[0-9a-f]{40}(\+dirty)?$")


def _check_recorded(recorded: dict) -> None:
    assert datetime.fromisoformat(recorded["date"]).tzinfo is not None
    assert recorded["commit"] is None or COMMIT.match(recorded["commit"])
    assert re.match(r"^\d+\.\d+\.\d+", recorded["torch"])
    machine = recorded["machine"]
    assert machine["cpu"] and machine["cpu_count"] >= 1 and machine["platform"]
    assert "accelerator" in machine


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_committed_results_record_their_run(path):
    recorded = json.loads(path.read_text())["recorded"]
    _check_recorded(recorded)
    assert recorded["commit"] is not None and not recorded["commit"].endswith("+dirty")
    git = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-t", recorded["commit"]],
        capture_output=True,
        text=True,
    )
    if git.returncode == 0:  # a checkout with its history: the commit is one of it
        assert git.stdout.strip() == "commit"


def test_emit_json_records_the_run():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _common.emit_json({"benchmark": "test", "ratio": float("nan")})
    line = json.loads(out.getvalue().strip().splitlines()[-1])
    assert line["benchmark"] == "test" and line["ratio"] is None
    recorded = line["recorded"]
    _check_recorded(recorded)
    assert recorded["torch"] == torch.__version__
    age = datetime.now(timezone.utc) - datetime.fromisoformat(recorded["date"])
    assert timedelta(0) <= age < timedelta(minutes=5)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True)
    if head.returncode == 0:
        assert recorded["commit"].removesuffix("+dirty") == head.stdout.decode().strip()


def test_commit_can_be_given_where_there_is_no_git(monkeypatch):
    monkeypatch.setenv("ASTERIA_COMMIT", "0" * 40)
    assert _common.recorded()["commit"] == "0" * 40


@pytest.mark.parametrize("path", sorted((ROOT / "bench").glob("*.py")), ids=lambda p: p.name)
def test_benches_print_json_through_emit_json(path):
    """No bench prints a JSON line of its own (``print(json.dumps(...))``), which would skip
    ``recorded``; a bench's other JSON (a worker's hand-over file) is not a result."""
    if path.name == "_common.py":
        return
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
            for arg in node.args:
                assert not (
                    isinstance(arg, ast.Call)
                    and isinstance(arg.func, ast.Attribute)
                    and arg.func.attr == "dumps"
                ), f"{path.name}:{node.lineno} prints JSON without emit_json"
