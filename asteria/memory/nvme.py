"""The NVMe tier: tensors spilled to a preallocated scratch file and paged back ahead of use.

Owns: ``SpillStore``, the Python face of ``csrc/io``: string keys, tensors in and out (shapes and
dtypes kept here), asynchronous ``put``/``get_async`` futures, ``prefetch`` (in the order
given), ``delete``, ``stats`` and ``close`` (which deletes the file). The I/O is C++: its own
threads doing pread/pwrite on one file preallocated to the capacity (O_DIRECT where allowed:
``mode``), with an XXH64 checksum per slot checked on every read.

Must not: decide what to spill or when, or hide an error: a failed write or read raises
``SpillIOError`` (an ``OSError`` with the errno), a checksum mismatch ``SpillChecksumError``
naming the key; the caller decides whether to recompute.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch

from asteria import _C

__all__ = ["SpillChecksumError", "SpillClosedError", "SpillFuture", "SpillIOError", "SpillStore"]

SpillIOError = _C.SpillIOError
SpillChecksumError = _C.SpillChecksumError
SpillClosedError = _C.SpillClosedError

_Meta = tuple[torch.Size, torch.dtype]


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)


def _check_key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"spill store keys are strings, got {type(key).__name__}: {key!r}")
    return key


class SpillFuture:
    """A pending ``put`` or ``get``. ``result()`` waits with the GIL released, then returns None
    for a put and the tensor for a get, or raises the operation's error."""

    def __init__(self, future: _C.SpillFuture, meta: _Meta | None) -> None:
        self._future = future
        self._meta = meta

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> torch.Tensor | None:
        """Raises ``TimeoutError`` when ``timeout`` seconds pass first."""
        out = self._future.result(timeout)
        if out is None or self._meta is None:
            return out
        shape, dtype = self._meta
        return out.view(dtype).view(shape)

    @property
    def started_at(self) -> float | None:
        """``time.monotonic()`` when an I/O thread started the operation, or None."""
        return self._future.started_at

    @property
    def finished_at(self) -> float | None:
        return self._future.finished_at


