"""Stream priorities on CUDA: training on a stream that the runtime's own streams yield to.

Owns: ``training_stream``, a context manager that runs the code inside it (the training loop) on a
CUDA stream of the greatest priority the device offers, and ``stream_priorities``, what the
runtime's streams and the current one have.

Note [Stream priorities]: CUDA schedules the blocks of kernels on streams of a higher priority
(a lower number: ``torch.cuda.Stream.priority_range()`` is ``(least, greatest)``, ``(0, -5)`` on
an H100/H200) first, as SMs free up; it does not preempt running blocks. The runtime's copy
stream (``asteria.memory.copies.CudaCopies``) and its device-refresh streams
(``placement.StreamExecutor``) are made at the least priority, 0. So is every stream torch
makes by default, the default stream included, where training runs unless told otherwise: a
device refresh or a window fill then competes with the training's kernels as an equal, and
nothing yields (issue 50). Giving the runtime's streams a priority below 0 is not possible (0 is
the least). What is: train on a stream of a greater priority. ``training_stream`` does that for
the code inside it, on the thread that enters it: it makes (once per device) a stream of the
greatest priority, makes it wait for the work already queued on the current stream, makes it
current, and on the way out makes the previous stream wait for it and current again.

What it costs: nothing per step (a stream switch is host-side bookkeeping). Kernels on the two
streams do not order each other: a tensor written on the previous stream before entering is
ordered by the entry's wait, and one written inside and read after leaving by the exit's wait;
a tensor allocated on one stream and freed while the other still uses it needs
``Tensor.record_stream`` (torch's caching allocator reuses memory in its allocation stream's
order). Tensors made inside (activations, gradients, the optimizer's state made at its first
step, the runtime's installs) are made on the training stream and need nothing. Other threads
keep their own current stream. A device refresh still takes SMs and memory bandwidth while its
blocks run; the priority decides only whose blocks are scheduled next.

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
