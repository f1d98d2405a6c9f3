"""Host memory and the copy stream, as the low-level API hands them out.

Owns: the CUDA checks in front of ``asteria.memory``'s host memory and copy streams: pinned
host memory (``host_empty(pinned=True)``), mapped device views (``device_view``) and the CUDA copy
stream (``copy_stream("cuda")``) raise ``CudaUnavailableError`` on a CPU-only build or without a
GPU, before the extension is asked. Everything else is ``asteria.memory`` itself.

Must not: own memory or copies (asteria/memory/host.py and copies.py do).
"""

from __future__ import annotations

import torch

from asteria.lowlevel.capabilities import require_cuda
from asteria.memory import host
from asteria.memory.copies import Copies, CudaCopies, HostCopies

__all__ = ["copy_stream", "device_view", "host_copy", "host_empty", "host_empty_like"]


def host_empty(
    shape: host.Shape,
    dtype: torch.dtype = torch.float32,
    pinned: bool | None = None,
    reuse: bool = False,
) -> torch.Tensor:
    """``asteria.memory.host_empty`` (a contiguous CPU tensor over a fresh 4 KiB-aligned host
    block), with ``pinned=True`` raising ``CudaUnavailableError`` where nothing can be pinned."""
    if pinned:
        require_cuda("host_empty(pinned=True) (page-locked host memory)")
    return host.host_empty(shape, dtype, pinned, reuse)


def host_empty_like(tensor: torch.Tensor, pinned: bool | None = None) -> torch.Tensor:
    """``host_empty`` of ``tensor``'s shape and dtype."""
    return host_empty(tensor.shape, tensor.dtype, pinned)


def host_copy(tensor: torch.Tensor, pinned: bool | None = None) -> torch.Tensor:
    """A synchronous copy of ``tensor`` (any device) into a fresh host block."""
    return host_empty_like(tensor, pinned).copy_(tensor)


def device_view(
    host_tensor: torch.Tensor, device: int | str | torch.device | None = None
) -> torch.Tensor:
    """A CUDA tensor aliasing the pinned host memory of ``host_tensor`` (zero-copy), which it
    keeps alive. ``CudaUnavailableError`` without CUDA; ValueError for memory that is not an
    Asteria host block or not pinned."""
    require_cuda("device_view (mapped host memory)")
    return host.device_view(host_tensor, device)


def copy_stream(device: torch.device | str) -> Copies:
    """The copy stream of ``device``: a ``CudaCopies`` (a ``torch.cuda.Stream`` of the least
    priority, 0 as the default stream's, with events) for a CUDA device, the in-order CPU stand-in
    (``HostCopies``) for ``"cpu"``. ``CudaUnavailableError`` for a CUDA device without CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        require_cuda(f"copy_stream({str(device)!r})")
        return CudaCopies(device)
    if device.type != "cpu":
        raise ValueError(f"copy_stream: device must be 'cuda' or 'cpu', got {device}")
    return HostCopies()
