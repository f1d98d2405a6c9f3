"""Asteria's runtime (single process): equivalence, determinism, the staleness bound, faults."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.runtime import (
    RefreshFailedError,
    Runtime,
    RuntimeConfig,
    StalenessTimeoutError,
)
from asteria.runtime.testing import slow_pool, wrapped_statistics
from tests.problems import StochasticQuartic, max_rel_diff, state_tensors

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}
SHAPES = [(6, 6), (5, 6), (4, 3, 2), (7,)]


def _orchestrated(cls, config, runtimes, **kw):
    def make(params):
        opt = cls(params, precondition_frequency=5, **kw)
        runtimes.append(Runtime(None, opt, config))
        return opt

    return make


@pytest.fixture
def runtimes():
    made: list[Runtime] = []
    yield made
    for r in made:
        r.close()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_staleness_zero_is_native_bitwise(name, runtimes):
    cls = OPTIMIZERS[name]
    problem = StochasticQuartic(SHAPES, 200, torch.float32)
    native = problem.run(lambda ps: cls(ps, precondition_frequency=5))
    orchestrated = problem.run(_orchestrated(cls, RuntimeConfig(staleness=0, workers=1), runtimes))
    for a, b in zip(orchestrated, native):
        assert torch.equal(a, b)
    stats = runtimes[-1].stats()
    assert stats["installs"] >= 3 * 39 and stats["staleness_histogram"] == {0: stats["installs"]}


def test_snapshots_through_staging_slots_keep_native_results(runtimes):
    """The device path (copies on the copy stream into slots of the staging ring, deferred
    submission; Note [Staged snapshots]), run here with the CPU stand-ins of the copy stream and
    the ring's fences."""
    from asteria.runtime.testing import staged_snapshots

    problem = StochasticQuartic(SHAPES, 60, torch.float32)
    native = problem.run(lambda ps: KLShampoo(ps, precondition_frequency=5))

    def make(params):
        opt = KLShampoo(params, precondition_frequency=5)
        # the staging path is for device parameters, where the statistics lane never runs
        config = RuntimeConfig(staleness=0, workers=1, statistics_lane=False)
        with staged_snapshots():
            runtimes.append(Runtime(None, opt, config))
        return opt

    staged = problem.run(make)
    for a, b in zip(staged, native):
        assert torch.equal(a, b)
    staging = runtimes[-1].stats()["snapshots"]
    assert staging["strategy"] == "staged"
    # one slot per (block, dim, factor|basis): (2 + 2 + 3) dims x 2, reused at every later
    # refresh (11 of them) without ever waiting for one
    ring = staging["ring"]
    assert ring["slots"] == 14 and ring["acquires"] == 14 * 11 and ring["waited"] == 0
    assert staging["staged"] == 14 * 11 and staging["unstaged"] == 0


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fixed_delay_is_deterministic_and_exact(name, runtimes):
    cls = OPTIMIZERS[name]
    problem = StochasticQuartic(SHAPES, 120, torch.float32)
    config = RuntimeConfig(staleness=3, fixed_delay=2, workers=2)
    first = problem.run(_orchestrated(cls, config, runtimes))
    second = problem.run(_orchestrated(cls, config, runtimes))
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    hist = runtimes[-1].stats()["staleness_histogram"]
    assert set(hist) == {2}
    native = problem.run(lambda ps: cls(ps, precondition_frequency=5))
    assert any(not torch.equal(a, b) for a, b in zip(first, native)), "the delay must matter"


