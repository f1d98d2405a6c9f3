"""The refresh worker pool for optimizers of your own: submit eigh, QR-refresh and inverse-root
jobs, get futures.

Owns: ``WorkerPool`` and ``RefreshFuture``, a typed face of the C++ pool (``asteria._C
.WorkerPool``, csrc/core/refresh_pool.h) with keywords, a context manager and cancellation. The
contract is the C++ one: jobs run on the pool's threads (``lapack_threads`` LAPACK threads and
``nice`` each); the smallest ``deadline`` runs first (ties: submission order); a newer job of the
same ``block`` cancels a queued older one; inputs are copied at submission (``copy=False`` hands
a CPU tensor over); ``result`` waits with the GIL released; a result belongs to its future.

Note [Cancelling a queued job]: the C++ pool cancels a queued job only when a newer job of its
block is submitted. ``RefreshFuture.cancel`` therefore supersedes it with the smallest job there
is (an eigh of a 1x1 matrix, same version, earliest deadline: microseconds) and returns whether
the job is cancelled (True: it was still queued; False: running or finished, never interrupted).
The superseding job counts in ``stats()``. Only a block's newest job can be cancelled so (an
older one not done is running). Binding ``JobHandle::cancel`` would remove the extra job; that
needs a rebuild of the extension.

Must not: hold scheduling of its own (the C++ queue decides), or keep results (futures do).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Generic, TypeVar

import torch

from asteria import _C
from asteria.optim.matrix_functions import check_real

__all__ = [
    "CancelledError",
    "EighResult",
    "FutureTimeoutError",
    "MatrixFunctionError",
    "QRResult",
    "RefreshFuture",
    "WorkerPool",
]

MatrixFunctionError = _C.MatrixFunctionError
CancelledError = _C.CancelledError
FutureTimeoutError = _C.FutureTimeoutError

#: ``submit_eigh``'s result: eigenvalues (descending) and eigenvectors (columns).
EighResult = tuple[torch.Tensor, torch.Tensor]
#: ``submit_qr_refresh``'s result: the new basis and the permutation (None without ``sort``).
QRResult = tuple[torch.Tensor, torch.Tensor | None]

R = TypeVar("R", EighResult, QRResult, torch.Tensor)

#: The deadline of the job that supersedes a cancelled one (Note [Cancelling a queued job]).
_FIRST = -(2**62)


class RefreshFuture(Generic[R]):
    """The pending result of one job. ``status()`` is 'queued', 'running', 'succeeded',
    'failed' or 'cancelled'."""

    def __init__(self, future: _C.Future, pool: WorkerPool, kind: str) -> None:
        self._future = future
        self._pool = pool
        self.kind = kind  # 'eigh', 'qr_refresh' or 'inverse_root'

    @property
    def block(self) -> str:
        return self._future.block

    @property
    def version(self) -> int:
        return self._future.version

    @property
    def deadline(self) -> int:
        return self._future.deadline

    @property
    def started_at(self) -> float | None:
        """``time.monotonic()`` when a worker started the job; None until then."""
        return self._future.started_at

    @property
    def finished_at(self) -> float | None:
        """``time.monotonic()`` when the job succeeded or failed; None until then."""
        return self._future.finished_at

    def done(self) -> bool:
        """Succeeded, failed or cancelled."""
        return self._future.done()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def run_ahead(self) -> bool:
        """While no worker has started this job, run the pool's first queued job (this one or
        one queued before it) on the calling thread, with the pool's LAPACK thread count;
        whether one ran. A thread about to wait for the result calls it until it returns
        False: its wait is never longer for it, and shorter when the workers are busy."""
        return self._future.run_ahead()

    def status(self) -> str:
        return self._future.status()

    def result(self, timeout: float | None = None) -> R:
        """The job's result, waiting (GIL released) up to ``timeout`` s (None: no limit); raises
        ``FutureTimeoutError`` (the job goes on), ``CancelledError``, or the job's error with its
        block and version (``MatrixFunctionError``, ``ValueError``)."""
        return self._future.result(timeout)

    def cancel(self) -> bool:
        """Cancel the job if it has not started: True if it is (now or already) cancelled,
        False when it is running or finished (Note [Cancelling a queued job])."""
        return self._pool._cancel(self)

    def __repr__(self) -> str:
        return (
            f"RefreshFuture({self.kind}, block={self.block!r}, version={self.version}, "
            f"deadline={self.deadline}, {self.status()})"
        )


class WorkerPool:
    """``workers`` C++ threads (default: the build's ``default_workers``) that compute refreshes:
    ``lapack_threads`` LAPACK threads each (per worker where the build allows:
    ``capabilities().per_worker_lapack_threads``), ``nice`` (0-19, Linux) added so that they yield
    to the training, ``affinity`` (cores, round robin), ``queue_capacity`` (a submission beyond it
    raises RuntimeError), ``trim_bytes`` (an idle worker after results of that many bytes returns
    memory to the system; 0: never). ValueError names a value out of range. It shuts down at
    ``shutdown()``, a ``with`` block's end, collection or exit."""

    def __init__(
        self,
        workers: int | None = None,
        *,
        lapack_threads: int = 1,
        nice: int = 0,
        affinity: Sequence[int] | None = None,
        queue_capacity: int = 1024,
        trim_bytes: int = 64 << 20,
    ) -> None:
        if workers is None:
            workers = int(_C.build_info()["default_workers"])
        self._pool = _C.WorkerPool(
            workers=workers,
            lapack_threads=lapack_threads,
            affinity=None if affinity is None else [int(c) for c in affinity],
            queue_capacity=queue_capacity,
            trim_bytes=trim_bytes,
            nice=nice,
        )
        self._lock = threading.RLock()  # also taken by weakref callbacks, maybe inside it
        # the newest job of each block, weakly: a result is owned by its future alone
        self._newest: dict[str, weakref.ref[RefreshFuture]] = {}

    # ---- submissions ---------------------------------------------------------------------------

    def submit_eigh(
        self,
        block: str,
        factor: torch.Tensor,
        *,
        dtype: torch.dtype = torch.float32,
        deadline: int = 0,
        version: int = 0,
        copy: bool = True,
    ) -> RefreshFuture[EighResult]:
        """Eigenvalues (descending) and eigenvectors of a symmetric ``factor``, in ``dtype``
        (as ``asteria.lowlevel.eigh_descending``)."""
        # a complex matrix is refused, not cast to real (issue 22)
        check_real(f"block {block!r} (version {version}): factor", factor)
        return self._submit(
            "eigh",
            block,
            lambda: self._pool.submit_eigh(block, version, deadline, factor, dtype, copy),
        )

    def submit_qr_refresh(
        self,
        block: str,
        factor: torch.Tensor,
        basis: torch.Tensor,
        *,
        sort: bool = True,
        dtype: torch.dtype = torch.float32,
        deadline: int = 0,
        version: int = 0,
        copy: bool = True,
    ) -> RefreshFuture[QRResult]:
        """One warm-started power iteration plus QR of ``factor @ basis`` (columns sorted by
        their eigenvalue estimates with ``sort``), as ``asteria.lowlevel.qr_refresh``."""
        check_real(f"block {block!r} (version {version}): factor", factor)
        check_real(f"block {block!r} (version {version}): basis", basis)
        return self._submit(
            "qr_refresh",
            block,
            lambda: self._pool.submit_qr_refresh(
                block, version, deadline, factor, basis, sort, dtype, copy
            ),
        )

    def submit_inverse_root(
        self,
        block: str,
        factor: torch.Tensor,
        root: float,
        *,
        epsilon: float = 1e-12,
        dtype: torch.dtype = torch.float32,
        deadline: int = 0,
        version: int = 0,
        copy: bool = True,
    ) -> RefreshFuture[torch.Tensor]:
        """``factor^(-1/root)`` of a symmetric PSD ``factor``, with Meta's perturbation by
        ``epsilon``, as ``asteria.lowlevel.inverse_root``."""
        check_real(f"block {block!r} (version {version}): factor", factor)
        return self._submit(
            "inverse_root",
            block,
            lambda: self._pool.submit_inverse_root(
                block, version, deadline, factor, float(root), float(epsilon), dtype, copy
            ),
        )

    def _submit(self, kind: str, block: str, submit) -> RefreshFuture:
        if not isinstance(block, str):
            raise TypeError(f"block must be a str, got {type(block).__name__}: {block!r}")
        with self._lock:
            future = RefreshFuture(submit(), self, kind)
            self._newest[block] = weakref.ref(future, self._forget(block))
        return future

    def _forget(self, block: str):
        """A callback that drops ``block``'s entry once its newest future is gone."""
        pool = weakref.ref(self)

        def forget(ref: weakref.ref) -> None:
            owner = pool()
            if owner is not None:
                with owner._lock:
                    if owner._newest.get(block) is ref:
                        del owner._newest[block]

        return forget

    def _cancel(self, future: RefreshFuture) -> bool:
        with self._lock:
            newest = self._newest.get(future.block)
            if future.done() or newest is None or newest() is not future:
                return future.cancelled()  # done, or running (Note [Cancelling a queued job])
            if not self._pool.is_shutdown():
                self._pool.submit_eigh(
                    future.block, future.version, _FIRST, torch.ones(1, 1), torch.float32, True
                )
                del self._newest[future.block]
        return future.cancelled()

    # ---- the rest ------------------------------------------------------------------------------

    @property
    def workers(self) -> int:
        return self._pool.workers

    @property
    def lapack_threads(self) -> int:
        return self._pool.lapack_threads

    @property
    def trims(self) -> int:
        """How often a worker returned freed memory to the system."""
        return self._pool.trims

    def stats(self) -> dict[str, int]:
        """``submitted``, ``completed``, ``cancelled``, ``failed``, ``queued``, ``running``,
        ``trims``."""
        return dict(self._pool.stats())

    def shutdown(self, wait: bool = True) -> None:
        """Cancel queued jobs, let running ones finish, and (``wait``) join the threads.
        Idempotent; a submission afterwards raises RuntimeError."""
        self._pool.shutdown(wait)
        with self._lock:
            self._newest.clear()

    def is_shutdown(self) -> bool:
        return self._pool.is_shutdown()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "shut down" if self.is_shutdown() else "running"
        return f"WorkerPool(workers={self.workers}, lapack_threads={self.lapack_threads}, {state})"
