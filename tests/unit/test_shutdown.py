"""Shutdown with work in flight (issue 7, item 2): each case runs in a subprocess with a timeout.

Every case keeps the refresh pool busy (long eigh jobs ahead of the refreshes, refreshes queued
behind them) and then ends the runtime a different way: ``close()``, garbage collection without
``close()``, interpreter exit, KeyboardInterrupt in the middle of a step (from a hook, from the
runtime's step boundary, and a real SIGINT while the step waits at the barrier). Each must finish
without waiting for the queued work, with the expected exit code, no crash, and no thread left
behind: the child counts its
OS threads (``/proc/self/task``; the pool's workers are C++ threads that ``threading`` does not
list) before the runtime starts and after it ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="counts threads through /proc/self/task"
)

PRELUDE = textwrap.dedent(
    """
    import gc, json, os, signal, sys, threading, time, weakref
    # A parent started in the background by a non-interactive shell (as CI may be) passes
    # SIGINT down ignored, and Python then installs no KeyboardInterrupt handler: restore it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch
    torch.set_num_threads(1)
    from asteria.optim import SOAP
    from asteria.runtime import Runtime, RuntimeConfig

    def tasks():
        return len(os.listdir("/proc/self/task"))

    def settle(n, timeout=30.0):
        # running jobs finish their current LAPACK call, then their threads exit
        t0 = time.monotonic()
        while tasks() > n and time.monotonic() - t0 < timeout:
            time.sleep(0.02)
        return tasks()

    BIG = torch.randn(500, 500, dtype=torch.float64)
    BIG = BIG @ BIG.T
    HUGE = torch.randn(1000, 1000, dtype=torch.float64)
    HUGE = HUGE @ HUGE.T

    def hog(rt, n, factor=BIG):
        # jobs of deadline 0: they run before any refresh (each ~0.1 s with BIG, ~1 s with HUGE);
        # they read the one factor (copy=False), so that hundreds fit in memory. The cases run at
        # staleness 8 (requests every 2 steps): no step before the ending waits at the barrier for
        # a refresh queued behind them.
        return [rt.pool.submit_eigh(f"hog{i}", 0, 0, factor, torch.float64, copy=False)
                for i in range(n)]

    def model_and_opt(freq=2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)
        )
        return model, SOAP(model.parameters(), precondition_frequency=freq)

    def train(model, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(16, 32)).square().mean().backward()
            opt.step()

    def finite(model):
        return all(bool(torch.isfinite(p).all()) for p in model.parameters())

    def report(**kw):
        print(json.dumps(kw), flush=True)

    # warm up torch (its lazily started threads are part of the baseline)
    _m, _o = model_and_opt()
    train(_m, _o, 3)
    BASE = tasks()
    """
)


def _run(body: str, timeout: float = 60.0) -> tuple[subprocess.CompletedProcess, dict]:
    """Run PRELUDE + body in a fresh interpreter; the JSON it printed last. ``timeout`` only
    detects a hang: the cases that must not wait for their queued work queue more of it (minutes
    on any machine) than the timeout lets them run."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    data = json.loads(lines[-1]) if lines else {}
    for bad in ("Fatal Python error", "terminate called", "Segmentation fault", "core dumped"):
        assert bad not in proc.stderr, proc.stderr
    return proc, data


def test_close_while_jobs_run():
    proc, out = _run(
        """
        results = {}
        for install in (True, False):
            model, opt = model_and_opt()
            rt = Runtime(model, opt, RuntimeConfig(staleness=8, workers=2))
            train(model, opt, 3)
            # install_pending=False must not wait for the work queued: minutes of it
            hogs = hog(rt, 12) if install else hog(rt, 600, HUGE)
            train(model, opt, 4)  # refreshes requested, queued behind the hogs
            in_flight, busy = rt.stats()["jobs"]["in_flight"], tasks()
            rt.close(install_pending=install)
            pending = sum(e.pending is not None for e in rt.blocks().values())
            train(model, opt, 2)  # native mode again, still works
            results[str(install)] = dict(
                in_flight=in_flight, busy=busy, pending_after=pending,
                cancelled=sum(h.cancelled() for h in hogs), after=settle(BASE),
                native=type(opt.refresher).__name__, finite=finite(model),
            )
        report(base=BASE, results=results)
        """
    )
    assert proc.returncode == 0, proc.stderr
    for install, r in out["results"].items():
        assert r["in_flight"] > 0 and r["busy"] >= out["base"] + 2
        assert r["after"] == out["base"], f"threads left behind (install_pending={install})"
        assert r["native"] == "NativeRefresher" and r["finite"]
    # install_pending=True waits for the refreshes (behind ~12 x 0.1 s of hogs on 2 workers)
    assert out["results"]["True"]["pending_after"] == 0, "close() installs what was in flight"
    # install_pending=False does not wait (the child would run out of time): queued jobs are
    # cancelled
    assert out["results"]["False"]["cancelled"] > 0


