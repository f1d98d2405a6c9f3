"""``RuntimeConfig``: every knob of Asteria's runtime, validated once.

Owns: the defaults and the allowed ranges (a ``ValueError`` names the argument and the range).
Must not: create threads, pools or streams (``runtime.py`` does, from a validated config).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["RuntimeConfig", "default_workers"]


def default_workers() -> int:
    """One pool worker per core, leaving one core to the training loop (at least one worker)."""
    return max(1, (os.cpu_count() or 2) - 1)


def _int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """How Asteria orchestrates an optimizer's refreshes.

    Attributes:
        staleness: the budget ``S``: a refresh requested at step ``t`` is installed by step
            ``t + S`` at the latest, the step waiting for it if needed (Note [Staleness bound]
            in registry.py). ``0`` reproduces native mode.
        workers: CPU worker threads of the refresh pool (default: cores - 1, at least 1).
        lapack_threads: LAPACK/BLAS threads per worker (1: one core per worker).
        affinity: CPU ids the workers are pinned to, round-robin (``None``: no pinning).
        fixed_delay: ``None`` (install as soon as ready, within the budget) or ``d <= S``: install
            every refresh exactly ``d`` steps after it was requested, for reproducible runs.
        barrier_timeout_s: how long a step waits at the barrier before failing with an error
            that names the block.
        max_consecutive_failures: a block whose refresh fails this many times in a row raises;
            fewer failures keep the previous version and are counted.
        hooks: register module hooks as scheduling signals (flush finished refreshes before a
            module runs); the runtime is correct without them.
    """

    staleness: int = 5
    workers: int | None = None
    lapack_threads: int = 1
    affinity: tuple[int, ...] | None = None
    fixed_delay: int | None = None
    barrier_timeout_s: float = 600.0
    max_consecutive_failures: int = 3
    hooks: bool = True

    def __post_init__(self) -> None:
        _int("staleness", self.staleness, 0)
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

    @property
    def resolved_workers(self) -> int:
        return default_workers() if self.workers is None else self.workers
