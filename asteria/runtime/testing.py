"""Test hooks of the runtime: public injection points for tests of its guarantees.

Owns: ``slow_pool``, which makes every refresh job submitted while it is active take at least a
given wall time (its future reports not done and its result blocks until then), as a pool that is
slower than the training would. The arithmetic is unchanged: the job's result is the pool's.

Must not: be used outside tests and benchmarks of the runtime's schedule.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["slow_pool"]

_global = {"seconds": 0.0}


@contextlib.contextmanager
def slow_pool(seconds: float) -> Iterator[None]:
    """While active, every refresh job takes at least ``seconds`` (from its submission)."""
    if not seconds >= 0.0:
        raise ValueError(f"seconds must be >= 0, got {seconds!r}")
    before = _global["seconds"]
    _global["seconds"] = float(seconds)
    try:
        yield
    finally:
        _global["seconds"] = before


def delayed(future: Any, timeout_error: type) -> Any:
    """``future`` as the runtime sees it: itself, or a slower view of it under ``slow_pool``."""
    seconds = _global["seconds"]
    if seconds <= 0.0:
        return future
    return _Delayed(future, time.perf_counter() + seconds, timeout_error)


class _Delayed:
    """A refresh future that is not done before ``ready_at`` (``time.perf_counter``)."""

    def __init__(self, future: Any, ready_at: float, timeout_error: type) -> None:
        self._future, self._ready_at, self._timeout_error = future, ready_at, timeout_error

    def done(self) -> bool:
        return time.perf_counter() >= self._ready_at and self._future.done()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def result(self, timeout_s: float | None = None) -> Any:
        left = self._ready_at - time.perf_counter()
        if left > 0.0:
            if timeout_s is not None and timeout_s < left:
                time.sleep(max(timeout_s, 0.0))
                raise self._timeout_error("slow_pool: not ready within the timeout")
            time.sleep(left)
            if timeout_s is not None:
                timeout_s = max(timeout_s - left, 0.0)
        return self._future.result(timeout_s=timeout_s)
