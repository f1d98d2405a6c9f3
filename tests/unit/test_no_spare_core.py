"""issue 24, item 5: where the training's threads and the refresh workers outnumber the cores,
the runtime warns once at attach (Note [No spare core] in asteria/runtime/attach.py), keeps the
text in stats()["warnings"], and asteria-train's report shows it."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asteria.optim import SOAP
from asteria.runtime import NoSpareCoreWarning, Runtime, RuntimeConfig
from asteria.runtime.attach import no_spare_core
from asteria.train.cli import main

CORES = os.cpu_count() or 1


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    """Every test here sets torch's threads; the next test gets them back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    threads=st.integers(1, 8),
    workers=st.integers(1, 8),
    processes=st.integers(1, 4),
    cores=st.integers(1, 32),
)
def test_warns_exactly_when_threads_and_workers_outnumber_the_cores(
    threads: int, workers: int, processes: int, cores: int
) -> None:
    torch.set_num_threads(threads)
    text = no_spare_core(workers, processes, cores)
    assert (text is None) == ((threads + workers) * processes <= cores)
    if text is None:
        return
    assert f"{threads} intra-op thread" in text and f"{cores} CPU cores" in text
    assert f"{workers} refresh worker" in text
    assert ("processes" in text) == (processes > 1)
    room = cores // processes - workers
    if room >= 1:  # the thread count it suggests leaves the workers their cores
        assert f"torch.set_num_threads({room})" in text and f"--threads {room}" in text
        torch.set_num_threads(room)
        assert no_spare_core(workers, processes, cores) is None
    else:
        assert "fewer workers" in text


def _attach(workers: int) -> tuple[Runtime, list[warnings.WarningMessage]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = SOAP(model.parameters(), lr=1e-2, precondition_frequency=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime = Runtime(model, opt, RuntimeConfig(staleness=1, workers=workers))
        for _ in range(4):  # steps and refreshes warn no more
            model(torch.randn(4, 8)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    return runtime, [w for w in caught if issubclass(w.category, NoSpareCoreWarning)]


def test_runtime_warns_once_at_attach_when_the_training_takes_every_core() -> None:
    torch.set_num_threads(CORES)
    runtime, caught = _attach(workers=1)
    with runtime:
        assert len(caught) == 1
        text = str(caught[0].message)
        assert caught[0].filename == __file__  # points at the attaching line
        assert runtime.stats()["warnings"] == [text]
        assert f"{CORES} intra-op thread" in text and "no core to hide refreshes on" in text


@pytest.mark.skipif(CORES < 2, reason="one core: no thread count leaves a worker its core")
def test_runtime_is_silent_where_the_workers_have_their_cores() -> None:
    torch.set_num_threads(1)
    runtime, caught = _attach(workers=CORES - 1)
    with runtime:
        assert caught == [] and runtime.stats()["warnings"] == []


def test_asteria_train_reports_the_warning(tmp_path: Path, monkeypatch) -> None:
    # One core stands for a machine whose cores all train: on this shared 2-core machine, two
    # training threads beside other jobs made the two steps take minutes.
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    out = tmp_path / "run"
    argv = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--val-every", "2"]
    argv += ["--data-bytes", "100000", "--no-progress", "--threads", "1", "--workers", "1"]
    with pytest.warns(NoSpareCoreWarning):
        assert main([*argv, "--compare", "adamw,soap:asteria", "--out", str(out)]) == 0
    runs = json.loads((out / "summary.json").read_text())["runs"]
    (text,) = runs["soap:asteria"]["runtime"]["warnings"]
    assert "runtime" not in runs["adamw"]
    report = (out / "report.md").read_text()
    assert report.count(text) == 1 and f"**Warning** (soap:asteria): {text}" in report