@pytest.mark.parametrize("lead", [True, False], ids=["refresh_lead", "no_lead"])
def test_shampoo_grafts_until_its_first_roots_arrive(lead, runtimes):
    """Shampoo's first roots are due at step 5 (its start). Under ``fixed_delay=2`` they are
    requested at step 4, one step ahead (Note [Refresh lead]), and arrive at step 6; without the
    lead, requested at step 5, they arrive at step 7. Until then the steps take the grafting
    direction, as before the start (identity roots there would rescale ``M_hat`` to the
    grafting norm instead)."""
    config = RuntimeConfig(staleness=2, fixed_delay=2, workers=1, refresh_lead=lead)
    first = 6 if lead else 7  # the first step that uses the roots

    def grafting(ps):
        return Shampoo(ps, precondition_frequency=5, start_preconditioning_step=10**9)

    problem = StochasticQuartic(SHAPES, first - 1, torch.float32)
    delayed = problem.run(_orchestrated(Shampoo, config, runtimes))
    assert max_rel_diff(delayed, problem.run(grafting)) < 1e-6  # another operation order
    longer = StochasticQuartic(SHAPES, first, torch.float32)
    delayed = longer.run(_orchestrated(Shampoo, config, runtimes))
    assert max_rel_diff(delayed, longer.run(grafting)) > 1e-4, f"step {first} uses the roots"
    hist = runtimes[-1].stats()["staleness_histogram"]
    assert {int(k) for k in hist} == {2}, hist  # one install per block, 2 steps after request


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    frequency=st.integers(1, 6),
    start=st.one_of(st.none(), st.integers(1, 8)),
    staleness=st.integers(1, 6),
    fixed=st.booleans(),
    lead=st.booleans(),
    lane=st.booleans(),
    hooks=st.booleans(),
    refresh=st.sampled_from(["interval", "staggered", "continuous"]),
)
def test_shampoo_first_roots_are_natives(
    frequency, start, staleness, fixed, lead, lane, hooks, refresh
):
    """Note [First roots]: at any budget of at least a step (by default not under
    ``fixed_delay``, with ``wait_first_refresh=True`` there too), the first preconditioned step
    runs on the roots of its own factors, bitwise native's up to that step, at basis age 0;
    ``wait_first_refresh=False`` leaves that step on the grafting direction (no roots yet),
    which differs."""
    first = frequency if start is None else start  # Shampoo's start step
    problem = StochasticQuartic(SHAPES, first, torch.float32)
    kw = dict(precondition_frequency=frequency, start_preconditioning_step=start)
    native = problem.run(lambda ps: Shampoo(ps, **kw))
    made: list[Runtime] = []

    def orchestrated(wait: bool):
        config = RuntimeConfig(
            staleness=staleness,
            fixed_delay=staleness if fixed else None,
            workers=1,
            refresh_lead=lead,
            statistics_lane=lane,
            hooks=hooks,
            refresh=refresh,
            wait_first_refresh=None if wait and not fixed else wait,
        )

        def make(ps):
            opt = Shampoo(ps, **kw)
            made.append(Runtime(None, opt, config))
            return opt

        return problem.run(make)

    try:
        waited = orchestrated(True)
        blocks = made[-1].stats()["blocks"]
        late = orchestrated(False)
    finally:
        for r in made:
            r.close()
    assert all(torch.equal(a, b) for a, b in zip(waited, native))
    assert {b["basis_age"] for b in blocks.values() if b["basis_age_bound"] is not None} == {0}
    assert any(not torch.equal(a, b) for a, b in zip(late, native))


def _hog(runtime: Runtime, jobs_per_worker: int = 50) -> list:
    """Occupy every pool worker with long jobs of deadline 0 (ahead of any refresh): float64
    eighs, seconds of work on any machine; close() cancels those still queued."""
    big = torch.randn(400, 400, dtype=torch.float64)
    big = big @ big.T
    return [
        runtime.pool.submit_eigh(f"hog{i}", 0, 0, big, torch.float64, copy=False)
        for i in range(jobs_per_worker * runtime.config.resolved_workers)
    ]


def test_no_version_is_staler_than_the_budget_when_the_pool_is_slow(runtimes):
    """Refreshes requested while the pool is slowed (``slow_pool``: each takes at least 1 s,
    some hundred steps of this problem) are not ready at their deadline: the step waits at the
    barrier and installs them there, at staleness 2, never later."""
    problem = StochasticQuartic([(16, 16), (12, 8)], 60, torch.float32)
    params = problem.params()
    opt = SOAP(params, precondition_frequency=4)
    rt = Runtime(None, opt, RuntimeConfig(staleness=2, workers=1))
    runtimes.append(rt)
    for t in range(60):
        slowed = 10 <= t < 14 or 30 <= t < 34  # one refresh request in each window
        with slow_pool(1.0 if slowed else 0.0):
            opt.zero_grad()
            problem.loss(params, t).backward()
            opt.step()
        for block in rt.stats()["blocks"].values():
            if block["pending"] >= 0:
                assert t + 1 - block["pending"] <= 2 + 1
    stats = rt.stats()
    assert stats["max_staleness"] <= 2
    assert 2 in stats["staleness_histogram"], "the slowed pool must have forced barrier installs"


def test_barrier_timeout_names_the_block(runtimes):
    model = torch.nn.Linear(8, 8, bias=False)
    opt = SOAP(model.parameters(), precondition_frequency=1)
    rt = Runtime(model, opt, RuntimeConfig(staleness=0, workers=1, barrier_timeout_s=0.05))
    runtimes.append(rt)
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()  # the first step: eigh in the step, nothing pending
    model(torch.randn(4, 8)).square().sum().backward()
    with slow_pool(60.0):  # the refresh cannot be ready within barrier_timeout_s
        with pytest.raises(StalenessTimeoutError, match=r"block 'weight\[0\]'.*step 1"):
            opt.step()


