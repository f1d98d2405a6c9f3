"""Training step time of native vs Asteria-orchestrated second-order optimizers, against AdamW.

A small OLMo-2-style model (asteria.train presets) is trained for ``--steps`` steps on the
embedded corpus with each variant: ``adamw``, ``<opt>_native`` and ``<opt>_asteria`` for SOAP,
KL-Shampoo and Shampoo. Every variant starts from the same weights and sees the same batches.
The training uses ``--threads`` intra-op threads (default 1) and the Asteria pool ``--workers``
workers (default 1): on a 2-core machine, one core each. On a GPU (``--device cuda``) the
training runs there and the pool on the host CPUs.

Per variant: median, p95 and max step time (fwd + bwd + optimizer step, excluding the first
``--skip`` steps), spike ratio = max / median, the optimizer's own step time, barrier waits,
the final training loss (mean of the last 10 steps) and, for Asteria variants, the staleness
histogram. The last line is JSON with ``ratios``: ``<variant>_vs_adamw_median`` for every variant.

Usage: ``python bench/step_time.py [--steps 110] [--variants adamw,soap_native,soap_asteria]``.
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
from bench._common import emit_json, env_header, print_table, synchronize  # noqa: E402

VARIANTS = [
    "adamw",
    "soap_native",
    "soap_asteria",
    "kl_shampoo_native",
    "kl_shampoo_asteria",
    "shampoo_native",
    "shampoo_asteria",
]


def _split(variant: str) -> tuple[str, str]:
    if variant == "adamw":
        return "adamw", "native"
    name, mode = variant.rsplit("_", 1)
    return name.replace("_", "-"), mode


def run_variant(variant: str, args: argparse.Namespace, corpus) -> dict:
    name, mode = _split(variant)
    device = torch.device(args.device)
    preset = get_preset(args.model)
    model = build_model(preset, vocab_size=VOCAB_SIZE, max_seq_len=args.seq_len, seed=args.seed)
    model.to(device)
    opt = build_optimizer(name, model.parameters())
    runtime = None
    if mode == "asteria":
        config = RuntimeConfig(
            staleness=args.staleness, workers=args.workers, refresh_lead=args.refresh_lead == "on"
        )
        runtime = Runtime(model, opt, config)
    batches = train_batches(
        corpus, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed
    )
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    step_ms, opt_ms, losses = [], [], []
    try:
        for _ in range(args.steps):
            tokens = next(batches).to(device)
            synchronize(device)
            t0 = time.perf_counter()
            if autocast is not None:
                with autocast:
                    loss = model(input_ids=tokens, labels=tokens).loss
            else:
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            synchronize(device)
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            synchronize(device)
            t2 = time.perf_counter()
            step_ms.append((t2 - t0) * 1e3)
            opt_ms.append((t2 - t1) * 1e3)
            losses.append(loss.item())
        stats = runtime.stats() if runtime is not None else None
    finally:
        if runtime is not None:
            runtime.close()
    timed = step_ms[args.skip :]
    med = statistics.median(timed)
    out = {
        "median_ms": med,
        "p95_ms": sorted(timed)[int(0.95 * (len(timed) - 1))],
        "max_ms": max(timed),
        "spike_ratio": max(timed) / med,
        "optimizer_median_ms": statistics.median(opt_ms[args.skip :]),
        "optimizer_max_ms": max(opt_ms[args.skip :]),
        "final_loss": statistics.fmean(losses[-10:]),
        "step_ms": [round(x, 2) for x in step_ms],
    }
    if device.type == "cuda":
        out["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    if stats is not None:
        out["barrier_wait_ms_total"] = sum(stats["barrier_wait_ms"])
        out["staleness_histogram"] = stats["staleness_histogram"]
        out["jobs"] = stats["jobs"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=110)
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--staleness", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--refresh-lead", choices=("on", "off"), default="on", help="RuntimeConfig.refresh_lead"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {VARIANTS}")
    if args.steps <= args.skip + 10:
        raise SystemExit("--steps must exceed --skip by more than 10")

    torch.set_num_threads(args.threads)
    env = env_header("asteria bench/step_time.py")
    corpus = load_corpus(min_tokens=args.seq_len + 1)
    results = {}
    for v in variants:
        print(f"-- {v}", flush=True)
        results[v] = run_variant(v, args, corpus)
    rows = [
        [
            v,
            r["median_ms"],
            r["p95_ms"],
            r["max_ms"],
            r["spike_ratio"],
            r["optimizer_median_ms"],
            r["final_loss"],
        ]
        for v, r in results.items()
    ]
    print_table(
        ["variant", "median ms", "p95 ms", "max ms", "spike", "opt median ms", "final loss"], rows
    )
    ratios = {}
    if "adamw" in results:
        base = results["adamw"]["median_ms"]
        ratios = {f"{v}_vs_adamw_median": r["median_ms"] / base for v, r in results.items()}
    emit_json(
        {
            "benchmark": "step_time",
            "env": env,
            "config": {
                k: getattr(args, k)
                for k in (
                    "model",
                    "steps",
                    "skip",
                    "batch_size",
                    "seq_len",
                    "threads",
                    "workers",
                    "staleness",
                    "refresh_lead",
                    "device",
                )
            },
            "results": results,
            "ratios": ratios,
        }
    )


if __name__ == "__main__":
    main()
