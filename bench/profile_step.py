"""Where a training step's host time goes, per variant: the runtime's own cost, measured.

On the H200 (docs/gpu.md) Asteria's ``tiny`` step took 35-40 ms more than native's, and a step
that short leaves no room for guesses. This benchmark trains each variant for ``--steps`` steps
(bf16 autocast on a GPU, the time-to-target budget's batch) and reports, over the steps after
``--skip``:

* the step time (forward, backward, optimizer step, ``loss.item()``): median and p95;
* ``torch.profiler`` over ``--profile-steps`` steps: the device's busy time per step (its
  kernels' and copies' own times: a step much longer than it is host-bound), the operators and
  CUDA runtime calls with the most host (self CPU) time, the kernels and copies with the most
  device time, and the calls that make the host wait for the device (``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, blocking ``cudaMemcpy``) or allocate
  pinned memory (``cudaHostAlloc``, ``cudaHostRegister``), with their count and time per step;
* ``cProfile`` over as many other steps: the Python functions with the most own time per step,
  and the runtime's entry points (``asteria/``) by cumulative time.

Variants: ``adamw``, ``<opt>_native`` and ``<opt>_asteria`` for ``soap``, ``kl_shampoo`` and
``shampoo``; an Asteria variant takes ``+`` options that isolate one part of the runtime:
``+bases_device`` (``placement={'bases': 'device'}``: no bases window), ``+no_hooks`` (the
module hooks off: installs at ``step()``), ``+pool`` (``device_refresh=False``: refreshes on the
host pool only). Example: ``soap_asteria+bases_device``.

Usage: ``python bench/profile_step.py --device cuda [--model tiny] [--variants ...]``; on the
CPU it runs too (the CUDA rows are then empty). The last line is JSON: per variant its figures,
and ``ratios`` (``<variant>_vs_<opt>_native_median``).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import os
import pstats
import statistics
import sys
import time
import traceback

import torch
from torch.autograd import DeviceType

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asteria.runtime import Runtime, RuntimeConfig  # noqa: E402
from asteria.train.data import VOCAB_SIZE, load_corpus, train_batches  # noqa: E402
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

VARIANTS = (
    "adamw",
    "soap_native",
    "soap_asteria",
    "soap_asteria+bases_device",
    "soap_asteria+no_hooks",
    "soap_asteria+pool",
    "shampoo_native",
    "shampoo_asteria",
)
OPTIONS = {
    "bases_device": {"placement": {"bases": "device"}},
    # the bases behind the window whatever the free memory (auto keeps them on an H100/H200's
    # device: Note [Bases by budget] in asteria/memory/tiers.py)
    "window": {"placement": {"bases": "host"}},
    "no_hooks": {"hooks": False},
    "pool": {"device_refresh": False},
}
#: CUDA runtime and driver calls that launch a kernel (``launches`` per step counts them all).
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
#: CUDA runtime calls that make the host wait for the device, or allocate pinned memory.
WAITS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaHostAlloc",
    "cudaHostRegister",
    "cudaMallocHost",
    "cudaFreeHost",
    "cudaHostUnregister",
)


def parse_variant(variant: str) -> tuple[str, str, dict]:
    """``(optimizer, mode, runtime options)`` of a variant name (see the module docstring)."""
    base, *opts = variant.split("+")
    if base == "adamw":
        name, mode = "adamw", "native"
    elif "_" in base and base.rsplit("_", 1)[1] in ("native", "asteria"):
        name, mode = base.rsplit("_", 1)
        name = name.replace("_", "-")
    else:
        raise ValueError(f"unknown variant {variant!r}: adamw or <opt>_native|asteria[+option]")
    if name not in ("adamw", "soap", "kl-shampoo", "shampoo"):
        raise ValueError(f"unknown optimizer {name!r} in variant {variant!r}")
    extra: dict = {}
    for o in opts:
        if o not in OPTIONS:
            raise ValueError(f"unknown option {o!r} in {variant!r}; choose from {sorted(OPTIONS)}")
        if mode != "asteria":
            raise ValueError(f"option {o!r} needs an asteria variant, got {variant!r}")
        extra.update(OPTIONS[o])
    return name, mode, extra


def top_profiler_rows(prof, steps: int, n: int) -> dict:
    """Per step: the ``n`` events with the most self CPU time (``top_ops``), the ``n`` kernels and
    copies with the most device time (``top_device``), the waiting calls (``waits``), and the
    sum of every kernel's and copy's time (``device_busy_ms``; streams that overlap count twice).
    The device rows come from the events that ran on the device, not from the operators'
    ``self_device_time_total``, which counts each kernel again under the operator that launched
    it (and a user annotation such as ``Optimizer.step`` spans its kernels and the gaps between
    them)."""
    rows, waits, launches = [], {}, 0.0
    for e in prof.key_averages():
        row = {
            "name": e.key,
            "calls": e.count / steps,
            "self_cpu_ms": e.self_cpu_time_total / 1e3 / steps,
            "cpu_ms": e.cpu_time_total / 1e3 / steps,
        }
        rows.append(row)
        if e.key in WAITS:
            waits[e.key] = {"calls": row["calls"], "ms": row["cpu_ms"]}
        if e.key in LAUNCHES:
            launches += row["calls"]
    on_device: dict[str, list[float]] = {}
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        if getattr(e, "is_user_annotation", False):
            continue
        calls_us = on_device.setdefault(e.name, [0, 0.0])
        calls_us[0] += 1
        calls_us[1] += e.time_range.elapsed_us()
    by_device = sorted(on_device.items(), key=lambda kv: -kv[1][1])
    return {
        "launches": launches,
        "top_ops": sorted(rows, key=lambda r: -r["self_cpu_ms"])[:n],
        "top_device": [
            {"name": k, "calls": c / steps, "device_ms": us / 1e3 / steps}
            for k, (c, us) in by_device[:n]
        ],
        "waits": waits,
        "device_busy_ms": sum(us for _, us in on_device.values()) / 1e3 / steps,
    }


def top_python(profile: cProfile.Profile, steps: int, n: int) -> tuple[list[dict], list[dict]]:
    """The ``n`` functions with the most own time, and the ``n`` asteria functions with the most
    cumulative time, per step."""
    st = pstats.Stats(profile)
    entries = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        where = file
        if "site-packages/" in where:
            where = where.split("site-packages/", 1)[1]
        elif "/asteria/" in where:
            where = "asteria/" + where.split("/asteria/", 1)[1]
        entries.append(
            {
                "function": f"{where}:{line}({func})",
                "calls": nc / steps,
                "own_ms": tt * 1e3 / steps,
                "cumulative_ms": ct * 1e3 / steps,
            }
        )
    own = sorted(entries, key=lambda e: -e["own_ms"])[:n]
    ours = [e for e in entries if e["function"].startswith("asteria/")]
    ours.sort(key=lambda e: -e["cumulative_ms"])
    return own, ours[:n]


def run_variant(variant: str, args: argparse.Namespace, corpus) -> dict:
    name, mode, extra = parse_variant(variant)
    device = torch.device(args.device)
    preset = get_preset(args.model)
    if args.layers is not None:
        preset = dataclasses.replace(preset, num_layers=args.layers)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model = build_model(preset, vocab_size=VOCAB_SIZE, max_seq_len=args.seq_len, seed=args.seed)
    model.to(device)
    opt = build_optimizer(name, model.parameters())
    runtime = None
    if mode == "asteria":
        runtime = Runtime(model, opt, RuntimeConfig(workers=args.workers, **extra))
    batches = train_batches(
        corpus, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed
    )

    def step() -> float:
        loss = lm_loss(model, next(batches).to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()  # the host waits here, as a training loop that logs the loss does

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    step_ms: list[float] = []
    out: dict = {"optimizer": name, "mode": mode, "options": extra}
    try:
        for _ in range(args.skip):
            step()
        synchronize(device)
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            step_ms.append((time.perf_counter() - t0) * 1e3)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.profile_steps):
                step()
            synchronize(device)
        out.update(top_profiler_rows(prof, args.profile_steps, args.top))
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.profile_steps):
            step()
        synchronize(device)
        profile.disable()
        out["top_python"], out["asteria_cumulative"] = top_python(
            profile, args.profile_steps, args.top
        )
        if runtime is not None:
            stats = runtime.stats()
            out["placement"] = runtime.memory_report()["placement"]
            out["jobs"] = stats.get("jobs")
    finally:
        if runtime is not None:
            runtime.close()
    out["median_ms"] = statistics.median(step_ms)
    out["p95_ms"] = sorted(step_ms)[int(0.95 * (len(step_ms) - 1))]
    out["step_ms"] = [round(x, 2) for x in step_ms]
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="tiny")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=40, help="timed steps (after --skip)")
    p.add_argument("--skip", type=int, default=15, help="untimed steps first")
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--top", type=int, default=12, help="rows per table")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-bytes", type=int, default=2_000_000)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--keep-going", action="store_true", help="a variant that raises is listed")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    for v in args.variants:
        parse_variant(v)  # a bad name stops the run before any variant trains
    for k in ("steps", "skip", "profile_steps", "top", "batch_size", "seq_len"):
        if getattr(args, k) < (0 if k == "skip" else 1):
            p.error(f"--{k.replace('_', '-')} must be >= {0 if k == 'skip' else 1}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    env = env_header("profile_step: where a training step's host time goes")
    corpus = load_corpus(max_bytes=args.data_bytes)
    results, errors = {}, {}
    for v in args.variants:
        print(f"-- {v}", flush=True)
        try:
            r = run_variant(v, args, corpus)
        except Exception as e:  # noqa: BLE001 (--keep-going lists it)
            if not args.keep_going:
                raise
            errors[v] = f"{type(e).__name__}: {e}"
            print(f"   FAILED: {errors[v]}", flush=True)
            traceback.print_exc(file=sys.stdout)
            continue
        results[v] = r
        partial_json({"benchmark": "profile_step", "env": env, "results": results})
        print(
            f"   median {r['median_ms']:.1f} ms, p95 {r['p95_ms']:.1f} ms; the device busy "
            f"{r['device_busy_ms']:.1f} ms a step (profiled)"
        )
        print_table(
            ["op (torch.profiler)", "calls/step", "self CPU ms/step"],
            [
                [o["name"][:60], f"{o['calls']:.1f}", f"{o['self_cpu_ms']:.2f}"]
                for o in r["top_ops"]
            ],
        )
        if r["top_device"]:
            print_table(
                ["on the device (own time)", "calls/step", "device ms/step"],
                [
                    [o["name"][:60], f"{o['calls']:.1f}", f"{o['device_ms']:.2f}"]
                    for o in r["top_device"]
                ],
            )
        if r["waits"]:
            print_table(
                ["host wait / pinned alloc", "calls/step", "ms/step"],
                [[k, f"{w['calls']:.1f}", f"{w['ms']:.2f}"] for k, w in r["waits"].items()],
            )
        print_table(
            ["python (own time)", "calls/step", "own ms/step"],
            [
                [e["function"][-70:], f"{e['calls']:.1f}", f"{e['own_ms']:.2f}"]
                for e in r["top_python"]
            ],
        )
        print_table(
            ["asteria (cumulative)", "calls/step", "cum ms/step"],
            [
                [e["function"][-70:], f"{e['calls']:.1f}", f"{e['cumulative_ms']:.2f}"]
                for e in r["asteria_cumulative"]
            ],
        )
    ratios = {}
    for v, r in results.items():
        name, mode, _ = parse_variant(v)
        native = results.get(f"{name.replace('-', '_')}_native")
        if mode == "asteria" and native is not None:
            ratios[f"{v}_vs_{name.replace('-', '_')}_native_median"] = (
                r["median_ms"] / native["median_ms"]
            )
    payload = {
        "benchmark": "profile_step",
        "env": env,
        "args": {k: v for k, v in vars(args).items()},
        "results": results,
        "ratios": ratios,
        "errors": errors,
    }
    emit_json(payload)
    if errors:
        sys.exit(1)
    return payload


if __name__ == "__main__":
    main()