def test_refresh_failures_keep_the_previous_version_then_raise(runtimes):
    problem = StochasticQuartic([(6, 6)], 40, torch.float32)
    params = problem.params()
    opt = SOAP(params, precondition_frequency=2)
    rt = Runtime(None, opt, RuntimeConfig(staleness=0, workers=1, max_consecutive_failures=2))
    runtimes.append(rt)
    for t in range(3):
        opt.zero_grad()
        problem.loss(params, t).backward()
        opt.step()
    rt.sync()  # finish the lane's work in flight (an install), as state_dict() does
    block = opt.state[params[0]]["blocks"][0]
    basis_before = [q.clone() for q in block["bases"]]
    block["factors"][0][0, 0] = float("nan")  # every later refresh fails in fp32 and in fp64
    t = 3
    while rt.stats()["jobs"]["failed"] == 0:
        opt.zero_grad()
        problem.loss(params, t).backward()
        opt.step()
        t += 1
    assert rt.stats()["jobs"]["failed"] == 1 and t <= 6
    rt.sync()
    assert all(torch.equal(a, b) for a, b in zip(block["bases"], basis_before))
    assert all(torch.isfinite(p).all() for p in params)
    with pytest.raises(RefreshFailedError, match=r"param0\[0\].*2 times in a row"):
        for later in range(t, t + 4):
            opt.zero_grad()
            problem.loss(params, later).backward()
            opt.step()


def test_worker_exception_reaches_the_step_with_the_block_name(runtimes, monkeypatch):
    problem = StochasticQuartic([(6, 6)], 10, torch.float32)
    params = problem.params()
    opt = Shampoo(params, precondition_frequency=2)
    rt = Runtime(None, opt, RuntimeConfig(staleness=1, workers=1))
    runtimes.append(rt)
    real_jobs = opt.refresh_jobs

    def broken_jobs(block, group):
        jobs = real_jobs(block, group)
        jobs[0].factor = jobs[0].factor[:, :3]  # not square: the worker raises
        return jobs

    monkeypatch.setattr(opt, "refresh_jobs", broken_jobs)
    with pytest.raises(RefreshFailedError, match=r"param0\[0\].*square"):
        for t in range(10):
            opt.zero_grad()
            problem.loss(params, t).backward()
            opt.step()


