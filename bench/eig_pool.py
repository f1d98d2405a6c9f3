"""Throughput of Asteria's C++ refresh pool on a batch of eigendecompositions.

The same batch of symmetric matrices (default: 16 of 512 and 4 of 1024, fp32) is decomposed
three ways, each call on one LAPACK thread:
  * sequential ``torch.linalg.eigh`` on one thread (the baseline),
  * ``torch.linalg.eigh`` from a Python ``ThreadPoolExecutor`` of ``--workers`` threads,
  * ``asteria._C.WorkerPool(workers=--workers)``: ``submit_eigh`` every matrix (handed over with
    ``copy=False``, as the threads read theirs in place), wait for all.
Each way runs ``--repeats`` times; the median batch time is reported.

Last line: JSON with the times and ``speedup_vs_sequential``, ``speedup_vs_python_threads``.
Usage: ``python bench/eig_pool.py [--workers 2] [--repeats 3] [--sizes 512x16,1024x4]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asteria._ext import load_extension  # noqa: E402
from bench._common import emit_json, env_header, median, print_table, time_ms  # noqa: E402


def make_batch(sizes: list[tuple[int, int]], dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    batch = []
    for n, count in sizes:
        for _ in range(count):
            a = torch.randn(n, n, generator=gen, dtype=torch.float64)
            batch.append((a @ a.T / n + 1e-3 * torch.eye(n, dtype=torch.float64)).to(dtype))
    return batch


def parse_sizes(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(n), int(c)) for n, c in (part.split("x") for part in text.split(","))]
    except ValueError:
        raise SystemExit(f"--sizes must look like 512x16,1024x4, got {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="512x16,1024x4")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.repeats < 1:
        raise SystemExit("--workers and --repeats must be >= 1")

    env = env_header("asteria bench/eig_pool.py")
    dtype = getattr(torch, args.dtype)
    sizes = parse_sizes(args.sizes)
    batch = make_batch(sizes, dtype)
    cpu = torch.device("cpu")
    torch.set_num_threads(1)  # every path: one LAPACK thread per call
    _C = load_extension()
    pool = _C.WorkerPool(workers=args.workers, lapack_threads=1)

    def sequential() -> None:
        for a in batch:
            torch.linalg.eigh(a)

    executor = ThreadPoolExecutor(max_workers=args.workers)

    def python_threads() -> None:
        list(executor.map(torch.linalg.eigh, batch))

    def asteria_pool() -> None:
        # The batch is handed over (copy=False): like the Python threads, the pool reads the
        # matrices in place instead of snapshotting them at submission.
        futures = [
            pool.submit_eigh(f"m{i}", 0, 0, a, dtype, copy=False) for i, a in enumerate(batch)
        ]
        for f in futures:
            f.result()

    results = {}
    for name, fn in [
        ("sequential", sequential),
        ("python_threads", python_threads),
        ("asteria_pool", asteria_pool),
    ]:
        fn()  # warm-up
        results[name] = median(time_ms(fn, cpu) for _ in range(args.repeats))
    executor.shutdown()
    pool.shutdown()

    print_table(
        ["way", "batch ms", "speedup vs sequential"],
        [[k, v, results["sequential"] / v] for k, v in results.items()],
    )
    emit_json(
        {
            "benchmark": "eig_pool",
            "env": env,
            "config": {
                "workers": args.workers,
                "sizes": args.sizes,
                "dtype": args.dtype,
                "repeats": args.repeats,
            },
            "batch_ms": results,
            "speedup_vs_sequential": results["sequential"] / results["asteria_pool"],
            "speedup_vs_python_threads": results["python_threads"] / results["asteria_pool"],
            "python_threads_vs_sequential": results["sequential"] / results["python_threads"],
        }
    )


if __name__ == "__main__":
    main()
