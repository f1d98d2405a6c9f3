"""``Runtime``: takes an optimizer's refreshes off the training critical path.

Owns: the facade over the runtime's parts (docs/architecture.md draws a step and a refresh
through them): made when it attaches to an optimizer as its ``Refresher`` (``parts.build``), it
holds the lock every part runs under, routes each call of the step to the part that owns it
(``plan`` to plan.py, ``pieces`` to the bases strategy, ``accumulate`` and ``run`` to the lane),
and takes everything down at ``close()``.

Note [One install batch per step]: a signal that looked for finished refreshes at every module
cost a scan per module (11-14 ms of a 73 ms H200 step, docs/gpu.md). So the first signal after a
step installs every finished refresh the pacing allows in one batch and disarms the hooks until
a step ends with a refresh in flight (Note [Disarmed signals] in hooks.py). What finished before
the model's first module is used in this step; what finishes later, the plan installs.

Must not: change any algorithm's math (``refresh_jobs``/``install_refresh_many`` are the only
way in), register hooks itself (hooks.py does), or hold logic that a part owns.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from asteria.optim.base import KroneckerOptimizer
from asteria.optim.groups import BlockGroup
from asteria.optim.refresher import BlockKey, Piece
from asteria.optim.state_io import blocks_of
from asteria.runtime import parts, report, state
from asteria.runtime.config import RuntimeConfig
from asteria.runtime.lane import halves, run_statistics
from asteria.runtime.registry import BlockView
from asteria.runtime.spill import SpillTier

__all__ = ["Runtime"]


class Runtime:
    """Orchestrate ``optimizer``'s refreshes for ``model`` (see module docstring).

    Use as a context manager or call :meth:`close`; both detach everything (hooks, pool threads)
    and leave the optimizer in native mode with all finished work installed.
    """

    def __init__(
        self,
        model: torch.nn.Module | None,
        optimizer: KroneckerOptimizer,
        config: RuntimeConfig | None = None,
        *,
        distributed: bool | None = None,
        ranks_per_node: int | None = None,
    ) -> None:
        if not isinstance(optimizer, KroneckerOptimizer):
            raise ValueError(
                "optimizer must be an Asteria optimizer (asteria.optim.SOAP, KLShampoo or "
                f"Shampoo), got {type(optimizer).__name__}"
            )
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        if model is not None:  # its hooks would signal nothing (issue 48's probe)
            mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
            if mine and not any(id(p) in mine for p in model.parameters()):
                raise ValueError(
                    f"model ({type(model).__name__}) holds none of the optimizer's "
                    f"{len(mine)} parameters: pass the model the optimizer trains, or None"
                )
        self.config = c = config if config is not None else RuntimeConfig()
        if not isinstance(c, RuntimeConfig):
            raise ValueError(f"config must be a RuntimeConfig, got {type(config).__name__}")
        if optimizer.orchestrated:  # before any thread starts
            raise ValueError(
                f"{type(optimizer).__name__} is already orchestrated by "
                f"{optimizer.refresher!r}; close() that runtime before attaching another"
            )
        self.optimizer = optimizer
        self._closed = False
        self._lock = threading.RLock()  # (before the parts: the window holds it too)
        self._step_t0 = 0.0
        self._signals_open = True  # Note [One install batch per step]
        self.per_step: dict[str, list[float]] = {"step_ms": [], "barrier_wait_ms": []}
        # every part, made once (attach.py; a refused attach leaves no thread, hook or file)
        self._parts = p = parts.build(self, model, optimizer, c, distributed, ranks_per_node)
        self.block_name, self.registry, self.schedule = p.block_name, p.registry, p.schedule
        self.arch, self.placement = p.choices.arch, p.choices.placement
        self._lane, self._bases, self._refreshes = p.lane, p.bases, p.refreshes
        self._plan, self._executors = p.plan, p.executors
        #: whether the update reads what the statistics write (KL-Shampoo's eigenvalues): its
        #: pieces wait for the lane's statistics of their blocks first
        self._reads_statistics = "update_statistics" in optimizer.phases
        self._split = p.lane is not None and c.split_updates  # Note [Split updates] in lane.py
        # a test's live settings, read where a statistics update is handed in: a dict look-up,
        # no call per block (Note [Test overrides at build] in attach.py)
        self._test_settings = None if p.testing is None else p.testing.settings()
        parts.connect(p, self, model, optimizer, c)  # the optimizer's refresher from here on

    # -- public read-only parts (tests and benchmarks reach the runtime through these) --------

    @property
    def pool(self) -> Any:
        """The refresh pool (``asteria._C.WorkerPool``); work submitted to it delays refreshes."""
        return self._parts.pool

    @property
    def spill(self) -> SpillTier | None:
        """The NVMe spill tier (spill.py), or None when nothing spills."""
        return self._parts.spill

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (a closed runtime orchestrates nothing again)."""
        return self._closed

    def blocks(self) -> dict[BlockKey, BlockView]:
        """Every block the runtime has seen, by key: a read-only ``BlockView`` (registry.py) of
        its version, request and install steps, counts, and its refresh in flight
        (docs/runtime.md, ``Runtime.blocks()``)."""
        with self._lock:
            return self.registry.views()

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(install_pending=exc[0] is None)

    def close(self, install_pending: bool = True) -> None:
        """Detach: remove hooks, install (or drop) refreshes in flight, stop the pool."""
        if self._closed:
            return
        p = self._parts
        with self._lock:
            self._closed = True
            if p.signals is not None:
                p.signals.remove()
            try:
                if self._lane is not None:
                    self._lane.wait_all(reported_too=False)
                if self._repairable() and install_pending:
                    self._plan.finish_interrupted()
                    self._refreshes.timed_out = False  # close() waits as a barrier does
                    self._refreshes.install_in_flight()
            finally:
                self.optimizer.detach_refresher()
                if p.grad_guards is not None:
                    p.grad_guards.remove()
                if self._lane is not None:
                    self._lane.close()
                self._refreshes.drop_all()  # what was not installed is dropped
                p.pool.shutdown(wait=False)
                self._executors.shutdown()
                self._refreshes.snapshots.clear()
                if p.spill is not None:
                    p.spill.close()  # deletes the spill file
                self._bases.close()
                p.finalizer.detach()

    def _repairable(self) -> bool:
        """Whether ``close()`` may finish an interrupted step and install what is in flight:
        not where that would take collectives of a rank whose coherence broke or whose step
        stopped (Note [A fault on one rank] in distributed.py: no collective)."""
        coherence = self._parts.coherence
        if coherence is None or not coherence.replicates:
            return True
        if self._plan.in_step:  # its step stopped: the other ranks are told why
            coherence.fail(
                f"rank {coherence.rank}'s step stopped before its end and the runtime was "
                "closed (an exception or a KeyboardInterrupt inside optimizer.step())"
            )
        return coherence.broken is None

    # -- the Refresher protocol (called by the optimizer's step) ------------------------------

    def begin(self) -> None:
        if self._closed:  # (the optimizer detached it: only a caller holding it gets here)
            raise RuntimeError(f"{self!r} is closed")
        if self._lane is not None:
            self._lane.check()  # a failed block's error, before this step changes anything
        plan = self._plan
        interrupted = plan.in_step  # the last step raised before its end
        if interrupted or plan.waiting or self._parts.coherence is not None:
            with self._lock:
                plan.finish_interrupted()  # Note [Interrupted steps] in plan.py
        plan.begin()
        if interrupted:  # (its end did not open the signals)
            self._open_signals()
        self._step_t0 = time.perf_counter()
        self._refreshes.wait_s = 0.0
        self._refreshes.timed_out = False
        if self._refreshes.snapshots.issued:
            self._refreshes.snapshots.step_begin()  # (the fences of the last step's snapshots)
        waits = self.per_step["barrier_wait_ms"]
        self._executors.step_begin(waits[-1] / 1e3 if waits else 0.0)  # (step time, harvest)
        if self.schedule.continuous:  # Note [Continuous refresh] in schedule.py
            with self._lock:
                self.schedule.pick(self._plan.candidates(), self._executors.has_room)

    def accumulate(self, keys: list[BlockKey], fn: Any, *args: Any) -> None:
        """The statistics of blocks ``keys``: now, or on the statistics lane (Note [Statistics
        lane] in lane.py)."""
        test = self._test_settings  # a test's wrapper (Note [Test overrides at build])
        wrap = None if test is None else test["statistics"]
        if self._lane is not None:
            self._lane.submit_many(keys, fn, args, wrap)
        elif wrap is None:
            fn(*args)
        else:
            run_statistics(keys, fn, args, wrap)

    def plan(self, groups: list[BlockGroup], hp: dict[str, Any]) -> None:
        """Note [One plan per step] (plan.py): every refresh decision of the groups' blocks at
        their step, carried out; the age of the basis each block's update reads."""
        with self._lock:
            self._plan.step(groups, hp)

    def pieces(self, groups: list[BlockGroup], passes: int = 1) -> list[Piece]:
        """The pieces the bases strategy hands out the groups' bases in (the window: Note
        [Pieces of the window] in window_bases.py); where the update reads what the statistics
        write, after the lane's statistics of the groups' blocks."""
        if self._reads_statistics and self._lane is not None:
            self._lane.wait_many([k for g in groups for k in g.keys])
        return self._bases.pieces(groups, passes)

    def run(self, fn: Any, groups: list[BlockGroup], bases: list, *args: Any) -> None:
        """``fn(groups, bases, *args)``; with the lane, on halves of the parameters of about
        equal flops (a parameter's blocks on one thread: SOAP's ``normalize_grads`` divides them
        by one norm), one on the lane (Note [Split updates] in lane.py)."""
        if not self._split or sum([len(g.keys) for g in groups]) < 2:
            fn(groups, bases, *args)
            return
        items = [(g, i) for g in groups for i in range(len(g.keys))]
        by_param: dict[int, list[int]] = {}
        for at, (g, i) in enumerate(items):
            by_param.setdefault(g.keys[i][0], []).append(at)
        params = list(by_param.values())
        if len(params) < 2:
            fn(groups, bases, *args)
            return
        costs = [
            sum([items[at][0].numel * (10 + 4 * _dims(items[at])) for at in p]) for p in params
        ]
        sides = halves(params, costs)
        mine, theirs = (sorted([at for i in side for at in params[i]]) for side in sides)
        wait = self._lane.beside(fn, *_part(groups, bases, items, theirs), *args)
        try:
            fn(*_part(groups, bases, items, mine), *args)
        finally:
            wait()  # also when this half raised: the other half must not outlive the step

    def end(self) -> None:
        refreshes, pacer = self._refreshes, self._parts.pacer
        with self._lock:
            if self._plan.waiting:  # (left by an interrupted plan: Note [Interrupted steps])
                self._plan.install_waited()
            if refreshes.deferred or refreshes.spill is not None:
                refreshes.step_end()
            self._bases.step_end()
        if pacer.enabled:
            pacer.step_end()
        self.per_step["step_ms"].append((time.perf_counter() - self._step_t0) * 1e3)
        self.per_step["barrier_wait_ms"].append(self._refreshes.wait_s * 1e3)
        if self.registry.in_flight:  # the next step's first signal installs what is ready
            self._signals_open = True  # (``_open_signals``, inline)
            if self._parts.signals is not None and not self._parts.signals.armed:
                self._parts.signals.arm()
        elif self._signals_open:  # (opened by this step's beginning: nothing to install)
            self._signals_open = False
            if self._parts.signals is not None and self._parts.signals.armed:
                self._parts.signals.disarm()
        self._plan.end()  # Note [All-or-nothing steps] in plan.py

    def sync(self) -> None:
        """Wait for the statistics lane (everything queued there has run) and for the copies
        of bases to host memory (the host is about to read the state: ``state_dict``)."""
        if self._lane is not None:
            self._lane.wait_all()
        self._bases.host_sync()

    # -- hooks: install what is ready ------------------------------------------------------------

    def _on_signal(self) -> None:
        """Note [One install batch per step]: the first signal after a step's end installs the
        step's batch; later ones return at the flag (only blocks that install on signals are
        hooked)."""
        if not self._signals_open:
            return
        self._signals_open = False
        signals = self._parts.signals
        if signals is not None:  # the step's later signals: none (Note [Disarmed signals])
            signals.disarm()
        if self._closed:
            return
        with self._lock:
            plan = self._plan
            if plan.in_step or plan.waiting or self._parts.coherence is not None:
                plan.finish_interrupted()  # between steps: the last one raised
            if self.registry.in_flight:
                self._refreshes.install_ready(self._parts.signalled)

    def _open_signals(self) -> None:
        """The next module signal installs the step's batch (Note [One install batch per step]):
        the flag set, the hooks armed (Note [Disarmed signals] in hooks.py)."""
        self._signals_open = True
        signals = self._parts.signals
        if signals is not None and not signals.armed:
            signals.arm()

    # -- checkpoints and reports -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The runtime's part of a checkpoint: every refresh still in flight, finished first
        and saved with its results (Note [Checkpoints with work in flight] in state.py)."""
        self.sync()
        with self._lock:
            self._plan.finish_interrupted()
            self._refreshes.timed_out = False  # the save waits as a barrier does
            return state.save(self._refreshes)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore the refreshes in flight of :meth:`state_dict`, after the optimizer's own
        ``load_state_dict`` (Note [Checkpoints with work in flight] in state.py)."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed: load into the runtime attached now")
        self.sync()
        with self._lock:
            self._plan.finish_interrupted()
            state.load(self._refreshes, saved, self.schedule.budget)
        if self.registry.in_flight:  # (the next signal installs what is ready)
            self._open_signals()

    def check_state_dict(self, saved: Any, groups: list[dict], states: dict) -> None:
        """Raise ``ValueError`` where the optimizer's load of ``groups`` and ``states`` would
        not keep the blocks the runtime was made for, or :meth:`load_state_dict` would refuse
        ``saved`` after it: an optimizer's load checks them before it changes anything (Note
        [Transactional loads] in asteria/optim/state_io.py)."""
        self.optimizer.check_layouts_kept(groups)
        if saved is None:
            return
        blocks = {k: (b, states[p]["step"]) for k, p, b, _ in blocks_of(groups, states)}
        coherence = self._parts.coherence
        state.check(saved, blocks, self.schedule.budget, coherence, self.block_name)

    def state_replaced(self) -> None:
        """The optimizer loaded a state: the refreshes in flight are dropped (a loaded
        ``"asteria_runtime"`` part puts its own back) and every version is taken from the loaded
        state at its next decision (Note [Transactional loads])."""
        with self._lock:
            self._refreshes.drop_all()
            self._plan.reset()
            self._bases.state_replaced()

    def stats(self) -> dict[str, Any]:
        """Figures the benchmarks read: per-step times, barrier waits, jobs, staleness
        (docs/runtime.md, ``Runtime.stats()``)."""
        p = self._parts
        hooks = 0 if p.signals is None else len(p.signals)
        out = report.stats(
            self._refreshes, self.schedule, self.per_step, p.lane, p.coherence, hooks
        )
        out["warnings"] = list(p.warnings)  # given at attach (Note [No spare core] in attach.py)
        return out

    def memory_report(self) -> dict[str, Any]:
        """Bytes per tier per state kind, measured on the tensors that exist now (report.py;
        docs/memory.md)."""
        with self._lock:
            return report.memory_report(self._refreshes, self._bases, self.placement, self.arch)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"asteria.Runtime(staleness={c.staleness}, workers={c.resolved_workers}, "
            f"fixed_delay={c.fixed_delay}, closed={self._closed})"
        )


def _part(groups: list[BlockGroup], bases: list, items: list[tuple], picked: list[int]) -> tuple:
    """The groups and bases of ``items[i]`` for ``i`` in ``picked`` (each group's in order)."""
    by: dict[int, tuple[BlockGroup, list, list[int]]] = {}
    where = {id(g): j for j, g in enumerate(groups)}
    for i in picked:
        g, b = items[i]
        entry = by.get(id(g))
        if entry is None:
            entry = by[id(g)] = (g, bases[where[id(g)]], [])
        entry[2].append(b)
    parts = list(by.values())
    return [g.take(idx) for g, _, idx in parts], [[q[i] for i in idx] for _, q, idx in parts]


def _dims(item: tuple) -> int:
    """The sum of a block's factored dims (a product into and out of each basis)."""
    g, i = item
    return sum([f.shape[0] for f in g.blocks[i]["factors"] if f is not None])
