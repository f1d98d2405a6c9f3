"""``Runtime``: takes an optimizer's refreshes off the training critical path.

Owns: the facade over the runtime's parts (docs/architecture.md): it makes them when it attaches
to a SOAP / KL-Shampoo / Shampoo optimizer as its ``Refresher`` (optim/refresher.py), holds the
lock every part runs under, routes each call of the optimizer's step to the part that owns it,
and takes everything down again at ``close()``. DESIGN.md's "Asteria mode", part by part:

1. the optimizer updates a block's factors every step, as in native mode (on CPU, possibly on
   the statistics lane: lane.py);
2. at each block boundary the schedule decides (Note [Staleness contract] in schedule.py) and
   the refreshes act (refreshes.py): a due refresh is snapshotted (snapshots.py) and submitted
   to the C++ pool, version ``t``, deadline ``t + S``; a finished one is installed where the
   bases live (bases.py), at the latest at its deadline, where the step waits for it;
3. a module hook (hooks.py) installs a finished refresh early, before its module runs;
4. under ``torch.distributed``, replicated blocks have one owner that computes their refresh,
   and every replica installs it at its deadline (distributed.py); results that wait for a
   ``fixed_delay`` install may go to the NVMe spill tier (spill.py).

Checkpoint state is in state.py, the reports (``stats``, ``memory_report``) in report.py, the
attach-time choices in attach.py.

Must not: change any algorithm's math (the optimizer's ``refresh_jobs``/``install_refresh`` are
the only way in), register hooks itself (hooks.py does), or hold logic that a part owns.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
import weakref
from typing import Any

import torch

from asteria._ext import load_extension
from asteria.optim.base import BlockKey, KroneckerOptimizer, NativeRefresher
from asteria.optim.matrix_functions import MatrixFunctionError
from asteria.runtime import attach, report, state, testing
from asteria.runtime.config import RuntimeConfig
from asteria.runtime.distributed import Coherence
from asteria.runtime.hooks import GradientGuards, ModuleSignals
from asteria.runtime.lane import StatisticsLane
from asteria.runtime.refreshes import Refreshes, block_state
from asteria.runtime.registry import RefreshFailedError, Registry, StalenessTimeoutError
from asteria.runtime.schedule import InstallCosts, Pacer, Schedule
from asteria.runtime.spill import SpillTier, open_spill

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
        self.config = c = config if config is not None else RuntimeConfig()
        if not isinstance(c, RuntimeConfig):
            raise ValueError(f"config must be a RuntimeConfig, got {type(config).__name__}")
        if not isinstance(optimizer.refresher, NativeRefresher):  # before any thread starts
            raise ValueError(
                f"{type(optimizer).__name__} is already orchestrated by "
                f"{optimizer.refresher!r}; close() that runtime before attaching another"
            )
        self.optimizer = optimizer
        self._closed = False
        #: an exception of a step's block boundary raised at the step's end (Note
        #: [All-or-nothing steps]), and whether a step began and has not ended
        self._error: BaseException | None = None
        self._in_step = False
        self._lock = threading.RLock()
        self._names = attach.param_names(model, optimizer)
        # (what the parts keep holds no reference to the runtime, which stays collectable
        # without close(): tests/unit/test_shutdown.py)
        self.block_name = attach.namer(self._names)
        self._pid_of = {id(p): i for i, p in enumerate(attach.params_of(optimizer))}
        self.registry = Registry(c.staleness)
        budget = c.staleness if c.fixed_delay is None else c.fixed_delay
        self.schedule = Schedule(
            budget,
            c.fixed_delay is not None,
            optimizer.refresh_precedes_update,
            c.refresh_lead,
            continuous=c.refresh == "continuous",
        )
        # Under torch.distributed: topology, owners and the sync of replicated blocks (Note
        # [Distributed coherence] in distributed.py). Its attach-time checks are collective and
        # come before any thread, hook or pool exists.
        self._coherence: Coherence | None = None
        distributed = attach.distributed_mode(distributed, ranks_per_node)
        if distributed:
            self._coherence = Coherence(optimizer, c, ranks_per_node)
        resumed = optimizer._resumed_refreshes  # checked before any thread starts
        if resumed is not None:
            blocks = {k: (b, optimizer.state[p]["step"]) for k, p, b, _ in optimizer.blocks()}
            state.check(resumed, blocks, self.schedule.budget, self._coherence, self.block_name)
        choices = attach.choose(optimizer, c, distributed, self.block_name)
        self.arch, self.placement = choices.arch, choices.placement
        # what the runtime warned about at attach, for reports (stats()["warnings"])
        self._warnings: list[str] = []
        if choices.no_spare_core is not None:  # Note [No spare core] in attach.py
            self._warnings.append(choices.no_spare_core)
            warnings.warn(choices.no_spare_core, attach.NoSpareCoreWarning, stacklevel=2)
        self._spill = open_spill(c.nvme_path, c.fixed_delay, choices.placement, choices.sizes)
        self._pool: Any = None
        self._lane: StatisticsLane | None = None
        self._grad_guards: GradientGuards | None = None
        self._signals: ModuleSignals | None = None
        try:  # a runtime refused here holds no thread, hook or file (issue 22)
            _C = load_extension()
            self._pool = _C.WorkerPool(
                workers=c.resolved_workers,
                lapack_threads=c.lapack_threads,
                affinity=list(c.affinity) if c.affinity else None,
                nice=choices.nice,
            )
            # where each refresh runs: the pool, or a device stream (Note [Refresh placement])
            self._executors = attach.executors(optimizer, c, self._pool, budget)
            weakref.finalize(self, self._executors.shutdown)  # the device stream's thread
            if choices.lane:
                # a gradient hook per parameter keeps the next backward from writing a gradient the
                # lane still reads (Note [Gradient guards] in hooks.py)
                self._lane = StatisticsLane(self.block_name)
                self._grad_guards = GradientGuards(
                    attach.params_of(optimizer), self._lane, always=self._coherence is not None
                )
            costs = InstallCosts(optimizer.install_cost, functools.partial(block_state, optimizer))
            # one low-priority copy stream, made once, for the window and the staged snapshots
            copies = functools.cache(functools.partial(attach.copy_stream, optimizer))
            self._bases = attach.choose_bases(
                optimizer, c, choices.placement, self._lane, costs, self.block_name, copies
            )
            thread_cost = _free if self._bases.installs_off_thread else costs
            self._pacer = Pacer(c.pace_installs, c.staleness, self.registry.entries, thread_cost)
            self._refreshes = Refreshes(
                optimizer,
                c,
                self.registry,
                self._executors,
                attach.choose_snapshots(choices, self._executors, self._lane, copies),
                self._bases,
                self._pacer,
                self.block_name,
                spill=self._spill,
                coherence=self._coherence,
                errors=(_C.MatrixFunctionError, MatrixFunctionError),
                timeout_error=_C.FutureTimeoutError,
            )
            self._step_t0 = 0.0
            self.per_step: dict[str, list[float]] = {"step_ms": [], "barrier_wait_ms": []}
            optimizer.attach_refresher(self)  # raises ValueError when already orchestrated
            for pid, name in self._names.items():  # messages name parameters (issue 7)
                optimizer.param_names.setdefault(pid, name)
            if model is not None and c.hooks:
                # issue 7: the hooks hold the runtime weakly and go when it is collected without
                # close(), so a model that outlives its optimizer keeps no runtime (or pool) alive;
                # none where they could not change anything (Note [Backward signals] in hooks.py)
                signalled = [i for i, pid in self._pid_of.items() if self._installs_on_signal(pid)]
                self._signals = ModuleSignals(model, signalled, _weak_signal(self))
                weakref.finalize(self, self._signals.remove)
            self._finalizer = weakref.finalize(
                self, Runtime._shutdown, self._pool, self._spill, self._lane, self._grad_guards
            )
        except BaseException:
            self._undo_attach()
            raise

    # -- public read-only parts (tests and benchmarks reach the runtime through these) --------

    @property
    def pool(self) -> Any:
        """The refresh pool (``asteria._C.WorkerPool``); work submitted to it delays refreshes."""
        return self._pool

    @property
    def spill(self) -> SpillTier | None:
        """The NVMe spill tier (spill.py), or None when nothing spills."""
        return self._spill

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (a closed runtime orchestrates nothing again)."""
        return self._closed

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(install_pending=exc[0] is None)

    def close(self, install_pending: bool = True) -> None:
        """Detach: remove hooks, install (or drop) refreshes in flight, stop the pool."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            if self._signals is not None:
                self._signals.remove()
            try:
                if self._lane is not None:
                    self._lane.wait_all(reported_too=False)
                if install_pending:
                    self._finish_interrupted_step()
                    self._refreshes.timed_out = False  # close() waits as a barrier does
                    self._refreshes.install_in_flight()
            finally:
                self.optimizer.detach_refresher()
                if self._grad_guards is not None:
                    self._grad_guards.remove()
                if self._lane is not None:
                    self._lane.close()
                self._refreshes.drop_all()  # what was not installed is dropped
                self._pool.shutdown(wait=False)
                self._executors.shutdown()
                self._refreshes.snapshots.clear()
                if self._spill is not None:
                    self._spill.close()  # deletes the spill file
                self._bases.close()
                self._finalizer.detach()

    def _undo_attach(self) -> None:
        """Take down what a refused ``__init__`` made (its threads joined)."""
        if self._signals is not None:
            self._signals.remove()
        if self.optimizer.refresher is self:
            self.optimizer.detach_refresher()
        if self._grad_guards is not None:
            self._grad_guards.remove()
        if self._lane is not None:
            self._lane.close()
        executors = getattr(self, "_executors", None)
        if executors is not None:
            executors.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._spill is not None:
            self._spill.close()

    @staticmethod
    def _shutdown(
        pool: Any,
        spill: SpillTier | None,
        lane: StatisticsLane | None = None,
        guards: GradientGuards | None = None,
    ) -> None:
        if guards is not None:
            guards.remove()
        if lane is not None:
            lane.abandon()
        pool.shutdown(wait=False)
        if spill is not None:
            spill.close()

    # -- the Refresher protocol (called by the optimizer's step) ------------------------------

    def step_begin(self) -> None:
        if self._closed:  # (the optimizer detached it: only a caller holding it gets here)
            raise RuntimeError(f"{self!r} is closed")
        if self._lane is not None:
            self._lane.check()  # a failed block's error, before this step changes anything
        with self._lock:
            self._finish_interrupted_step()
        self._in_step = True
        self._error = None
        self._step_t0 = time.perf_counter()
        self._refreshes.wait_s = 0.0
        self._refreshes.timed_out = False
        self._refreshes.snapshots.step_begin()
        waits = self.per_step["barrier_wait_ms"]
        self._executors.step_begin(waits[-1] / 1e3 if waits else 0.0)
        if self.schedule.continuous:  # Note [Continuous refresh] in schedule.py
            with self._lock:
                self.schedule.pick(self._refresh_candidates(), self._executors.has_room)

    def accumulate(self, key: BlockKey, fn: Any, *args: Any) -> None:
        fn = testing.statistics_update(key, fn)
        if self._lane is None:
            fn(*args)
        else:
            self._lane.submit(key, fn, *args)

    def block_begin(self, key: BlockKey, block: dict) -> None:
        if self._lane is not None:
            self._lane.wait(key)

    def bases(self, key: BlockKey, block: dict) -> list:
        if self._bases.stable:
            return self._bases.read(key, block)
        with self._lock:  # the window's ring is shared with installs from hooks
            return self._bases.read(key, block)

    @property
    def bases_stable(self) -> bool:
        return self._bases.stable

    @property
    def splits_updates(self) -> bool:
        return self._lane is not None and self.config.split_updates

    @property
    def lead(self) -> int:
        return self.schedule.lead  # Note [Refresh lead] in schedule.py

    @property
    def installs_late(self) -> bool:
        return self.schedule.budget > 0  # Note [Late roots] in asteria/optim/shampoo.py

    def beside(self, fn: Any, *args: Any) -> Any:
        """Part of the step's update on the statistics lane (Note [Split updates] in lane.py)."""
        return self._lane.beside(fn, *args)

    def sync(self) -> None:
        """Wait for the statistics lane (everything queued there has run)."""
        if self._lane is not None:
            self._lane.wait_all()

    def block_boundary(self, key: BlockKey, block: dict, group: dict, step: int, due: bool) -> None:
        """Note [Staleness contract] (schedule.py): install what is due, then request or
        coalesce; measure the age of the basis this step's update reads."""
        schedule, refreshes = self.schedule, self._refreshes
        freq = group["precondition_frequency"]
        with self._lock:
            e = refreshes.entry(key)
            due = schedule.due(e, step, freq, due)  # Note [Continuous refresh] in schedule.py
            if e.version is None and _has_bases(block, self._bases.field):
                e.version = schedule.initial_version(step, freq)  # a basis made before us
            if not schedule.precedes_update:
                schedule.record_age(e, step, freq)  # the update of this step read it already
            replicated = refreshes.replicated(key)
            if e.pending is not None and schedule.install_now(
                e.pending, step, due or e.owed, schedule.fixed or replicated, self._pacer, key
            ):
                self._install_at_boundary(key, e, step, block, replicated)
            elif e.pending is not None and schedule.fixed and not replicated:
                refreshes.maybe_spill(e)  # a finished refresh waiting for its install step
            if due and e.pending is not None:
                if not e.owed:
                    schedule.coalesced += 1
                e.owed = True  # requested where the refresh in flight is installed
            elif (
                due
                or (e.owed and e.pending is None)
                or schedule.wants(key, e, schedule.fixed or replicated)
            ):
                e.owed = False
                refreshes.request(key, e, block, group, step)
                if e.pending is not None and schedule.budget == 0:
                    self._install_at_boundary(key, e, step, block, replicated)
            if schedule.precedes_update:
                schedule.record_age(e, step, freq)  # installed above, read by this step
            e.boundary_step = step

    def _refresh_candidates(self) -> list[tuple[int, BlockKey]]:
        """The blocks a continuous refresh may request this step, with the version they will
        have: none in flight, or a finished one (installed at their boundary)."""
        out = []
        for key, e in self.registry.entries.items():
            p = e.pending
            if e.version is not None and (p is None or (p.owner is None and p.done())):
                out.append((e.version if p is None else p.requested, key))
        return out

    def _install_at_boundary(
        self, key: BlockKey, e: Any, step: int, block: dict, replicated: bool
    ) -> None:
        """Install ``e``'s refresh in flight; a refresh failure past the limit or a barrier
        timeout is kept for the step's end, so that every block of the step is updated (Note
        [All-or-nothing steps]). A timed-out refresh is dropped: the block keeps its basis."""
        try:
            self._refreshes.install_now(key, e, step, block, replicated)
        except (RefreshFailedError, StalenessTimeoutError) as err:
            if isinstance(err, StalenessTimeoutError) and e.pending is not None:
                owed = e.owed
                self._refreshes.drop(e)
                e.owed = owed
            if self._error is None:
                self._error = err

    def _finish_interrupted_step(self) -> None:
        """Note [Interrupted steps]: after a step that raised before its end (a KeyboardInterrupt,
        an error of the model's code in a closure-less step, ...), finish what its skipped block
        boundaries owed: each runs now, at the block's step, as a due one (a refresh at its
        deadline installed, a new one requested or coalesced). Called with the lock held."""
        if not self._in_step:
            return
        refreshes = self._refreshes
        for key, e in sorted(self.registry.entries.items()):
            step = refreshes.current_step(key)
            if step > e.boundary_step:  # its boundary of that step did not run to its end
                group = refreshes.group_of(key)
                self.block_boundary(key, refreshes.block_state(key), group, step, True)
        self._in_step = False
        error, self._error = self._error, None
        if error is not None:
            raise error

    def step_end(self) -> None:
        with self._lock:
            self._refreshes.step_end()
            self._bases.step_end()
        self._pacer.step_end()
        self.per_step["step_ms"].append((time.perf_counter() - self._step_t0) * 1e3)
        self.per_step["barrier_wait_ms"].append(self._refreshes.wait_s * 1e3)
        self._in_step = False
        error, self._error = self._error, None
        if error is not None:  # Note [All-or-nothing steps]: the step was applied in full
            raise error

    # -- hooks: install what is ready ------------------------------------------------------------

    def _installs_on_signal(self, pid: int) -> bool:
        """Whether a ready refresh of parameter ``pid``'s blocks may be installed on a module
        signal: not under ``fixed_delay`` (installs happen exactly at their step), nor where a
        coherence installs its blocks at their deadline on every rank (replicated: every block
        of a DDP model)."""
        if self.config.fixed_delay is not None:
            return False
        return self._coherence is None or not self._coherence.replicated((pid, 0))

    def _on_signal(self, param_ids: tuple[int, ...], event: str) -> None:
        if self._closed:
            return
        with self._lock:
            if self._in_step:  # between steps: the last one raised before its end
                self._finish_interrupted_step()
            for i in param_ids:
                pid = self._pid_of[i]
                if self._installs_on_signal(pid):
                    self._refreshes.install_ready(self.registry.by_param.get(pid, ()))

    # -- checkpoints and reports -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The runtime's part of a checkpoint: every refresh still in flight, finished first
        and saved with its results (Note [Checkpoints with work in flight] in state.py)."""
        self.sync()
        with self._lock:
            self._finish_interrupted_step()
            self._refreshes.timed_out = False  # the save waits as a barrier does
            return state.save(self._refreshes)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore the refreshes in flight of :meth:`state_dict`, after the optimizer's own
        ``load_state_dict`` (Note [Checkpoints with work in flight] in state.py)."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed: load into the runtime attached now")
        self.sync()
        with self._lock:
            self._finish_interrupted_step()
            state.load(self._refreshes, saved, self.schedule.budget)

    def check_state_dict(self, saved: Any, blocks: dict[BlockKey, tuple[dict, int]]) -> None:
        """Raise ``ValueError`` where :meth:`load_state_dict` would refuse ``saved`` for the
        optimizer blocks ``blocks`` (key -> (block state, step)): an optimizer's load checks
        its runtime part before it changes anything (Note [Transactional loads] in
        asteria/optim/base.py)."""
        state.check(saved, blocks, self.schedule.budget, self._coherence, self.block_name)

    def state_replaced(self) -> None:
        """The optimizer loaded a state: the refreshes in flight were requested from the old
        one and are dropped (a loaded ``"asteria_runtime"`` part puts its own back), and every
        block's version is taken from the loaded state at its next boundary, so the staleness
        contract holds from the load on (Note [Transactional loads])."""
        with self._lock:
            self._refreshes.drop_all()
            self._in_step, self._error = False, None
            for e in self.registry.entries.values():
                e.version, e.owed, e.consecutive_failures = None, False, 0
                e.boundary_step = -1

    def stats(self) -> dict[str, Any]:
        """Figures the benchmarks read: per-step times, barrier waits, jobs, staleness
        (docs/runtime.md, ``Runtime.stats()``)."""
        hooks = 0 if self._signals is None else len(self._signals)
        out = report.stats(
            self._refreshes, self.schedule, self.per_step, self._lane, self._coherence, hooks
        )
        out["warnings"] = list(self._warnings)  # given at attach (Note [No spare core])
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


def _weak_signal(runtime: Runtime) -> Any:
    """``runtime._on_signal`` through a weak reference (a no-op once the runtime is gone)."""
    ref = weakref.WeakMethod(runtime._on_signal)

    def signal(param_ids: tuple[int, ...], event: str) -> None:
        method = ref()
        if method is not None:
            method(param_ids, event)

    return signal


def _free(key: BlockKey, block: dict | None = None) -> float:
    """The training thread's cost of an install that runs elsewhere."""
    return 0.0


