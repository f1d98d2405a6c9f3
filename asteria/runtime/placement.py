"""Where a refresh runs: the executors, and the rule that places each job on one of them.

Owns: ``Submission`` (a job with its name, version, deadline and inputs), ``Executors`` (the C++
pool and a ``StreamExecutor`` where one exists, each job placed by Note [Refresh placement]),
the moving averages of measured durations (``Durations``), the backlogs, the room for more work
(Note [Continuous refresh] in schedule.py), and ``StreamExecutor``: one thread running jobs with
torch in deadline order on a least-priority CUDA stream, or on the CPU (the tests' stand-in).

Must not: decide when a refresh is requested or installed, install, or change what a job
computes (the optimizer's ``RefreshJob`` does on either executor).

Note [One submission path]: a job is made once (``refresh_jobs``) and reaches an executor once:
the plan's requests wrap it in a ``Submission``, the snapshot strategy puts in its copied inputs,
and ``Executors.submit_many`` checks, places and submits it (``job.submit``: the C++ call that
copies the inputs; or the stream, which copies them and runs ``job.compute``).

Note [Refresh placement]
~~~~~~~~~~~~~~~~~~~~~~~~
A job goes to the pool unless a device stream exists, the step time and the pool's duration for
it are known (moving averages per executor, kind and size; an unseen size scaled as ``d^3``) and
the pool would miss its deadline (``(backlog + duration) / workers > B * step_time``); then to
the stream if that finishes sooner. Decisions are per job (``stats()["placement"]``). A device
refresh copies its inputs on a stream of its own at submission, runs at the least priority
(Note [Stream priorities] in streams.py) on its own thread (CUDA ``eigh`` syncs with the host),
and its results stay on the device. docs/runtime.md, "Refresh placement", has the measurements.
"""

from __future__ import annotations

import heapq
import itertools
import operator
import threading
import time
from collections import Counter
from typing import Any

import torch

from asteria.optim.matrix_functions import check_matrix
from asteria.optim.refresher import RefreshJob
from asteria.runtime.registry import Resolved

__all__ = ["Durations", "Executors", "StreamExecutor", "Submission"]


class Submission(tuple):
    """A refresh's job on its way to an executor, a value: ``name`` (block and dim), ``version``
    (the request step), ``deadline``, and the inputs, ``factor`` and ``basis`` (the job's own, or a
    snapshot: ``with_inputs``). The runtime makes one with ``tuple.__new__``: no Python call."""

    __slots__ = ()

    def __new__(
        cls, job: RefreshJob, name: str, version: int, deadline: int, inputs: Any = None
    ) -> Submission:
        factor, basis = (job.factor, job.basis) if inputs is None else inputs
        return tuple.__new__(cls, (job, name, version, deadline, factor, basis))

    job = property(operator.itemgetter(0))
    name = property(operator.itemgetter(1))
    version = property(operator.itemgetter(2))
    deadline = property(operator.itemgetter(3))
    factor = property(operator.itemgetter(4))
    basis = property(operator.itemgetter(5))

    def with_inputs(self, factor: Any, basis: Any, version: int | None = None) -> Submission:
        """The same job with other inputs (a copy of them), at ``version`` where given."""
        version = self[2] if version is None else version
        return tuple.__new__(Submission, (*self[:2], version, self[3], factor, basis))


#: Weight of the newest measurement in the moving averages.
EMA = 0.3


