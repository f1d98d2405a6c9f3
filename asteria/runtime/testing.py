"""Test hooks of the runtime: public injection points for tests of its guarantees.

Owns: context managers that change what a runtime sees or how fast its pool is, never what it
computes: ``slow_pool`` (every CPU pool job takes at least a given wall time: its future not
done and its ``finished_at`` slowed until then; the result is the pool's), ``pretend_arch``
(runtimes attached meanwhile see the given architecture, e.g. a discrete GPU on a CPU machine,
run on the stand-ins, and optionally another window size and free device memory: Note [Bases
by budget] in asteria/memory/tiers.py), ``staged_snapshots`` (the device path's staged
snapshots on the CPU stand-ins), ``wrapped_statistics`` (every statistics update through a
wrapper that may delay, hold or fail it: the lane's faults and races) and
``device_stream_stand_in`` (a device-stream executor on the CPU for refresh placement).

Must not: be used outside tests and benchmarks of the runtime, or be imported by the runtime's
own modules: a runtime consults it at attach, and only where it was imported (Note [Test
overrides at build] in attach.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

__all__ = [
    "device_stream_stand_in",
    "pretend_arch",
    "slow_pool",
    "staged_snapshots",
    "wrapped_statistics",
]

_global: dict[str, Any] = {
    "seconds": 0.0,
    "arch": None,
    "window_blocks": None,
    "device_free": 0,
    "staged": False,
    "statistics": None,
    "device_stream": False,
}


@contextlib.contextmanager
def _setting(**values: Any) -> Iterator[None]:
    before = {k: _global[k] for k in values}
    _global.update(values)
    try:
        yield
    finally:
        _global.update(before)


@contextlib.contextmanager
def slow_pool(seconds: float) -> Iterator[None]:
    """While active, every refresh job takes at least ``seconds`` (from its submission)."""
    if not seconds >= 0.0:
        raise ValueError(f"seconds must be >= 0, got {seconds!r}")
    with _setting(seconds=float(seconds)):
        yield


@contextlib.contextmanager
def pretend_arch(
    arch: Any, window_blocks: int | None = None, device_free_bytes: int = 0
) -> Iterator[None]:
    """While active, runtimes attach as if their parameters were on ``arch`` (an
    ``asteria.memory.tiers.Arch``), with a bases window of ``window_blocks`` slots if given,
    and ``device_free_bytes`` of device memory free (what the bases budget is a fraction of:
    Note [Bases by budget] in asteria/memory/tiers.py; 0: the bases go behind the window)."""
    if window_blocks is not None and window_blocks < 1:
        raise ValueError(f"window_blocks must be >= 1, got {window_blocks!r}")
    if device_free_bytes < 0:
        raise ValueError(f"device_free_bytes must be >= 0, got {device_free_bytes!r}")
    with _setting(arch=arch, window_blocks=window_blocks, device_free=int(device_free_bytes)):
        yield


@contextlib.contextmanager
def staged_snapshots() -> Iterator[None]:
    """While active, runtimes attach with the device path's staged snapshots."""
    with _setting(staged=True):
        yield


@contextlib.contextmanager
def wrapped_statistics(wrap: Any) -> Iterator[None]:
    """While active, each statistics update a runtime runs is ``wrap(key, update, *args)``
    instead of ``update(*args)``: ``wrap`` calls ``update(*args)`` itself, or raises instead.
    It is looked up when the update is handed to the runtime (each step), not at attach."""
    if not callable(wrap):
        raise TypeError(f"wrap must be callable, got {type(wrap).__name__}")
    with _setting(statistics=wrap):
        yield


def settings() -> dict[str, Any]:
    """The live settings of this module (a runtime attached in a test process reads its
    ``"statistics"`` wrapper where an update is handed in: ``wrapped_statistics``)."""
    return _global


def arch_of(device: Any, detect: Any) -> Any:
    """The architecture a runtime attaching now sees for ``device`` (``detect(device)``)."""
    arch = _global["arch"]
    return detect(device) if arch is None else arch


def window_blocks(default: int) -> int:
    """The bases window's slots for a runtime attaching now."""
    blocks = _global["window_blocks"]
    return default if blocks is None else blocks


def device_free_bytes() -> int:
    """The device memory free that a runtime attaching now on a pretended GPU sees."""
    return int(_global["device_free"])


def staged_snapshots_forced() -> bool:
    return bool(_global["staged"])


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

    def run_ahead(self) -> bool:
        return self._future.run_ahead()

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

    @property
    def started_at(self) -> Any:
        return self._future.started_at

    @property
    def finished_at(self) -> float | None:
        """The pool's finishing time, or ``ready_at`` if later (``time.monotonic``): the
        duration a placement measures is the slowed one."""
        end = self._future.finished_at
        if end is None or not self.done():
            return None
        ready = self._ready_at - time.perf_counter() + time.monotonic()
        return max(end, ready)


@contextlib.contextmanager
def device_stream_stand_in() -> Iterator[None]:
    """While active, runtimes attach with a device-stream executor that runs on the CPU (a
    thread running the refreshes with torch, asteria/runtime/placement.py): on a machine
    without CUDA, what refresh placement can move a job to."""
    with _setting(device_stream=True):
        yield


def device_stream_forced() -> bool:
    return bool(_global["device_stream"])
