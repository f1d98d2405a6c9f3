"""What the runtime decides once, when it attaches to an optimizer.

Owns: every choice that depends only on the optimizer's parameters, the config and the machine,
made here at attach time so that nothing later tests what a block or a pending refresh holds
to find out: the placement of the state (the tier policy, ``asteria.memory.tiers.plan``, over
the optimizer's state sizes, ``asteria.memory.accounting``), the staging ring's size, whether
the statistics lane runs, the pool workers' priority, the snapshot strategy (snapshots.py) and
the bases strategy (bases.py), which share the device's one copy stream
(``asteria.memory.copies``), and the parameters' names in messages; and the making of the
runtime's parts from these choices (``build``: the registry, schedule, coherence, spill tier,
pool and executors, statistics lane and gradient guards, bases, pacer, refreshes, plan and
module signals, returned as one ``Parts``), undone in full when an attach is
refused (``Parts.undo``).

Note [Test overrides at build]: the test hooks of ``asteria.runtime.testing`` (a slowed pool, a
pretended GPU, forced staged snapshots, wrapped statistics, a device-stream stand-in) are
looked up here, when the runtime attaches, and only where a test or benchmark imported that
module (``test_overrides``); the parts are handed what they use (``Parts.testing``, the
``delayed`` of ``Executors``, the runtime's statistics wrapper). Production code imports no test
module and reads no test global on a step's path; in a test process the hooks stay live after
attach (a test may enter ``slow_pool`` between steps), through the functions handed in.

Must not: decide anything per step, or hold a strong reference to the runtime in what it makes
(hooks and finalizers hold it weakly).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from asteria.memory.accounting import detect_arch, estimate_blocks, snapshot_tensors
from asteria.memory.copies import Copies, copies_for
from asteria.memory.host import StagingRing
from asteria.memory.tiers import Arch, BlockSizes, Placement, plan
from asteria.memory.window import WINDOW_BLOCKS, BasesWindow
from asteria.optim.base import KroneckerOptimizer
from asteria.optim.matrix_functions import MatrixFunctionError
from asteria.optim.refresher import BlockKey
from asteria.runtime import state
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

#: The staging ring's slot granularity (csrc/memory/host_block.h's kHostAlignment).
_HOST_ALIGNMENT = 4096


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


__all__ = [
    "Attachment",
    "NoSpareCoreWarning",
    "Parts",
    "build",
    "choose",
    "connect",
    "choose_bases",
    "choose_snapshots",
    "copy_stream",
    "distributed_mode",
    "executors",
    "installs_on_signal",
    "namer",
    "no_spare_core",
    "param_names",
    "params_of",
]


@dataclass(frozen=True)
class Attachment:
    """The attach-time choices (see module docstring)."""

    arch: Arch
    sizes: list[BlockSizes]
    placement: Placement
    nice: int  # added to the pool workers' nice value (Note [Worker priority])
    lane: bool  # whether the statistics lane runs
    staged: bool  # whether snapshots are staged (device parameters)
    ring: tuple[int, int]  # the staging ring's slots and slot bytes (Note [Staged snapshots])
    # why the refreshes have no core of their own, or None (Note [No spare core])
    no_spare_core: str | None = None


def params_of(optimizer: KroneckerOptimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def param_names(model: torch.nn.Module | None, optimizer: KroneckerOptimizer) -> dict[int, str]:
    """The model's names of the optimizer's parameters, by flattened index."""
    if model is None:
        return {}
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {i: by_id[id(p)] for i, p in enumerate(params_of(optimizer)) if id(p) in by_id}


def namer(names: dict[int, str]) -> Callable[[BlockKey], str]:
    """``name[i]`` for block ``i`` of a parameter, ``name`` for its parameter-level state (block
    -1); ``param<index>`` for parameters the model does not name."""

    def block_name(key: BlockKey) -> str:
        param = names.get(key[0], f"param{key[0]}")
        return param if key[1] < 0 else f"{param}[{key[1]}]"

    return block_name


def distributed_mode(distributed: bool | None, ranks_per_node: int | None) -> bool:
    """Whether the runtime runs in distributed mode: ``distributed``, or (None) whether a
    process group of more than one rank is initialized."""
    if distributed is None:
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    elif not isinstance(distributed, bool):
        raise ValueError(f"distributed must be True, False or None, got {distributed!r}")
    if not distributed and ranks_per_node is not None:
        raise ValueError("ranks_per_node applies to distributed mode only")
    return distributed


def choose(
    optimizer: KroneckerOptimizer,
    config: RuntimeConfig,
    distributed: bool,
    block_name: Callable[[BlockKey], str],
) -> Attachment:
    """Every attach-time choice (ValueError: what to change, for a placement that cannot be)."""
    params = params_of(optimizer)
    t = test_overrides()
    staged = any(p.is_cuda for p in params) or (t is not None and t.staged_snapshots_forced())
    ring = (0, 0)
    if staged:
        try:
            tensors = snapshot_tensors(optimizer)
        except ValueError:
            tensors = []  # an optimizer without a size model: every snapshot unstaged
        ring = (len(tensors), _round_up(max(tensors, default=0), _HOST_ALIGNMENT))
    arch, sizes, placement = _placement(optimizer, config, params, block_name, ring)
    # Whether torch's intra-op threads leave a core free; under torchrun, the threads of every
    # process on this machine (LOCAL_WORLD_SIZE) count.
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1) if distributed else 1
    spare_core = torch.get_num_threads() * local < (os.cpu_count() or 1)
    nice = config.worker_nice
    if nice is None:  # Note [Worker priority] in csrc/core/worker_pool.cpp
        nice = 10 if spare_core else 0
    # Factor statistics of CPU-resident parameters run on the statistics lane (Note [Statistics
    # lane] in lane.py). FSDP2 writes sharded gradients outside autograd, where the gradient
    # guards cannot see it: the lane is opt-in (statistics_lane=True) for DTensor parameters.
    # By default only where the training leaves a core free: on a machine whose cores all run
    # intra-op threads, the lane would take its time from the training itself. Never with the
    # window (its CPU stand-in is a test of a discrete GPU, where no lane runs).
    cpu_only = all(p.device.type == "cpu" for p in params)
    sharded = any(hasattr(p, "to_local") for p in params)
    lane_on = config.statistics_lane or (
        config.statistics_lane is None and not sharded and spare_core
    )
    lane = cpu_only and bool(lane_on) and placement.bases_access != "window"
    no_core = no_spare_core(config.resolved_workers, local) if cpu_only else None
    return Attachment(arch, sizes, placement, nice, lane, staged, ring, no_core)


# Note [No spare core]: the runtime hides a refresh only where a core runs it beside the
# training. On a CPU-only machine the training's intra-op threads stand for the GPU and the
# other cores for its host; when the threads and the pool's workers together (under torchrun,
# those of every process on the machine) outnumber the cores, a refresh takes its time from
# the training and shows up as a slower step, as in native mode (issue 24: `make demo` at
# torch's default of every core, the same refresh spikes one step later). The runtime still
# works, so it does not refuse: it warns once, when it attaches, and says what to change;
# Runtime.stats()["warnings"] keeps the text for reports (asteria-train's report.md). On a
# GPU the training's work runs on the device, and no warning is given.


class NoSpareCoreWarning(RuntimeWarning):
    """The training's threads and the refresh workers outnumber the cores (Note [No spare
    core])."""


def no_spare_core(workers: int, processes: int = 1, cores: int | None = None) -> str | None:
    """The warning for a CPU training whose ``torch.get_num_threads()`` intra-op threads and
    ``workers`` refresh workers (times ``processes`` on this machine) outnumber ``cores``
    (``os.cpu_count()``), or None where they fit (Note [No spare core])."""
    threads = torch.get_num_threads()
    cores = cores if cores is not None else (os.cpu_count() or 1)
    if (threads + workers) * processes <= cores:
        return None
    each = f" in each of {processes} processes" if processes > 1 else ""
    room = cores // processes - workers  # the threads that would leave the workers their cores
    fix = (
        f"torch.set_num_threads({room}) before attaching (asteria-train: --threads {room})"
        if room >= 1
        else f"fewer workers (RuntimeConfig(workers=...), below {max(1, cores // processes)})"
    )
    return (
        f"Asteria: the training's {threads} intra-op thread{'s' if threads != 1 else ''} and "
        f"the runtime's {workers} refresh "
        f"worker{'s' if workers != 1 else ''}{each} outnumber this machine's {cores} CPU cores, "
        "so there is no core to hide refreshes on: they take their time from the training "
        f"steps, as in native mode. Leave the workers their cores: {fix}."
    )


def _placement(
    optimizer: KroneckerOptimizer,
    config: RuntimeConfig,
    params: list[torch.Tensor],
    block_name: Callable[[BlockKey], str],
    ring: tuple[int, int],
) -> tuple[Arch, list[BlockSizes], Placement]:
    """The tier policy's placement for this optimizer's state."""
    device = params[0].device if params else torch.device("cpu")
    t = test_overrides()
    arch = detect_arch(device) if t is None else t.arch_of(device, detect_arch)
    try:
        sizes = estimate_blocks(optimizer, lambda pid, bi: block_name((pid, bi)))
    except ValueError:
        if config.device_budget_bytes is not None or config.host_budget_bytes is not None:
            raise
        sizes = []  # an optimizer without a size model: no budgets to check
    staging = ring[0] * ring[1] if arch.cuda else 0
    placement = plan(
        sizes,
        arch,
        device_budget_bytes=config.device_budget_bytes,
        host_budget_bytes=config.host_budget_bytes,
        nvme=config.nvme_path is not None,
        placement=config.placement,
        staging_bytes=staging,
        bases_window=True,
        window_blocks=window_blocks(),
        bases_device_bytes=int(config.device_bases_fraction * _free_device_bytes(device, arch)),
    )
    return arch, sizes, placement


def test_overrides() -> Any:
    """Note [Test overrides at build]: ``asteria.runtime.testing`` where a test or benchmark
    imported it, else None. The runtime's parts are handed what they use of it when they are
    made (the wrapper of the statistics updates, the slowed futures, the pretended machine);
    production code never imports it, and a run without it takes no test branch anywhere."""
    return sys.modules.get("asteria.runtime.testing")


def window_blocks() -> int:
    """The bases window's slots: ``WINDOW_BLOCKS``, or a test's (``testing.pretend_arch``)."""
    t = test_overrides()
    return WINDOW_BLOCKS if t is None else t.window_blocks(WINDOW_BLOCKS)


def _free_device_bytes(device: torch.device, arch: Arch) -> int:
    """The device memory free now (Note [Bases by budget] in asteria/memory/tiers.py): torch's
    ``mem_get_info`` on a CUDA device, what ``testing.pretend_arch`` says on a pretended one
    (0 unless given: the window)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    t = test_overrides()
    return t.device_free_bytes() if arch.cuda and t is not None else 0


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
    delayed = None if t is None else t.delayed
    return Executors(pool, stream, config.resolved_workers, budget, timeout_error, delayed)


