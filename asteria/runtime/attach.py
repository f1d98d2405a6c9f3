"""What the runtime decides once, when it attaches to an optimizer.

Owns: every choice that depends only on the optimizer's parameters, the config and the machine,
made at attach so that nothing later tests what a block holds to find out: the placement of the
state (``asteria.memory.tiers.plan`` over ``asteria.memory.accounting``'s sizes), the staging
ring's size, whether the statistics lane runs, the workers' priority, and the parameters' names
in messages. parts.py makes the parts from these choices.

Note [Test overrides at build]: the hooks of ``asteria.runtime.testing`` are looked up at
attach, and only where a test or benchmark imported that module (``test_overrides``); the parts
are handed what they use (``Executors``' testing hooks, the statistics wrapper), so production
code imports no test module and reads no test global on a step's path.

Must not: decide anything per step, or make a part.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from asteria.memory.accounting import detect_arch, estimate_blocks, snapshot_tensors
from asteria.memory.tiers import Arch, BlockSizes, Placement, plan
from asteria.memory.window import WINDOW_BLOCKS
from asteria.optim.base import KroneckerOptimizer
from asteria.optim.refresher import BlockKey
from asteria.runtime.config import RuntimeConfig

#: The staging ring's slot granularity (csrc/memory/host_block.h's kHostAlignment).
_HOST_ALIGNMENT = 4096


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


__all__ = [
    "Attachment",
    "NoSpareCoreWarning",
    "choose",
    "distributed_mode",
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
