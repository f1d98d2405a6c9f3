"""Refresh capacity: one factor's refresh on the device against Asteria's CPU worker pool.

For each factor size ``n`` in ``--sizes`` (default 256..4096) a symmetric positive definite
``n x n`` fp32 factor ``A`` and an orthonormal basis ``Q`` are made on the host, and a refresh is
timed two ways:

  * device (``--device``, default cuda): ``torch.linalg.eigh(A)`` and SOAP's QR refresh, one power
    iteration ``torch.linalg.qr(A @ Q)``, on the device; the median of ``--repeats`` calls, the
    device drained before and after each (``device_eigh_ms``, ``device_qr_ms``);
  * pool: ``asteria._C.WorkerPool(workers=--workers, lapack_threads=1)`` is handed ``--workers``
    copies at once (``submit_eigh`` / ``submit_qr_refresh``, ``copy=False``), as many as it runs
    in parallel, in ``--repeats`` batches up to n = 1024 and one batch above; ``pool_*_ms`` is
    the median time one job ran on its worker (the future's ``finished_at - started_at``) and
    ``pool_*_per_s`` the median batch's jobs per second of wall time (the pool's throughput with
    every worker busy).

``*_capacity`` = pool jobs per second / device jobs per second (``1000 / device_ms``): above 1
the host pool refreshes more factors of that size per second than the device does one after
another. ``*_latency_ratio`` = pool job ms / device ms (how much older a basis is when it
comes from the pool). Sizes are measured smallest first; a size that would end past ``--budget-s``
of wall time (its expected time: the previous size's, scaled by n^3) is not started, and it and
the larger ones are listed under ``not_measured``: nothing is extrapolated into the results.

On a machine without CUDA, ``--device cpu`` runs the same code with torch's own CPU threads as
the "device" (a rehearsal of the code path; its figures say nothing about a GPU).

Last line: JSON. Usage: ``python bench/gpu_refresh_time.py [--device cuda]
[--sizes 256,512,1024,2048,4096] [--workers 15] [--repeats 3] [--budget-s 150]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asteria._ext import load_extension  # noqa: E402
from bench._common import emit_json, env_header, median, print_table, time_ms  # noqa: E402

POOL_REPEAT_MAX_N = 1024  # larger sizes: one pool batch (a 4096 eigh runs for seconds per job)


def make_factor(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A well-conditioned SPD ``n x n`` fp32 factor and an orthonormal ``n x n`` basis."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, n, generator=gen)
    factor = g @ g.T / n + 1e-3 * torch.eye(n)
    basis, _ = torch.linalg.qr(torch.randn(n, n, generator=gen))
    return factor.contiguous(), basis.contiguous()


def device_times(
    factor: torch.Tensor, basis: torch.Tensor, device: torch.device, repeats: int
) -> dict[str, float]:
    a, q = factor.to(device), basis.to(device)

    def eigh() -> None:
        torch.linalg.eigh(a)

    def qr() -> None:
        torch.linalg.qr(a @ q)

    out = {}
    for key, fn in (("device_eigh_ms", eigh), ("device_qr_ms", qr)):
        fn()  # warm-up: solver handles, workspaces
        out[key] = median(time_ms(fn, device) for _ in range(repeats))
    return out


def pool_times(
    pool, factor: torch.Tensor, basis: torch.Tensor, jobs: int, batches: int, tag: str
) -> dict:
    """``batches`` times, ``jobs`` copies of each refresh handed to the pool at once: the median
    job's run time and the median batch's throughput."""
    out = {}
    for kind in ("eigh", "qr"):
        job_ms, per_s = [], []
        for b in range(batches):
            copies = [factor.clone() for _ in range(jobs)]
            start = time.perf_counter()
            if kind == "eigh":
                futures = [
                    pool.submit_eigh(f"{tag}/eigh/{b}/{i}", 0, 0, c, torch.float32, copy=False)
                    for i, c in enumerate(copies)
                ]
            else:
                futures = [
                    pool.submit_qr_refresh(
                        f"{tag}/qr/{b}/{i}", 0, 0, c, basis, sort=True, dtype=torch.float32,
                        copy=False,
                    )
                    for i, c in enumerate(copies)
                ]  # fmt: skip
            for f in futures:
                f.result()
            per_s.append(jobs / (time.perf_counter() - start))
            job_ms += [1e3 * (f.finished_at - f.started_at) for f in futures]
            del futures  # each result is owned by its future alone: freed here
        out[f"pool_{kind}_ms"] = median(job_ms)
        out[f"pool_{kind}_per_s"] = median(per_s)
    return out


def capacity_row(n: int, dev: dict[str, float], pool: dict[str, float]) -> dict[str, float]:
    """The per-size record: the device and pool figures and their ratios."""
    row: dict[str, float] = {"n": n, **dev, **pool}
    for kind in ("eigh", "qr"):
        device_ms = dev[f"device_{kind}_ms"]
        row[f"{kind}_capacity"] = pool[f"pool_{kind}_per_s"] * device_ms / 1e3
        row[f"{kind}_latency_ratio"] = pool[f"pool_{kind}_ms"] / device_ms
    return row


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--sizes must look like 256,512,1024, got {text!r}") from None
    if not sizes or sizes[0] < 2:
        raise SystemExit("--sizes must list sizes >= 2")
    return sizes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sizes", default="256,512,1024,2048,4096")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=150.0)
    args = parser.parse_args(argv)
    if args.workers < 1 or args.repeats < 1:
        raise SystemExit("--workers and --repeats must be >= 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA device")
    sizes = parse_sizes(args.sizes)

    env = env_header("asteria bench/gpu_refresh_time.py (device refresh vs CPU pool)")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (rehearsal)"
    print(f"   device: {name}; pool: {args.workers} workers x 1 LAPACK thread")
    _C = load_extension()
    pool_ = _C.WorkerPool(workers=args.workers, lapack_threads=1)
    start = time.perf_counter()
    rows, not_measured = [], []
    try:
        last = None  # (n, seconds) of the size measured last
        for n in sizes:
            elapsed = time.perf_counter() - start
            # The refreshes are O(n^3): a size that would end past the budget is not started.
            expected = 0.0 if last is None else last[1] * (n / last[0]) ** 3
            if elapsed + expected > args.budget_s:
                not_measured.append(n)
                continue
            size_start = time.perf_counter()
            print(f"-- n={n}", flush=True)
            factor, basis = make_factor(n, seed=n)
            dev = device_times(factor, basis, device, args.repeats)
            if not rows:  # warm-up: the workers' first LAPACK calls (workspaces, page faults)
                pool_times(pool_, factor, basis, args.workers, 1, "warm-up")
            batches = args.repeats if n <= POOL_REPEAT_MAX_N else 1
            timed = pool_times(pool_, factor, basis, args.workers, batches, str(n))
            rows.append(capacity_row(n, dev, timed))
            last = (n, time.perf_counter() - size_start)
    finally:
        pool_.shutdown()
    if not_measured:
        print(f"   not measured (over --budget-s {args.budget_s:g}): {not_measured}")
    print_table(
        ["n", "dev eigh ms", "pool eigh ms", "pool eigh/s", "eigh capacity", "dev qr ms",
         "pool qr ms", "pool qr/s", "qr capacity"],
        [[r["n"], r["device_eigh_ms"], r["pool_eigh_ms"], r["pool_eigh_per_s"], r["eigh_capacity"],
          r["device_qr_ms"], r["pool_qr_ms"], r["pool_qr_per_s"], r["qr_capacity"]]
         for r in rows],
    )  # fmt: skip
    emit_json(
        {
            "benchmark": "capacity",
            "source": "bench/gpu_refresh_time.py",
            "env": env,
            "device": name,
            "config": {
                "device": args.device,
                "sizes": sizes,
                "workers": args.workers,
                "repeats": args.repeats,
                "budget_s": args.budget_s,
            },
            "sizes": rows,
            "not_measured": not_measured,
        }
    )


if __name__ == "__main__":
    main()
