"""What this build and machine offer to the low-level API, and the error for what they lack.

Owns: ``Capabilities`` (CUDA in the build and a visible GPU, pinned and mapped host memory,
O_DIRECT for the spill store, the LAPACK path, per-worker LAPACK threads, the custom ops),
``capabilities()`` that measures them, ``CudaUnavailableError`` and ``require_cuda``, which the
CUDA-only parts of ``asteria.lowlevel`` call before touching the extension.

Must not: change any state beyond the probe of O_DIRECT, which opens a spill store of 4 KiB in
a temporary directory it deletes at once (the only way to know what the filesystem accepts is to
ask it), and only when asked to (``probe_o_direct``).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import torch

from asteria import _C
from asteria._ext import cuda_missing
from asteria.ops import OPS

__all__ = ["Capabilities", "CudaUnavailableError", "capabilities", "require_cuda"]


class CudaUnavailableError(RuntimeError):
    """A CUDA-only part of the low-level API was used where CUDA is not available: a CPU-only
    build of the extension, or a CUDA build on a machine without a visible GPU. The message
    names the part and which of the two is missing."""


def require_cuda(what: str) -> None:
    """Raise ``CudaUnavailableError`` naming ``what`` unless this build has CUDA and a GPU is
    visible."""
    if not _C.cuda_enabled():
        raise CudaUnavailableError(
            f"{what} needs CUDA, and this asteria build has no CUDA (a CPU-only build): "
            f"{cuda_missing(_C)} (`python -m asteria.info` shows the build)"
        )
    if not torch.cuda.is_available():
        raise CudaUnavailableError(
            f"{what} needs a GPU: this asteria build has CUDA, but torch sees no CUDA device"
        )


@dataclass(frozen=True)
class Capabilities:
    """What the low-level API can do on this build and machine (``capabilities()``)."""

    #: The extension was compiled with CUDA (``asteria._C`` has the CUDA paths).
    cuda_build: bool
    #: torch sees a CUDA device.
    cuda_device: bool
    #: ``host_empty(pinned=True)`` works: page-locked host memory (a CUDA build with a GPU).
    pinned_memory: bool
    #: ``device_view`` works: CUDA tensors that alias pinned host memory (zero-copy).
    mapped_memory: bool
    #: The CUDA copy stream and fences on it (``copy_stream("cuda")``); else the CPU stand-in.
    cuda_copy_stream: bool
    #: A spill store in ``spill_dir`` opens with O_DIRECT (None: not probed).
    o_direct: bool | None
    #: What the filesystem said (the store's ``mode_reason``), or why it was not probed.
    o_direct_reason: str
    #: The directory the O_DIRECT probe ran in.
    spill_dir: str | None
    #: The LAPACK library the extension calls (``mkl``, ``openblas``, ...).
    lapack_backend: str
    #: The eigendecomposition path: ``aten`` (at::linalg_eigh) or ``mkl_direct``.
    eigh_path: str
    #: Each pool worker sets its own LAPACK thread count (thread-local MKL or OpenMP); without
    #: it ``lapack_threads`` applies process-wide.
    per_worker_lapack_threads: bool
    #: The pool's default worker count on this machine.
    default_workers: int
    #: The ``torch.library`` custom ops registered (``torch.ops.asteria.*``).
    custom_ops: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _o_direct(spill_dir: str) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(dir=spill_dir, prefix="asteria-probe-") as scratch:
        store = _C.SpillStore(scratch, 4096, 1, "auto")
        try:
            return store.mode == "direct", store.mode_reason
        finally:
            store.close()


def capabilities(
    spill_dir: str | os.PathLike[str] | None = None, probe_o_direct: bool = True
) -> Capabilities:
    """Measure what this build and machine offer. ``spill_dir``: where O_DIRECT is probed
    (default: the system's temporary directory; the answer depends on the filesystem, so pass
    the directory a ``SpillStore`` will use); ``probe_o_direct=False`` skips the probe."""
    info = _C.build_info()
    cuda_build = bool(info["cuda"])
    cuda_device = torch.cuda.is_available()
    gpu = cuda_build and cuda_device
    if probe_o_direct:
        directory = os.fspath(spill_dir) if spill_dir is not None else tempfile.gettempdir()
        o_direct, reason = _o_direct(directory)
    else:
        directory, o_direct, reason = None, None, "not probed"
    return Capabilities(
        cuda_build=cuda_build,
        cuda_device=cuda_device,
        pinned_memory=gpu,
        mapped_memory=gpu,
        cuda_copy_stream=gpu,
        o_direct=o_direct,
        o_direct_reason=reason,
        spill_dir=directory,
        lapack_backend=str(info["lapack_backend"]),
        eigh_path=str(info["eigh_path"]),
        per_worker_lapack_threads=bool(info["thread_local_mkl"] or info["thread_local_openmp"]),
        default_workers=int(info["default_workers"]),
        custom_ops=tuple(name for name in OPS if _registered(name)),
    )


def _registered(qualname: str) -> bool:
    namespace, name = qualname.split("::")
    return hasattr(getattr(torch.ops, namespace), name)
