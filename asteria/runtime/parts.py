"""The parts of a runtime, made once from the attach-time choices (attach.py).

Owns: ``Parts`` and ``build`` (the registry, schedule, coherence, spill tier, pool and
executors, statistics lane and gradient guards, snapshot and bases strategies sharing the
device's one copy stream, pacer, refreshes, plan and module signals), ``connect`` (the runtime
made the optimizer's refresher, the model hooked), and ``Parts.undo``, which takes down what a
refused attach made.

Must not: decide anything (attach.py chooses; the parts act per step), or hold a strong
reference to the runtime in what it makes (hooks and finalizers hold it weakly).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from asteria.memory.copies import Copies, copies_for
from asteria.memory.host import StagingRing
from asteria.memory.tiers import Placement
from asteria.memory.window import BasesWindow
from asteria.optim.base import KroneckerOptimizer
from asteria.optim.matrix_functions import MatrixFunctionError
from asteria.optim.refresher import BlockKey
from asteria.runtime import state
from asteria.runtime.attach import (
    Attachment,
    NoSpareCoreWarning,
    choose,
    device_stream_allowed,
    distributed_mode,
    namer,
    param_names,
    params_of,
    test_overrides,
    window_blocks,
)
from asteria.runtime.bases import BasesAccess, DeviceBases, MappedBases
from asteria.runtime.config import RuntimeConfig
from asteria.runtime.distributed import Coherence
from asteria.runtime.hooks import GradientGuards, ModuleSignals
from asteria.runtime.lane import StatisticsLane
from asteria.runtime.placement import Executors, StreamExecutor
from asteria.runtime.plan import Plan
from asteria.runtime.refreshes import Refreshes
from asteria.runtime.registry import Registry
from asteria.runtime.schedule import InstallCosts, Pacer, Schedule
from asteria.runtime.snapshots import LaneSnapshots, Snapshots, StagedSnapshots
from asteria.runtime.spill import SpillTier, open_spill
from asteria.runtime.window_bases import WindowBases

__all__ = ["Parts", "build", "check_cuda_build", "connect", "installs_on_signal"]


def copy_stream(optimizer: KroneckerOptimizer) -> Copies:
    """The copy stream of the parameters' device (the one the runtime's parts share)."""
    params = params_of(optimizer)
    return copies_for(params[0].device if params else torch.device("cpu"))


def choose_snapshots(
    choices: Attachment,
    pool: object,
    lane: StatisticsLane | None,
    copies: Callable[[], Copies],
) -> Snapshots:
    """Device parameters: staged copies; CPU ones: on the lane where it runs, else direct."""
    if choices.staged:
        slots, slot_bytes = choices.ring
        ring = StagingRing(slots, slot_bytes) if slots else None
        return StagedSnapshots(copies(), ring)
    if lane is not None:
        return LaneSnapshots(lane, pool)
    return Snapshots()


def choose_bases(
    optimizer: KroneckerOptimizer,
    config: RuntimeConfig,
    placement: Placement,
    lane: StatisticsLane | None,
    install_flops: Callable[[BlockKey, dict | None], float],
    block_name: Callable[[BlockKey], str],
    copies: Callable[[], Copies],
    lock: Any,
) -> BasesAccess:
    """The bases strategy of the placement's ``bases_access``."""
    access = placement.bases_access
    if access == "mapped":
        return MappedBases(optimizer)
    if access != "window":
        return DeviceBases(optimizer, lane, install_flops)
    # (on CPU parameters the copy stream is the stand-in: a test that makes the CPU look like a
    # discrete GPU, asteria.runtime.testing.pretend_arch)
    slots = window_blocks()
    window = BasesWindow(copies(), slots, placement.window_bytes // slots)

    def fit(key: BlockKey, need: int, window: BasesWindow) -> None:
        """Grow the window's slots when a block's bases outgrow them (a parameter added after
        attaching, a state loaded in another dtype), within ``device_budget_bytes``."""
        budget = config.device_budget_bytes
        planned = placement.bytes["device"]
        total = planned["factors"] + planned["moments"] + window.slots * need
        if budget is not None and total > budget:
            raise ValueError(
                f"Asteria: the bases of block '{block_name(key)}' take {need} bytes, more than "
                f"the {window.slot_bytes}-byte slots of the device window planned when the "
                f"runtime was attached; a window of {window.slots} such slots puts {total} "
                f"bytes of optimizer state on the device, over device_budget_bytes={budget}. "
                f"Raise device_budget_bytes to at least {total}, attach the runtime after "
                "every parameter is in the optimizer, or lower max_preconditioner_dim"
            )
        window.resize(need)

    return WindowBases(optimizer, window, fit, lock)


def executors(
    optimizer: KroneckerOptimizer, config: RuntimeConfig, pool: object, budget: int
) -> Executors:
    """Where refreshes run (Note [Refresh placement] in placement.py): the pool, and a device
    stream where ``device_refresh`` allows one (default: the parameters are on a CUDA device;
    under ``testing.device_stream_stand_in``, a CPU stand-in)."""
    from asteria._ext import load_extension

    timeout_error = load_extension().FutureTimeoutError
    params = params_of(optimizer)
    device = params[0].device if params else torch.device("cpu")
    cuda = device.type == "cuda" and torch.cuda.is_available()
    t = test_overrides()
    stand_in = t is not None and t.device_stream_forced()
    if config.device_refresh and not cuda and not stand_in:
        raise ValueError(
            "device_refresh=True needs parameters on a CUDA device; these are on "
            f"{device} (device_refresh=None or False runs every refresh on the pool)"
        )
    stream = None
    if stand_in:
        stream = StreamExecutor(None, timeout_error)
    elif device_stream_allowed(config, cuda):
        stream = StreamExecutor(device, timeout_error)
    return Executors(pool, stream, config.resolved_workers, budget, timeout_error, t)


@dataclass
class Parts:
    """The parts of one runtime (docs/architecture.md), made by :func:`build`; a part not made
    (its feature off, or an attach refused before it) is None."""

    names: dict[int, str]  # the model's names of the parameters, by flattened index
    block_name: Callable[[BlockKey], str]
    pid_of: dict[int, int]  # id(parameter) -> flattened index
    registry: Registry
    schedule: Schedule
    coherence: Coherence | None = None
    choices: Attachment | None = None
    warnings: list[str] = field(default_factory=list)  # given at attach (stats()["warnings"])
    spill: SpillTier | None = None
    pool: Any = None
    executors: Executors | None = None
    lane: StatisticsLane | None = None
    grad_guards: GradientGuards | None = None
    signals: ModuleSignals | None = None
    #: the parameters (flattened indices) whose finished refreshes a module signal installs
    signalled: frozenset[int] = frozenset()
    bases: BasesAccess | None = None
    pacer: Pacer | None = None
    refreshes: Refreshes | None = None
    plan: Plan | None = None
    finalizer: Any = None  # weakref.finalize: stops the pool when the runtime goes uncollected
    testing: Any = None  # the test hooks where imported (Note [Test overrides at build])

    def undo(self, optimizer: KroneckerOptimizer, runtime: object) -> None:
        """Take down what a refused attach made (its threads joined)."""
        if self.signals is not None:
            self.signals.remove()
        if optimizer.refresher is runtime:
            optimizer.detach_refresher()
        if self.grad_guards is not None:
            self.grad_guards.remove()
        if self.lane is not None:
            self.lane.close()
        if self.executors is not None:
            self.executors.shutdown()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self.spill is not None:
            self.spill.close()


def build(
    runtime: Any,
    model: torch.nn.Module | None,
    optimizer: KroneckerOptimizer,
    config: RuntimeConfig,
    distributed: bool | None,
    ranks_per_node: int | None,
) -> Parts:
    """Make ``runtime``'s parts for ``optimizer`` from the attach-time choices; :func:`connect`
    then attaches them. A refused attach (an exception of either) leaves no thread, hook or file
    (issue 22). What the parts keep holds no reference to the runtime, which stays collectable
    without ``close()`` (tests/unit/test_shutdown.py): hooks and finalizers hold it weakly."""
    check_cuda_build(q.device for q in params_of(optimizer))
    c = config
    names = param_names(model, optimizer)
    block_name = namer(names)
    budget = c.staleness if c.fixed_delay is None else c.fixed_delay
    schedule = Schedule(
        budget,
        c.fixed_delay is not None,
        optimizer.refresh_precedes_update,
        c.refresh_lead,
        continuous=c.refresh == "continuous",
        wait_first=c.resolved_wait_first_refresh,
        staggered=c.refresh == "staggered",
    )
    pid_of = {id(p): i for i, p in enumerate(params_of(optimizer))}
    p = Parts(names, block_name, pid_of, Registry(c.staleness), schedule)
    p.testing = test_overrides()
    # Under torch.distributed: topology, owners and the sync of replicated blocks (Note
    # [Distributed coherence] in distributed.py). Its attach-time checks are collective and
    # come before any thread, hook or pool exists.
    distributed = distributed_mode(distributed, ranks_per_node)
    if distributed:
        p.coherence = Coherence(optimizer, c, ranks_per_node)
    resumed = optimizer._resumed_refreshes  # checked before any thread starts
    if resumed is not None:
        blocks = {k: (b, optimizer.state[q]["step"]) for k, q, b, _ in optimizer.blocks()}
        state.check(resumed, blocks, schedule.budget, p.coherence, block_name)
    p.choices = choices = choose(optimizer, c, distributed, block_name)
    if choices.no_spare_core is not None:  # Note [No spare core]
        p.warnings.append(choices.no_spare_core)
        warnings.warn(choices.no_spare_core, NoSpareCoreWarning, stacklevel=3)
    p.spill = open_spill(c.nvme_path, c.fixed_delay, choices.placement, choices.sizes)
    try:
        _make_threads(p, runtime, optimizer, c, budget)
    except BaseException:
        p.undo(optimizer, runtime)
        raise
    return p


def check_cuda_build(devices: Iterable[torch.device]) -> None:
    """Refuse CUDA parameters at attach on a CPU-only build of the extension, with what is
    missing and how to fix it (Note [CPU-only builds on CUDA machines] in setup.py), instead of
    a failure at the first refresh request (the staging fences, the window's pinned memory)."""
    if any(d.type == "cuda" for d in devices):
        from asteria._ext import cuda_missing, load_extension
        from asteria.lowlevel.capabilities import CudaUnavailableError

        missing = cuda_missing(load_extension())
        if missing is not None:
            raise CudaUnavailableError(f"Asteria: the parameters are on CUDA, but {missing}")


def _make_threads(
    p: Parts, runtime: Any, optimizer: KroneckerOptimizer, c: RuntimeConfig, budget: int
) -> None:
    """The parts with threads or streams, each kept in ``p`` as soon as it exists (so that
    ``Parts.undo`` takes down what a failure leaves)."""
    from asteria._ext import load_extension

    choices = p.choices
    _C = load_extension()
    p.pool = _C.WorkerPool(
        workers=c.resolved_workers,
        lapack_threads=c.lapack_threads,
        affinity=list(c.affinity) if c.affinity else None,
        nice=choices.nice,
    )
    # where each refresh runs: the pool, or a device stream (Note [Refresh placement])
    p.executors = executors(optimizer, c, p.pool, budget)
    weakref.finalize(runtime, p.executors.shutdown)  # the device stream's thread
    if choices.lane:
        # a gradient hook per parameter keeps the next backward from writing a gradient the
        # lane still reads (Note [Gradient guards] in hooks.py)
        p.lane = StatisticsLane(p.block_name, c.barrier_timeout_s)
        p.grad_guards = GradientGuards(params_of(optimizer), p.lane, always=p.coherence is not None)
    # (a cost is asked for only once ``p.refreshes``, made below, installs)
    costs = InstallCosts(optimizer.install_cost, lambda key: p.refreshes.block_state(key))
    # one copy stream (least priority), made once, for the window and the staged snapshots
    copies = functools.cache(functools.partial(copy_stream, optimizer))
    p.bases = choose_bases(
        optimizer, c, choices.placement, p.lane, costs, p.block_name, copies, runtime._lock
    )
    # a staged snapshot waits for the host bases it reads itself (Note [Host sources of a
    # snapshot] in asteria/memory/staging.py); another, read by the pool, needs ``settle``
    p.bases.settles = p.bases.settles and not choices.staged
    thread_cost = _free if p.bases.installs_off_thread else costs
    p.pacer = Pacer(c.pace_installs, c.staleness, p.registry.entries, thread_cost)
    p.refreshes = Refreshes(
        optimizer,
        c,
        p.registry,
        p.executors,
        choose_snapshots(choices, p.executors, p.lane, copies),
        p.bases,
        p.pacer,
        p.block_name,
        spill=p.spill,
        coherence=p.coherence,
        errors=(_C.MatrixFunctionError, MatrixFunctionError),
        timeout_error=_C.FutureTimeoutError,
    )
    p.plan = Plan(p.schedule, p.refreshes, p.registry, p.pacer)


def connect(
    p: Parts,
    runtime: Any,
    model: torch.nn.Module | None,
    optimizer: KroneckerOptimizer,
    config: RuntimeConfig,
) -> None:
    """Attach ``runtime``, which holds the parts ``p`` already (a resumed optimizer loads its
    refreshes in flight into it here), as ``optimizer``'s refresher, and hook ``model``'s
    modules; a refusal takes every part down (``Parts.undo``) and raises."""
    try:
        optimizer.attach_refresher(runtime)  # raises ValueError when already orchestrated
        for pid, name in p.names.items():  # messages name parameters (issue 7)
            optimizer.param_names.setdefault(pid, name)
        if model is not None and config.hooks:
            # the hooks hold the runtime weakly and go when it is collected without close(), so
            # a model that outlives its optimizer keeps no runtime alive; none where they could
            # not change anything (``installs_on_signal``)
            p.signalled = frozenset(
                pid for pid in p.pid_of.values() if installs_on_signal(config, p.coherence, pid)
            )
            signalled = [i for i, pid in p.pid_of.items() if pid in p.signalled]
            p.signals = ModuleSignals(model, signalled, _weak_signal(runtime))
            weakref.finalize(runtime, p.signals.remove)
        p.finalizer = weakref.finalize(runtime, _shutdown, p.pool, p.spill, p.lane, p.grad_guards)
    except BaseException:
        p.undo(optimizer, runtime)
        raise


def installs_on_signal(config: RuntimeConfig, coherence: Coherence | None, pid: int) -> bool:
    """Whether a ready refresh of parameter ``pid``'s blocks may be installed on a module
    signal: not under ``fixed_delay`` (installs happen exactly at their step), nor where a
    coherence installs its blocks at their deadline on every rank (replicated: every block
    of a DDP model)."""
    if config.fixed_delay is not None:
        return False
    return coherence is None or not coherence.replicated((pid, 0))


def _shutdown(
    pool: Any,
    spill: SpillTier | None,
    lane: StatisticsLane | None = None,
    guards: GradientGuards | None = None,
) -> None:
    """A runtime collected without ``close()``: its threads and its spill file go."""
    if guards is not None:
        guards.remove()
    if lane is not None:
        lane.abandon()
    pool.shutdown(wait=False)
    if spill is not None:
        spill.close()


def _weak_signal(runtime: Any) -> Any:
    """``runtime._on_signal`` through a weak reference (a no-op once the runtime is gone)."""
    ref = weakref.WeakMethod(runtime._on_signal)

    def signal() -> None:
        method = ref()
        if method is not None:
            method()

    return signal


def _free(key: BlockKey, block: dict | None = None) -> float:
    """The training thread's cost of an install that runs elsewhere."""
    return 0.0