def test_garbage_collection_without_close():
    """Drop the optimizer and runtime without close(), once with the model and once while the
    model lives on (its hooks must not keep the runtime alive)."""
    proc, out = _run(
        """
        def start():
            model, opt = model_and_opt()
            rt = Runtime(model, opt, RuntimeConfig(staleness=8, workers=2))
            train(model, opt, 3)
            hog(rt, 200)  # the refreshes requested next cannot be done within 4 steps
            train(model, opt, 4)
            assert rt.stats()["jobs"]["in_flight"] > 0
            return model, weakref.ref(rt), weakref.ref(opt), tasks()

        results = {}
        for keep_model in (False, True):
            model, rt_ref, opt_ref, busy = start()
            hooks = lambda: sum(
                len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()
            )
            hooks_before = hooks()
            if not keep_model:
                del model
            gc.collect()
            collected = rt_ref() is None and opt_ref() is None
            after = settle(BASE)
            results[str(keep_model)] = dict(
                busy=busy, after=after, collected=collected, hooks_before=hooks_before,
                hooks_after=hooks() if keep_model else 0,
            )
            if keep_model:
                train(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)  # hooks gone
        report(base=BASE, results=results)
        """
    )
    assert proc.returncode == 0, proc.stderr
    for keep_model, r in out["results"].items():
        assert r["busy"] >= out["base"] + 2
        assert r["collected"], f"runtime/optimizer not collectable (keep_model={keep_model})"
        assert r["after"] == out["base"], f"pool threads left (keep_model={keep_model})"
    kept = out["results"]["True"]
    assert kept["hooks_before"] == 2 and kept["hooks_after"] == 0


@pytest.mark.parametrize("how", ["normal", "exception"])
def test_interpreter_exit_with_jobs_in_flight(how):
    proc, out = _run(
        f"""
        model, opt = model_and_opt()
        rt = Runtime(model, opt, RuntimeConfig(staleness=8, workers=2))
        train(model, opt, 3)
        hog(rt, 600, HUGE)  # minutes of queued work: exit must not wait for it
        train(model, opt, 4)
        report(in_flight=rt.stats()["jobs"]["in_flight"])
        if "{how}" == "exception":
            raise RuntimeError("boom with jobs in flight")
        """
    )
    assert out["in_flight"] > 0
    if how == "normal":
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 1 and "boom with jobs in flight" in proc.stderr


def test_keyboard_interrupt_from_a_hook_uncaught():
    """Ctrl-C in the forward pass (a user's hook) with jobs in flight, not caught: the process
    dies of SIGINT, as any Python program, promptly and without a crash."""
    proc, _ = _run(
        """
        model, opt = model_and_opt()
        rt = Runtime(model, opt, RuntimeConfig(staleness=8, workers=2))
        train(model, opt, 3)
        hog(rt, 600, HUGE)  # minutes of queued work: the exit must not wait for it
        train(model, opt, 4)
        calls = []
        def interrupt(module, args):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
        model[2].register_forward_pre_hook(interrupt)
        report()
        train(model, opt, 5)
        """
    )
    assert proc.returncode in (-signal.SIGINT, 128 + signal.SIGINT), proc.stderr
    assert "KeyboardInterrupt" in proc.stderr


def test_keyboard_interrupt_inside_a_step_is_recoverable():
    """(1) KeyboardInterrupt raised inside a step (after its parameters were updated);
    (2) a real SIGINT while the step is blocked at the staleness barrier behind minutes of work:
    raised while the work is still queued (not when the wait ends: the child would run out of
    time first). Either way the user catches it, leaves the runtime's ``with`` block (queued work
    is cancelled) and trains on natively."""
    proc, out = _run(
        """
        model, opt = model_and_opt()
        plans = []
        try:
            with Runtime(model, opt, RuntimeConfig(staleness=2, workers=2)) as rt:
                real = rt.plan
                def plan(*args):
                    plans.append(1)
                    if len(plans) == 3:  # step 3, after its update
                        raise KeyboardInterrupt
                    return real(*args)
                rt.plan = plan
                train(model, opt, 3)
                hog(rt, 10)
                train(model, opt, 10)
            between_blocks = False
        except KeyboardInterrupt:
            between_blocks = True
        after_first = settle(BASE)
        train(model, opt, 4)
        native = type(opt.refresher).__name__

        model, opt = model_and_opt(freq=1)
        sent = []
        try:
            with Runtime(model, opt, RuntimeConfig(staleness=0, workers=1)) as rt:
                train(model, opt, 1)
                hogs = hog(rt, 600, HUGE)
                def fire():
                    sent.append(time.monotonic())
                    os.kill(os.getpid(), signal.SIGINT)
                threading.Timer(0.3, fire).start()
                train(model, opt, 3)  # the first step waits at the barrier behind the hogs
            caught = None
        except KeyboardInterrupt:
            caught = time.monotonic()
        after_second = settle(BASE)
        train(model, opt, 2)
        report(base=BASE, between_blocks=between_blocks, after_first=after_first,
               native=native, delay=caught - sent[0] if caught else None,
               after_second=after_second, cancelled=sum(h.cancelled() for h in hogs),
               finite=finite(model))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert out["between_blocks"] and out["native"] == "NativeRefresher"
    assert out["after_first"] == out["base"]
    # on failure, the child's stderr shows where the interrupt went (one CI run lost it once)
    assert out["delay"] is not None, (out, proc.stderr[-3000:])
    assert out["cancelled"] > 0 and out["finite"]
    assert out["after_second"] == out["base"]
