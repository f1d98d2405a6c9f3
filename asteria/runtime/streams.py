"""Stream priorities on CUDA: training on a stream that the runtime's own streams yield to.

Owns: ``training_stream``, a context manager that runs the code inside it (the training loop) on
a CUDA stream of the greatest priority the device offers, and ``stream_priorities``.

Note [Stream priorities]: CUDA schedules the blocks of kernels on higher-priority streams first
as SMs free up (no preemption). The runtime's copy stream and device-refresh streams are at the
least priority, 0, as is every stream torch makes by default, training included: so nothing
yields (issue 50), and 0 is the least there is. ``training_stream`` makes (once per device) a
stream of the greatest priority, makes it wait for the current one's queued work, makes it
current, and on the way out makes the previous one wait for it and current again: free per step.
Tensors made inside are the training stream's; one freed while the other stream uses it needs
``record_stream``. docs/gpu.md, "Stream priorities", has the details and measurements.

Must not: change the priority of streams it did not make, or switch streams on another thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["stream_priorities", "training_stream"]

_streams: dict[int, torch.cuda.Stream] = {}  # device index -> its greatest-priority stream


def _greatest_priority_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        _least, greatest = torch.cuda.Stream.priority_range()
        stream = _streams[index] = torch.cuda.Stream(device=index, priority=greatest)
    return stream


@contextlib.contextmanager
def training_stream(
    device: torch.device | str | int | None = None,
) -> Iterator[torch.cuda.Stream | None]:
    """Run the body on ``device``'s stream of the greatest priority (Note [Stream priorities]),
    so that the runtime's copy and device-refresh streams (the least priority) yield to the
    training's kernels. Yields that stream; on a CPU device (or without CUDA) it changes nothing
    and yields None.

    ``device``: a CUDA device (default: the current one)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        yield None
        return
    stream = _greatest_priority_stream(device)
    before = torch.cuda.current_stream(stream.device)
    stream.wait_stream(before)  # what was queued before entering
    with torch.cuda.stream(stream):
        try:
            yield stream
        finally:
            before.wait_stream(stream)  # what was queued inside, before leaving


def stream_priorities() -> dict[str, int]:
    """The priority range (``least``, ``greatest``: lower is scheduled first) and the current CUDA
    stream's priority; ``{}`` without CUDA. For tests and benchmarks of Note [Stream
    priorities]."""
    if not torch.cuda.is_available():
        return {}
    least, greatest = torch.cuda.Stream.priority_range()
    return {"least": least, "greatest": greatest, "current": torch.cuda.current_stream().priority}
