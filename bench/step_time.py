"""Training step time of native vs Asteria-orchestrated second-order optimizers, against AdamW.

A small OLMo-2-style model (asteria.train presets) is trained for ``--steps`` steps on the
embedded corpus with each variant: ``adamw``, and ``<opt>_native``, ``<opt>_asteria`` (auto
placement), ``<opt>_window`` (the bases forced behind the device window) and ``<opt>_device``
(the bases forced onto the device) for SOAP, KL-Shampoo and Shampoo (``MODES``). Every
variant starts from the same weights and sees the same batches.
The training uses ``--threads`` intra-op threads (default 1) and the Asteria pool ``--workers``
workers (default 1): on a 2-core machine, one core each. On a GPU (``--device cuda``) the
training runs there and the pool on the host CPUs.

Per variant: median, p95 and max step time (fwd + bwd + optimizer step, excluding the first
``--skip`` steps), spike ratio = max / median, the optimizer's own step time, barrier waits,
the final training loss (mean of the last 10 steps) and, for Asteria variants, the staleness
histogram. The last line is JSON with ``ratios``: ``<variant>_vs_adamw_median`` for every variant.

On CUDA, each variant also reports ``max_memory_allocated`` (the peak of that variant alone: the
peak statistics are reset before it). ``--layers`` trains the preset with fewer (or more) layers.
``--energy`` reads the energy counters (asteria.train.energy: NVML on a GPU, RAPL on the host)
over the timed steps and reports ``energy_j_per_step`` per source (absent sources are named in
``energy_unavailable``, never estimated), and ``ratios`` gains
``<variant>_vs_adamw_energy_per_step`` (NVML where the training runs on a GPU, else RAPL).
``--keep-going``: a variant that raises (say, out of memory) is listed under ``errors`` with its
message, the others still run, the JSON is printed, and the exit status is 1.

Usage: ``python bench/step_time.py [--steps 110] [--variants adamw,soap_native,soap_asteria]
[--device cuda --model olmo-150m --layers 12 --batch-size 64 --seq-len 512 --energy]``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asteria.runtime import Runtime, RuntimeConfig  # noqa: E402
from asteria.train.data import VOCAB_SIZE, load_corpus, train_batches  # noqa: E402
from asteria.train.energy import EnergyMeter  # noqa: E402
from asteria.train.models import build_model, get_preset  # noqa: E402
from asteria.train.optimizers import build_optimizer  # noqa: E402
from bench._common import (  # noqa: E402
    emit_json,
    env_header,
    lm_loss,
    partial_json,
    print_table,
    synchronize,
)

#: Asteria's modes: ``asteria`` (``placement="auto"``: on an H100/H200 the bases stay on the
#: device, Note [Bases by budget]), ``window`` (the bases forced into pinned host memory behind
#: the device window: ``placement={"bases": "host"}``) and ``device`` (the bases forced onto the
#: device). On the CPU, ``window`` and ``device`` run the GPU strategies on their CPU stand-ins
#: (``asteria.runtime.testing.pretend_arch`` and ``staged_snapshots``).
MODES = ("native", "asteria", "window", "device")
VARIANTS = ["adamw"] + [
    f"{name}_{mode}" for name in ("soap", "kl_shampoo", "shampoo") for mode in MODES
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
    if args.layers is not None:
        preset = dataclasses.replace(preset, num_layers=args.layers)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(preset, vocab_size=VOCAB_SIZE, max_seq_len=args.seq_len, seed=args.seed)
    model.to(device)
    opt = build_optimizer(name, model.parameters())
    runtime = None
    if mode != "native":
        placement = {"window": {"bases": "host"}, "device": {"bases": "device"}}.get(mode, "auto")
        config = RuntimeConfig(
            staleness=args.staleness,
            workers=args.workers,
            refresh_lead=args.refresh_lead == "on",
            placement=placement,
        )
        with contextlib.ExitStack() as stack:
            if device.type != "cuda" and mode in ("window", "device"):  # the GPU strategies
                from asteria.memory.tiers import Arch
                from asteria.runtime import testing

                stack.enter_context(testing.staged_snapshots())
                stack.enter_context(testing.pretend_arch(Arch(cuda=True)))
            runtime = Runtime(model, opt, config)
    batches = train_batches(
        corpus, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed
    )
    step_ms, opt_ms, losses = [], [], []
    meter = EnergyMeter.probe(use_nvml=device.type == "cuda") if args.energy else None
    joules = None
    try:
        for step in range(args.steps):
            tokens = next(batches).to(device)
            synchronize(device)
            if meter is not None and step == args.skip:
                meter.start()
            t0 = time.perf_counter()
            loss = lm_loss(model, tokens)
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
        if meter is not None:
            joules = meter.read()
        stats = runtime.stats() if runtime is not None else None
        report = runtime.memory_report() if runtime is not None else None
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
    if meter is not None:
        out["energy_j_per_step"] = {k: j / len(timed) for k, j in (joules or {}).items()}
        out["energy_unavailable"] = dict(meter.unavailable)
    if stats is not None:
        out["bases_access"] = report["placement"]["bases_access"]
        out["window"] = report["placement"].get("window")
        out["snapshots"] = stats["snapshots"]
        out["barrier_wait_ms_total"] = sum(stats["barrier_wait_ms"])
        out["staleness_histogram"] = stats["staleness_histogram"]
        out["jobs"] = stats["jobs"]
    return out


def energy_ratios(results: dict, device: torch.device) -> dict[str, float]:
    """``<variant>_vs_adamw_energy_per_step`` from the source that covers the training: NVML on a
    GPU, RAPL on the host; none where that source was not measured for AdamW and the variant."""
    source = "nvml" if device.type == "cuda" else "rapl"
    base = results["adamw"].get("energy_j_per_step", {}).get(source)
    out = {}
    for v, r in results.items():
        ours = r.get("energy_j_per_step", {}).get(source)
        if ours is not None and base is not None and base > 0:
            out[f"{v}_vs_adamw_energy_per_step"] = ours / base
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
    parser.add_argument(
        "--layers", type=int, default=None, help="override the preset's number of layers"
    )
    parser.add_argument(
        "--energy", action="store_true", help="joules per timed step (NVML on a GPU, RAPL)"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="a variant that fails is listed under 'errors' (exit 1) and the others still run",
    )
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {VARIANTS}")
    if args.steps <= args.skip + 10:
        raise SystemExit("--steps must exceed --skip by more than 10")
    if args.layers is not None and args.layers < 1:
        raise SystemExit("--layers must be >= 1")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA device")

    torch.set_num_threads(args.threads)
    env = env_header("asteria bench/step_time.py")
    corpus = load_corpus(min_tokens=args.seq_len + 1)
    results, errors = {}, {}
    for v in variants:
        print(f"-- {v}", flush=True)
        try:
            results[v] = run_variant(v, args, corpus)
        except Exception as err:  # --keep-going: record it, run the other variants
            if not args.keep_going:
                raise
            errors[v] = f"{type(err).__name__}: {err}"
            print(f"   {v} failed: {errors[v]}", flush=True)
            if torch.device(args.device).type == "cuda":
                torch.cuda.empty_cache()
        partial_json({"benchmark": "step_time", "env": env, "results": results, "errors": errors})
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
    headers = ["variant", "median ms", "p95 ms", "max ms", "spike", "opt median ms", "final loss"]
    if args.energy:
        sources = sorted({k for r in results.values() for k in r["energy_j_per_step"]})
        headers += [f"{k} J/step" for k in sources]
        for row, r in zip(rows, results.values()):
            row += [r["energy_j_per_step"].get(k) for k in sources]
        for v, r in results.items():
            for k, why in r["energy_unavailable"].items():
                print(f"   {v}: {k} not measured: {why}")
    print_table(headers, rows)
    ratios = {}
    if "adamw" in results:
        base = results["adamw"]["median_ms"]
        ratios = {f"{v}_vs_adamw_median": r["median_ms"] / base for v, r in results.items()}
        if args.energy:
            ratios.update(energy_ratios(results, torch.device(args.device)))
    config = {
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
    }
    if args.layers is not None:
        config["layers"] = args.layers
    if args.energy:
        config["energy"] = True
    emit_json(
        {
            "benchmark": "step_time",
            "env": env,
            "config": config,
            "results": results,
            "ratios": ratios,
            **({"errors": errors} if errors else {}),
        }
    )
    if errors:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
