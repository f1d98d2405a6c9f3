"""The statistics lane: factor statistics of CPU-resident parameters, off the training thread.

Owns: one background thread that runs, in submission order, the statistics an optimizer hands
its refresher (``Refresher.accumulate``), the runtime's work that must follow them (refresh
submissions, SOAP's installs, half of a split update), and the per-block waits.

Note [Statistics lane]: on a CPU-only run the statistics are a third of SOAP's step and most of
KL-Shampoo's, and nothing in the step reads them before the block's next refresh or update. So
they run here, on the core the pool shares. Per block: an update that reads them waits first
(``Runtime.pieces``: ``wait_many``); a refresh's submission is queued behind them (``call``), so
a refresh step never waits; the gradient is read in place (only an accumulating backward, Note
[Gradient guards] in hooks.py, or ``zero_grad(set_to_none=False)``, which syncs, writes it
again); a computing install is queued here and the block's next read waits for it;
``state_dict``, ``load_state_dict`` and ``close()`` wait for all (``wait_all``). The same
functions on the same tensors and threads: bitwise native (tests/unit/test_runtime.py).

Note [Split updates]: the lane's core idles while the training thread updates, so ``Runtime.run``
splits a piece's update into two halves of about equal flops (a parameter's blocks together,
``halves``), the lane running one (``beside``) after what is queued before it: bitwise native
(tiny LM: SOAP 141 -> 73 ms).

Note [State between steps]: with the lane, ``step()`` returns while the lane may still write
``optimizer.state``. Asteria's reads wait, as do ``state_dict()``, ``load_state_dict()`` and
``close()``; code reading ``opt.state`` directly calls ``runtime.sync()`` first (waiting inside
every step would give back the overlap: bench/state_sync.py).
tests/unit/test_state_between_steps.py checks it.

Must not: decide what the statistics are, or be used for parameters on a GPU.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["LaneWork", "StatisticsLane", "StatisticsLaneError", "halves", "run_statistics"]


def _no_grad_call(fn: Callable[..., None], args: tuple) -> None:
    with torch.no_grad():  # grad mode is per thread
        fn(*args)


def _nothing() -> None:
    """The statistics of a block whose group's first block updated them all."""


def run_statistics(keys: Sequence[Hashable], fn: Callable, args: tuple, wrap: Any) -> None:
    """``fn(*args)``, the statistics of blocks ``keys``; under a test's wrapper ``wrap(keys[0], fn,
    *args)``, then ``wrap(key, _nothing)`` for the others. An error carries ``failed_keys``: the
    keys left undone."""
    at = 0
    try:
        if wrap is None:
            fn(*args)
            return
        for at, key in enumerate(keys):
            if at == 0:
                wrap(key, fn, *args)
            else:
                wrap(key, _nothing)
    except Exception as err:
        err.failed_keys = list(keys) if wrap is None or at == 0 else [keys[at]]
        raise


def halves(items: list, costs: list[float]) -> tuple[list[int], list[int]]:
    """The indices of ``items`` in two parts of about equal cost (largest first, each to the
    cheaper part so far), each in its original order."""
    side, load = [0] * len(items), [0.0, 0.0]
    for i in sorted(range(len(items)), key=costs.__getitem__, reverse=True):
        side[i] = 0 if load[0] <= load[1] else 1
        load[side[i]] += costs[i]
    return [i for i, s in enumerate(side) if s == 0], [i for i, s in enumerate(side) if s == 1]


class StatisticsLaneError(RuntimeError):
    """A statistics update (or a snapshot behind it) failed on the lane; names the block."""


class LaneWork:
    """Work queued on the lane behind a block's statistics (a refresh's submission: the
    ``LaneSnapshots`` of snapshots.py): ``query`` whether it ran, ``synchronize`` to wait for it
    (raising its block's error); ``value`` is what the work returned."""

    def __init__(self, lane: StatisticsLane, key: Hashable) -> None:
        self._lane, self._key = lane, key
        self.future: Future | None = None
        self.value: Any = None

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        self.value = fn(*args)

    def query(self) -> bool:
        return self.future.done()

    def synchronize(self) -> None:
        """Wait for the work; a failed statistics update of its block before it raises here."""
        self._lane._result(self._key, self.future)


