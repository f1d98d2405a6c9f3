"""Throughput of the NVMe spill store against plain sequential file I/O on the same disk.

Only the spill-store part of the memory benchmark exists so far (the per-tier accounting is not
measured here). ``--total-mib`` (default 512) of data in tensors of ``--tensor-mib`` (default 16)
are written and read back two ways, in the same directory and the same run:

  * plain (the baseline): one thread ``os.write``s each tensor's bytes, in order, to a file
    preallocated with ``posix_fallocate``, then ``os.read``s them back in order;
  * spill: ``SpillStore(dir, io_threads=--io-threads)``: ``put`` every tensor and wait for all the
    futures, then ``get_async`` every key and wait for all.

The tensors are 4 KiB-aligned host blocks (``host_empty``, as the host tier hands them over), so in
O_DIRECT mode the store moves them without a bounce copy. Each way runs ``--repeats`` times with a
fresh file, and every timed pass starts after an untimed ``os.sync()``, so that writeback left
over from the previous pass does not land in it; the median throughput is reported.

The page cache: dropping it needs root (``/proc/sys/vm/drop_caches``) and is not done. Instead each
comparison matches the baseline to the spill store's mode:
  * 'direct' (O_DIRECT): the store's writes are handed to the device and its reads come from it.
    The plain writer therefore waits for its dirty pages to be written back (``sync_file_range``
    with WAIT_BEFORE|WRITE|WAIT_AFTER, timed: the same guarantee O_DIRECT gives, with no device
    cache flush; ``fsync``, which also flushes the drive's cache, only where that call is missing)
    and drops its file's pages (``posix_fadvise DONTNEED``) before reading, so both read from the
    device;
  * 'buffered': both write into the page cache and read back at once, so both reads are served
    from the page cache (memory bandwidth, not the disk's).
With ``--mode auto`` both comparisons run where the filesystem takes O_DIRECT (the headline ratios
are the 'direct' ones, the store's default there), else only 'buffered'.

Last line: JSON with the throughputs and ``spill_write_ratio`` / ``spill_read_ratio`` = spill
throughput / plain throughput in the store's default mode (higher is better; the goal is >= 0.8),
plus the same per mode under ``modes``.
Usage: ``python bench/memory.py [--dir /mnt/nvme] [--total-mib 512] [--tensor-mib 16]
[--io-threads 2] [--mode auto|direct|buffered] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asteria._ext import load_extension  # noqa: E402

load_extension()

from asteria.memory import SpillStore, host_empty  # noqa: E402
from bench._common import emit_json, env_header, median, print_table, ratio  # noqa: E402

MiB = 1 << 20


@dataclass(frozen=True)
class Run:
    write_s: float
    read_s: float


def make_tensors(total_mib: int, tensor_mib: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    count = max(1, total_mib // tensor_mib)
    tensors = []
    for _ in range(count):
        t = host_empty((tensor_mib * MiB,), torch.uint8, pinned=False)
        tensors.append(t.random_(0, 256, generator=gen))
    return tensors


def _sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


SYNC_FILE_RANGE = _sync_file_range()
WRITEBACK = "sync_file_range(WAIT_BEFORE|WRITE|WAIT_AFTER)" if SYNC_FILE_RANGE else "fsync"


def writeback(fd: int, nbytes: int) -> None:
    """Wait until the file's dirty pages are on the device (what an O_DIRECT write guarantees)."""
    if SYNC_FILE_RANGE is None:
        os.fsync(fd)
    elif SYNC_FILE_RANGE(fd, 0, nbytes, 1 | 2 | 4) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sync_file_range: {os.strerror(err)}")