def test_hooks_are_signals_and_close_removes_them():
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    opt = SOAP(model.parameters(), precondition_frequency=2)
    with Runtime(model, opt, RuntimeConfig(staleness=4, workers=1)) as rt:
        # a forward pre-hook on each Linear (Note [One install batch per step]: the first signal
        # installs the step's batch)
        assert rt.stats()["hooks"] == 2
        for _ in range(12):
            opt.zero_grad()
            model(torch.randn(16, 6)).square().mean().backward()
            opt.step()
        stats = rt.stats()
        assert stats["installs"] > 0 and stats["max_staleness"] <= 4
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert type(opt.refresher).__name__ == "NativeRefresher"
    assert all(e.pending is None for e in rt.blocks().values())
    # with fixed_delay, installs happen at their step: a hook would only return
    with Runtime(model, opt, RuntimeConfig(staleness=4, fixed_delay=2, workers=1)) as rt:
        assert rt.stats()["hooks"] == 0
        assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_hook_installs_count_staleness_as_the_optimizer_uses_the_version(name):
    """A refresh installed by a hook, between steps t and t+1, is used from step t+1: native
    SOAP and KL-Shampoo do the same with their refresh of step t (staleness 0), native Shampoo
    already used it in step t (staleness 1; Note [Staleness bound]), except its first roots,
    which the step that first uses them waits for (staleness 0, once per block; Note [First
    roots]), and its roots of rank-deficient factors, waited for at their step too (staleness
    0, counted in ``urgent_waits``; Note [Rank-deficient factors]): here the biases' and the
    merged 3 x 6 weight's."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    opt = OPTIMIZERS[name](model.parameters(), precondition_frequency=2)
    config = RuntimeConfig(staleness=3, workers=1, statistics_lane=False)
    with Runtime(model, opt, config) as rt:
        for _ in range(12):
            opt.zero_grad()
            # every refresh is ready when the next forward starts
            while any(e.pending and not e.pending.done() for e in rt.blocks().values()):
                time.sleep(0.001)
            model(torch.randn(16, 6)).square().mean().backward()
            opt.step()
        hist = rt.stats()["staleness_histogram"]
        urgent = rt.stats()["jobs"]["urgent_waits"]
        blocks = len(rt.blocks())
    if name == "shampoo":
        assert urgent > 0
        assert hist == {0: blocks + urgent, 1: sum(hist.values()) - blocks - urgent}
    else:
        assert hist == {0: sum(hist.values())}
    assert sum(hist.values()) >= 2 * 5


def test_forward_signals_allow_inplace_ops():
    """The module signals are forward pre-hooks: an in-place op on a hooked module's output
    (which a full backward pre-hook refuses) trains, and the runtime installs."""
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 6), torch.nn.ReLU(inplace=True), torch.nn.Linear(6, 3)
    )
    opt = SOAP(model.parameters(), precondition_frequency=2)
    with Runtime(model, opt, RuntimeConfig(staleness=2, workers=1)) as rt:
        for _ in range(8):
            opt.zero_grad()
            model(torch.randn(16, 6)).square().mean().backward()
            opt.step()
        assert rt.stats()["installs"] > 0


def test_soap_install_carries_state_over_exactly():
    """Installing a new basis keeps the original-space moment and permutes v."""
    problem = StochasticQuartic([(6, 5)], 8, torch.float64)
    params = problem.params()
    opt = SOAP(params, precondition_frequency=100, refresh_dtype=torch.float64)
    for t in range(8):
        opt.zero_grad()
        problem.loss(params, t).backward()
        opt.step()
    block = opt.state[params[0]]["blocks"][0]
    q_old = [q.clone() for q in block["bases"]]
    m_original = q_old[0] @ block["exp_avg"] @ q_old[1].T
    v_old = block["exp_avg_sq"].clone()
    results = [job.run() for job in opt.refresh_jobs(block, opt.param_groups[0])]
    opt.install_refresh(block, results)
    q_new = block["bases"]
    assert torch.allclose(q_new[0] @ block["exp_avg"] @ q_new[1].T, m_original, atol=1e-13)
    expected_v = v_old.index_select(0, results[0][1]).index_select(1, results[1][1])
    assert torch.equal(block["exp_avg_sq"], expected_v)


def test_kl_shampoo_install_keeps_eigenvalue_estimates():
    problem = StochasticQuartic([(6, 5)], 6, torch.float64)
    params = problem.params()
    opt = KLShampoo(params, precondition_frequency=100)
    for t in range(6):
        opt.zero_grad()
        problem.loss(params, t).backward()
        opt.step()
    block = opt.state[params[0]]["blocks"][0]
    s_before = [s.clone() for s in block["eigen_sqrt_inv"]]
    results = [job.run() for job in opt.refresh_jobs(block, opt.param_groups[0])]
    opt.install_refresh(block, results)
    assert all(torch.equal(a, b) for a, b in zip(block["eigen_sqrt_inv"], s_before))
    assert all(torch.equal(q, r[0]) for q, r in zip(block["bases"], results))


def _installs_per_step(pace: bool, cls=SOAP, blocks: int = 8, staleness: int = 4) -> list[int]:
    """Installs of the refresh of step 5 (precondition_frequency 5) at each of the steps that
    follow it, with every result finished before the next step begins."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(12, 12)) for _ in range(blocks)]
    opt = cls(params, precondition_frequency=5)
    config = RuntimeConfig(  # every block requested at step 5: interval refresh, not staggered
        staleness=staleness,
        workers=1,
        statistics_lane=False,
        pace_installs=pace,
        refresh="interval",
    )
    installs = []
    with Runtime(None, opt, config) as rt:
        for t in range(5 + staleness + 1):
            for p in params:
                p.grad = torch.randn_like(p)
            for e in rt.blocks().values():  # the results are ready before the step
                while e.pending is not None and not e.pending.done():
                    e.pending.futures[0].result(timeout_s=60)
                    e.pending.futures[1].result(timeout_s=60)
            opt.step()
            if t >= 5:
                installs.append(sum(e.installed_step == t for e in rt.blocks().values()))
        assert rt.stats()["max_staleness"] <= staleness
    return installs


