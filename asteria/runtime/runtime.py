"""``Runtime``: takes an optimizer's refreshes off the training critical path.

Owns: the C++ refresh pool (``asteria._C.WorkerPool``), the coherence registry, the module hooks
and, on CUDA, the shadow stream. It attaches to a SOAP / KL-Shampoo / Shampoo optimizer as its
``Refresher`` (optim/refresher.py) and runs DESIGN.md's "Asteria mode":

1. the optimizer updates a block's factors every step, as in native mode;
2. when a refresh is due at step ``t``, the runtime snapshots what the refresh reads (factors,
   current basis; on CUDA by an asynchronous copy on the low-priority shadow stream) and submits
   one job per factor to the pool, version ``t``, deadline ``t + S`` (on CPU with the statistics
   lane, the lane submits it, behind the step's statistics); the step goes on;
3. at each later step boundary of the block, or when a hook says the block's module is about to
   run, a finished refresh is installed with the optimizer's ``install_refresh`` (which carries
   basis-dependent state over exactly); at step ``t + S`` the step waits for it (Note [Staleness
   bound] in registry.py);
4. a newer request for a block supersedes an older one still in flight (cancelled when queued,
   discarded when running), so a job's input basis is always the basis its result replaces.

Memory tiers (asteria.memory.tiers decides, this file carries it out): finished refreshes that
wait for their install step (``fixed_delay``) are written to the NVMe spill store for the blocks
the policy spills, with the job's inputs, and paged back ahead of use in access order at the step
before their install; a corrupt or unreadable slot is recomputed from those inputs on the pool
(same inputs, same result, same install step). On unified-memory GPUs the bases in use live in
pinned host memory that the device reads through mapped views; on discrete GPUs they live in
pinned host memory too and the optimizer reads them (``bases``) from a device window, a ring of
buffers filled just before use on a low-priority stream, the next block's copy overlapping the
current block's kernels (Note [Bases window] in asteria/memory/window.py). ``memory_report()``
accounts every byte by tier and kind.

Under ``torch.distributed`` (DDP, FSDP2, HSDP; auto-detected, or ``distributed=``), replicated
blocks have one owner that computes their refresh, and every replica installs it at its deadline
(Note [Distributed coherence] in distributed.py); local (sharded) blocks run as above.

Must not: change any algorithm's math (the optimizer's ``refresh_jobs``/``install_refresh`` are
the only way in), or register hooks itself (hooks.py does).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

from asteria._ext import load_extension
from asteria.memory.accounting import detect_arch, estimate_blocks
from asteria.memory.host import device_view, host_copy, host_empty, is_host_tensor
from asteria.memory.staging import StagingSlots
from asteria.memory.tiers import KINDS, TIERS, Placement, plan
from asteria.memory.window import (
    WINDOW_BLOCKS,
    BasesWindow,
    CudaCopies,
    HostCopies,
    view_like,
)
from asteria.optim.base import BlockKey, KroneckerOptimizer, RefreshJob
from asteria.optim.matrix_functions import MatrixFunctionError
from asteria.runtime import testing
from asteria.runtime.config import RuntimeConfig
from asteria.runtime.distributed import Coherence
from asteria.runtime.hooks import GradientGuards, ModuleSignals
from asteria.runtime.lane import LaneWork, StatisticsLane, StatisticsLaneError
from asteria.runtime.registry import (
    BlockEntry,
    PendingRefresh,
    RefreshFailedError,
    Registry,
    StalenessTimeoutError,
)
from asteria.runtime.schedule import Schedule
from asteria.runtime.spill import SpilledRefresh, Spiller, SpillLost

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
        self.config = config if config is not None else RuntimeConfig()
        if not isinstance(self.config, RuntimeConfig):
            raise ValueError(f"config must be a RuntimeConfig, got {type(config).__name__}")
        self.optimizer = optimizer
        self.registry = Registry(self.config.staleness)
        fixed = self.config.fixed_delay
        self.schedule = Schedule(
            self.config.staleness if fixed is None else fixed,
            fixed is not None,
            optimizer.refresh_precedes_update,
        )
        self._lock = threading.RLock()
        self._closed = False
        self._names = self._param_names(model, optimizer)
        self._pid_of = {id(p): i for i, p in enumerate(_params(optimizer))}
        # Under torch.distributed: topology, owners and the sync of replicated blocks (Note
        # [Distributed coherence] in distributed.py). Its attach-time checks are collective and
        # come before any thread, hook or pool exists.
        self._coherence: Coherence | None = None
        if distributed is None:
            distributed = (
                dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            )
        elif not isinstance(distributed, bool):
            raise ValueError(f"distributed must be True, False or None, got {distributed!r}")
        if distributed:
            self._coherence = Coherence(optimizer, self.config, ranks_per_node)
        elif ranks_per_node is not None:
            raise ValueError("ranks_per_node applies to distributed mode only")
        self.placement = self._plan(optimizer)
        self._mapped: set[int] = set()  # data_ptr of bases read through mapped views
        self._window = self._open_window() if self.placement.bases_access == "window" else None
        self._window_seen: list[BlockKey] = []  # blocks in the order this step read their bases
        self._window_next: dict[BlockKey, BlockKey] = {}  # the block read after each, last step
        self._pool_names: set[str] = set()
        self._spiller: Spiller | None = None
        if self.placement.spilled and self._spill_waits():
            self._spiller = self._open_spill_store()  # before any thread or hook exists
        _C = load_extension()
        self._C = _C
        # Whether torch's intra-op threads leave a core free; under torchrun, the threads of
        # every process on this machine (LOCAL_WORLD_SIZE) count.
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1) if distributed else 1
        spare_core = torch.get_num_threads() * local < (os.cpu_count() or 1)
        nice = self.config.worker_nice
        if nice is None:  # Note [Worker priority] in csrc/core/worker_pool.cpp
            nice = 10 if spare_core else 0
        self._pool = _C.WorkerPool(
            workers=self.config.resolved_workers,
            lapack_threads=self.config.lapack_threads,
            affinity=list(self.config.affinity) if self.config.affinity else None,
            nice=nice,
        )
        # Device snapshots go through pinned staging slots on the shadow stream; CPU tensors are
        # copied by the pool itself at submission, or on the statistics lane when it runs.
        self._staging: StagingSlots | None = None
        if any(p.is_cuda for p in _params(optimizer)):
            self._staging = StagingSlots(_C.ShadowStream())
        # Factor statistics of CPU-resident parameters run on the statistics lane, off the
        # training thread (Note [Statistics lane] in lane.py); a gradient hook per parameter
        # keeps the next backward from writing a gradient the lane still reads.
        self._lane: StatisticsLane | None = None
        self._grad_guards: GradientGuards | None = None
        cpu_only = all(p.device.type == "cpu" for p in _params(optimizer))
        # FSDP2 writes sharded gradients outside autograd, where the guards cannot see it: the
        # lane is opt-in (statistics_lane=True) for DTensor parameters.
        sharded = any(hasattr(p, "to_local") for p in _params(optimizer))
        # By default only where the training leaves a core free: on a machine whose cores all
        # run intra-op threads, the lane would take its time from the training itself.
        lane_on = self.config.statistics_lane or (
            self.config.statistics_lane is None and not sharded and spare_core
        )
        if cpu_only and lane_on and self._window is None:  # the window's stand-in: no lane
            names = self._names
            self._lane = StatisticsLane(
                lambda key: f"{names.get(key[0], f'param{key[0]}')}[{key[1]}]"
            )
            self._grad_guards = GradientGuards(
                _params(optimizer), self._lane, always=self._coherence is not None
            )
        # Installs that compute go to the lane too, for optimizers that read their bases (and
        # the state installs rewrite) only after ``Refresher.bases``.
        self._lane_installs_on = self._lane is not None and optimizer.reads_bases_through_refresher
        self._lane_installs: set[BlockKey] = set()
        optimizer.attach_refresher(self)  # raises ValueError when already orchestrated
        for pid, name in self._names.items():  # messages name parameters (issue 7)
            optimizer.param_names.setdefault(pid, name)
        self._signals = None
        if model is not None and self.config.hooks:
            # issue 7: the hooks hold the runtime weakly and go when it is collected without
            # close(), so a model that outlives its optimizer keeps no runtime (or pool) alive
            self._signals = ModuleSignals(model, self._signalled(), _weak_signal(self))
            weakref.finalize(self, self._signals.remove)
        self._closed = False
        self._step = 0
        self._step_t0 = 0.0
        self._step_wait = 0.0
        self._install_costs: dict[BlockKey, float] = {}
        self._pace_step, self._pace_budget, self._pace_spent = -1, 0.0, 0.0
        self._submitted = 0
        self._failed = 0
        self._cancelled = 0
        self.per_step: dict[str, list[float]] = {"step_ms": [], "barrier_wait_ms": []}
        self._finalizer = weakref.finalize(
            self, Runtime._shutdown, self._pool, self._spiller, self._lane, self._grad_guards
        )

    def _signalled(self) -> list[int]:
        """The ``id()`` of the parameters whose hooks can change anything (``_on_signal``). A
        hook that would only return costs a registration per forward (Note [Backward
        signals] in hooks.py), so it is not registered."""
        return [i for i, pid in self._pid_of.items() if self._installs_on_signal(pid)]

    def _installs_on_signal(self, pid: int) -> bool:
        """Whether a ready refresh of parameter ``pid``'s blocks may be installed on a module
        signal: not under ``fixed_delay`` (installs happen exactly at their step), nor where a
        coherence installs its blocks at their deadline on every rank (replicated: every block
        of a DDP model)."""
        if self.config.fixed_delay is not None:
            return False
        return self._coherence is None or not self._coherence.replicated((pid, 0))

    def _plan(self, optimizer: KroneckerOptimizer) -> Placement:
        """The tier policy's placement for this optimizer's state (ValueError: what to change)."""
        c = self.config
        params = _params(optimizer)
        self.arch = detect_arch(params[0].device if params else "cpu")
        try:
            self._sizes = estimate_blocks(optimizer, lambda pid, bi: self._block_name((pid, bi)))
        except ValueError:
            if c.device_budget_bytes is not None or c.host_budget_bytes is not None:
                raise
            self._sizes = []  # an optimizer without a size model: no budgets to check
        staging = sum(b.snapshots for b in self._sizes) if self.arch.cuda else 0
        return plan(
            self._sizes,
            self.arch,
            device_budget_bytes=c.device_budget_bytes,
            host_budget_bytes=c.host_budget_bytes,
            nvme=c.nvme_path is not None,
            placement=c.placement,
            staging_bytes=staging,
            bases_window=optimizer.reads_bases_through_refresher,
            window_blocks=WINDOW_BLOCKS,
        )

    def _open_window(self) -> BasesWindow:
        """The device window of the bases (CUDA parameters; else the CPU stand-in, used where a
        test makes the CPU look like a discrete GPU)."""
        params = _params(self.optimizer)
        device = params[0].device if params else torch.device("cpu")
        copies = CudaCopies(device) if device.type == "cuda" else HostCopies()
        slot = self.placement.window_bytes // WINDOW_BLOCKS
        return BasesWindow(copies, WINDOW_BLOCKS, slot)

    def _spill_waits(self) -> bool:
        """Results wait for their install across a step boundary only with fixed_delay >= 2."""
        return self.config.fixed_delay is not None and self.config.fixed_delay >= 2

    def _open_spill_store(self) -> Spiller:
        path = os.fspath(self.config.nvme_path)
        spilled = [b for b in self._sizes if b.name in self.placement.spilled]
        # every slot is rounded up to 4 KiB: at most 4 tensors per dim, 4 dims per block
        capacity = sum(b.results + b.snapshots for b in spilled) + len(spilled) * 64 * 4096
        capacity += 1 << 20
        free = shutil.disk_usage(path).free
        if capacity > free:
            raise ValueError(
                f"nvme_path {path!r} has {free} bytes free, the spill file needs {capacity}; "
                "free space there, pick another directory, or raise host_budget_bytes"
            )
        try:
            return Spiller(path, capacity)
        except (ValueError, OSError) as err:
            raise ValueError(f"nvme_path {path!r}: cannot create the spill file: {err}") from err

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
                    self._install_in_flight()
            finally:
                self.optimizer.detach_refresher()
                if self._grad_guards is not None:
                    self._grad_guards.remove()
                if self._lane is not None:
                    self._lane.close()
                for e in self.registry.entries.values():  # what was not installed is dropped
                    if e.pending is not None:
                        self._drop(e)
                self._pool.shutdown(wait=False)
                if self._staging is not None:
                    self._staging.clear()
                if self._spiller is not None:
                    self._spiller.close()  # deletes the spill file
                self._unmap_bases()
                self._close_window()
                self._finalizer.detach()

    def _install_in_flight(self) -> None:
        """Install every refresh in flight; one not ready within the barrier timeout is dropped."""
        for key, e in sorted(self.registry.entries.items()):
            if e.pending is None:
                continue
            if self._coherence is not None and self._coherence.replicated(key):
                self._sync(key, e, self._current_step(key), None)  # collective: every rank closes
                continue
            try:
                self._wait(e, self._current_step(key))
            except StalenessTimeoutError as err:
                warnings.warn(f"{err}; dropped at close()", RuntimeWarning, stacklevel=3)
                e.pending = None
                continue
            except StatisticsLaneError:  # raised by a step already (close() waited for the lane)
                self._drop(e)
                continue
            self._install(key, e, self._current_step(key))

    @staticmethod
    def _shutdown(
        pool: Any,
        spiller: Spiller | None,
        lane: StatisticsLane | None = None,
        guards: GradientGuards | None = None,
    ) -> None:
        if guards is not None:
            guards.remove()
        if lane is not None:
            lane.abandon()
        pool.shutdown(wait=False)
        if spiller is not None:
            spiller.close()

    # -- the Refresher protocol (called by the optimizer's step) ------------------------------

    def step_begin(self, opt: KroneckerOptimizer) -> None:
        self._step_t0 = time.perf_counter()
        self._step_wait = 0.0

    def accumulate(self, opt: KroneckerOptimizer, key: BlockKey, fn: Any, *args: Any) -> None:
        if self._lane is None:
            fn(*args)
        else:
            self._lane.submit(key, fn, *args)

    def block_begin(self, opt: KroneckerOptimizer, key: BlockKey, block: dict) -> None:
        if self._lane is not None:
            self._lane.wait(key)

    @property
    def splits_updates(self) -> bool:
        return self._lane is not None and self.config.split_updates

    # Note [Refresh lead]
    # ~~~~~~~~~~~~~~~~~~~
    # Native Shampoo computes a due root inside the step that first uses it: at a refresh step
    # t it preconditions with the roots of L_t. A runtime cannot hand back a result in the step
    # that requests it (unless S = 0), so a request at step t left step t on the roots of the
    # previous refresh, L_{t-f}, f steps old, and every later step of the interval on those of
    # L_t, as native. With a budget of at least one step, such optimizers
    # (``refresh_precedes_update``) request the refresh one step ahead instead, at the
    # boundary of step t-1, with the factors of L_{t-1}: the job runs during step t's forward
    # and backward, and step t's boundary installs it when it is ready (at the latest at
    # t-1+S, as any request). Every step of the interval then uses roots one gradient older
    # than native's (one term of a sum over t steps for Shampoo's default betas[1] = 1), none
    # f steps older. The registry counts the same staleness, 1, for both. S = 0 keeps the
    # native schedule, bit for bit; SOAP and KL-Shampoo update with the bases of the previous
    # refresh natively, and keep their schedule.
    @property
    def lead(self) -> int:
        budget = self.config.fixed_delay
        if budget is None:
            budget = self.config.staleness
        return 1 if budget >= 1 and self.config.refresh_lead else 0

    def beside(self, opt: KroneckerOptimizer, fn: Any, *args: Any) -> Any:
        """Part of the step's update on the statistics lane (Note [Split updates])."""
        return self._lane.beside(fn, *args)

    # Note [Split updates]: with a statistics lane, training takes one core and the lane and
    # the refresh pool share the other; the lane's statistics and the pool's refreshes run
    # while the training thread does the forward and backward, and the second core idles while
    # the training thread does the optimizer's update. So an optimizer that updates a group's
    # blocks together (SOAP's 2-D blocks, one C++ call per chunk; KL-Shampoo's blocks, once
    # the training thread has waited for their statistics and bases) splits them in two halves
    # of about equal flops and hands one to the lane (``Refresher.beside``), which runs it
    # while the training thread does the other; the step goes on once both are done. Each
    # block's update is the same ops on the same tensors with the same thread count, whichever
    # thread runs it, so the parameters stay bitwise those of native mode. The lane's half runs
    # after everything queued on the lane before it (installs included), so it reads a block's
    # installed bases just as the training thread's half does after ``bases``. On
    # bench/step_time.py's tiny LM (one training thread, 2 cores) SOAP's step went from 141 ms
    # to 73 ms, and the forward and backward beside it did not slow down (1108 -> 1084 ms);
    # KL-Shampoo's went from 137 to 73-86 ms. Shampoo still updates parameter by parameter.

    def sync(self, opt: KroneckerOptimizer) -> None:
        if self._lane is not None:
            self._lane.wait_all()

    def bases(self, opt: KroneckerOptimizer, key: BlockKey, block: dict) -> list:
        if self._window is None:
            self._settle_install(key)  # the update reads the bases, then m and v
            return block[opt.bases_field]
        with self._lock:
            return self._window_use(key, block, prefetch=True)

    @property
    def bases_stable(self) -> bool:
        return self._window is None  # a window slot is reused two blocks later

    def block_boundary(
        self,
        opt: KroneckerOptimizer,
        key: BlockKey,
        block: dict,
        group: dict,
        step: int,
        due: bool,
    ) -> None:
        """Note [Staleness contract] (schedule.py): install what is due, then request or
        coalesce; measure the age of the basis this step's update reads."""
        schedule = self.schedule
        freq = group["precondition_frequency"]
        with self._lock:
            e = self.registry.entry(key, self._block_name)
            if e.version is None and e.installs == 0 and _has_bases(block):
                e.version = schedule.initial_version(step, freq)  # a basis made before us
            if not schedule.precedes_update:
                schedule.record_age(e, step, freq)  # the update of this step read it already
            replicated = self._coherence is not None and self._coherence.replicated(key)
            if e.pending is not None and schedule.install_now(
                e.pending,
                step,
                due or e.owed,
                exact=schedule.fixed or replicated,
                paced=lambda: self._paced(key, step),
            ):
                self._install_now(key, e, step, block, replicated)
            elif e.pending is not None and schedule.fixed and not replicated:
                self._maybe_spill(e)  # a finished refresh waiting for its install step
            if due and e.pending is not None:
                if not e.owed:
                    schedule.coalesced += 1
                e.owed = True  # requested where the refresh in flight is installed
            elif due or (e.owed and e.pending is None):
                e.owed = False
                self._request(key, e, block, group, step)
                if e.pending is not None and schedule.budget == 0:
                    self._install_now(key, e, step, block, replicated)
            if schedule.precedes_update:
                schedule.record_age(e, step, freq)  # installed above, read by this step

    def _install_now(
        self, key: BlockKey, e: BlockEntry, step: int, block: dict, replicated: bool
    ) -> None:
        """Install ``e``'s refresh in flight at this boundary, waiting for it: on every rank at
        once for a replicated block (Note [Distributed coherence] in distributed.py)."""
        if replicated:
            self._sync(key, e, step, block)
        else:
            self._wait(e, step)
            self._install(key, e, step, block)

    def step_end(self, opt: KroneckerOptimizer) -> None:
        with self._lock:
            for e in self.registry.entries.values():
                if e.pending is not None and e.pending.copies:
                    self._submit_copied(e, wait=False)
            if self._spiller is not None:
                self._page_in()
            if self.placement.bases_access == "mapped":
                for _, _, block, _ in opt.blocks():
                    self._map_bases(block)
            if self._window is not None:
                self._window_step_end(opt)
        self._step += 1
        self.per_step["step_ms"].append((time.perf_counter() - self._step_t0) * 1e3)
        self.per_step["barrier_wait_ms"].append(self._step_wait * 1e3)

    def _sync(self, key: BlockKey, e: BlockEntry, step: int, block: dict | None) -> None:
        """The owner waits for its refresh and sends it (or its failure) to the block's replica
        group; every rank installs what the owner sent, at the same step."""
        coherence = self._coherence
        pending = e.pending
        if block is None:
            block = self._block_state(key)
        status, results, error = 1.0, None, ""
        if coherence.is_owner(key):
            self._wait(e, step)  # the bounded barrier on the owner's own pool
            try:
                results = self._results(key, e, pending, block)
            except (self._C.MatrixFunctionError, MatrixFunctionError) as err:
                status, error = 0.0, str(err)
            except Exception as err:
                status, error = -1.0, f"{type(err).__name__}: {err}"
        e.pending = None
        factors = block["factors"]
        dims = [0 if f is None else int(f.shape[0]) for f in factors]
        dtype = next(f for f in factors if f is not None).dtype
        t0 = time.perf_counter()
        status, results = coherence.exchange(
            key, e.name, step, pending.jobs, dims, dtype, status, results
        )
        self._step_wait += time.perf_counter() - t0
        owner = coherence.owner(key)
        if status == 0.0:
            self._count_failure(e, f" (owner rank {owner})", error)
            return  # keep the previous version, on every rank
        if status != 1.0:
            self._failed += 1
            raise RefreshFailedError(
                f"Asteria: the refresh of block '{e.name}' (version {pending.requested}) failed "
                f"in a worker of its owner rank {owner}" + (f": {error}" if error else "")
            )
        self._install_results(key, block, results)
        self.registry.record_install(e, pending.requested, step)
        e.synced_step = step

    # -- requests, waits, installs ------------------------------------------------------------

    def _settle_install(self, key: BlockKey) -> None:
        """Wait for ``key``'s install on the statistics lane, if one is queued (Note
        [Statistics lane] in lane.py)."""
        if key in self._lane_installs:
            self._lane_installs.discard(key)
            self._lane.wait(key)

    def _request(self, key: BlockKey, e: BlockEntry, block: dict, group: dict, step: int) -> None:
        self._settle_install(key)  # the job's input basis is the one its result replaces
        jobs = self.optimizer.refresh_jobs(block, group)
        if all(job is None for job in jobs):
            return  # nothing to refresh (e.g. SOAP's unfactored 1-D blocks)
        e.pending = PendingRefresh(
            requested=step,
            futures=[None] * len(jobs),
            jobs=[
                None
                if j is None
                else RefreshJob(j.kind, None, None, j.sort, j.root, j.epsilon, j.dtype)
                for j in jobs
            ],
            group=group,
        )
        if self._coherence is not None and self._coherence.replicated(key):
            if not self._coherence.is_owner(key):
                e.pending.owner = self._coherence.owner(key)
                return  # the owner computes it; this rank receives it at the deadline
        if self._spiller is not None and e.name in self.placement.spilled:
            e.pending.snapshots = SpilledRefresh(f"{e.name}/v{step}/s", len(jobs))
        for dim, job in enumerate(jobs):
            if job is None:
                continue
            if self._staging is not None:  # device parameters: never with the lane
                events = [self._staging.copy((key, dim, "factor"), job.factor)]
                if job.basis is not None:
                    events.append(self._staging.copy((key, dim, "basis"), job.basis))
                e.pending.copies.append((dim, job, events))
            elif self._lane is not None:
                # the factors are what this step's statistics, still on the lane, write: the
                # job is submitted from the lane, behind them (Note [Statistics lane] in lane.py)
                # (what the lane runs holds no reference to the runtime or the optimizer, which
                # stay collectable without close(): tests/unit/test_shutdown.py)
                keep = e.pending.snapshots is not None
                name, deadline = f"{e.name}.dim{dim}", step + self.config.staleness
                work = self._lane.call(
                    key, _lane_submit, self._pool, name, step, deadline, job, keep
                )
                e.pending.copies.append((dim, job, [work]))
            else:
                e.pending.futures[dim] = self._submit(e, dim, job, job.factor, job.basis)

    def _submit(
        self,
        e: BlockEntry,
        dim: int,
        job: RefreshJob,
        factor: torch.Tensor | None,
        basis: torch.Tensor | None,
        pending: PendingRefresh | None = None,
        future: Any = None,
    ) -> Any:
        """One job on the pool (it copies its inputs): version = request step, deadline t + S,
        or the bookkeeping of one the statistics lane submitted (``future``). A spilled block's
        inputs are written to the spill store too (an exact recompute)."""
        pending = e.pending if pending is None else pending
        if pending.snapshots is not None and pending is e.pending:
            self._spiller.add(pending.snapshots, dim, (factor, basis), clone=True)
            self._spiller.counts["snapshots"] += 1
        self._submitted += 1
        name = f"{e.name}.dim{dim}"
        self._pool_names.add(name)
        if future is not None:
            return future
        version = pending.requested
        deadline = version + self.config.staleness
        return _pool_submit(self._pool, name, version, deadline, job, factor, basis)

    def _submit_copied(self, e: BlockEntry, wait: bool) -> None:
        """Submit the jobs whose snapshot copies have landed (all of them when ``wait``); book
        those the statistics lane submitted."""
        remaining = []
        for dim, job, events in e.pending.copies:
            if not wait and not all(ev.query() for ev in events):
                remaining.append((dim, job, events))
                continue
            for ev in events:
                ev.synchronize()  # (done already unless ``wait``) raises a failed copy's error
            if isinstance(events[0], LaneWork):
                future, kept = events[0].value
                factor, basis = kept if kept is not None else (None, None)
                e.pending.futures[dim] = self._submit(e, dim, job, factor, basis, future=future)
                continue
            basis = events[1].host if len(events) > 1 else None
            e.pending.futures[dim] = self._submit(e, dim, job, events[0].host, basis)
        e.pending.copies = remaining

    def _drop(self, e: BlockEntry) -> None:
        """Forget ``e``'s refresh in flight: its unfinished jobs count as cancelled, its spilled
        data is discarded. A job still waiting for its snapshot copy was never submitted: it
        counts as cancelled too."""
        self._cancelled += sum(f is not None and not f.done() for f in e.pending.futures)
        self._cancelled += len(e.pending.copies)
        if self._spiller is not None:
            self._spiller.discard(e.pending.spilled)
            self._spiller.discard(e.pending.snapshots)
        e.pending = None
        e.owed = False

    def _wait(self, e: BlockEntry, step: int) -> None:
        """The bounded barrier: wait (GIL released) for every future of ``e``'s refresh."""
        t0 = time.perf_counter()
        limit = self.config.barrier_timeout_s
        if e.pending.copies:
            self._submit_copied(e, wait=True)
        for f in e.pending.futures:
            if f is None or f.done():
                continue
            remaining = limit - (time.perf_counter() - t0)
            try:
                _interruptible_result(f, max(remaining, 0.0), self._C.FutureTimeoutError)
            except self._C.FutureTimeoutError:
                raise StalenessTimeoutError(
                    f"Asteria: the refresh of block '{e.name}' requested at step "
                    f"{e.pending.requested} was not ready at step {step} (staleness budget "
                    f"{self.config.staleness}) after waiting {limit:g} s at the barrier "
                    f"(barrier_timeout_s)"
                ) from None
            except Exception:  # failures are handled by _install, which reads every result
                pass
        self._step_wait += time.perf_counter() - t0

    def _count_failure(
        self, e: BlockEntry, where: str, error: str, cause: BaseException | None = None
    ) -> None:
        """A refresh of ``e`` that failed (the previous version stays in use): counted, and a
        ``RefreshFailedError`` once ``max_consecutive_failures`` are in a row. ``where`` follows
        the block's name in the message (" (owner rank r)" under torch.distributed)."""
        self._failed += 1
        e.failures += 1
        e.consecutive_failures += 1
        if e.consecutive_failures >= self.config.max_consecutive_failures:
            raise RefreshFailedError(
                f"Asteria: the refresh of block '{e.name}'{where} failed "
                f"{e.consecutive_failures} times in a row"
                + (f"; last error: {error}" if error else "")
            ) from cause

    def _install(self, key: BlockKey, e: BlockEntry, step: int, block: dict | None = None) -> None:
        pending, e.pending = e.pending, None
        try:
            results = self._results(key, e, pending, block)
        except (self._C.MatrixFunctionError, MatrixFunctionError) as err:
            self._count_failure(e, "", str(err), cause=err)
            return  # keep the previous version
        except Exception as err:
            self._failed += 1
            raise RefreshFailedError(
                f"Asteria: the refresh of block '{e.name}' (version {pending.requested}) failed "
                f"in a worker: {err}"
            ) from err
        if block is None:
            block = self._block_state(key)
        self._install_results(key, block, results)
        self.registry.record_install(e, pending.requested, step)
        if self.config.pace_installs:
            self._pace_period(step)
            self._pace_spent += self._install_cost(key, block)

    # Note [Paced installs]: refreshes requested at the same step (SOAP's blocks all share the
    # precondition frequency) tend to finish together, a step or two later, and an install that
    # computes (SOAP rotates its first moment into the new basis, about a third of its step's
    # work) would then put all of them on one step: the step after every refresh was the
    # largest of bench/step_time.py. The budget allows installing any of them at any step up
    # to the deadline, so the runtime spreads them: each step gets an allowance, the sum over
    # the finished refreshes of install cost / steps left before its deadline (counted at the
    # step's first decision), and a finished refresh is installed while the step has spent less
    # (at least one per step, so none waits behind a large one). The deadline still forces an
    # install, whatever the allowance (and is charged to it). Costs are the optimizer's
    # ``install_cost`` (flops); a free install (KL-Shampoo, Shampoo: a pointer swap) is never
    # held back, and neither is one the statistics lane runs (it costs the training thread
    # nothing). ``fixed_delay``, ``staleness=0`` and replicated blocks under torch.distributed
    # install at fixed steps and do not pace. Opt-in (``pace_installs``): the spread costs
    # staleness (on bench/step_time.py, without the lane's installs, SOAP's final loss went from
    # 2.244 to 2.28 with the largest step 1.35 -> 1.29 times the median).

    def _paced(self, key: BlockKey, step: int) -> bool:
        """Whether a finished refresh of ``key`` may be installed in this step (``step``: the
        optimizer step whose boundary comes next) within its allowance (Note [Paced installs])."""
        if not self.config.pace_installs:
            return True
        cost = self._install_cost(key)
        if cost == 0.0:
            return True
        self._pace_period(step)
        return self._pace_spent == 0.0 or self._pace_spent + cost <= self._pace_budget

    def _pace_period(self, step: int) -> None:
        """Open this step's allowance at its first install decision."""
        if self._pace_step == self._step:
            return
        self._pace_step, self._pace_spent = self._step, 0.0
        budget = 0.0
        for key, e in self.registry.entries.items():
            p = e.pending
            if p is not None and p.owner is None and p.done():
                left = p.requested + self.config.staleness - step + 1
                budget += self._install_cost(key) / max(1, left)
        self._pace_budget = budget

    def _install_cost(self, key: BlockKey, block: dict | None = None) -> float:
        """The install's cost on the training thread: none when it runs on the lane."""
        return 0.0 if self._lane_installs_on else self._install_flops(key, block)

    def _install_flops(self, key: BlockKey, block: dict | None = None) -> float:
        """The optimizer's ``install_cost`` of ``key``'s block (its shapes never change)."""
        cost = self._install_costs.get(key)
        if cost is None:
            block = self._block_state(key) if block is None else block
            cost = self._install_costs[key] = float(self.optimizer.install_cost(block))
        return cost

    def _install_results(self, key: BlockKey, block: dict, results: list[Any]) -> None:
        """``install_refresh`` where the bases live: device, mapped host memory, or host memory
        behind the window (the new bases are copied to pinned host memory right away)."""
        results = [self._to_device(r, block) for r in results]
        if self._window is None:
            if self._lane_installs_on and self._install_flops(key, block) > 0:
                # an install that computes (SOAP's rotation of m) runs on the statistics lane;
                # the block's next read of its state waits for it (``_settle_install``)
                opt = weakref.ref(self.optimizer)
                self._lane.submit(key, _install_weakly, opt, block, results)
                self._lane_installs.add(key)
                return
            self.optimizer.install_refresh(block, results)
            if self.placement.bases_access == "mapped":
                self._map_bases(block)
            return
        bases = self._host_bases(block)
        handed: list[Any] = []
        if self.optimizer.install_reads_bases and any(q is not None for q in bases):
            hosted = list(bases)
            handed = bases[:] = self._window_use(key, block, prefetch=False)
        self.optimizer.install_refresh(block, results)
        bases = self._bases_list(block)
        for i, q in enumerate(handed):  # a dim the refresh left alone keeps its host tensor
            if q is not None and bases[i] is q:
                bases[i] = hosted[i]
        self._host_bases(block)

    # -- the spill tier ---------------------------------------------------------------------------

    def _results(
        self,
        key: BlockKey,
        e: BlockEntry,
        pending: PendingRefresh,
        block: dict | None,
        consume: bool = True,
    ) -> list[Any]:
        """A refresh's results: from its futures, or read back from the spill store (a lost
        slot is recomputed, see ``_recompute``). ``consume`` (an install) discards the spilled
        data afterwards; a checkpoint reads without consuming."""
        if pending.spilled is None:
            results = [None if f is None else f.result() for f in pending.futures]
            if self._spiller is not None and consume:
                self._spiller.discard(pending.snapshots)
            return results
        try:
            return self._spiller.load(pending.spilled)
        except SpillLost as err:
            return self._recompute(key, e, pending, block, err)
        finally:
            if consume:
                self._spiller.discard(pending.spilled)
                self._spiller.discard(pending.snapshots)

    def _recompute(
        self,
        key: BlockKey,
        e: BlockEntry,
        pending: PendingRefresh,
        block: dict | None,
        err: SpillLost,
    ) -> list[Any]:
        """Run a lost refresh again on the pool and wait for it (the install step is kept): from
        its snapshot when that reads back intact (the same inputs, so the same result), else from
        the block's current factors and basis (a fresher refresh than the lost one)."""
        inputs = None
        if pending.snapshots is not None:
            try:
                inputs = self._spiller.load(pending.snapshots)
                self._spiller.counts["recomputed_from_snapshot"] += 1
                source = "its spilled inputs (same result)"
            except SpillLost:
                inputs = None
        if inputs is None:
            if block is None:
                block = self._block_state(key)
            jobs = self.optimizer.refresh_jobs(block, pending.group)
            inputs = [None if j is None else (j.factor, j.basis) for j in jobs]
            self._spiller.counts["recomputed_from_factors"] += 1
            source = "the current factors (its inputs were lost too)"
        warnings.warn(
            f"Asteria: the spilled refresh of block '{e.name}' (version {pending.requested}) "
            f"could not be read back ({err}); recomputed from {source}",
            RuntimeWarning,
            stacklevel=5,
        )
        futures = [
            None
            if job is None or inp is None
            else self._submit(e, dim, job, inp[0], inp[1], pending=pending)
            for dim, (job, inp) in enumerate(zip(pending.jobs, inputs))
        ]
        t0 = time.perf_counter()
        results = [
            None if f is None else f.result(timeout_s=self.config.barrier_timeout_s)
            for f in futures
        ]
        self._step_wait += time.perf_counter() - t0
        return results

    def _maybe_spill(self, e: BlockEntry) -> None:
        """A finished refresh that waits for its install step goes to the spill store when the
        policy spills its block; a failed job stays put (``_install`` reports it)."""
        pending = e.pending
        if (
            self._spiller is None
            or pending.spilled is not None
            or e.name not in self.placement.spilled
            or not pending.done()
        ):
            return
        try:
            results = [None if f is None else f.result() for f in pending.futures]
        except Exception:
            return
        rec = SpilledRefresh(f"{e.name}/v{pending.requested}/r", len(results))
        for dim, r in enumerate(results):
            self._spiller.add(rec, dim, tuple(r) if isinstance(r, tuple) else r)
        self._spiller.counts["spilled_refreshes"] += 1
        pending.spilled = rec
        pending.futures = [None] * len(results)
        for dim, r in enumerate(results):  # the pool's copy of the results: host memory no more
            if r is not None:
                self._pool.release(f"{e.name}.dim{dim}", pending.requested)

    def _page_in(self) -> None:
        """Settle finished writes; start reading, in access order, the spilled refreshes that
        the next step installs."""
        fixed = self.config.fixed_delay
        due = []
        for key in sorted(self.registry.entries):
            p = self.registry.entries[key].pending
            if p is None:
                continue
            if p.snapshots is not None:
                self._spiller.poll(p.snapshots)
            if p.spilled is None:
                continue
            self._spiller.poll(p.spilled)
            if p.requested + fixed <= self._current_step(key) + 1:
                due.append(p.spilled)
        self._spiller.prefetch(due)

    # -- bases in mapped host memory (unified-memory GPUs) ----------------------------------------

    @staticmethod
    def _bases_list(block: dict) -> list[Any]:
        return block["bases"] if "bases" in block else block.get("roots", [])

    def _map_bases(self, block: dict) -> None:
        """Move a block's bases in use to pinned host memory, read by the GPU through views."""
        bases = self._bases_list(block)
        for i, q in enumerate(bases):
            if q is None or not q.is_cuda or q.data_ptr() in self._mapped:
                continue
            view = device_view(host_copy(q, pinned=True), q.device)
            self._mapped.add(view.data_ptr())
            bases[i] = view

    def _unmap_bases(self) -> None:
        """Back to native mode: bases in device memory again."""
        if not self._mapped:
            return
        for _, _, block, _ in self.optimizer.blocks():
            bases = self._bases_list(block)
            for i, q in enumerate(bases):
                if q is not None and q.data_ptr() in self._mapped:
                    bases[i] = q.clone()
        self._mapped.clear()

    # -- bases in pinned host memory behind a device window (discrete GPUs) -----------------------

    def _window_use(self, key: BlockKey, block: dict, prefetch: bool) -> list[Any]:
        """Device copies of ``key``'s bases from the window; with ``prefetch``, also start the
        copy of the block read after it last step (Note [Bases window])."""
        srcs = self._host_bases(block)
        if all(q is None for q in srcs):
            return list(srcs)  # nothing to read yet (Shampoo before its first roots, 1-D SOAP)
        upcoming = None
        if prefetch:
            self._window_seen.append(key)
            nxt = self._window_next.get(key)
            nblock = None if nxt is None else self._block_state_or_none(nxt)
            if nblock is not None:
                nsrcs = self._bases_list(nblock)
                if all(q is None or is_host_tensor(q) for q in nsrcs):
                    upcoming = (nxt, nsrcs)
        self._fit_window(key, srcs)
        return self._window.use(key, srcs, upcoming)

    def _host_bases(self, block: dict) -> list[Any]:
        """Move ``block``'s bases that are not in Asteria host memory there (pinned on CUDA, in
        their own layout); the copy is synchronous, like the installs' host-to-device copies."""
        bases = self._bases_list(block)
        for i, q in enumerate(bases):
            if q is not None and not is_host_tensor(q):
                flat = host_empty(q.numel(), q.dtype, pinned=q.is_cuda)
                bases[i] = view_like(flat, q).copy_(q)  # q's layout: the same arithmetic
        return bases

    def _fit_window(self, key: BlockKey, srcs: list[Any]) -> None:
        """Grow the window's slots when a block's bases outgrow them (a parameter added after
        attaching, a state loaded in another dtype), within ``device_budget_bytes``."""
        need = BasesWindow.bytes_of(srcs)
        window = self._window
        if need <= window.slot_bytes:
            return
        budget = self.config.device_budget_bytes
        planned = self.placement.bytes["device"]
        device = planned["factors"] + planned["moments"] + window.slots * need
        if budget is not None and device > budget:
            raise ValueError(
                f"Asteria: the bases of block '{self._block_name(key)}' take {need} bytes, more "
                f"than the {window.slot_bytes}-byte slots of the device window planned when the "
                f"runtime was attached; a window of {window.slots} such slots puts {device} "
                f"bytes of optimizer state on the device, over device_budget_bytes={budget}. "
                f"Raise device_budget_bytes to at least {device}, attach the runtime after "
                "every parameter is in the optimizer, or lower max_preconditioner_dim"
            )
        window.resize(need)

    def _window_step_end(self, opt: KroneckerOptimizer) -> None:
        """The last block's kernels are issued; bases made this step (first steps) go to host
        memory; the order the step read the blocks in becomes the prefetch order."""
        self._window.finish()
        for _, _, block, _ in opt.blocks():
            self._host_bases(block)
        seen = self._window_seen
        if seen:
            self._window_next = {k: seen[(i + 1) % len(seen)] for i, k in enumerate(seen)}
            self._window_seen = []

    def _close_window(self) -> None:
        """Back to native mode: the bases in device memory again, the window freed."""
        if self._window is None:
            return
        self._window.close()
        for _, p, block, _ in self.optimizer.blocks():
            bases = self._bases_list(block)
            for i, q in enumerate(bases):
                if q is not None and q.device != p.device:
                    bases[i] = q.to(p.device)

    def _block_state_or_none(self, key: BlockKey) -> dict | None:
        state = self.optimizer.state.get(_params(self.optimizer)[key[0]])
        blocks = None if state is None else state.get("blocks")
        return None if blocks is None or key[1] >= len(blocks) else blocks[key[1]]

    @staticmethod
    def _to_device(result: Any, block: dict) -> Any:
        if result is None:
            return None
        device = next(t for t in block["factors"] if t is not None).device
        if isinstance(result, tuple):
            return tuple(None if r is None else r.to(device) for r in result)
        return result.to(device)

    # -- hooks: flush what is ready --------------------------------------------------------------

    def _on_signal(self, param_ids: tuple[int, ...], event: str) -> None:
        if self._closed:
            return
        with self._lock:
            for i in param_ids:
                pid = self._pid_of[i]
                if not self._installs_on_signal(pid):
                    continue
                for key, e in self.registry.by_param.get(pid, ()):
                    if e.pending is None:
                        continue
                    if e.pending.copies:
                        self._submit_copied(e, wait=False)
                    step = self._current_step(key)
                    if e.pending.done() and self._paced(key, step + 1):
                        # between steps `step` and `step + 1`; Shampoo, which refreshes
                        # before its update, would have used it in step `step` already
                        late = int(self.optimizer.refresh_precedes_update)
                        self._install(key, e, step + late)

    # -- introspection -----------------------------------------------------------------------

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The runtime's part of a checkpoint: every refresh still in flight, finished first.

        Note [Checkpoints with work in flight]: a refresh requested at step ``t`` and not yet
        installed is waited for (the barrier, bounded by ``barrier_timeout_s``) and saved with its
        request step and results, not re-submitted on load: its inputs were the factors of step
        ``t``, which the checkpoint no longer holds. After ``load_state_dict`` it is installed at
        the step it would have been (``t + fixed_delay``, or as soon as possible within the
        budget), so a ``fixed_delay`` run resumed from a checkpoint follows the uninterrupted run
        bit for bit (tests/unit/test_checkpoint.py). Save it next to ``optimizer.state_dict()``
        (taken at the same step boundary) and load both in that order.

        Under torch.distributed the state is this rank's (save it per rank, e.g. with
        :func:`asteria.checkpoint.save`); it involves no collective. A replicated block's refresh
        in flight is saved with its results by its owner, and as "expected from rank ``r``" by the
        other replicas, with the job options the sync needs; after loading on the same ranks, the
        sync at its deadline proceeds as it would have (tests/distributed).
        """
        self.sync(self.optimizer)
        pending = []
        with self._lock:
            for key, e in sorted(self.registry.entries.items()):
                p = e.pending
                if p is None:
                    continue
                item: dict[str, Any] = {
                    "key": key,
                    "requested": p.requested,
                    "results": None,
                    "error": None,
                    "jobs": [None if j is None else _job_options(j) for j in p.jobs],
                    "owner": p.owner,
                }
                if p.owner is None:  # computed here (a local block, or this rank owns it)
                    self._wait(e, self._current_step(key))
                    try:
                        item["results"] = self._results(key, e, p, None, consume=False)
                    except (self._C.MatrixFunctionError, MatrixFunctionError) as err:
                        item["error"] = str(err)
                pending.append(item)
        return {"format": 1, "pending": pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the refreshes in flight of :meth:`state_dict`, after the optimizer's own
        ``load_state_dict`` (Note [Checkpoints with work in flight])."""
        if not isinstance(state, dict) or state.get("format") != 1:
            raise ValueError("not a Runtime.state_dict() of this version (format 1)")
        known = {key for key, *_ in self.optimizer.blocks()}
        with self._lock:
            for item in state["pending"]:
                key = tuple(item["key"])
                if key not in known:
                    raise ValueError(
                        f"the checkpoint has a refresh in flight for block {key}, which the "
                        "optimizer does not have: load the optimizer's state_dict first"
                    )
                e = self.registry.entry(key, self._block_name)
                jobs = [None if j is None else _job_from_options(j) for j in item.get("jobs", [])]
                owner = item.get("owner")
                if owner is not None and (
                    self._coherence is None or self._coherence.owner(key) != owner
                ):
                    raise ValueError(
                        f"the checkpoint expects block {key}'s refresh in flight from rank "
                        f"{owner}, which does not own it here: load on the ranks that saved it"
                    )
                if owner is not None:
                    futures: list[Any] = [None] * len(jobs)
                elif item["error"] is not None:
                    futures = [_Restored(error=item["error"])]
                else:
                    futures = [None if r is None else _Restored(r) for r in item["results"]]
                e.pending = PendingRefresh(
                    requested=int(item["requested"]), futures=futures, jobs=jobs, owner=owner
                )

    def stats(self) -> dict[str, Any]:
        """Figures the benchmarks read: per-step times, barrier waits, jobs, staleness."""
        pool = dict(self._pool.stats())
        hist = dict(sorted(self.registry.histogram.items()))
        return {
            "steps": self._step,
            "step_ms": list(self.per_step["step_ms"]),
            "barrier_wait_ms": list(self.per_step["barrier_wait_ms"]),
            "jobs": {
                "submitted": self._submitted,
                "completed": int(pool.get("completed", 0)),
                "cancelled": self._cancelled,
                "failed": self._failed,
                "coalesced_requests": self.schedule.coalesced,
                "in_flight": self.registry.pending_count(),
            },
            "pool": pool,
            "staleness_histogram": hist,
            "max_staleness": max(hist) if hist else 0,
            # the age of the basis every step read (Note [Staleness contract] in schedule.py)
            "basis_age": self.schedule.report(list(self.registry.entries.values())),
            "installs": sum(hist.values()),
            "blocks": self.registry.snapshot(),
            # updates skipped for NaN/Inf gradients (Note [Non-finite gradients], optim/base.py)
            "nonfinite_grads": self.optimizer.nonfinite_grads,
            "statistics_lane": None
            if self._lane is None
            else {"updates": self._lane.submitted, "wait_ms": self._lane.wait_s * 1e3},
            # this rank's figures under torch.distributed (Note [Distributed coherence])
            "distributed": None if self._coherence is None else self._coherence.stats(),
        }

    def memory_report(self) -> dict[str, Any]:
        """Bytes per tier per state kind, measured on the tensors that exist now.

        ``report[tier][kind]`` for tier in ``device``, ``host``, ``nvme`` and kind in
        ``factors``, ``moments``, ``bases``, ``results``, ``snapshots``, ``staging``. Counted:
        the optimizer's state tensors (by kind; bases by where they are: on a CPU-only machine
        the placement says which tier the CPU tensors stand for), refresh results waiting for
        install (in their futures, in host memory, paged in, or in the spill store), the pool's
        copy of each block's newest result (``WorkerPool.latest``), the job inputs kept for a
        spilled refresh, the CUDA staging slots and the bases window's device buffers
        (``device/bases``). A storage shared by several of these is counted once, under the
        first. Also: ``planned`` (the policy's figures), ``placement`` (kind -> tier, spilled
        blocks, how the device reads host bases, the window's counters or None) and ``spill``
        (the spill store's counters, or None).
        """
        report = {tier: dict.fromkeys(KINDS, 0) for tier in TIERS}
        seen: set[tuple[int, int]] = set()

        def add(tier: str, kind: str, value: Any) -> None:
            if isinstance(value, (list, tuple)):
                for v in value:
                    add(tier, kind, v)
                return
            if not isinstance(value, torch.Tensor) or value.nbytes == 0:
                return
            ident = (value.data_ptr(), value.nbytes)
            if ident in seen:
                return
            seen.add(ident)
            report[tier][kind] += value.nbytes

        bases_tier = self.placement.tiers["bases"]

        def where(t: Any) -> str:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                return "host" if t.data_ptr() in self._mapped else "device"
            return "host" if self.arch.cuda else bases_tier

        with self._lock:
            for p in _params(self.optimizer):
                state = self.optimizer.state.get(p, {})
                for name, value in state.items():
                    if name != "blocks":
                        add("device", "moments", value)
                        continue
                    for block in value:
                        for field, v in block.items():
                            if field == "factors":
                                add("device", "factors", v)
                            elif field in ("bases", "roots"):
                                for q in v:
                                    add(where(q), "bases", q)
                            else:
                                add("device", "moments", v)
            spiller = self._spiller
            for e in self.registry.entries.values():
                pending = e.pending
                if pending is None:
                    continue
                for f in pending.futures:
                    if f is not None and f.done():
                        try:
                            add("host", "results", f.result())
                        except Exception:
                            pass
                for kind, rec in (("results", pending.spilled), ("snapshots", pending.snapshots)):
                    if rec is None:
                        continue
                    add("host", kind, rec.host_tensors())
                    report["nvme"][kind] += spiller.nvme_bytes(rec)
                    report["host"][kind] += spiller.paged_bytes(rec)
            for name in sorted(self._pool_names):
                latest = self._pool.latest(name)
                if latest is not None:
                    add("host", "results", latest[1])
            if self._staging is not None:
                add("host", "staging", [buf for buf, _ in self._staging._slots.values()])
            if self._window is not None:
                add("device", "bases", self._window.buffers())
        report["planned"] = {tier: dict(kinds) for tier, kinds in self.placement.bytes.items()}
        report["placement"] = {
            "tiers": dict(self.placement.tiers),
            "spilled_blocks": sorted(self.placement.spilled),
            "bases_access": self.placement.bases_access,
            "notes": list(self.placement.notes),
            "window": None if self._window is None else self._window.stats(),
        }
        report["spill"] = None if self._spiller is None else self._spiller.stats()
        return report

    # -- helpers ------------------------------------------------------------------------------

    def _current_step(self, key: BlockKey) -> int:
        p = _params(self.optimizer)[key[0]]
        return int(self.optimizer.state[p]["step"])

    def _block_state(self, key: BlockKey) -> dict:
        p = _params(self.optimizer)[key[0]]
        return self.optimizer.state[p]["blocks"][key[1]]

    def _block_name(self, key: BlockKey) -> str:
        """``name[i]`` for block ``i`` of a parameter; ``name`` for its parameter-level state."""
        param = self._names.get(key[0], f"param{key[0]}")
        return param if key[1] < 0 else f"{param}[{key[1]}]"

    @staticmethod
    def _param_names(model: torch.nn.Module | None, opt: KroneckerOptimizer) -> dict[int, str]:
        if model is None:
            return {}
        by_id = {id(p): n for n, p in model.named_parameters()}
        return {i: by_id[id(p)] for i, p in enumerate(_params(opt)) if id(p) in by_id}

    def __repr__(self) -> str:
        c = self.config
        return (
            f"asteria.Runtime(staleness={c.staleness}, workers={c.resolved_workers}, "
            f"fixed_delay={c.fixed_delay}, closed={self._closed})"
        )