class Durations:
    """Moving averages of measured job seconds per (executor, kind, size)."""

    def __init__(self) -> None:
        self._mean: dict[tuple[str, str, int], float] = {}

    def observe(self, measured: list[tuple[str, str, int, float]]) -> None:
        """Each ``(executor, kind, size, seconds)`` of ``measured``, in order."""
        mean = self._mean
        for executor, kind, size, seconds in measured:
            key = (executor, kind, size)
            old = mean.get(key)
            mean[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def predict(self, executor: str, kind: str, size: int) -> float | None:
        """The average for this size, else the nearest size seen scaled as ``d^3``, else None."""
        exact = self._mean.get((executor, kind, size))
        if exact is not None:
            return exact
        seen = [
            (abs(n - size), n, s)
            for (e, k, n), s in self._mean.items()
            if (e, k) == (executor, kind)
        ]
        if not seen:
            return None
        _, n, s = min(seen)
        return s * (size / n) ** 3

    def longest(self, executor: str) -> float | None:
        """The longest average of ``executor``'s jobs (any kind and size), None before any;
        what a helping waiter expects of a job it does not know (Note [Helping within the
        deadline] in refreshes.py)."""
        seen = [s for (e, _, _), s in self._mean.items() if e == executor]
        return max(seen) if seen else None

    def report(self) -> dict[str, float]:
        return {f"{e}/{k}:{n}": 1e3 * s for (e, k, n), s in sorted(self._mean.items())}


class _StreamFuture:
    """A job of a ``StreamExecutor``: the pool future's interface."""

    def __init__(self, timeout_error: type) -> None:
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._cancelled = False
        self._timeout_error = timeout_error
        self.started_at: float | None = None
        self.finished_at: float | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def cancelled(self) -> bool:
        return self._cancelled

    def run_ahead(self) -> bool:
        return False  # the stream's thread runs its jobs in its own order

    def status(self) -> str:
        if self._cancelled:
            return "cancelled"
        if not self._event.is_set():
            return "queued" if self.started_at is None else "running"
        return "failed" if self._error is not None else "succeeded"

    def result(self, timeout_s: float | None = None) -> Any:
        if not self._event.wait(timeout_s):
            raise self._timeout_error("device stream: not ready within the timeout")
        if self._error is not None:
            raise self._error
        value = self._value
        if torch.cuda.is_available():  # results made on the stream, read on the caller's
            for t in value if isinstance(value, tuple) else (value,):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(torch.cuda.current_stream(t.device))
        return value


class StreamExecutor:
    """One thread that runs refresh jobs with torch (``RefreshJob.run``), in deadline order
    (ties: submission order): on ``device``'s least-priority stream, or on the CPU with
    ``device`` None (the stand-in). Inputs are copied at submission."""

    name = "device_stream"

    def __init__(self, device: torch.device | None, timeout_error: type) -> None:
        self.device = device
        self._timeout_error = timeout_error
        self._stream = self._copies = None
        if device is not None:
            low, _ = torch.cuda.Stream.priority_range()
            self._stream = torch.cuda.Stream(device=device, priority=low)
            # the inputs' copies: a stream of their own, so that a submission never waits
            # behind a refresh running on the first one
            self._copies = torch.cuda.Stream(device=device, priority=low)
        self._queue: list[tuple[int, int, Submission, _StreamFuture]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self.counts: Counter[str] = Counter()
        self._thread = threading.Thread(target=self._run, name="asteria-device-stream", daemon=True)
        self._thread.start()

    def submit(self, sub: Submission) -> _StreamFuture:
        """``sub``'s job on copies of its inputs (made now: a slot or snapshot may be reused
        once this returns)."""
        sub = sub.with_inputs(self._copy(sub.factor), self._copy(sub.basis))
        future = _StreamFuture(self._timeout_error)
        with self._cv:
            if self._closed:
                raise RuntimeError("the device stream executor is shut down")
            heapq.heappush(self._queue, (sub.deadline, next(self._seq), sub, future))
            self.counts["submitted"] += 1
            self._cv.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                _, _, sub, future = heapq.heappop(self._queue)
            future.started_at = time.monotonic()
            try:
                if self._stream is None:
                    future._value = sub.job.compute(sub.factor, sub.basis)
                else:
                    # the job's inputs were copied on the copies stream, not waited for at
                    # submission (``_copy``): the refresh stream waits for them on the device
                    self._stream.wait_stream(self._copies)
                    with torch.cuda.stream(self._stream):
                        future._value = sub.job.compute(sub.factor, sub.basis)
                    self._stream.synchronize()
                self.counts["completed"] += 1
            except BaseException as err:  # the caller's result() raises it
                future._error = err
                self.counts["failed"] += 1
            future.finished_at = time.monotonic()
            future._event.set()

    def _copy(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A copy of ``t``: on the CPU, or on the device through the copies stream (after the
        caller's stream's writes to it; the refresh stream waits for it); only a host input is
        waited for here."""
        if t is None:
            return None
        if self.device is None:
            return t.detach().clone()
        copies = self._copies
        current = torch.cuda.current_stream(t.device) if t.is_cuda else None
        if current is not None:
            copies.wait_stream(current)  # after the training stream's writes to it
        with torch.cuda.stream(copies):
            out = t.to(self.device, copy=True, non_blocking=True)
        if current is not None:
            # the training stream rewrites the factor in place from the next step on: its later
            # work waits for the copy on the device, and the host goes on (a host wait here
            # would drain the training stream at every device-placed submission)
            current.wait_stream(copies)
        else:
            copies.synchronize()  # a host source may be rewritten once submit returns
        out.record_stream(self._stream)
        return out

    def backlog(self) -> int:
        with self._cv:
            return len(self._queue)

    def shutdown(self) -> None:
        """Cancel what is queued, let the running job finish, join the thread."""
        with self._cv:
            self._closed = True
            for _, _, _, future in self._queue:
                future._cancelled = True
                future._error = RuntimeError("cancelled: the runtime closed")
                future._event.set()
                self.counts["cancelled"] += 1
            self._queue.clear()
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()


class Executors:
    """What the refreshes and snapshots submit to (see module docstring): the C++ ``pool``
    (``workers`` threads), and ``stream`` (a ``StreamExecutor``) or None; ``budget`` is ``B``."""

    def __init__(
        self,
        pool: Any,
        stream: StreamExecutor | None,
        workers: int,
        budget: int,
        timeout_error: type,
        testing: Any = None,
    ) -> None:
        self.pool = pool
        #: ``asteria.runtime.testing`` where a test or benchmark imported the test hooks (Note
        #: [Test overrides at build] in attach.py): its ``delayed`` slows the futures while its
        #: settings ask for it
        self._delayed = None if testing is None else testing.delayed
        self._slow = None if testing is None else testing.settings()
        self.stream = stream
        self.workers = workers
        self.budget = budget
        self.durations = Durations()
        self._timeout_error = timeout_error
        # per executor: (future, kind, size, predicted seconds) of the jobs not seen finished
        self._outstanding: dict[str, list[tuple[Any, str, int, float | None]]] = {"pool": []}
        if stream is not None:
            self._outstanding[stream.name] = []
        self.jobs: Counter[str] = Counter()
        self.ran_on: dict[str, str] = {}  # block name -> where its last job ran
        self.block_jobs: dict[str, dict[int, tuple[str, int]]] = {}  # name -> dim -> (kind, size)
        self.step_s: float | None = None
        self._versions: dict[str, int] = {}  # the latest version submitted per pool block name
        self._last_step: float | None = None
        self._reserved_s = 0.0

    def submit_many(self, subs: list[Submission]) -> list[Any]:
        """The one submission path: each of ``subs`` checked, placed and submitted (Note [One
        submission path]); a future each. A complex or non-square input is refused (the pool would
        drop an imaginary part): its future raises the ``ValueError``, a crashed refresh of its
        block."""
        if self.stream is not None:
            self._harvest()  # (the placement reads the backlogs; ``step_begin`` harvests too)
        means, slow, outstanding = self.durations._mean, self._slow, self._outstanding
        strided = torch.strided
        futures = []
        for sub in subs:
            job, factor, basis = sub.job, sub.factor, sub.basis
            ok = True  # a real, dense, square matrix each (``check_matrix``), inline
            for t in (factor,) if basis is None else (factor, basis):
                ok = ok and t.is_floating_point() and t.layout == strided and t.dim() == 2
                ok = ok and t.shape[0] == t.shape[1]
            if not ok:
                futures.append(_refused(sub))
                continue
            kind, size = job.kind, factor.shape[0]
            where = "pool"
            if self.stream is not None:
                where = self._place(kind, size, sub.deadline - sub.version)
            if where == "pool":
                # Note [Versions after a load]: the C++ pool refuses a version older than the
                # one it holds queued for the block (a caller's mistake, in general). A load
                # into a live runtime drops the refreshes in flight and requests again from the
                # checkpoint's earlier steps while a dropped job may still be queued: such a
                # submission goes in at the queued version, so it supersedes (cancels) the
                # dropped job instead of being refused. The deadline, which orders the queue,
                # stays the request's.
                name, versions = sub.name, self._versions
                kept = versions.get(name, 0)
                if kept > sub.version:
                    sub = sub.with_inputs(factor, basis, kept)
                versions[name] = sub.version
                future = job.submit(self.pool, sub)
                if slow is not None and slow["seconds"] > 0.0:
                    future = self._delayed(future, self._timeout_error)
            else:
                future = self.stream.submit(sub)
            predicted = means.get((where, kind, size))
            if predicted is None and means:
                predicted = self.durations.predict(where, kind, size)
            outstanding[where].append((future, kind, size, predicted))
            self.jobs[where] += 1
            futures.append(future)
            block, _, dim = sub.name.rpartition(".dim")
            self.ran_on[block] = where
            if dim.isdigit():
                jobs = self.block_jobs.get(block)
                if jobs is None:
                    jobs = self.block_jobs[block] = {}
                jobs[int(dim)] = (kind, size)
        return futures

    def stats(self) -> dict[str, int]:
        """The pool's counters (``WorkerPool.stats()``), the stream's jobs added."""
        out = {k: int(v) for k, v in dict(self.pool.stats()).items()}
        if self.stream is not None:
            c = self.stream.counts
            for k in ("submitted", "completed", "failed", "cancelled"):
                out[k] = out.get(k, 0) + c[k]
            out["queued"] = out.get("queued", 0) + self.stream.backlog()
        return out

    # -- placement (Note [Refresh placement]) --------------------------------------------------

    def _harvest(self) -> None:
        """Measure the jobs that finished since last looked, and forget them."""
        measured = []
        for where, jobs in self._outstanding.items():
            left = []
            for future, kind, size, predicted in jobs:
                if not future.done():
                    left.append((future, kind, size, predicted))
                    continue
                start, end = future.started_at, future.finished_at
                if start is not None and end is not None and not future.cancelled():
                    measured.append((where, kind, size, max(end - start, 0.0)))
            jobs[:] = left
        if measured:
            self.durations.observe(measured)

    def backlog_s(self, where: str) -> float:
        """Predicted seconds of the jobs ``where`` has not finished (unknown ones: a step)."""
        unknown = self.step_s or 0.0
        return sum(unknown if p is None else p for _, _, _, p in self._outstanding[where])

    def _place(self, kind: str, size: int, steps: int) -> str:
        if self.stream is None or steps <= 0 or self.step_s is None:
            return "pool"
        pool_s = self.durations.predict("pool", kind, size)
        if pool_s is None:
            return "pool"
        pool_finish = (self.backlog_s("pool") + pool_s) / self.workers
        if pool_finish <= steps * self.step_s:
            return "pool"
        dev_s = self.durations.predict(self.stream.name, kind, size) or 0.0
        stream_finish = self.backlog_s(self.stream.name) + dev_s
        return self.stream.name if stream_finish < pool_finish else "pool"

    # -- room for more work (Note [Continuous refresh] in schedule.py) ------------------------

    def step_begin(self, waited_s: float = 0.0) -> None:
        """A step begins: the step time's moving average (less ``waited_s``, the last barrier wait),
        finished jobs measured, the room reserved for continuous requests released."""
        now = time.monotonic()
        if self._last_step is not None:
            dt = max(now - self._last_step - waited_s, 0.0)
            self.step_s = dt if self.step_s is None else (1 - EMA) * self.step_s + EMA * dt
        self._last_step = now
        if self._outstanding["pool"] or len(self._outstanding) > 1:
            self._harvest()
        self._reserved_s = 0.0

    def has_room(self, block: str) -> bool:
        """Whether the executors can take ``block``'s refresh and keep at most ``min(2, B)`` steps
        of work queued per worker and stream (with nothing queued, always); room granted is reserved
        until the next ``step_begin``."""
        outstanding = sum(len(v) for v in self._outstanding.values())
        step_s = self.step_s
        jobs = self.block_jobs.get(block, {}).values()
        cost = sum(self.durations.predict("pool", k, n) or (step_s or 0.0) for k, n in jobs)
        if outstanding == 0 and self._reserved_s == 0.0:
            self._reserved_s += max(cost, 1e-9)
            return True
        if step_s is None:
            return False
        lanes = self.workers + (1 if self.stream is not None else 0)
        capacity = min(2, max(self.budget, 1)) * step_s * lanes
        queued = sum(self.backlog_s(w) for w in self._outstanding)
        if queued + self._reserved_s + cost > capacity:
            return False
        self._reserved_s += max(cost, 1e-9)
        return True

    def report(self) -> dict[str, Any]:
        """``stats()["placement"]``: jobs per executor, where each block's last job ran, the
        measured durations (ms) and the step time the rule uses."""
        return {
            "executors": ["pool"] + ([self.stream.name] if self.stream is not None else []),
            "jobs": dict(self.jobs),
            "blocks": dict(self.ran_on),
            "duration_ms": self.durations.report(),
            "step_ms": None if self.step_s is None else 1e3 * self.step_s,
            "device": None
            if self.stream is None
            else ("cpu stand-in" if self.stream.device is None else str(self.stream.device)),
        }

    def shutdown(self) -> None:
        if self.stream is not None:
            self.stream.shutdown()


def _refused(sub: Submission) -> Resolved:
    """The future of a submission whose input ``check_matrix`` refuses: its error."""
    try:
        check_matrix(f"{sub.name}: factor", sub.factor)
        if sub.basis is not None:
            check_matrix(f"{sub.name}: basis", sub.basis)
    except ValueError as err:
        return Resolved(error=err)
    raise AssertionError(f"{sub.name}: refused, but check_matrix takes it")