def test_paced_installs_spread_a_refresh_over_the_budget():
    """Note [Paced installs]: 8 equal SOAP blocks requested at step 5 and all finished at step 6
    are installed two per step up to the deadline (step 9), not all eight at step 6."""
    assert _installs_per_step(pace=True) == [0, 2, 2, 2, 2]
    assert _installs_per_step(pace=False) == [0, 8, 0, 0, 0]
    # a free install (KL-Shampoo swaps its bases) is never held back
    assert _installs_per_step(pace=True, cls=KLShampoo) == [0, 8, 0, 0, 0]
    # the deadline wins over the allowance: with S = 1 everything is installed at step 6
    assert _installs_per_step(pace=True, staleness=1) == [0, 8]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(staleness=-1), "staleness"),
        (dict(staleness=2, fixed_delay=3), "fixed_delay"),
        (dict(workers=0), "workers"),
        (dict(barrier_timeout_s=0), "barrier_timeout_s"),
        (dict(split_updates="yes"), "split_updates"),
        (dict(refresh_lead=1), "refresh_lead"),
        (dict(wait_first_refresh="yes"), "wait_first_refresh"),
        (dict(lapack_threads=0), "lapack_threads"),
        (dict(max_consecutive_failures=0), "max_consecutive_failures"),
        (dict(affinity=()), "affinity"),
        (dict(hooks="yes"), "hooks"),
        (dict(pace_installs=1), "pace_installs"),
        (dict(worker_nice=-1), "worker_nice"),
        (dict(worker_nice=20), "worker_nice"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RuntimeConfig(**kwargs)


def test_bad_attachments():
    p = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="Asteria optimizer"):
        Runtime(None, torch.optim.AdamW([p]))
    opt = SOAP([p])
    with Runtime(None, opt, RuntimeConfig(workers=1)):
        with pytest.raises(ValueError, match="already orchestrated"):
            Runtime(None, opt, RuntimeConfig(workers=1))
    with pytest.raises(ValueError, match="config"):
        Runtime(None, opt, config={"staleness": 1})


# -- the statistics lane (Note [Statistics lane] in asteria/runtime/lane.py) -------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_statistics_lane_is_bitwise_the_training_thread(name, runtimes):
    """Factor statistics on the lane give the same bits as in the step, at any delay."""
    cls = OPTIMIZERS[name]
    problem = StochasticQuartic(SHAPES, 60, torch.float32)
    runs = {}
    for lane in (False, True):
        config = RuntimeConfig(staleness=3, fixed_delay=2, workers=1, statistics_lane=lane)
        runs[lane] = problem.run(_orchestrated(cls, config, runtimes))
        stats = runtimes[-1].stats()["statistics_lane"]
        assert (stats is not None) == lane
        if lane:
            assert stats["updates"] >= 59 * 3  # every step of every factored block
    for a, b in zip(runs[True], runs[False]):
        assert torch.equal(a, b)


def _model_run(lane: bool, zero_grad, steps: int = 14) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    opt = KLShampoo(model.parameters(), precondition_frequency=3)
    gen = torch.Generator().manual_seed(1)
    config = RuntimeConfig(staleness=2, fixed_delay=1, workers=1, statistics_lane=lane)
    with Runtime(model, opt, config):
        for _ in range(steps):
            zero_grad(opt)
            model(torch.randn(16, 8, generator=gen)).square().mean().backward()
            opt.step()
        state = opt.state_dict()  # waits for the lane
    assert all(torch.isfinite(t).all() for s in state["state"].values() for t in state_tensors(s))
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "zero_grad",
    [
        lambda opt: opt.zero_grad(),  # gradients replaced: the lane keeps reading the old ones
        lambda opt: opt.zero_grad(set_to_none=False),  # zeroed in place: zero_grad waits first
    ],
    ids=["set_to_none", "in_place"],
)
def test_statistics_lane_never_reads_a_gradient_being_rewritten(zero_grad):
    assert all(
        torch.equal(a, b) for a, b in zip(_model_run(True, zero_grad), _model_run(False, zero_grad))
    )


def test_statistics_lane_guards_gradients_accumulated_in_place(monkeypatch):
    """Without zero_grad the next backward adds into .grad in place: the gradient hook waits
    for the lane before that, so the statistics still read the gradient of their own step
    (the lane is slowed down so that, unguarded, the backward would get there first)."""
    import time

    def slow(key, update, *args):
        time.sleep(0.01)
        update(*args)

    def accumulate(opt):  # two micro-batches per step, .grad zeroed in place every other step
        accumulate.calls += 1
        if accumulate.calls % 2:
            opt.zero_grad(set_to_none=False)

    with wrapped_statistics(slow):
        accumulate.calls = 0
        with_lane = _model_run(True, accumulate)
        accumulate.calls = 0
        without = _model_run(False, accumulate)
    assert all(torch.equal(a, b) for a, b in zip(with_lane, without))