def device_stream_allowed(config: RuntimeConfig, cuda: bool) -> bool:
    """Whether refreshes may move to the device stream (Note [Refresh placement]): on a CUDA
    device unless ``device_refresh=False``; under ``fixed_delay`` only when asked for
    (``device_refresh=True``). The executor is chosen by measured times, and cuSOLVER's results
    are not LAPACK's bit for bit, so the default keeps a fixed-delay run on the pool, where it
    is reproducible as ``fixed_delay`` promises (two H200 runs through the bases window and
    with the bases on the device differed at fixed_delay=3, 2026-12-04)."""
    if not cuda or config.device_refresh is False:
        return False
    return config.device_refresh is True or config.fixed_delay is None


# -- the parts, made from the choices -----------------------------------------------------------


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
    costs = InstallCosts(optimizer.install_cost, functools.partial(_block_state, optimizer))
    # one copy stream (least priority), made once, for the window and the staged snapshots
    copies = functools.cache(functools.partial(copy_stream, optimizer))
    p.bases = choose_bases(
        optimizer, c, choices.placement, p.lane, costs, p.block_name, copies, runtime._lock
    )
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
            # issue 7: the hooks hold the runtime weakly and go when it is collected without
            # close(), so a model that outlives its optimizer keeps no runtime (or pool) alive;
            # none where they could not change anything (Note [Backward signals] in hooks.py)
            p.signalled = frozenset(
                pid for pid in p.pid_of.values() if installs_on_signal(config, p.coherence, pid)
            )
            signalled = [i for i, pid in p.pid_of.items() if pid in p.signalled]
            # forward signals only: the first one installs the step's batch (Note [One install
            # batch per step] in runtime.py), a backward one would find nothing to do
            p.signals = ModuleSignals(model, signalled, _weak_signal(runtime), backward=False)
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

    def signal(param_ids: tuple[int, ...], event: str) -> None:
        method = ref()
        if method is not None:
            method(param_ids, event)

    return signal


def _block_state(optimizer: KroneckerOptimizer, key: BlockKey) -> dict:
    """The state of ``optimizer``'s block ``key``."""
    return optimizer.state[params_of(optimizer)[key[0]]]["blocks"][key[1]]


def _free(key: BlockKey, block: dict | None = None) -> float:
    """The training thread's cost of an install that runs elsewhere."""
    return 0.0