# -- issue 7: shutdown helpers -----------------------------------------------------------------


def _weak_signal(runtime: Runtime) -> Any:
    """``runtime._on_signal`` through a weak reference (a no-op once the runtime is gone)."""
    ref = weakref.WeakMethod(runtime._on_signal)

    def signal(param_ids: tuple[int, ...], event: str) -> None:
        method = ref()
        if method is not None:
            method(param_ids, event)

    return signal


def _pool_submit(
    pool: Any,
    name: str,
    version: int,
    deadline: int,
    job: RefreshJob,
    factor: torch.Tensor,
    basis: torch.Tensor | None,
) -> Any:
    """One job on the pool (it copies ``factor`` and ``basis`` at submission); slower under
    ``asteria.runtime.testing.slow_pool``."""
    if job.kind == "qr":
        future = pool.submit_qr_refresh(name, version, deadline, factor, basis, job.sort, job.dtype)
    else:
        future = pool.submit_inverse_root(
            name, version, deadline, factor, job.root, job.epsilon, job.dtype
        )
    return testing.delayed(future, load_extension().FutureTimeoutError)


def _lane_submit(
    pool: Any, name: str, version: int, deadline: int, job: RefreshJob, keep: bool
) -> tuple[Any, tuple | None]:
    """On the statistics lane, behind the block's statistics: submit the job (the pool copies
    the factor and basis as they are now), and keep copies of them for a spilled block
    (``keep``)."""
    kept = None
    if keep:
        kept = (job.factor.clone(), None if job.basis is None else job.basis.clone())
    return _pool_submit(pool, name, version, deadline, job, job.factor, job.basis), kept


