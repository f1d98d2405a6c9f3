"""Asteria's public low-level API: the parts the runtime is made of, for optimizers of your own.

* the refresh worker pool: ``WorkerPool`` (C++ threads with per-worker LAPACK threads and a
  nice value), ``submit_eigh`` / ``submit_qr_refresh`` / ``submit_inverse_root`` returning
  ``RefreshFuture``s (``result(timeout)``, ``cancel()``, deadline order as priority);
* the matrix functions, synchronous: ``eigh_descending``, ``qr_refresh``, ``inverse_root``
  (the ``torch.ops.asteria.*`` custom ops, traceable by ``torch.compile``);
* host memory: ``host_empty`` (aligned, pinned and mapped where a GPU is visible),
  ``host_empty_like``, ``host_copy``, ``device_view`` (zero-copy CUDA views of pinned memory),
  ``host_memory_stats``, ``host_tensor_info``, ``is_host_tensor``, ``release_host_cache`` (the
  blocks ``host_empty(..., reuse=True)`` left for reuse); every tensor owns its memory through
  its storage;
* the staging path: ``StagingRing`` / ``StagingSlot`` (fenced, reusable pinned slots),
  ``copy_stream`` (the copy stream, ``CopyStream``), ``snapshot`` / ``Snapshot``
  (device-to-host copies into ring slots with their fences);
* the NVMe spill store: ``SpillStore`` / ``SpillFuture``;
* ``capabilities()``: what this build and machine offer (``python -m asteria.info`` prints it).

Stability: every name in ``__all__`` is stable across minor versions (0.x -> 0.y): its
signature keeps working (new parameters come as keyword arguments with defaults), its documented
contract (docs/api.md) holds, and the errors it documents stay those exception types (messages
may change). Dict keys of ``stats()`` may be added to, never removed. What may change in a minor
version: anything not in ``__all__``, ``asteria._C`` (private: the extension's bindings and its
``_testing_*`` hooks), reprs, the module each name is defined in (import them from here), and
performance. A breaking change to a name here comes with a deprecation warning for one minor
version first, and is listed in CHANGELOG.md.

CUDA-only parts (pinned memory, ``device_view``, ``copy_stream("cuda")``) raise
``CudaUnavailableError`` on a CPU-only build or without a GPU; everything else works on a CPU.
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