class StatisticsLane:
    """A FIFO of statistics updates on one background thread (Note [Statistics lane])."""

    def __init__(
        self, name_of: Callable[[Hashable], str] = str, timeout_s: float | None = None
    ) -> None:
        #: how long a wait for the lane may take (``barrier_timeout_s``; Note [Lane deadlines])
        self.timeout_s = timeout_s
        threads = torch.get_num_threads()
        # The lane computes with the training's intra-op thread count (a new thread starts with
        # OpenMP's default), so BLAS takes the same code path and gives the same bits.
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="asteria-statistics",
            initializer=torch.set_num_threads,
            initargs=(threads,),
        )
        self._last: dict[Hashable, Future] = {}
        # The first error of each block: a later update of the block replaces its future in
        # ``_last`` before anyone waits, and must not hide it.
        self._errors: dict[Hashable, BaseException] = {}
        self._reported: set[Hashable] = set()  # blocks whose error a wait has raised
        self._name_of = name_of
        self._lock = threading.Lock()
        self._count = 0  # submissions so far (a future's ``seq``: the lane runs in its order)
        self.submitted = 0
        self.wait_s = 0.0

    def submit(self, key: Hashable, fn: Callable[..., None], *args: Any) -> Future:
        """Queue ``fn(*args)`` after everything submitted before it."""
        return self.submit_many((key,), fn, args, None)

    def submit_many(
        self, keys: Sequence[Hashable], fn: Callable[..., None], args: tuple, wrap: Any
    ) -> Future:
        """Queue ``run_statistics(keys, fn, args, wrap)`` after everything submitted before it;
        ``wait(key)`` of any of ``keys`` waits for it."""
        future = self._executor.submit(self._run, keys, fn, args, wrap)
        self._count += 1
        future.seq = self._count
        with self._lock:
            self._last.update(dict.fromkeys(keys, future))
        self.submitted += len(keys)  # (block updates)
        return future

    def call(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> LaneWork:
        """Queue ``fn(*args)`` after everything submitted before it (``key``'s statistics
        included); ``wait(key)`` waits for it too, and its result is the work's ``value``."""
        work = LaneWork(self, key)
        work.future = self.submit(key, work.run, fn, *args)
        return work

    def beside(self, fn: Callable[..., None], *args: Any) -> Callable[[], None]:
        """Queue ``fn(*args)``, part of the step's update (Note [Split updates]),
        after everything submitted before it; return the function that waits for it and raises
        its own error (no block's: the step that called it fails, nothing else)."""
        future = self._executor.submit(_no_grad_call, fn, args)
        return lambda: self._wait_beside(future)

    def _wait_beside(self, future: Future) -> None:
        t0 = time.perf_counter()
        try:
            future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise StatisticsLaneError(
                f"Asteria: the half of a split update on the statistics lane did not finish "
                f"within barrier_timeout_s={self.timeout_s:g} s"
            ) from None
        finally:
            self.wait_s += time.perf_counter() - t0

    def _run(self, keys: Sequence[Hashable], fn: Callable, args: tuple, wrap: Any) -> None:
        """On the lane: ``run_statistics(keys, fn, args, wrap)``, unless an earlier update of
        one of ``keys`` failed (then nothing of it runs any more, and every wait for it raises
        that first error)."""
        errors = self._errors
        if errors:
            for key in keys:
                if key in errors:
                    raise errors[key]
        try:
            with torch.no_grad():  # grad mode is per thread; the step's no_grad stays there
                run_statistics(keys, fn, args, wrap)
        except Exception as err:
            with self._lock:
                for key in err.failed_keys:
                    errors.setdefault(key, err)
            raise

    def pending(self) -> bool:
        with self._lock:
            return any(not f.done() for f in self._last.values())

    def wait(self, key: Hashable) -> None:
        """Block until every update of ``key`` submitted so far has run; re-raise its error.
        A wait that is interrupted (KeyboardInterrupt) keeps the work for the next wait."""
        with self._lock:
            future = self._last.get(key)
        if future is None:
            return
        try:
            self._result(key, future)
        except StatisticsLaneError:
            self._forget(key, future)
            raise
        self._forget(key, future)

    def wait_many(self, keys: Sequence[Hashable]) -> None:
        """``wait(key)`` of every key of ``keys``: the lane runs in submission order, so one
        wait for the last of their work, then each failed key's error."""
        last = self._last
        with self._lock:
            found = [(key, last[key]) for key in keys if key in last]
        if not found:
            return
        newest = max(found, key=_seq)
        self.wait(newest[0])
        for key, future in found:
            if key in self._errors:
                self.wait(key)
            if last.get(key) is future:
                with self._lock:
                    if last.get(key) is future:
                        del last[key]

    def _forget(self, key: Hashable, future: Future) -> None:
        with self._lock:
            if self._last.get(key) is future:
                del self._last[key]

    def check(self) -> None:
        """Raise the first error of a failed block (``StatisticsLaneError``) without waiting:
        a step calls it before it changes anything (Note [All-or-nothing steps] in plan.py)."""
        with self._lock:
            failed = next(iter(self._errors.items()), None)
            if failed is not None:
                self._reported.add(failed[0])
        if failed is not None:
            key, err = failed
            raise StatisticsLaneError(
                f"Asteria: the statistics update of block '{self._name_of(key)}' failed on the "
                f"statistics lane: {err}"
            ) from err

    def wait_all(self, reported_too: bool = True) -> None:
        """Block until everything submitted has run; re-raise the first error of a block (not
        one already raised by an earlier wait, unless ``reported_too``)."""
        with self._lock:
            items = list(self._last.items())
            self._last.clear()
        for key, future in items:
            if reported_too or key not in self._reported:
                self._result(key, future)
            else:
                concurrent.futures.wait([future], timeout=self.timeout_s)

    def close(self) -> None:
        """Finish the queued work (errors not raised before are raised now), stop the thread."""
        try:
            self.wait_all(reported_too=False)
        finally:
            self._executor.shutdown(wait=True)

    def abandon(self) -> None:
        """Stop without waiting (garbage collection of a runtime never closed)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _result(self, key: Hashable, future: Future) -> None:
        t0 = time.perf_counter()
        try:
            try:
                future.result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError:
                # Note [Lane deadlines]: the block counts as failed (its later updates are not
                # run, every later wait raises), as a statistics update that raised does
                raise TimeoutError(
                    f"it did not finish within barrier_timeout_s={self.timeout_s:g} s"
                ) from None
            with self._lock:
                first = self._errors.get(key)
            if first is not None:
                raise first
        except Exception as err:
            with self._lock:
                err = self._errors.setdefault(key, err)
                self._reported.add(key)
            raise StatisticsLaneError(
                f"Asteria: the statistics update of block '{self._name_of(key)}' failed on the "
                f"statistics lane: {err}"
            ) from err
        finally:
            self.wait_s += time.perf_counter() - t0


def _seq(item: tuple) -> int:
    return item[1].seq


# Note [Lane deadlines]
# ~~~~~~~~~~~~~~~~~~~~~
# Every wait for the lane (a step's wait for a block's statistics or install, the split update's
# other half, ``sync()``, a load, ``close()``) takes at most ``barrier_timeout_s``, as a barrier
# does (Note [Helping within the deadline] in refreshes.py): a statistics update still running
# then (a hung or pathologically slow one) fails its block with a ``StatisticsLaneError`` naming
# the block and the knob, and the block is failed from then on, as after an update that raised.
# tests/unit/test_deadlines.py holds a lane update past the deadline.
