"""The copy stream: the one way Asteria copies between host and device memory.

Owns: ``Copies``, what a copy stream offers (device buffers, events on the main stream, copies
on the copy stream that wait for such events, the main stream waiting for a copy), and two
implementations: ``CudaCopies`` (a least-priority ``torch.cuda.Stream`` per device, Note [Stream
priorities] in asteria/runtime/streams.py; events, ``non_blocking`` copies to and from pinned
memory) and ``HostCopies``, the CPU stand-in (the copy stream a queue of plain copies run in
order once their events completed; events completed at once or by hand). The runtime makes one
per device for both directions: snapshots of a refresh's inputs and the bases window's fills.

Must not: decide what is copied or when, or own the memory it copies (the callers keep sources
and destinations alive until the copy's event has completed).

Note [Host writes]: behind the window each install copies new bases back to pinned host memory
(``to_host``). A blocking copy would make the host wait for the GPU at every install (from a
forward hook, mid-forward), so ``to_host`` issues the copies on the main stream (after the
kernels that wrote the sources, which may be dropped at once) and remembers the event after
them; later copy-stream copies wait for it on the device, and a host reader (a snapshot the
pool copies, ``Runtime.sync``) calls ``host_sync()`` first.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from asteria import _C

__all__ = ["Copies", "CudaCopies", "HostCopies", "HostEvent", "copies_for"]

Tensors = Sequence[torch.Tensor | None]


class Copies(Protocol):
    """What a device's copy stream offers: buffers, copies, events on the main stream."""

    #: The copy stream (a ``torch.cuda.Stream``), or None for the stand-in: what a fence of the
    #: copies' completion is recorded on (``asteria.memory.StagingSlot.record``).
    stream: Any
    #: Host memory its copies in flight read, each with the event after which it may be freed
    #: (``asteria.memory.staging`` keeps it: ``record_stream`` cannot protect host memory).
    kept: list[tuple[Any, tuple[torch.Tensor, ...]]]

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A device buffer of ``nbytes`` bytes (uint8)."""
        ...

    def record(self) -> Any:
        """An event recorded on the main (current) stream: after every kernel issued so far."""
        ...

    def copy(self, dsts: Tensors, srcs: Tensors, waits: Sequence[Any]) -> Any:
        """On the copy stream: wait for ``waits`` (and for the ``to_host`` copies not yet
        complete), copy each src into its dst, record an event."""
        ...

    def to_host(self, dsts: Tensors, srcs: Tensors) -> Any:
        """Copy device tensors ``srcs`` into host tensors ``dsts`` without waiting for them
        (Note [Host writes]); return the event after the copies."""
        ...

    def host_sync(self) -> None:
        """Wait on the host for the ``to_host`` copies (before the host reads their dsts);
        ``host_waits`` counts the calls that found them still in flight."""
        ...

    def wait(self, event: Any) -> None:
        """Make the main stream's later kernels wait for ``event``."""
        ...

    def synchronize(self) -> None:
        """Wait on the host for everything issued on both streams."""
        ...