def test_backward_runs_beside_the_lane_unless_it_accumulates_into_grad(monkeypatch):
    """The gradient hook waits for the lane only where the backward writes into an existing
    ``.grad``: after ``zero_grad()`` (set to None) it runs while the lane still reads the last
    gradient; without it, it waits. The lane's statistics are held on an event to show both:
    where the backward waits, every gradient is accumulated only after the event is set (from
    another thread, 0.3 s on), whatever the machine's speed."""
    import threading

    release, entered = threading.Event(), threading.Event()
    order: list[str] = []

    def gated(key, update, *args):
        entered.set()
        assert release.wait(60)
        update(*args)

    def open_gate():
        order.append("released")
        release.set()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    opt = KLShampoo(model.parameters(), precondition_frequency=3)
    x = torch.randn(16, 8)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: order.append("accumulated"))

    def backward():
        model(x).square().mean().backward()

    config = RuntimeConfig(staleness=2, workers=1, statistics_lane=True)
    with Runtime(model, opt, config) as rt, contextlib.ExitStack() as later:
        backward()
        opt.step()  # the first step: factors and bases only
        later.enter_context(wrapped_statistics(gated))
        for zero_grad in (True, False):
            release.clear()
            entered.clear()
            opt.zero_grad()
            backward()
            opt.step()  # queues this step's statistics on the lane, which holds them
            assert entered.wait(60)
            order.clear()
            if zero_grad:
                opt.zero_grad()
                backward()  # new .grad tensors: does not wait
                assert rt.stats()["statistics_lane"]["pending"]
                assert order == ["accumulated"] * 4  # all of them with the gate still closed
                open_gate()
            else:
                threading.Timer(0.3, open_gate).start()
                backward()  # adds into the .grad the lane reads: waits for the lane
                assert order[0] == "released", order  # no gradient written before the gate
                assert order.count("accumulated") == 4
                assert not rt.stats()["statistics_lane"]["pending"]
            opt.step()
            rt.sync()  # this step's statistics pass the gate before it closes again


def test_statistics_lane_error_reaches_the_step_with_the_block_name(runtimes):
    problem = StochasticQuartic([(6, 6)], 12, torch.float32)

    def broken(key, update, *args):
        raise FloatingPointError("injected statistics failure")

    with (
        wrapped_statistics(broken),
        pytest.raises(RuntimeError, match=r"statistics update of block 'param0\[0\]'.*injected"),
    ):
        problem.run(_orchestrated(SOAP, RuntimeConfig(staleness=2, workers=1), runtimes))


def test_refresh_step_does_not_wait_for_the_statistics_lane(runtimes):
    """The snapshot of a due refresh is queued behind the step's statistics on the lane: the
    step returns while they still run, and the result is still bitwise native (staleness 0)."""
    import threading

    release, waited_out = threading.Event(), []

    def held(key, update, *args):
        if held.armed:
            waited_out.append(not release.wait(timeout=30))
            held.armed = False
        update(*args)

    held.armed = False
    problem = StochasticQuartic([(6, 6), (5, 6)], 12, torch.float32)
    native = problem.run(lambda ps: SOAP(ps, precondition_frequency=5))
    params = problem.params()
    opt = SOAP(params, precondition_frequency=5)
    rt = Runtime(None, opt, RuntimeConfig(staleness=0, workers=1, statistics_lane=True))
    runtimes.append(rt)
    with wrapped_statistics(held):
        for t in range(12):
            opt.zero_grad()
            problem.loss(params, t).backward()
            if t == 9:  # the backward ran beside the last step's statistics: let them finish
                rt.sync()
            if t != 9:
                opt.step()
                continue
            # step 10 refreshes: its statistics wait for the release below. Armed here and disarmed
            # by the lane itself, whenever it gets to them: the lane thread may not have started
            # them even at the next step (a loaded machine), and they must still be the held ones.
            held.armed = True
            rt.config = RuntimeConfig(staleness=5, workers=1)  # let step 10 not install at once
            opt.step()
            release.set()  # the step returned with its statistics still held on the lane
            rt.config = RuntimeConfig(staleness=0, workers=1)
    assert waited_out == [False]
    rt.close()
    for a, b in zip(params, native):
        assert torch.equal(a, b)