def _has_bases(block: dict, field: str) -> bool:
    return any(q is not None for q in block.get(field, ()))


# Note [All-or-nothing steps]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# What an exception inside ``optimizer.step()`` leaves, with a runtime attached:
#   * a refresh failing ``max_consecutive_failures`` times in a row (or crashing in a worker), a
#     barrier timeout: the step runs to its end, every parameter updated with the bases it has
#     (a timed-out refresh is dropped, the block keeps its basis and requests again at its next
#     due boundary; later barriers of that step do not wait), and ``step_end`` raises the first
#     such error: the step is complete, the next ``step()`` is an ordinary one. Native mode does
#     the same for refresh failures (Note [Refresh failures] in asteria/optim/refresher.py);
#   * a block whose statistics failed on the lane: every later ``step()`` raises
#     ``StatisticsLaneError`` at its start, before it changes anything (``StatisticsLane.check``);
#     the step that was running when the lane failed stops at the failed block's first wait;
#   * anything else (a KeyboardInterrupt, an error of a split update): the step stops where it
#     was, some parameters updated and some not, and the next step is a complete one (Note
#     [Interrupted steps]). A rollback of every parameter and state tensor would cost a copy of
#     all of them at every step, to undo what the user chose to interrupt.
# The runtime's own invariants are checked where its state changes (``Registry.record_install``:
# an install outside ``[t, t + B]`` is a bug of the runtime, an AssertionError the tests find);
# no fault of the user's or of the machine reaches one. tests/unit/test_all_or_nothing_steps.py
# has every fault of issue 22 (hypothesis over optimizer x runtime x fault x the step and the
# point at which it strikes), each ending in a clear error with the state unchanged, or in a run
# that keeps the staleness contract, with no thread left after ``close()``.

# Note [Interrupted steps]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A step that raised before ``step_end`` (``_in_step`` still set) may have updated a block without
# running its boundary, where a refresh at its deadline was due to be installed: left so, the
# next boundary would install it a step past its budget. Every block's entry keeps the step whose
# boundary last ran to its end (``boundary_step``); before the next step changes anything (and
# before ``state_dict``, ``close``, or a module signal installs), ``_finish_interrupted_step``
# finishes the skipped boundaries: a refresh whose deadline is the block's step is installed
# there (waiting for it, as the boundary would have), and a refresh is requested (or coalesced
# into the one in flight) as if that boundary were due: the request it may have owed, from
# the same step, so that the age of the basis stays within its bound. Requests and installs are
# atomic against interruption: a refresh is in flight once all its jobs are submitted, and stays
# in flight until its results are installed (refreshes.py), so an interrupted one is installed
# again, never twice, and never half. A statistics lane wait that is interrupted keeps its work
# for the next wait.
