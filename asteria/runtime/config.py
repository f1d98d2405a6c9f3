"""``RuntimeConfig``: every knob of Asteria's runtime, validated once.

Owns: the defaults and the allowed ranges (a ``ValueError`` names the argument and the range).
Must not: create threads, pools or streams (``parts.build`` does, from a validated config).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from asteria.memory.tiers import explicit_tiers

__all__ = ["RuntimeConfig", "default_workers"]


#: How a block's refreshes are requested (Notes [Staggered refresh], [Continuous refresh] in
#: schedule.py).
REFRESH_MODES = ("interval", "staggered", "continuous")


def default_workers() -> int:
    """One pool worker per core, leaving one core to the training loop (at least one worker)."""
    return max(1, (os.cpu_count() or 2) - 1)


def _int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """How Asteria orchestrates an optimizer's refreshes (docs/runtime.md, "RuntimeConfig", has
    every field's default and effect).

    Attributes:
        staleness: the budget ``S``: a refresh requested at step ``t`` is installed by ``t + S``,
            waited for if need be (Note [Staleness bound] in registry.py); ``0``: native mode.
        workers, lapack_threads, affinity: the pool's threads (default: cores - 1), LAPACK
            threads per worker, and the CPU ids they are pinned to.
        worker_nice: added to the workers' nice value (Linux, 0..19; Note [Worker priority] in
            csrc/core/worker_pool.cpp); ``None``: 10 where the training leaves a core free.
        fixed_delay: ``None``, or ``d <= S``: every refresh installed exactly ``d`` steps after
            its request (reproducible runs).
        pace_installs: spread early installs over the steps to their deadlines (Note [Paced
            installs] in schedule.py): a computing install's spike for staleness.
        split_updates: with the lane, half of each update runs there (Note [Split updates]).
        refresh_lead: with a budget, an optimizer that uses its own step's refresh (Shampoo)
            requests it a step ahead (Note [Refresh lead] in schedule.py).
        wait_first_refresh: its first and urgent refreshes computed from their own step and
            waited for, as natively (Notes [First roots], [Rank-deficient factors], [Young
            factors]); ``None``: on, except under ``fixed_delay``.
        barrier_timeout_s: how long a step waits at the barrier before an error naming the block.
        max_consecutive_failures: a block failing this often in a row raises.
        hooks: module hooks as scheduling signals (installs before a module runs).
        device_budget_bytes, host_budget_bytes: the most optimizer state on the device, in host
            memory (``None``: no limit); the host budget spills results to ``nvme_path``.
        device_bases_fraction: under ``placement="auto"`` on a discrete GPU, the bases stay on
            the device where its state with them fits this fraction of its free memory (Note
            [Bases by budget] in asteria/memory/tiers.py).
        placement: ``"auto"`` (docs/memory.md, "Placement") or a dict state kind -> tier.
        refresh: ``"staggered"``, ``"interval"`` or ``"continuous"`` (Notes [Staggered
            refresh], [Continuous refresh] in schedule.py).
        device_refresh: refreshes may run on a device stream when the pool would miss their
            deadline (Note [Refresh placement]); ``None``: with CUDA parameters, unless
            ``fixed_delay``.
        statistics_lane: CPU parameters' statistics on a thread of their own (Note [Statistics
            lane] in lane.py); ``None``: where the training leaves a core free.
    """

    staleness: int = 5
    workers: int | None = None
    lapack_threads: int = 1
    affinity: tuple[int, ...] | None = None
    worker_nice: int | None = None
    fixed_delay: int | None = None
    pace_installs: bool = False
    split_updates: bool = True
    refresh_lead: bool = True
    wait_first_refresh: bool | None = None
    barrier_timeout_s: float = 600.0
    max_consecutive_failures: int = 3
    hooks: bool = True
    device_budget_bytes: int | None = None
    device_bases_fraction: float = 0.5
    host_budget_bytes: int | None = None
    nvme_path: str | os.PathLike[str] | None = None
    placement: str | Mapping[str, str] = "auto"
    statistics_lane: bool | None = None
    refresh: str = "staggered"
    device_refresh: bool | None = None

    def __post_init__(self) -> None:
        _int("staleness", self.staleness, 0)
        if self.refresh not in REFRESH_MODES:
            raise ValueError(
                f"refresh must be one of {', '.join(map(repr, REFRESH_MODES))}, "
                f"got {self.refresh!r}"
            )
        if self.device_refresh is not None and not isinstance(self.device_refresh, bool):
            raise ValueError(
                f"device_refresh must be True, False or None, got {self.device_refresh!r}"
            )
        if self.workers is not None:
            _int("workers", self.workers, 1)
        _int("lapack_threads", self.lapack_threads, 1)
        if self.affinity is not None:
            if not isinstance(self.affinity, (tuple, list)) or not self.affinity:
                raise ValueError(
                    f"affinity must be a non-empty tuple of CPU ids, got {self.affinity!r}"
                )
            for cpu in self.affinity:
                _int("affinity[i]", cpu, 0)
            object.__setattr__(self, "affinity", tuple(self.affinity))
        if self.worker_nice is not None:
            _int("worker_nice", self.worker_nice, 0)
            if self.worker_nice > 19:
                raise ValueError(f"worker_nice must be in [0, 19], got {self.worker_nice!r}")
        if self.fixed_delay is not None:
            _int("fixed_delay", self.fixed_delay, 0)
            if self.fixed_delay > self.staleness:
                raise ValueError(
                    f"fixed_delay must be in [0, staleness={self.staleness}], "
                    f"got {self.fixed_delay}"
                )
        if (
            isinstance(self.barrier_timeout_s, bool)
            or not isinstance(self.barrier_timeout_s, (int, float))
            or not self.barrier_timeout_s > 0
        ):
            raise ValueError(
                f"barrier_timeout_s must be a number > 0, got {self.barrier_timeout_s!r}"
            )
        _int("max_consecutive_failures", self.max_consecutive_failures, 1)
        if not isinstance(self.hooks, bool):
            raise ValueError(f"hooks must be True or False, got {self.hooks!r}")
        if not isinstance(self.pace_installs, bool):
            raise ValueError(f"pace_installs must be True or False, got {self.pace_installs!r}")
        if not isinstance(self.split_updates, bool):
            raise ValueError(f"split_updates must be True or False, got {self.split_updates!r}")
        if not isinstance(self.refresh_lead, bool):
            raise ValueError(f"refresh_lead must be True or False, got {self.refresh_lead!r}")
        if self.wait_first_refresh is not None and not isinstance(self.wait_first_refresh, bool):
            raise ValueError(
                f"wait_first_refresh must be True, False or None, got {self.wait_first_refresh!r}"
            )
        if self.statistics_lane is not None and not isinstance(self.statistics_lane, bool):
            raise ValueError(
                f"statistics_lane must be True, False or None, got {self.statistics_lane!r}"
            )
        fraction = self.device_bases_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise ValueError(f"device_bases_fraction must be a number, got {fraction!r}")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"device_bases_fraction must be in [0, 1], got {fraction!r}")
        for name in ("device_budget_bytes", "host_budget_bytes"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), 0)
        if self.nvme_path is not None:
            object.__setattr__(self, "nvme_path", _check_nvme_path(self.nvme_path))
        self._check_placement()

    def _check_placement(self) -> None:
        placement = self.placement
        if isinstance(placement, str):
            if placement != "auto":
                raise ValueError(
                    f"placement must be 'auto' or a dict state kind -> tier, got {placement!r}"
                )
            return
        if not isinstance(placement, Mapping):
            raise ValueError(
                f"placement must be 'auto' or a dict state kind -> tier, got {placement!r}"
            )
        explicit_tiers(placement)  # ValueError naming the kind or tier
        object.__setattr__(self, "placement", MappingProxyType(dict(placement)))

    @property
    def resolved_workers(self) -> int:
        return default_workers() if self.workers is None else self.workers

    @property
    def resolved_wait_first_refresh(self) -> bool:
        """``wait_first_refresh``, ``None`` resolved: on, except under ``fixed_delay``."""
        if self.wait_first_refresh is None:
            return self.fixed_delay is None
        return self.wait_first_refresh


#: Below this much free space a spill directory counts as full.
MIN_FREE_BYTES = 16 << 20


def _check_nvme_path(path: object) -> str:
    """An existing, writable directory with free space; ``ValueError`` saying what to change."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"nvme_path must be a directory path or None, got {path!r}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"nvme_path {path!r} does not exist; create it or pick another directory")
    if not os.path.isdir(path):
        raise ValueError(f"nvme_path {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(
            f"nvme_path {path!r} is not writable by this process; fix its permissions or pick "
            "another directory"
        )
    free = shutil.disk_usage(path).free
    if free < MIN_FREE_BYTES:
        raise ValueError(
            f"nvme_path {path!r} is full ({free} bytes free); free space there or pick another "
            "directory"
        )
    return path