def test_statistics_lane_keeps_the_first_error_of_a_block():
    from asteria.runtime.lane import StatisticsLane

    lane = StatisticsLane()

    def fail():
        raise FloatingPointError("first")

    lane.submit("b", fail)
    lane.submit("b", lambda: None)  # replaces the failed future before anyone waits
    work = lane.call("b", torch.ones, 2)
    with pytest.raises(RuntimeError, match="block 'b'.*first"):
        lane.wait("b")
    with pytest.raises(RuntimeError, match="block 'b'.*first"):
        work.synchronize()
    assert work.value is None  # nothing of a failed block runs any more
    work = lane.call("c", torch.ones, 2)
    lane.wait("c")
    assert work.query() and torch.equal(work.value, torch.ones(2))
    lane.abandon()


def test_close_without_installing_drops_what_is_in_flight():
    problem = StochasticQuartic([(16, 16)], 12, torch.float32)
    made: list[Runtime] = []
    problem.run(_orchestrated(SOAP, RuntimeConfig(staleness=5, workers=1), made))
    rt = made[0]
    hogs = _hog(rt)  # the pool is busy: the last refresh cannot be ready
    opt = rt.optimizer
    for _, p, _, _ in opt.blocks():
        p.grad = torch.randn_like(p)
    for _ in range(5):  # up to a refresh step, so that one is in flight
        opt.step()
    assert rt.stats()["jobs"]["in_flight"] > 0
    rt.close(install_pending=False)
    stats = rt.stats()
    assert stats["jobs"]["in_flight"] == 0 and stats["jobs"]["cancelled"] > 0
    assert type(opt.refresher).__name__ == "NativeRefresher"
    assert any(h.cancelled() for h in hogs)


def test_soap_installs_run_on_the_statistics_lane(runtimes, monkeypatch):
    """Note [Statistics lane]: SOAP's installs (the rotation of m) run on the lane, bitwise as
    in the training thread; KL-Shampoo's pointer swaps stay on the training thread."""
    import threading

    threads: list[str] = []  # per block installed, the thread that installed it
    inside = threading.local()  # (an install_refresh inside install_refresh_many: counted)
    for cls in (SOAP, KLShampoo):
        real, real_many = cls.install_refresh, cls.install_refresh_many

        def spy(self, block, results, real=real):
            if not getattr(inside, "many", False):
                threads.append(threading.current_thread().name)
            real(self, block, results)

        def spy_many(self, blocks, results, real_many=real_many):
            threads.extend([threading.current_thread().name] * len(blocks))
            inside.many = True
            try:
                real_many(self, blocks, results)
            finally:
                inside.many = False

        monkeypatch.setattr(cls, "install_refresh", spy)
        monkeypatch.setattr(cls, "install_refresh_many", spy_many)
    problem = StochasticQuartic(SHAPES, 40, torch.float32)
    for cls in (SOAP, KLShampoo):
        threads.clear()
        runs = {}
        for lane in (False, True):
            config = RuntimeConfig(staleness=2, fixed_delay=1, workers=1, statistics_lane=lane)
            runs[lane] = problem.run(_orchestrated(cls, config, runtimes))
        for a, b in zip(runs[True], runs[False]):
            assert torch.equal(a, b)
        on_lane = [name.startswith("asteria-statistics") for name in threads]
        half = len(threads) // 2  # the run without the lane, then the one with it
        assert half >= 3 * 7 and not any(on_lane[:half])
        assert all(on_lane[half:]) if cls is SOAP else not any(on_lane[half:])


def _split_runs(cls, problem, native, runtimes, calls: list) -> dict[bool, list]:
    """Note [Split updates]: ``cls`` with the lane, with and without split updates. At S = 0
    each run is bitwise ``native``; under ``fixed_delay=1`` (installs queued on the lane before
    its half, and read by both halves) split equals unsplit. Returns, per ``split``, the
    ``(lane?, size)`` of the ``calls`` the spy recorded in the run at S = 0."""
    seen, delayed = {}, {}
    for split in (False, True):
        calls.clear()
        config = RuntimeConfig(staleness=0, workers=1, statistics_lane=True, split_updates=split)
        for a, b in zip(problem.run(_orchestrated(cls, config, runtimes)), native):
            assert torch.equal(a, b)
        seen[split] = [(name.startswith("asteria-statistics"), n) for name, n in calls]
        config = RuntimeConfig(
            staleness=2, fixed_delay=1, workers=1, statistics_lane=True, split_updates=split
        )
        delayed[split] = problem.run(_orchestrated(cls, config, runtimes))
    for a, b in zip(delayed[True], delayed[False]):
        assert torch.equal(a, b)
    return seen