def plain_run(directory: str, tensors: list[torch.Tensor], device_bound: bool) -> Run:
    """Sequential os.write / os.read of the tensors' bytes through one preallocated file."""
    total = sum(t.numel() for t in tensors)
    fd, path = tempfile.mkstemp(prefix="asteria-bench-plain-", dir=directory)
    try:
        os.posix_fallocate(fd, 0, total)
        os.sync()
        start = time.perf_counter()
        for t in tensors:
            view = memoryview(t.numpy())
            while view:
                view = view[os.write(fd, view) :]
        if device_bound:
            writeback(fd, total)
        write_s = time.perf_counter() - start
        if device_bound:
            os.posix_fadvise(fd, 0, total, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        os.sync()
        start = time.perf_counter()
        for t in tensors:
            want = t.numel()
            parts = []
            while want:
                data = os.read(fd, want)
                if not data:
                    raise RuntimeError(f"{path}: unexpected end of file")
                parts.append(data)
                want -= len(data)
            chunks.append(parts[0] if len(parts) == 1 else b"".join(parts))
        read_s = time.perf_counter() - start
        if chunks[-1] != tensors[-1].numpy().tobytes():
            raise RuntimeError("plain: read back other bytes than were written")
        return Run(write_s, read_s)
    finally:
        os.close(fd)
        os.unlink(path)


def spill_run(
    directory: str, tensors: list[torch.Tensor], io_threads: int, mode: str
) -> tuple[Run, str, str]:
    """put every tensor and wait; then get_async every key and wait. Returns the store's mode."""
    total = sum(t.numel() for t in tensors)
    with SpillStore(directory, total, io_threads=io_threads, mode=mode) as store:
        os.sync()
        start = time.perf_counter()
        futures = [store.put(f"t{i}", t) for i, t in enumerate(tensors)]
        for f in futures:
            f.result()
        write_s = time.perf_counter() - start
        os.sync()
        start = time.perf_counter()
        reads = [store.get_async(f"t{i}") for i in range(len(tensors))]
        back = [f.result() for f in reads]
        read_s = time.perf_counter() - start
        if not torch.equal(back[0], tensors[0]) or not torch.equal(back[-1], tensors[-1]):
            raise RuntimeError("spill: read back other bytes than were written")
        return Run(write_s, read_s), store.mode, store.mode_reason


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where both files go")
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--tensor-mib", type=int, default=16)
    parser.add_argument("--io-threads", type=int, default=2)
    parser.add_argument("--mode", choices=["auto", "direct", "buffered"], default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.total_mib < 1 or args.tensor_mib < 1 or args.repeats < 1 or args.io_threads < 1:
        raise SystemExit("--total-mib, --tensor-mib, --io-threads and --repeats must be >= 1")
    if args.tensor_mib > args.total_mib:
        raise SystemExit("--tensor-mib must not exceed --total-mib")
    if not os.path.isdir(args.dir):
        raise SystemExit(f"--dir {args.dir!r} is not a directory")

    env = env_header("asteria bench/memory.py (spill store vs plain file I/O)")
    tensors = make_tensors(args.total_mib, args.tensor_mib)
    nbytes = sum(t.numel() for t in tensors)

    modes = [args.mode]
    if args.mode == "auto":
        with SpillStore(args.dir, MiB) as probe:
            default_mode, reason = probe.mode, probe.mode_reason
        modes = ["direct", "buffered"] if default_mode == "direct" else ["buffered"]
        print(f"   spill store default here: {default_mode} ({reason})")
    print(f"   direct: plain writes wait for {WRITEBACK}, pages dropped before reading")
    print("   buffered: both read back from the page cache (drop_caches needs root; not done)")

    per_mode: dict[str, dict[str, object]] = {}
    rows = []
    for mode in modes:
        spill_runs, plain_runs = [], []
        for _ in range(args.repeats):
            run, _, reason = spill_run(args.dir, tensors, args.io_threads, mode)
            spill_runs.append(run)
            plain_runs.append(plain_run(args.dir, tensors, device_bound=mode == "direct"))
        result = {
            way: {
                "write_gbps": median(gbps(nbytes, r.write_s) for r in runs),
                "read_gbps": median(gbps(nbytes, r.read_s) for r in runs),
            }
            for way, runs in (("spill", spill_runs), ("plain", plain_runs))
        }
        write_ratio = ratio(result["spill"]["write_gbps"], result["plain"]["write_gbps"])
        read_ratio = ratio(result["spill"]["read_gbps"], result["plain"]["read_gbps"])
        per_mode[mode] = {
            **result,
            "spill_write_ratio": write_ratio,
            "spill_read_ratio": read_ratio,
            "mode_reason": reason,
            "baseline": "os.write/os.read, one thread, preallocated file"
            + (
                f", {WRITEBACK} after writing, fadvise(DONTNEED) before reading"
                if mode == "direct"
                else ", page cache"
            ),
        }
        for way, r in result.items():
            rows.append([f"{mode}: {way}", r["write_gbps"], r["read_gbps"]])
        rows.append([f"{mode}: spill / plain", write_ratio, read_ratio])
    print_table(["way", "write GB/s", "read GB/s"], rows)

    headline = per_mode[modes[0]]
    emit_json(
        {
            "benchmark": "memory",
            "env": env,
            "config": {
                "dir": args.dir,
                "total_mib": nbytes // MiB,
                "tensor_mib": args.tensor_mib,
                "tensors": len(tensors),
                "io_threads": args.io_threads,
                "mode_requested": args.mode,
                "repeats": args.repeats,
            },
            "spill_mode": modes[0],
            "spill_write_ratio": headline["spill_write_ratio"],
            "spill_read_ratio": headline["spill_read_ratio"],
            "modes": per_mode,
        }
    )


if __name__ == "__main__":
    main()
