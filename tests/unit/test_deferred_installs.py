"""Note [One plan per step] (asteria/runtime/plan.py) and Note [Helping waiters]
(csrc/core/worker_pool.cpp): the refreshes a Shampoo step waits for at once are all requested
before the first of them is installed, the training thread computes some of them itself, and
the step's results are those of installing each at its boundary: bitwise native at ``S = 0``
and through the first and urgent roots, with the batched step and the per-parameter one
(momentum), over the settings. An interrupted install is finished by the next step, at the
step it was requested.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asteria import _C
from asteria.memory.tiers import Arch
from asteria.optim import Shampoo
from asteria.runtime import Runtime, RuntimeConfig
from asteria.runtime.refreshes import Refreshes
from asteria.runtime.testing import pretend_arch

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# full-rank 2-D blocks, a merged one and a 1-D one (rank-deficient: urgent for d steps)
SHAPES = [(8, 8), (6, 4), (5,), (3, 2, 2)]


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _train(params, opt, steps: int, seed: int, each=None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1000)
    for t in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        if each is not None:
            each(t)
    return [p.detach().clone() for p in params]


@pytest.mark.filterwarnings("ignore::asteria.runtime.NoSpareCoreWarning")  # (two workers)
@SETTINGS
@given(
    frequency=st.integers(1, 4),
    staleness=st.integers(0, 3),
    momentum=st.sampled_from([0.0, 0.5]),
    workers=st.integers(1, 2),
    lead=st.booleans(),
    steps=st.integers(1, 14),
    tier=st.sampled_from([None, "device", "host"]),
)
def test_waited_refreshes_train_bitwise_native(
    frequency, staleness, momentum, workers, lead, steps, tier
):
    """At ``S = 0`` every refresh, and at ``S >= 1`` the first and urgent ones (here: every
    refresh of the first ``4f`` steps, the 1-D block's until it is full rank), is installed at
    its own step: the parameters are native's bit for bit, every basis read was of age 0, and
    nothing is left deferred after a step; with the bases where the CPU keeps them (``None``),
    and on the CPU stand-in of a discrete GPU, on the device or behind the window (``host``)."""
    kw = dict(precondition_frequency=frequency, momentum=momentum, merge_dims=True)
    horizon = steps if staleness == 0 else min(steps, 4 * frequency)
    native_params = _params(frequency)
    native = _train(native_params, Shampoo(native_params, **kw), horizon, seed=frequency)
    params = _params(frequency)
    opt = Shampoo(params, **kw)
    placement = {} if tier is None else dict(placement={"bases": tier})
    config = RuntimeConfig(staleness=staleness, workers=workers, statistics_lane=False,
                           refresh_lead=lead, refresh="interval", **placement)  # fmt: skip
    arch = (
        contextlib.nullcontext()
        if tier is None
        else pretend_arch(Arch(cuda=True), device_free_bytes=1 << 40)
    )
    with arch, Runtime(None, opt, config) as rt:
        left: list[int] = []
        got = _train(params, opt, horizon, frequency, lambda t: left.append(len(rt._plan.waiting)))
        stats = rt.stats()
        access = rt.memory_report()["placement"]["bases_access"]
    assert all(torch.equal(a, b) for a, b in zip(got, native))
    assert left == [0] * horizon
    assert stats["max_staleness"] == 0
    assert access == {None: "direct", "device": None, "host": "window"}[tier]


def test_a_steps_waited_refreshes_are_all_requested_before_the_first_install(monkeypatch):
    """The batched step ends every block before it reads a root: at a step that waits for its
    refreshes (``S = 0``), every request comes before every install, and with one worker the
    training thread runs some of the jobs itself (``stats()["jobs"]["helped"]``)."""
    events: list[tuple[str, int]] = []
    request_many, install_many = Refreshes.request_many, Refreshes.install_many

    def requested(self, requests):
        events.extend(("request", r[4]) for r in requests)
        return request_many(self, requests)

    def installed(self, batch, charge=True):
        events.extend(("install", step) for _, _, step, _ in batch)
        return install_many(self, batch, charge)

    monkeypatch.setattr(Refreshes, "request_many", requested)
    monkeypatch.setattr(Refreshes, "install_many", installed)
    params = [torch.nn.Parameter(torch.randn(96, 96)) for _ in range(6)]
    opt = Shampoo(params, precondition_frequency=2)
    config = RuntimeConfig(staleness=0, workers=1, statistics_lane=False)
    with Runtime(None, opt, config) as rt:
        _train(params, opt, 6, seed=0)
        helped = rt.stats()["jobs"]["helped"]
    for step in (2, 4, 6):
        kinds = [k for k, s in events if s == step]
        assert kinds == ["request"] * 6 + ["install"] * 6, (step, kinds)
    assert helped >= 1


def _interrupting(nth: int, original):
    """``Refreshes.install_many`` (every install batch: a step's waited refreshes, a signal's)
    raising KeyboardInterrupt at its ``nth`` call (once)."""
    calls = [0]

    def install_many(refreshes, batch, charge=True):
        calls[0] += 1
        if calls[0] == nth:
            raise KeyboardInterrupt
        return original(refreshes, batch, charge)

    return install_many


@SETTINGS
@given(nth=st.integers(1, 8), staleness=st.integers(0, 2), frequency=st.integers(1, 3))
def test_an_interrupted_install_is_finished_at_its_step(nth, staleness, frequency):
    """Ctrl-C during a step's deferred installs: the next step installs what was left first, as
    installed at the interrupted step (``Registry.record_installs`` checks the bound), and
    every later basis read keeps the staleness contract."""
    params = _params(3)
    opt = Shampoo(params, precondition_frequency=frequency)
    config = RuntimeConfig(staleness=staleness, workers=1, statistics_lane=False)
    original = Refreshes.install_many
    with Runtime(None, opt, config) as rt:
        Refreshes.install_many = _interrupting(nth, original)
        try:
            interrupted_at = None
            for t in range(12):
                for p in params:
                    p.grad = torch.randn(p.shape)
                try:
                    opt.step()
                except KeyboardInterrupt:
                    interrupted_at = t + 1
                    left = list(rt._plan.waiting)
        finally:
            Refreshes.install_many = original
        if interrupted_at == 12:  # (the last step: the next one finishes it)
            for p in params:
                p.grad = torch.randn(p.shape)
            opt.step()
        stats = rt.stats()
        assert not rt._plan.waiting
    if interrupted_at is not None and left:  # (an install at its decision defers nothing)
        assert all(step == interrupted_at for _, _, step, _, _ in left)
    assert stats["basis_age"]["max"] <= stats["basis_age"]["bound"]


def test_run_ahead_runs_the_jobs_queued_up_to_it_on_the_calling_thread():
    """``Future.run_ahead``: while the pool's one worker is busy, a thread about to wait for a
    queued job runs it, and the jobs queued before it, itself (they start before the busy job
    ends), one per call; never a job queued behind it."""
    pool = _C.WorkerPool(workers=1)
    try:
        big = torch.randn(1400, 1400, dtype=torch.float64)
        busy = pool.submit_eigh("busy", 0, 0, big @ big.T, torch.float64)
        while busy.status() == "queued":
            time.sleep(0.001)
        small = [torch.eye(4, dtype=torch.float64) * (i + 1) for i in range(3)]
        a, mine, later = (pool.submit_eigh(n, 0, d, f, torch.float64)
                          for n, d, f in zip(("a", "mine", "later"), (1, 2, 3), small))  # fmt: skip
        ran = 0
        while mine.run_ahead():
            ran += 1
        still_busy = busy.status() == "running"
        assert ran == 2 and a.done() and mine.done()
        if still_busy:  # (the eigh of 1,400 takes well over the few ms the small jobs take)
            assert later.status() == "queued"
            assert a.started_at < (busy.finished_at or float("inf"))
        assert not mine.run_ahead() and not busy.run_ahead()
        later.result(timeout_s=60)
        assert torch.allclose(mine.result()[0], torch.full((4,), 2.0, dtype=torch.float64))
    finally:
        pool.shutdown(wait=True)


def test_shutdown_waits_for_a_job_a_helping_thread_runs():
    """``shutdown(wait=True)`` returns only once a job run by a helping thread has finished (its
    inputs and results are the pool's until then)."""
    pool = _C.WorkerPool(workers=1)
    big = torch.randn(900, 900, dtype=torch.float64)
    busy = pool.submit_eigh("busy", 0, 0, big @ big.T, torch.float64)
    while busy.status() == "queued":
        time.sleep(0.001)
    mine = pool.submit_eigh("mine", 0, 1, big @ big.T, torch.float64)
    helper = threading.Thread(target=mine.run_ahead)
    helper.start()
    while mine.status() == "queued":
        time.sleep(0.001)
    pool.shutdown(wait=True)
    assert mine.done() and mine.status() == "succeeded"
    helper.join()


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_stats_count_the_jobs_the_training_thread_ran(momentum):
    """``stats()["jobs"]["helped"]`` is at most the jobs completed, and the completed jobs are
    the pool's count whoever ran them."""
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(4)]
    opt = Shampoo(params, precondition_frequency=1, momentum=momentum)
    with Runtime(None, opt, RuntimeConfig(staleness=0, workers=1, statistics_lane=False)) as rt:
        _train(params, opt, 4, seed=1)
        jobs = rt.stats()["jobs"]
    assert 0 <= jobs["helped"] <= jobs["completed"] == jobs["submitted"]
