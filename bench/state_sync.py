"""What a settled ``optimizer.state`` after every step costs: ``runtime.sync()`` after each step.

Note [State between steps] in asteria/runtime/lane.py: with the statistics lane, ``step()``
returns while the lane still writes that step's statistics into ``opt.state``; ``runtime.sync()``
settles it. A user who reads ``opt.state`` after every step (logging, model averaging) pays that
wait each step, and the lane's statistics stop overlapping the next forward and backward. This
trains asteria.train's ``--model`` preset on the embedded corpus with each Asteria optimizer
(SOAP, KL-Shampoo, Shampoo), the lane on (one training thread, one worker: the 2-core default),
twice per round: ``free`` (no sync) and ``sync`` (``runtime.sync()`` right after ``step()``,
inside the timed step). Both start from the same weights and see the same batches; rounds
alternate the order. Per optimizer and variant: the median step time (forward + backward +
step [+ sync], the first ``--skip`` steps of each run left out) and the median of the sync
alone. The last line is JSON with ``ratios``: ``<opt>_sync_vs_free_median``.

Usage: ``python bench/state_sync.py [--steps 30] [--rounds 2] [--optimizers soap,kl-shampoo]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asteria.runtime import Runtime, RuntimeConfig  # noqa: E402
from asteria.train.data import VOCAB_SIZE, load_corpus, train_batches  # noqa: E402
from asteria.train.models import build_model, get_preset  # noqa: E402
from asteria.train.optimizers import build_optimizer  # noqa: E402
from bench._common import emit_json, env_header, lm_loss, print_table  # noqa: E402

OPTIMIZERS = ("soap", "kl-shampoo", "shampoo")
VARIANTS = ("free", "sync")


def run(name: str, sync: bool, args: argparse.Namespace, corpus) -> tuple[list, list]:
    """Step times and sync times (ms) of one run."""
    model = build_model(
        get_preset(args.model), vocab_size=VOCAB_SIZE, max_seq_len=args.seq_len, seed=args.seed
    )
    opt = build_optimizer(name, model.parameters())
    config = RuntimeConfig(staleness=args.staleness, workers=1, statistics_lane=True)
    batches = train_batches(
        corpus, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed
    )
    step_ms, sync_ms = [], []
    with Runtime(model, opt, config) as runtime:
        for _ in range(args.steps):
            tokens = next(batches)
            t0 = time.perf_counter()
            lm_loss(model, tokens).backward()
            opt.step()
            t1 = time.perf_counter()
            if sync:
                runtime.sync()
            t2 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            step_ms.append((t2 - t0) * 1e3)
            sync_ms.append((t2 - t1) * 1e3)
    return step_ms[args.skip :], sync_ms[args.skip :]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--staleness", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    if set(names) - set(OPTIMIZERS) or args.steps <= args.skip or args.rounds < 1:
        raise SystemExit(f"--optimizers from {OPTIMIZERS}, --steps > --skip, --rounds >= 1")
    torch.set_num_threads(1)
    env = env_header("asteria bench/state_sync.py")
    corpus = load_corpus(min_tokens=args.seq_len + 1)
    results, ratios, rows = {}, {}, []
    for name in names:
        steps = {v: [] for v in VARIANTS}
        syncs = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            for v in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                print(f"-- {name} {v} round {r + 1}", flush=True)
                s, w = run(name, v == "sync", args, corpus)
                steps[v] += s
                syncs[v] += w
        results[name] = {
            v: {
                "median_ms": statistics.median(steps[v]),
                "sync_median_ms": statistics.median(syncs[v]),
                "steps": len(steps[v]),
            }
            for v in VARIANTS
        }
        free, synced = (results[name][v]["median_ms"] for v in VARIANTS)
        ratios[f"{name}_sync_vs_free_median"] = synced / free
        rows.append([name, free, synced, results[name]["sync"]["sync_median_ms"], synced / free])
    print_table(["optimizer", "free ms", "sync ms", "sync alone ms", "sync/free"], rows)
    emit_json({**env, "args": vars(args), "results": results, "ratios": ratios})


if __name__ == "__main__":
    main()