class SpillStore:
    """Tensors under string keys in a scratch file of ``capacity_bytes`` in ``path_dir``.

    ``path_dir``: an existing writable directory, ideally a local NVMe drive; the file is
    preallocated (ValueError where it does not fit) and deleted by ``close()`` or collection.
    ``io_threads`` (1-64) do the I/O; ``mode``: 'auto' (O_DIRECT where taken), 'direct' or
    'buffered'. ``put`` does not copy a contiguous CPU tensor (leave it until its future resolved);
    ``get`` returns a new 4 KiB-aligned CPU tensor or fills ``out`` (a pinned one makes the next
    host-to-device copy asynchronous)."""

    def __init__(
        self,
        path_dir: str | os.PathLike[str],
        capacity_bytes: int,
        io_threads: int = 2,
        mode: str = "auto",
    ) -> None:
        if mode not in ("auto", "direct", "buffered"):
            raise ValueError(f"mode must be 'auto', 'direct' or 'buffered', got {mode!r}")
        self._store = _C.SpillStore(os.fspath(path_dir), int(capacity_bytes), int(io_threads), mode)
        self._lock = threading.Lock()
        self._meta: dict[str, _Meta] = {}
        self._prefetched: dict[str, SpillFuture] = {}
        self._prefetch_issued = 0
        self._prefetch_hits = 0

    # ---- properties --------------------------------------------------------------------------

    @property
    def path(self) -> str:
        """The spill file (deleted on close)."""
        return self._store.path

    @property
    def mode(self) -> str:
        """'direct' (O_DIRECT, bypassing the page cache) or 'buffered'."""
        return self._store.mode

    @property
    def mode_reason(self) -> str:
        """Why that mode: what the filesystem accepted or refused."""
        return self._store.mode_reason

    @property
    def capacity_bytes(self) -> int:
        return int(self._store.stats()["capacity_bytes"])

    @property
    def closed(self) -> bool:
        return self._store.closed()

    # ---- writes ------------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor) -> SpillFuture:
        """Start writing ``tensor`` under ``key`` (replacing any older value). A store without
        room raises ``SpillIOError`` (ENOSPC) at once; an I/O failure fails the future."""
        _check_key(key)
        with self._lock:
            self._prefetched.pop(key, None)
            future = self._store.write(key, tensor)
            self._meta[key] = (tensor.shape, tensor.dtype)
        return SpillFuture(future, None)

    def delete(self, key: str) -> bool:
        """Forget ``key``; its space is reused once reads in flight finished. False if absent."""
        _check_key(key)
        with self._lock:
            self._prefetched.pop(key, None)
            self._meta.pop(key, None)
            return self._store.remove(key)

    # ---- reads -------------------------------------------------------------------------------

    def get_async(self, key: str, out: torch.Tensor | None = None) -> SpillFuture:
        """Start reading ``key`` (into ``out`` if given: contiguous, CPU, same number of bytes).
        ``KeyError`` when the key is absent."""
        _check_key(key)
        self._check_open("get")
        with self._lock:
            meta = self._meta.get(key)
            if meta is None or not self._store.contains(key):
                raise KeyError(f"key {key!r} is not in the spill store")
            future = self._store.read(key, out)
        return SpillFuture(future, None if out is not None else meta)

    def get(
        self, key: str, out: torch.Tensor | None = None, timeout: float | None = None
    ) -> torch.Tensor:
        """Read ``key``, from its prefetched buffer when ``prefetch`` started one."""
        _check_key(key)
        self._check_open("get")
        with self._lock:
            prefetched = self._prefetched.pop(key, None)
            if prefetched is not None:
                self._prefetch_hits += 1
        future = prefetched if prefetched is not None else self.get_async(key, out)
        result = future.result(timeout)
        if result is None:  # not reached: reads return tensors
            raise RuntimeError(f"SpillStore.get: the read of {key!r} returned nothing")
        if prefetched is not None and out is not None:
            if not out.is_contiguous() or out.device.type != "cpu" or out.nbytes != result.nbytes:
                raise ValueError(
                    f"SpillStore.get: out must be a contiguous CPU tensor of {result.nbytes} "
                    f"bytes for key {key!r}, got {tuple(out.shape)} {out.dtype} on {out.device}"
                )
            _bytes_of(out).copy_(_bytes_of(result))
            return out
        return result

    def prefetch(self, keys: Iterable[str]) -> int:
        """Start reading ``keys`` into host buffers, in this order, ahead of their ``get``; keys
        already prefetched are skipped. Each buffer is held until ``get`` takes it (or ``put``,
        ``delete`` or ``close`` drops it). Returns how many reads it started; ``KeyError`` for a
        key that is not in the store."""
        started = 0
        self._check_open("prefetch")
        for key in keys:
            _check_key(key)
            with self._lock:
                if key in self._prefetched:
                    continue
                meta = self._meta.get(key)
                if meta is None or not self._store.contains(key):
                    raise KeyError(f"prefetch: key {key!r} is not in the spill store")
                self._prefetched[key] = SpillFuture(self._store.read(key, None), meta)
                self._prefetch_issued += 1
            started += 1
        return started

    # ---- the rest ----------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._store.contains(key)

    def __len__(self) -> int:
        return len(self._store.keys())

    def keys(self) -> list[str]:
        return list(self._store.keys())

    def nbytes(self, key: str) -> int:
        """Bytes stored under ``key`` (KeyError if absent)."""
        self._check_open("nbytes")
        n = self._store.nbytes(_check_key(key))
        if n is None:
            raise KeyError(f"key {key!r} is not in the spill store")
        return int(n)

    def stats(self) -> dict[str, Any]:
        """``bytes_written``, ``bytes_read``, ``writes``, ``reads``, ``write_failures``,
        ``read_failures``, ``checksum_failures``, ``keys``, ``used_bytes``, ``capacity_bytes``,
        ``queued``, ``io_threads``, ``mode``, ``mode_reason``, ``path``, ``prefetch_issued``,
        ``prefetch_hits``, ``prefetched`` (buffers waiting for their ``get``)."""
        out: dict[str, Any] = dict(self._store.stats())
        with self._lock:
            out.update(
                mode=self.mode,
                mode_reason=self.mode_reason,
                path=self.path,
                prefetch_issued=self._prefetch_issued,
                prefetch_hits=self._prefetch_hits,
                prefetched=len(self._prefetched),
            )
        return out

    def _check_open(self, what: str) -> None:
        """A closed store raises its own error (``SpillClosedError``), not "key not found"."""
        if self._store.closed():
            raise SpillClosedError(f"SpillStore.{what}: the spill store '{self.path}' is closed")

    def close(self) -> None:
        """Stop: queued operations fail, running ones finish, the file is deleted. Idempotent."""
        with self._lock:
            self._prefetched.clear()
            self._meta.clear()
        self._store.close()

    def __enter__(self) -> SpillStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self)} keys"
        return f"SpillStore({self.path!r}, mode={self.mode!r}, {state})"