def test_soap_update_is_split_with_the_statistics_lane(runtimes, monkeypatch):
    """Note [Split updates]: with the lane, SOAP's 2-D and basis-free blocks are updated in two
    halves of about equal flops, one on the lane, beside the training thread; the parameters
    are bitwise those of native mode. An error in the lane's half reaches the step as is."""
    import threading

    from asteria.optim.kernels import soap as soap_module

    calls: list[tuple[str, int]] = []
    real = soap_module.whole

    def spy(groups, *args):
        calls.append((threading.current_thread().name, sum(g.numel * len(g) for g in groups)))
        real(groups, *args)

    monkeypatch.setattr(soap_module, "whole", spy)
    problem = StochasticQuartic([(12, 10), (6, 6), (5, 6), (4, 3, 2), (7,)], 40, torch.float32)
    native = problem.run(lambda ps: SOAP(ps, precondition_frequency=5))
    assert len(calls) == 39  # the first step initializes the bases and does not update
    seen = _split_runs(SOAP, problem, native, runtimes, calls)
    for split, runs in seen.items():
        lane = [n for on_lane, n in runs if on_lane]
        mine = [n for on_lane, n in runs if not on_lane]
        if split:
            # the (12, 10) block alone on one side, the other four (36 + 30 + 24 + 7) on the
            # other (every block goes through the batched update: Note [Batched steps])
            assert len(lane) == len(mine) == 39 and sorted({*lane, *mine}) == [97, 120]
        else:
            assert not lane and len(mine) == 39

    def broken(groups, *args):
        if threading.current_thread().name.startswith("asteria-statistics"):
            raise ValueError("broken on the lane")
        real(groups, *args)

    monkeypatch.setattr(soap_module, "whole", broken)
    with pytest.raises(ValueError, match="broken on the lane"):
        problem.run(_orchestrated(SOAP, RuntimeConfig(staleness=2, workers=1), runtimes))


def test_kl_shampoo_update_is_split_with_the_statistics_lane(runtimes, monkeypatch):
    """Note [Split updates] for KL-Shampoo: its blocks' updates in two halves, one on the lane;
    bitwise native at S = 0, and split = unsplit with refreshes in flight."""
    import threading

    from asteria.optim.kernels import kl_shampoo as kl_module

    calls: list[tuple[str, int]] = []
    real = kl_module.whole

    def spy(groups, *args):
        calls.append((threading.current_thread().name, sum(len(g) for g in groups)))
        real(groups, *args)

    monkeypatch.setattr(kl_module, "whole", spy)
    problem = StochasticQuartic(SHAPES, 40, torch.float32)
    native = problem.run(lambda ps: KLShampoo(ps, precondition_frequency=5))
    assert [n for _, n in calls] == [3] * 39  # one call per step, the three matrix blocks
    seen = _split_runs(KLShampoo, problem, native, runtimes, calls)
    for split, runs in seen.items():
        lane = sorted(n for on_lane, n in runs if on_lane)
        mine = sorted(n for on_lane, n in runs if not on_lane)
        # the (6, 6) block (the most flops) alone in the training thread, (5, 6) and (4, 3, 2)
        # on the lane
        assert (lane, mine) == (([2] * 39, [1] * 39) if split else ([], [3] * 39))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc (Linux)")
def test_pool_workers_run_at_a_lower_priority():
    """Note [Worker priority]: the workers add ``worker_nice`` to their nice value; the
    training thread keeps its own."""

    def nice_of(tid: str) -> int:
        stat = open(f"/proc/self/task/{tid}/stat").read()
        return int(stat.rsplit(")", 1)[1].split()[16])  # field 19 of proc(5)

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    p = torch.nn.Parameter(torch.zeros(3, 3))
    cores, threads = os.cpu_count() or 1, torch.get_num_threads()
    # (worker_nice, torch threads, expected): by default +10 only where a core is left free
    cases = [(0, threads, 0), (7, threads, 7), (None, cores, 0)]
    if cores > 1:
        cases.append((None, 1, 10))
    try:
        for nice, training_threads, expected in cases:
            torch.set_num_threads(training_threads)
            before = set(os.listdir("/proc/self/task"))
            with Runtime(None, SOAP([p]), RuntimeConfig(workers=2, worker_nice=nice)):
                workers = set(os.listdir("/proc/self/task")) - before
                assert len(workers) >= 2
                assert sorted(nice_of(t) for t in workers)[:2] == [min(19, mine + expected)] * 2
            assert os.getpriority(os.PRIO_PROCESS, 0) == mine
    finally:
        torch.set_num_threads(threads)
