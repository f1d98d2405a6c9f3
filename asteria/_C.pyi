"""Type stub for asteria._C, the C++ extension (csrc/bindings/module.cpp). Keep both in step."""

import torch

# ---- errors ---------------------------------------------------------------------------------

class MatrixFunctionError(RuntimeError):
    """A refresh failed in its dtype and in float64, or its input was not finite."""

class CancelledError(RuntimeError):
    """Future.result() of a job that was superseded or dropped at shutdown before it started."""

class FutureTimeoutError(TimeoutError):
    """Future.result(timeout_s) ran out of time."""

# ---- build --------------------------------------------------------------------------------

def build_info() -> dict[str, bool | int | str]:
    """torch_version, cuda, cuda_version, lapack_backend, eigh_path, thread_local_mkl,
    thread_local_openmp, default_workers, cplusplus, compiler."""

# ---- matrix functions (GIL released while they run) -----------------------------------------

def eigh_descending(
    factor: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]: ...
def qr_refresh(
    factor: torch.Tensor,
    basis: torch.Tensor,
    sort: bool = True,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]: ...
def inverse_root(
    factor: torch.Tensor,
    root: float,
    epsilon: float = 1e-12,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor: ...
def eigh_path() -> str:
    """'aten' (at::linalg_eigh, the default) or 'mkl_direct' (torch's MKL ?syevd_)."""

def set_eigh_path(path: str) -> None: ...
def _testing_fail_next(n: int, include_float64: bool = False) -> None:
    """Test hook: the next n eigh/QR LAPACK calls (non-float64 unless include_float64) fail."""

# ---- worker pool ----------------------------------------------------------------------------

RefreshResult = (
    torch.Tensor | tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor | None]
)

class Future:
    def done(self) -> bool: ...
    def cancelled(self) -> bool: ...
    def status(self) -> str:
        """'queued', 'running', 'succeeded', 'failed' or 'cancelled'."""

    def result(self, timeout_s: float | None = None) -> RefreshResult:
        """Waits with the GIL released. Raises the job's error (block and version prepended),
        CancelledError, or FutureTimeoutError."""

    @property
    def block(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def deadline(self) -> int: ...
    @property
    def started_at(self) -> float | None:
        """time.monotonic() when a worker started the job; None until then (or if cancelled)."""

    @property
    def finished_at(self) -> float | None:
        """time.monotonic() when the job finished (succeeded or failed); None until then."""

class WorkerPool:
    def __init__(
        self,
        workers: int,
        lapack_threads: int = 1,
        affinity: list[int] | None = None,
        queue_capacity: int = 1024,
    ) -> None: ...
    def submit_eigh(
        self,
        block: str,
        version: int,
        deadline: int,
        factor: torch.Tensor,
        dtype: torch.dtype = torch.float32,
    ) -> Future: ...
    def submit_qr_refresh(
        self,
        block: str,
        version: int,
        deadline: int,
        factor: torch.Tensor,
        basis: torch.Tensor,
        sort: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> Future: ...
    def submit_inverse_root(
        self,
        block: str,
        version: int,
        deadline: int,
        factor: torch.Tensor,
        root: float,
        epsilon: float = 1e-12,
        dtype: torch.dtype = torch.float32,
    ) -> Future: ...
    def shutdown(self, wait: bool = True) -> None: ...
    def is_shutdown(self) -> bool: ...
    def stats(self) -> dict[str, int]:
        """submitted, completed, cancelled, failed, queued, running."""

    def latest(self, block: str) -> tuple[int, RefreshResult] | None: ...
    def published_version(self, block: str) -> int | None: ...
    @property
    def workers(self) -> int: ...
    @property
    def lapack_threads(self) -> int: ...

# ---- shadow stream --------------------------------------------------------------------------

def cuda_enabled() -> bool: ...
def count_nonfinite(tensor: torch.Tensor) -> torch.Tensor:
    """Number of NaN/Inf entries as a 0-dim int64 tensor on the tensor's device (no host sync)."""

class CopyEvent:
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    @property
    def host(self) -> torch.Tensor: ...

class ShadowStream:
    def __init__(self, device: int = -1) -> None: ...
    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor) -> CopyEvent: ...
    def host_buffer_like(self, src: torch.Tensor) -> torch.Tensor: ...
    def synchronize(self) -> None: ...
    @property
    def is_cuda(self) -> bool: ...
    @property
    def device(self) -> int: ...
    @property
    def priority(self) -> int: ...
