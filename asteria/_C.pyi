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

# ---- SOAP's per-step block math (GIL released; soap_step.h) ---------------------------------

def soap_update_blocks(
    grads: list[torch.Tensor],
    lefts: list[torch.Tensor | None],
    rights: list[torch.Tensor | None],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    weights: list[torch.Tensor],
    step_sizes: list[float],
    beta1: float,
    beta2: float,
    eps: float,
    normalize: bool,
) -> None: ...
def soap_accumulate(
    factors: list[torch.Tensor | None], grad: torch.Tensor, beta: float
) -> None: ...
def eigh_path() -> str:
    """'aten' (at::linalg_eigh, the default) or 'mkl_direct' (torch's MKL ?syevd_)."""

def set_eigh_path(path: str) -> None: ...
def _testing_fail_next(n: int, include_float64: bool = False) -> None:
    """Test hook: the next n eigh/QR LAPACK calls (non-float64 unless include_float64) fail."""

# ---- worker pool ----------------------------------------------------------------------------

RefreshResult = (
    torch.Tensor | tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor | None]
)

class OneLapackThread:
    """The calling thread's LAPACK/BLAS threads at 1 for a with-block, then restored (Note [One
    thread per refresh] in csrc/core/aligned.cpp)."""

    def __init__(self) -> None: ...
    def __enter__(self) -> None: ...
    def __exit__(self, *args: object) -> bool: ...

class Future:
    def done(self) -> bool: ...
    def cancelled(self) -> bool: ...
    def run_ahead(self) -> bool:
        """While no worker has started this job, run the pool's first queued job (this one or
        one queued before it) on the calling thread, GIL released; whether one ran."""

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
        trim_bytes: int = 64 << 20,
        nice: int = 0,
    ) -> None: ...
    @property
    def trims(self) -> int: ...
    def submit_eigh(
        self,
        block: str,
        version: int,
        deadline: int,
        factor: torch.Tensor,
        dtype: torch.dtype = torch.float32,
        copy: bool = True,
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
        copy: bool = True,
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
        copy: bool = True,
    ) -> Future: ...
    def shutdown(self, wait: bool = True) -> None: ...
    def is_shutdown(self) -> bool: ...
    def stats(self) -> dict[str, int]:
        """submitted, completed, cancelled, failed, queued, running."""

    @property
    def workers(self) -> int: ...
    @property
    def lapack_threads(self) -> int: ...

# ---- CUDA (csrc/cuda/device.h) ---------------------------------------------------------------

def cuda_enabled() -> bool: ...
def count_nonfinite(tensor: torch.Tensor) -> torch.Tensor:
    """Number of NaN/Inf entries as a 0-dim int64 tensor on the tensor's device (no host sync)."""

# ---- host memory (csrc/memory) --------------------------------------------------------------

class WaitTimeoutError(TimeoutError):
    """StagingRing.acquire or SpillFuture.result ran out of time."""

def host_empty(
    sizes: list[int], dtype: torch.dtype, pinned: bool | None = None, reuse: bool = False
) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor over a 4 KiB-aligned host block; pinned: None
    pins where a GPU is visible, True requires it, False never pins; reuse: the block comes from
    (and goes back to) the cache of reused blocks."""

def release_host_cache() -> int:
    """Free every block in the cache of reused host blocks; the bytes freed."""

def host_memory_stats() -> dict[str, int]:
    """live_blocks, live_bytes, registered_blocks, registered_bytes, peak_bytes,
    allocated_blocks, cached_blocks, cached_bytes, reused_blocks."""

def device_view(host: torch.Tensor, device: int = -1) -> torch.Tensor:
    """A CUDA tensor aliasing pinned host memory (zero-copy); keeps the memory alive."""

class HostTensorInfo:
    @property
    def block_bytes(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def pinned(self) -> bool: ...
    @property
    def device_view(self) -> bool: ...
    @property
    def staging_slot(self) -> bool: ...

def host_tensor_info(tensor: torch.Tensor) -> HostTensorInfo | None: ...
def _testing_hold_fences() -> None:
    """Test hook: CPU stand-in fences recorded from now on stay pending."""

def _testing_release_fences() -> None:
    """Test hook: complete the held stand-in fences and stop holding."""

class RingStats:
    @property
    def slots(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def leased(self) -> int: ...
    @property
    def held_by_views(self) -> int: ...
    @property
    def pending_copies(self) -> int: ...
    @property
    def acquires(self) -> int: ...
    @property
    def waited(self) -> int: ...
    @property
    def pinned(self) -> bool: ...

class StagingSlot:
    @property
    def index(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def released(self) -> bool: ...
    def view(self, sizes: list[int], dtype: torch.dtype) -> torch.Tensor: ...
    def record(self, stream: int, device: int) -> None:
        """Fence on a raw CUDA stream handle of `device`; device < 0: the CPU stand-in."""

    def query(self) -> bool: ...
    def wait(self, timeout_s: float | None = None) -> bool: ...
    def release(self) -> None: ...

class StagingRing:
    def __init__(self, slots: int, slot_bytes: int, pinned: bool | None = None) -> None: ...
    def acquire(self, timeout_s: float | None = None) -> StagingSlot:
        """Waits with the GIL released; WaitTimeoutError names what holds the slots."""

    def stats(self) -> RingStats: ...
    @property
    def slots(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...

# ---- NVMe spill store (csrc/io) -------------------------------------------------------------

class SpillIOError(OSError):
    """A spill-store read or write failed; errno says why (ENOSPC, EIO, ...)."""

class SpillChecksumError(RuntimeError):
    """A spilled slot's data does not match its checksum (the message names the key)."""

class SpillKeyError(KeyError):
    """The key is not in the spill store."""

class SpillClosedError(RuntimeError):
    """The spill store was closed (also what queued operations fail with at close)."""

class SpillFuture:
    def done(self) -> bool: ...
    def result(self, timeout_s: float | None = None) -> torch.Tensor | None:
        """Waits with the GIL released: None for a write, a uint8 tensor (or `out`) for a read."""

    @property
    def is_read(self) -> bool: ...
    @property
    def started_at(self) -> float | None: ...
    @property
    def finished_at(self) -> float | None: ...

class SpillStore:
    def __init__(
        self, path_dir: str, capacity_bytes: int, io_threads: int = 2, mode: str = "auto"
    ) -> None: ...
    def write(self, key: str, tensor: torch.Tensor) -> SpillFuture: ...
    def read(self, key: str, out: torch.Tensor | None = None) -> SpillFuture: ...
    def remove(self, key: str) -> bool: ...
    def contains(self, key: str) -> bool: ...
    def nbytes(self, key: str) -> int | None: ...
    def extent(self, key: str) -> tuple[int, int] | None:
        """(offset, bytes) of the key's slot in the file."""

    def keys(self) -> list[str]: ...
    def close(self) -> None: ...
    def closed(self) -> bool: ...
    def stats(self) -> dict[str, int]: ...
    @property
    def path(self) -> str: ...
    @property
    def mode(self) -> str:
        """'direct' or 'buffered'."""

    @property
    def mode_reason(self) -> str: ...
    @property
    def io_threads(self) -> int: ...

def _testing_io_fail_next(n: int, errno: int, op: str = "write") -> None:
    """Test hook: the next n spill-file operations of kind op ('write', 'read', 'open_direct')
    fail with this errno."""