class CudaCopies:
    """The CUDA backend: copies on a least-priority stream of ``device`` (priority 0: below the
    training only where it runs inside ``asteria.runtime.training_stream``), events on its
    current stream. Host sources should be pinned (``asteria.memory.host_empty``) for the copies
    to be asynchronous."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        least, _greatest = torch.cuda.Stream.priority_range()  # (lowest, highest) priority
        self.stream = torch.cuda.Stream(self.device, priority=least)
        self._host_writes: torch.cuda.Event | None = None  # after the last ``to_host`` copies
        self.kept: list[tuple[Any, tuple[torch.Tensor, ...]]] = []
        #: ``host_sync`` calls that found the copies to host still in flight (the host waited)
        self.host_waits = 0

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(self, dsts: Tensors, srcs: Tensors, waits: Sequence[Any]) -> torch.cuda.Event:
        waits = list(waits)
        if self._host_writes is not None:
            if self._host_writes.query():
                self._host_writes = None
            else:
                waits.append(self._host_writes)
        with torch.cuda.stream(self.stream):
            for event in waits:
                self.stream.wait_event(event)
            _copy_all(dsts, srcs, non_blocking=True)
            seen: set[int] = set()  # device memory the caching allocator must not reuse before
            for t in (*dsts, *srcs):  # the copy stream is done with it: once per storage
                if t is not None and t.is_cuda and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    t.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def to_host(self, dsts: Tensors, srcs: Tensors) -> torch.cuda.Event:
        _copy_all(dsts, srcs, non_blocking=True)  # on the main stream (Note [Host writes])
        self._host_writes = self.record()
        return self._host_writes

    def host_sync(self) -> None:
        if self._host_writes is not None:
            if not self._host_writes.query():
                self.host_waits += 1
            self._host_writes.synchronize()
            self._host_writes = None

    def wait(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        self.stream.synchronize()
        torch.cuda.current_stream(self.device).synchronize()
        self._host_writes = None


class HostEvent:
    """A stand-in event: ``order`` says when it was recorded; complete once ``complete()``d."""

    def __init__(self, order: int, done: bool = False) -> None:
        self.order = order
        self._done = done

    def query(self) -> bool:
        return self._done

    def complete(self) -> None:
        self._done = True

    def synchronize(self) -> None:
        """The stand-in cannot wait: a pending event here is a copy that never runs."""
        if not self._done:
            raise RuntimeError(f"stand-in: {self!r} is waited for but never completes")

    def __repr__(self) -> str:
        return f"HostEvent({self.order}, {'done' if self._done else 'pending'})"


class HostCopies:
    """The CPU stand-in of ``CudaCopies``: buffers are CPU tensors, the copy stream a queue of plain
    copies, each run in order once the events it waits for completed. ``auto_complete``: main stream
    events complete at once (the runtime's); ``False``: a test completes them
    (``HostEvent.complete``) and calls ``run()``. ``log`` lists what happened, in order.

    Note [Stand-in host writes]: the stand-in orders host memory as CUDA does, so that a host reader
    that forgets to wait fails on the CPU too: ``to_host`` writes its destinations only when its
    event completes (with ``auto_complete``, when the host waits), while later "device" copies read
    what it writes; a copy between two Asteria host tensors runs at once, as CUDA runs it."""

    stream = None  # no stream: fences of its copies are the CPU stand-in's

    def __init__(self, auto_complete: bool = True) -> None:
        self.auto_complete = auto_complete
        self._order = itertools.count()
        self._queue: list[tuple[list, Tensors, Tensors, HostEvent]] = []
        self._host_writes: HostEvent | None = None
        self._unlanded: list[_HostWrites] = []  # copies to host not yet seen by the host
        self.kept: list[tuple[HostEvent, tuple[torch.Tensor, ...]]] = []
        self.host_waits = 0  # ``host_sync`` calls that found them pending (as CudaCopies')
        self.log: list[tuple] = []

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def record(self) -> HostEvent:
        event = HostEvent(next(self._order), done=self.auto_complete)
        self.log.append(("record", event))
        return event

    def copy(self, dsts: Tensors, srcs: Tensors, waits: Sequence[HostEvent]) -> HostEvent:
        info, now = _C.host_tensor_info, None
        for k, (d, s) in enumerate(zip(dsts, srcs)):  # (no Python call per pair)
            if (
                d is not None
                and s is not None
                and not d.is_cuda
                and not s.is_cuda
                and info(d) is not None
                and info(s) is not None
            ):
                now = [] if now is None else now
                now.append(k)
        if now:  # run by the host at once, as CUDA does (Note [Stand-in host writes])
            dsts, to, of = list(dsts), [], []
            for k in now:
                to.append(dsts[k])
                of.append(srcs[k])
                dsts[k] = None
            _copy_all(to, of)
        waits = list(waits)
        if self._host_writes is not None and not self._host_writes._done:
            if self.auto_complete:  # the device reads what the copies to host write; the host
                srcs = _landed(srcs, self._unlanded)  # sees it once it waits
            else:
                waits.append(self._host_writes)
        done = HostEvent(next(self._order))
        self._queue.append((waits, dsts, srcs, done))
        self.run()  # (at once where it waits for nothing pending, as the stand-in's device)
        return done

    def to_host(self, dsts: Tensors, srcs: Tensors) -> HostEvent:
        # (the sources are read when the event completes: the caller may drop them, as the
        # caching allocator keeps a device source for a copy in its stream's order)
        pairs = [(d, s) for d, s in zip(dsts, srcs) if d is not None and s is not None]
        self._host_writes = event = _HostWrites(next(self._order), pairs, self.auto_complete)
        self._unlanded = [e for e in self._unlanded if not e.query()] + [event]
        self.log.append(("to_host", event))
        return event

    def host_sync(self) -> None:
        if self._host_writes is not None:
            if not self._host_writes._done:
                self.host_waits += 1
            for event in self._unlanded:  # in their order (the main stream's)
                event.synchronize()
            self._unlanded = []
            self._host_writes = None

    def run(self) -> None:
        """Run queued copies, in order, until one waits for an event not yet complete."""
        queue = self._queue
        while queue:
            waits, dsts, srcs, done = queue[0]
            for event in waits:
                if not event._done:
                    return
            del queue[0]
            _copy_all(dsts, srcs)
            done._done = True  # (a HostEvent's ``complete``)
            self.log.append(("copy", done, waits))

    def pending(self) -> int:
        """Copies queued behind an event that has not completed."""
        return len(self._queue)

    def wait(self, event: HostEvent) -> None:
        if self._queue:
            self.run()
        if not event._done:
            raise RuntimeError(
                f"stand-in: the main stream would wait for {event!r}, a copy queued behind a "
                "reader event that is not complete (complete it, then run())"
            )

    def synchronize(self) -> None:
        self.run()
        if self._queue:
            raise RuntimeError(
                f"stand-in: {len(self._queue)} copies wait for events that are not complete"
            )
        self.host_sync()


class _HostWrites(HostEvent):
    """The event of the stand-in's ``to_host`` copies: they write their destinations when it
    completes (Note [Stand-in host writes]). With ``lands_when_waited``, a host wait
    (``synchronize``) completes it: the device catches up with its main stream."""

    def __init__(self, order: int, pairs: list, lands_when_waited: bool) -> None:
        super().__init__(order)
        # What the sources hold now, read by one _foreach_copy_: the host's work of the copy,
        # CudaCopies' launch. Its buffers and its landing are the stand-in's bookkeeping, the
        # device's work on a GPU, so an op counter (bench/host_overhead.py) does not see them.
        with _unseen():
            held = [torch.empty_like(s) for _, s in pairs]
        _copy_all(held, [s for _, s in pairs])  # (a to_host: once per install batch)
        self._pairs = [(d, h) for (d, _), h in zip(pairs, held)]
        self._lands_when_waited = lands_when_waited

    def complete(self) -> None:
        if not self._done:
            to, of = [], []
            for d, s in self._pairs:
                to.append(d)
                of.append(s)
            if torch._C._len_torch_dispatch_stack():
                with _unseen():
                    _copy_all(to, of)
            else:
                _copy_all(to, of)
            self._pairs = []
        self._done = True

    def synchronize(self) -> None:
        if self._lands_when_waited:
            self.complete()
        else:
            HostEvent.synchronize(self)


def _landed(srcs: Tensors, unlanded: list[_HostWrites]) -> list[torch.Tensor | None]:
    """What the device reads at each of ``srcs`` after the copies to host ``unlanded`` (in
    order): what the last of them that writes that tensor memory writes, else the src."""
    writes = {}
    for event in unlanded:
        if not event._done:
            for d, s in event._pairs:
                writes[(d.data_ptr(), d.shape, d.stride(), d.dtype)] = s
    out = []
    for s in srcs:
        out.append(s if s is None else writes.get((s.data_ptr(), s.shape, s.stride(), s.dtype), s))
    return out


def copies_for(device: torch.device) -> Copies:
    """The copy stream of ``device``: ``CudaCopies`` on a GPU, the stand-in on the CPU."""
    return CudaCopies(device) if device.type == "cuda" else HostCopies()


def _unseen() -> Any:
    """Torch dispatch modes (an op counter) off while the CPU stand-in keeps its own books."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _copy_all(dsts: Tensors, srcs: Tensors, non_blocking: bool = False) -> None:
    """Each src into its dst in one ``torch._foreach_copy_`` (one dispatch for a window's fill or a
    batch's copy to host, however many tensors: Note [Grouped install copies] in
    asteria/runtime/bases.py); pairs with a None are skipped."""
    to, of = [], []
    for d, s in zip(dsts, srcs):
        if d is not None and s is not None:
            to.append(d)
            of.append(s)
    if to:
        torch._foreach_copy_(to, of, non_blocking=non_blocking)
