"""Soak test: Asteria-SOAP on the tiny LM for a long time, with random faults (issue 7, item 6).

Not in CI (20 minutes by default; ``--minutes`` to change). Trains ``asteria.optim.SOAP`` under
``asteria.Runtime`` on the ``tiny`` preset (byte-level stdlib corpus) and, at each step, with
probability ``--fault-rate``, injects one fault drawn uniformly from:

  * ``nan_batch``: the loss is multiplied by NaN: every gradient of the step is NaN; the step
    must skip every parameter (``nonfinite_grads`` grows by the number of parameters);
  * ``inf_grad``: one random entry of one random parameter's gradient is set to +-Inf; that
    parameter alone is skipped;
  * ``corrupt_snapshot``: the next refresh request reads a copy of its factor with a NaN in it
    (the optimizer's state is not touched): the worker's result is non-finite in fp32 and in the
    fp64 retry, so the refresh fails, is counted, and the previous basis stays in use;
  * ``lapack_error``: the next eigh/QR LAPACK call raises (``_C._testing_fail_next``); the fp64
    retry must recover it;
  * ``slow_worker``: ~2-4 s of long eigh jobs is put ahead of every refresh in the pool's queue,
    so refreshes reach their deadline and the step waits at the staleness barrier.

A fault is *survived* when the following step completes and every parameter is finite. At the
end: steps, faults injected / survived per kind, parameters finite, the largest staleness of an
installed version against the budget, and resident memory (``VmRSS``) after warm-up and at the
end; ``rss_ok`` says whether growth stayed within ``--rss-bound-mib`` (default 64 MiB: the state
is allocated during warm-up, so growth beyond noise would be a leak).

The last line of output is one JSON object with those figures.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
import warnings
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asteria._ext import load_extension  # noqa: E402
from asteria.optim import SOAP  # noqa: E402
from asteria.runtime import RefreshFailedError, Runtime, RuntimeConfig  # noqa: E402
from asteria.train.data import load_corpus, train_batches  # noqa: E402
from asteria.train.models import build_model, get_preset  # noqa: E402
from bench._common import emit_json  # noqa: E402

KINDS = ("nan_batch", "inf_grad", "corrupt_snapshot", "lapack_error", "slow_worker")


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="wall-clock length (default 20)")
    ap.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--precondition-frequency", type=int, default=10)
    ap.add_argument("--staleness", type=int, default=4, help="the staleness budget S")
    ap.add_argument("--workers", type=int, default=None, help="pool workers (default cores - 1)")
    ap.add_argument("--fault-rate", type=float, default=0.1, help="faults per step (0-1)")
    ap.add_argument("--warmup-steps", type=int, default=50, help="steps before RSS is sampled")
    ap.add_argument("--rss-bound-mib", type=float, default=64.0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not args.minutes > 0:
        ap.error("--minutes must be > 0")
    if not 0.0 <= args.fault_rate <= 1.0:
        ap.error("--fault-rate must be in [0, 1]")
    return args


class CorruptNextRefresh:
    """Wraps ``opt.refresh_jobs``: while armed, each request's first factor is a NaN copy."""

    def __init__(self, opt: SOAP) -> None:
        self.real = opt.refresh_jobs
        self.armed = 0  # requests still to corrupt
        self.fired = 0
        opt.refresh_jobs = self  # instance attribute: the runtime calls opt.refresh_jobs(...)

    def __call__(self, block, group):
        jobs = self.real(block, group)
        if self.armed:
            for job in jobs:
                if job is not None:
                    job.factor = job.factor.clone()
                    job.factor[0, 0] = float("nan")
                    self.armed -= 1
                    self.fired += 1
                    break
        return jobs


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    _C = load_extension()

    preset = get_preset(args.preset)
    corpus = load_corpus(min_tokens=args.seq_len + 1)
    model = build_model(
        preset, vocab_size=corpus.vocab_size, max_seq_len=args.seq_len, seed=args.seed
    )
    batches = train_batches(corpus, batch_size=args.batch_size, seq_len=args.seq_len, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = SOAP(
        params,
        lr=args.lr,
        betas=(0.95, 0.95),
        weight_decay=0.01,
        precondition_frequency=args.precondition_frequency,
    )
    config = RuntimeConfig(staleness=args.staleness, workers=args.workers)
    rt = Runtime(model, opt, config)
    corrupt = CorruptNextRefresh(opt)
    hog = torch.randn(500, 500, dtype=torch.float64)
    hog = hog @ hog.T

    hogs: list = []  # (pool block name, future) of slow_worker jobs
    injected: Counter[str] = Counter()
    survived: Counter[str] = Counter()
    deferred: list[str] = []  # refresh faults: survived when the run ends without error
    error = None
    steps = 0
    rss_start = None
    losses: list[float] = []
    rss_samples: list[float] = []  # every 30 s
    t_start = time.monotonic()
    deadline = t_start + 60.0 * args.minutes
    next_report = t_start + 30.0
    warnings.simplefilter("ignore", RuntimeWarning)  # the one non-finite warning is expected
    print(
        f"== soak: SOAP on {preset.name} ({sum(p.numel() for p in params) / 1e6:.2f}M params), "
        f"{args.minutes:g} min, staleness {args.staleness}, workers {config.resolved_workers}, "
        f"fault rate {args.fault_rate}",
        flush=True,
    )
    try:
        while time.monotonic() < deadline:
            kind = None
            if steps >= args.warmup_steps and rng.random() < args.fault_rate:
                kind = rng.choice(KINDS)
                injected[kind] += 1
            if kind == "corrupt_snapshot":
                corrupt.armed += 1
            elif kind == "lapack_error":
                _C._testing_fail_next(1)
            elif kind == "slow_worker":
                for i in range(40):
                    name = f"soak-hog{i}"
                    hogs.append((name, rt.pool.submit_eigh(name, 0, 0, hog, torch.float64)))
            # the hogs' results are garbage: a finished future dropped frees its result
            while hogs and hogs[0][1].done():
                hogs.pop(0)

            x = next(batches)
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=x, labels=x).loss
            if kind == "nan_batch":
                loss = loss * float("nan")
            loss.backward()
            if kind == "inf_grad":
                p = rng.choice(params)
                p.grad.view(-1)[rng.randrange(p.numel())] = rng.choice([math.inf, -math.inf])
            skipped_before = opt.nonfinite_grads
            opt.step()
            steps += 1
            skipped = opt.nonfinite_grads - skipped_before

            if not all(bool(torch.isfinite(p).all()) for p in params):
                error = f"non-finite parameters after step {steps} (fault {kind})"
                break
            if kind in ("nan_batch", "inf_grad"):
                # judged now: exactly the poisoned parameters were skipped
                with_grad = sum(p.grad is not None for p in params)
                if skipped == (with_grad if kind == "nan_batch" else 1):
                    survived[kind] += 1
            elif kind is not None:
                deferred.append(kind)  # its effect lands at a later install: judged at the end
            if kind is None:
                losses.append(float(loss.detach()))
            if steps == args.warmup_steps:
                rss_start = rss_mib()
            now = time.monotonic()
            if now >= next_report:
                next_report = now + 30.0
                stats = rt.stats()
                rss_samples.append(round(rss_mib(), 1))
                print(
                    f"   {now - t_start:6.0f} s  step {steps}  loss {losses[-1]:.3f}  "
                    f"faults {sum(injected.values())}  failed refreshes "
                    f"{stats['jobs']['failed']}  max staleness {stats['max_staleness']}  "
                    f"rss {rss_mib():.0f} MiB",
                    flush=True,
                )
    except RefreshFailedError as err:  # max_consecutive_failures reached on one block
        error = f"RefreshFailedError: {err}"
    stats = rt.stats()
    rt.close(install_pending=error is None)
    rss_end = rss_mib()
    if rss_start is None:
        rss_start = rss_end
    finite = all(bool(torch.isfinite(p).all()) for p in params)
    state_finite = all(
        bool(torch.isfinite(t).all())
        for s in opt.state.values()
        for t in _tensors(s)
        if t.is_floating_point()
    )
    if error is None:
        survived.update(k for k in deferred if k != "corrupt_snapshot")
        # a corrupted request is survived once it has run (failed and been counted); one armed
        # at the very end may not have fired yet
        survived["corrupt_snapshot"] = corrupt.fired
    growth = rss_end - rss_start
    result = {
        "bench": "soak",
        "minutes": round((time.monotonic() - t_start) / 60.0, 2),
        "preset": preset.name,
        "steps": steps,
        "faults_injected": {k: injected[k] for k in KINDS},
        "faults_survived": {k: survived[k] for k in KINDS},
        "survived": error is None
        and all(survived[k] == injected[k] for k in KINDS if k != "corrupt_snapshot")
        and corrupt.fired + corrupt.armed == injected["corrupt_snapshot"],
        "error": error,
        "params_finite": finite,
        "state_finite": state_finite,
        "nonfinite_grad_skips": opt.nonfinite_grads,
        "corrupt_snapshots_fired": corrupt.fired,
        "failed_refreshes": stats["jobs"]["failed"],
        "installs": stats["installs"],
        "max_staleness": stats["max_staleness"],
        "staleness_budget": args.staleness,
        "staleness_ok": stats["max_staleness"] <= args.staleness,
        "max_barrier_wait_ms": round(max(stats["barrier_wait_ms"], default=0.0), 1),
        "loss_first": round(losses[0], 4) if losses else None,
        "loss_last": round(losses[-1], 4) if losses else None,
        "rss_start_mib": round(rss_start, 1),
        "rss_end_mib": round(rss_end, 1),
        "rss_growth_mib": round(growth, 1),
        "rss_samples_mib": rss_samples,
        "rss_bound_mib": args.rss_bound_mib,
        "rss_ok": growth <= args.rss_bound_mib,
        "pool_trims": stats["pool"].get(
            "trims"
        ),  # Note [Returning freed memory] (refresh_pool.cpp)
    }
    emit_json(result)  # with ``recorded`` (Note [Recorded runs] in bench/_common.py)
    return result


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


if __name__ == "__main__":
    out = main()
    sys.exit(0 if out["survived"] and out["params_finite"] and out["staleness_ok"] else 1)
