"""Asteria's public low-level API: the parts the runtime is made of, for optimizers of your own.

The refresh worker pool (``WorkerPool``: C++ threads with their LAPACK threads and nice value;
``submit_eigh`` / ``submit_qr_refresh`` / ``submit_inverse_root`` return ``RefreshFuture``s,
deadline order as priority); the matrix functions (``eigh_descending``, ``qr_refresh``,
``inverse_root``: the ``torch.ops.asteria.*`` custom ops); host memory (``host_empty`` and
friends, ``device_view``, ``host_memory_stats``, ``release_host_cache``: every tensor owns its
memory through its storage); the staging path (``StagingRing`` / ``StagingSlot``,
``copy_stream``, ``snapshot`` / ``Snapshot``); the NVMe spill store (``SpillStore`` /
``SpillFuture``); ``capabilities()`` (``python -m asteria.info`` prints it).

Stability: every name in ``__all__`` is stable across minor versions (0.x -> 0.y): its signature
keeps working (new parameters as keywords with defaults), its documented contract (docs/api.md)
holds, its documented exception types stay; ``stats()`` keys may be added, never removed. Not
covered: names outside ``__all__``, ``asteria._C``, reprs, the defining module (import from
here), performance. A breaking change warns for one minor version first (CHANGELOG.md).
CUDA-only parts raise ``CudaUnavailableError`` on a CPU-only build or machine.
"""

from asteria._C import WaitTimeoutError
from asteria.lowlevel.capabilities import Capabilities, CudaUnavailableError, capabilities
from asteria.lowlevel.memory import copy_stream, device_view, host_copy, host_empty, host_empty_like
from asteria.lowlevel.pool import (
    CancelledError,
    EighResult,
    FutureTimeoutError,
    MatrixFunctionError,
    QRResult,
    RefreshFuture,
    WorkerPool,
)
from asteria.memory.copies import Copies as CopyStream
from asteria.memory.host import (
    StagingRing,
    StagingSlot,
    host_memory_stats,
    host_tensor_info,
    is_host_tensor,
    release_host_cache,
)
from asteria.memory.nvme import (
    SpillChecksumError,
    SpillClosedError,
    SpillFuture,
    SpillIOError,
    SpillStore,
)
from asteria.memory.staging import Snapshot, snapshot
from asteria.ops import eigh_descending, inverse_root, qr_refresh

__all__ = [
    "CancelledError",
    "Capabilities",
    "CopyStream",
    "CudaUnavailableError",
    "EighResult",
    "FutureTimeoutError",
    "MatrixFunctionError",
    "QRResult",
    "RefreshFuture",
    "Snapshot",
    "SpillChecksumError",
    "SpillClosedError",
    "SpillFuture",
    "SpillIOError",
    "SpillStore",
    "StagingRing",
    "StagingSlot",
    "WaitTimeoutError",
    "WorkerPool",
    "capabilities",
    "copy_stream",
    "device_view",
    "eigh_descending",
    "host_copy",
    "host_empty",
    "host_empty_like",
    "host_memory_stats",
    "host_tensor_info",
    "inverse_root",
    "is_host_tensor",
    "qr_refresh",
    "release_host_cache",
    "snapshot",
]