def _install_weakly(opt: weakref.ref, block: dict, results: list[Any]) -> None:
    """On the statistics lane: ``install_refresh``, unless the optimizer is gone."""
    optimizer = opt()
    if optimizer is not None:
        optimizer.install_refresh(block, results)


def _job_options(job: RefreshJob) -> dict[str, Any]:
    """A job's options without its tensors, as plain values (a checkpoint's)."""
    return {
        "kind": job.kind,
        "sort": job.sort,
        "root": job.root,
        "epsilon": job.epsilon,
        "dtype": str(job.dtype).removeprefix("torch."),
    }


def _job_from_options(options: dict[str, Any]) -> RefreshJob:
    o = dict(options)
    return RefreshJob(
        o["kind"], None, None, o["sort"], o["root"], o["epsilon"], getattr(torch, o["dtype"])
    )


class _Restored:
    """A refresh result restored from a checkpoint: a future that has already resolved."""

    def __init__(self, value: Any = None, error: str | None = None) -> None:
        self._value, self._error = value, error

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def result(self, timeout_s: float | None = None) -> Any:
        if self._error is not None:
            raise MatrixFunctionError(self._error)
        return self._value


def _interruptible_result(future: Any, timeout_s: float, timeout_error: type) -> Any:
    """``future.result(timeout_s)`` in slices of 0.1 s: between slices the interpreter runs, so
    Ctrl-C (SIGINT) raises KeyboardInterrupt promptly during a long barrier wait."""
    deadline = time.perf_counter() + timeout_s
    while True:
        try:
            return future.result(timeout_s=min(0.1, max(deadline - time.perf_counter(), 0.0)))
        except timeout_error:
            if time.perf_counter() >= deadline:
                raise


def _has_bases(block: dict) -> bool:
    bases = block["bases"] if "bases" in block else block.get("roots", [])
    return any(q is not None for q in bases)


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]
