"""Optimizer state per memory tier (analytical and measured), and the NVMe spill store's throughput.

Part 1, accounting. State bytes per tier for OLMo-2 1B (d 2048, 24 layers, MLP 8192) and OLMo-2 7B
(d 4096, 32 layers, MLP 11008 per projection, 22016 fused), vocabulary 100352 (OLMo-2's padded
embedding), every parameter given to the optimizer, fp32 state, ``max_preconditioner_dim=2048``,
for SOAP and KL-Shampoo. Sizes come from ``asteria.memory.accounting.estimate_blocks`` (the
optimizers' own blocking, on ``meta`` parameters: nothing allocated) and tiers from
``asteria.memory.tiers.plan``:
  * native device = factors (L, R) + bases (Q_L, Q_R) + moments (SOAP: m, v; KL-Shampoo: m and
    the eigenvalue estimates; AdamW m, v for vectors);
  * Asteria device = factors + moments, bases in host memory, on a unified-memory GPU (GH200:
    mapped reads) and on a discrete GPU behind the device window (two slots, the window at most
    1/16 of the bases: Note [A window smaller than the bases it spares] in
    asteria/memory/tiers.py);
  * ``device_ratio`` = Asteria device bytes / native device bytes (goal <= 0.7);
  * ``per_gpu``: the same with the budgets a real device gives (``GPUS``: an 80 GB H100 and a
    141 GB H200, less ``CONTEXT_BYTES``; the bases budget ``device_bases_fraction`` of that):
    native, Asteria auto (the bases stay on the device where the budget holds them), the window
    forced, unified memory;
  * ``largest_model``: per GPU, OLMo-2 width family (1B's, 7B's) and optimizer, the most layers
    (and parameters) whose optimizer state fits the GPU, per tier, and ``vs_native`` (goal:
    >= 1.5x native's parameters).
Host bytes: bases, one waiting refresh result per block, and on CUDA the staging slots (a factor
and basis snapshot per block).
The same accounting is then measured on a small OLMo-shaped stack of parameters trained here
(SOAP and KL-Shampoo under ``fixed_delay`` with results spilled to ``--dir``): the policy's
figures against ``Runtime.memory_report()`` and against the native optimizer's state tensors.

Part 2, spill throughput. ``--total-mib`` (default 512) of data in tensors of ``--tensor-mib``
(default 16) are written and read back two ways, in the same directory and the same run:

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

Measured mode, ``--measure-cuda`` (instead of parts 1 and 2): the device bytes the optimizers
take on a real GPU, from ``torch.cuda.max_memory_allocated``, not estimates. An asteria.train
preset (``--model``, ``--layers``) is built on the GPU and trained ``--measure-steps`` steps on a
fixed batch (bf16 autocast) four ways per optimizer, each from a fresh peak: with no optimizer
(the baseline: model, gradients and activations), native, under the runtime with the window
forced (``placement={"bases": "host"}``: the bases in pinned host memory behind the device
window) and under the default ``RuntimeConfig`` (auto: on an H100/H200 at OLMo-150m the bases
fit the bases budget and stay on the device). ``optimizer_peak_bytes`` = peak - the baseline's
peak; ``resident_bytes`` = what stays allocated after the last step (gradients freed) beyond the
model. ``window_ratio`` and ``ratio`` = the window's and auto's peak figure over native's (goal
<= 0.75 for SOAP, on the window), ``resident_ratio`` of the resident one (auto). Without CUDA it
prints why and emits ``{"benchmark": "memory", "mode": "measure_cuda", "skipped": ...}`` (exit 0).

Last line: JSON with ``accounting`` (part 1), ``device_ratio`` per model and optimizer, the
throughputs and ``spill_write_ratio`` / ``spill_read_ratio`` = spill throughput / plain
throughput in the store's default mode (higher is better; the goal is >= 0.8),
plus the same per mode under ``modes``.
Usage: ``python bench/memory.py [--dir /mnt/nvme] [--total-mib 512] [--tensor-mib 16]
[--io-threads 2] [--mode auto|direct|buffered] [--repeats 3]``, or ``python bench/memory.py
--measure-cuda [--model olmo-150m] [--layers 12] [--batch-size 8] [--seq-len 512]``.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
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
from asteria.memory.accounting import estimate_blocks  # noqa: E402
from asteria.memory.tiers import Arch, plan  # noqa: E402
from asteria.optim import SOAP, KLShampoo  # noqa: E402
from asteria.runtime import Runtime, RuntimeConfig  # noqa: E402
from asteria.train.data import VOCAB_SIZE  # noqa: E402
from asteria.train.models import build_model, get_preset  # noqa: E402
from asteria.train.optimizers import build_optimizer  # noqa: E402
from bench._common import (  # noqa: E402
    emit_json,
    env_header,
    median,
    partial_json,
    print_table,
    ratio,
)

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


# ---- part 1: accounting ------------------------------------------------------------------------

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo}


def measured_optimizer(name: str, params) -> torch.optim.Optimizer:
    """``--measure-cuda``'s optimizer ``name`` (a key of OPTIMIZERS) as asteria-train builds it
    (its registry spells ``kl-shampoo``)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
    return build_optimizer(name.replace("_", "-"), params)


MODELS = {  # name: (d_model, layers, MLP width per projection, vocab)
    "olmo2-1b": (2048, 24, 8192, 100352),
    "olmo2-7b": (4096, 32, 11008, 100352),
}
GiB = 1 << 30


def olmo2_shapes(d: int, layers: int, mlp: int, vocab: int) -> list[tuple[int, ...]]:
    """OLMo-2's parameters in ``named_parameters`` order (no biases, untied embeddings)."""
    shapes: list[tuple[int, ...]] = [(vocab, d)]
    for _ in range(layers):
        shapes += [(d, d)] * 4 + [(d,), (d,)]  # q, k, v, o; q_norm, k_norm
        shapes += [(mlp, d), (mlp, d), (d, mlp)]  # gate, up, down
        shapes += [(d,), (d,)]  # post-attention and post-feedforward norms
    return shapes + [(d,), (vocab, d)]  # final norm, lm_head


def tiers_of(blocks, arch: Arch, **kw) -> dict[str, dict[str, int]]:
    return plan(blocks, arch, **kw).bytes


#: One GPU of each size the project runs on (bytes, as sold: 80 GB, 141 GB). What is free at
#: attach is that less the CUDA context and torch's own (CONTEXT_BYTES, about what an idle
#: process holds on an H100/H200); the runtime's bases budget is RuntimeConfig's
#: device_bases_fraction of it (Note [Bases by budget] in asteria/memory/tiers.py).
GPUS = {"h100": 80 * 10**9, "h200": 141 * 10**9}
CONTEXT_BYTES = 1 << 30
BASES_FRACTION = RuntimeConfig().device_bases_fraction


def _blocks(model: str, optimizer: str, max_dim: int, layers: int | None = None):
    d, n, mlp, vocab = MODELS[model]
    shapes = olmo2_shapes(d, n if layers is None else layers, mlp, vocab)
    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in shapes]
    opt = OPTIMIZERS[optimizer](params, max_preconditioner_dim=max_dim)
    return estimate_blocks(opt), sum(p.numel() for p in params)


def device_tiers(blocks, gpu_bytes: int) -> dict[str, int]:
    """Device bytes of the optimizer's state on a GPU of ``gpu_bytes``, per tier: native (all on
    the device), Asteria auto (the bases stay when the bases budget holds them, else the
    window), Asteria with the window forced, and on unified memory (mapped host bases)."""
    free = gpu_bytes - CONTEXT_BYTES
    budget = int(BASES_FRACTION * free)
    arch = Arch(cuda=True)
    tiers = {
        "native": tiers_of(blocks, arch, placement={"bases": "device"}),
        "asteria_auto": tiers_of(blocks, arch, bases_window=True, bases_device_bytes=budget),
        "asteria_window": tiers_of(
            blocks, arch, placement={"bases": "host"}, bases_window=True,
            bases_device_bytes=budget,
        ),
        "asteria_unified": tiers_of(blocks, Arch(cuda=True, unified_memory=True)),
    }  # fmt: skip
    return {k: sum(v["device"].values()) for k, v in tiers.items()}


def largest_fitting(model: str, optimizer: str, max_dim: int, gpu_bytes: int) -> dict:
    """Per tier, the most layers of ``model``'s widths (and their parameters) whose optimizer
    state fits one GPU of ``gpu_bytes`` (what is free at attach), by bisection on layers."""
    free = gpu_bytes - CONTEXT_BYTES
    cache: dict[int, tuple[dict[str, int], int]] = {}

    def at(layers: int) -> tuple[dict[str, int], int]:
        if layers not in cache:
            blocks, params = _blocks(model, optimizer, max_dim, layers)
            cache[layers] = (device_tiers(blocks, gpu_bytes), params)
        return cache[layers]

    out = {}
    for tier in ("native", "asteria_auto", "asteria_window", "asteria_unified"):
        lo, hi = 0, 1
        while at(hi)[0][tier] <= free and hi < 1024:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if at(mid)[0][tier] <= free else (lo, mid)
        out[tier] = {"layers": lo, "params": at(lo)[1] if lo else 0}
    base = out["native"]["params"]
    for tier in ("asteria_auto", "asteria_window", "asteria_unified"):
        out[tier]["vs_native"] = out[tier]["params"] / base if base else None
    return out


def analytical(model: str, optimizer: str, max_dim: int) -> dict[str, object]:
    blocks, n_params = _blocks(model, optimizer, max_dim)
    native = tiers_of(blocks, Arch(cuda=True), placement={"bases": "device"})
    unified = tiers_of(blocks, Arch(cuda=True, unified_memory=True))
    window = tiers_of(
        blocks, Arch(cuda=True), placement={"bases": "host"}, bases_window=True, window_blocks=2
    )
    staging = sum(b.snapshots for b in blocks)
    native_device = sum(native["device"].values())

    def asteria(bytes_: dict[str, dict[str, int]]) -> dict[str, object]:
        device = sum(bytes_["device"].values())
        return {
            "device": bytes_["device"],
            "host": {**bytes_["host"], "staging": staging},
            "device_gib": device / GiB,
            "device_ratio": device / native_device,
        }

    per_gpu = {}
    for gpu, size in GPUS.items():
        dev = device_tiers(blocks, size)
        per_gpu[gpu] = {
            "device_bytes": dev,
            "device_ratio": {k: v / dev["native"] for k, v in dev.items() if k != "native"},
            "fits": {k: v <= size - CONTEXT_BYTES for k, v in dev.items()},
        }
    return {
        "params": n_params,
        "blocks": sum(1 for b in blocks if b.factors),
        "native": {"device": native["device"], "device_gib": native_device / GiB},
        "asteria_unified": asteria(unified),
        "asteria_discrete_window": asteria(window),
        "device_ratio": asteria(unified)["device_ratio"],
        "device_ratio_discrete_window": asteria(window)["device_ratio"],
        "per_gpu": per_gpu,
    }


def _state_bytes(opt) -> dict[str, int]:
    out = {"factors": 0, "moments": 0, "bases": 0}
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out["moments"] += value.nbytes
            if key != "blocks":
                continue
            for block in value:
                for field, v in block.items():
                    kind = {"factors": "factors", "bases": "bases"}.get(field, "moments")
                    for t in v if isinstance(v, list) else [v]:
                        out[kind] += 0 if t is None else t.nbytes
    return out


def measured(optimizer: str, directory: str, steps: int = 13) -> dict[str, object]:
    """A small OLMo-shaped stack trained here: memory_report() against the policy's figures and
    the native optimizer's state."""
    shapes = olmo2_shapes(64, 2, 176, 512)
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
    noise = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]

    def run(orchestrated: bool):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = OPTIMIZERS[optimizer](params, precondition_frequency=5, max_preconditioner_dim=64)
        rt = None
        if orchestrated:
            config = RuntimeConfig(
                staleness=4, fixed_delay=4, workers=1, nvme_path=directory,
                placement={"results": "nvme"},
            )  # fmt: skip
            rt = Runtime(None, opt, config)
        for t in range(steps):  # refreshes requested at step 10 wait, spilled, for step 14
            opt.zero_grad()
            sum(((p - 0.1 * n) ** 2).sum() for p, n in zip(params, noise[t])).backward()
            opt.step()
        if rt is None:
            return _state_bytes(opt), None, None
        for e in rt.blocks().values():
            if e.pending is not None and e.pending.spilled is not None:
                rt.spill.settle(e.pending)
        report = rt.memory_report()
        rt.close()
        return _state_bytes(opt), report, report["planned"]

    native_state, _, _ = run(False)
    allocated, report, planned = run(True)
    native_device = sum(native_state.values())
    asteria_device = sum(report["device"].values())
    checks = {
        "device_factors": [report["device"]["factors"], planned["device"]["factors"]],
        "device_moments": [report["device"]["moments"], planned["device"]["moments"]],
        "host_bases": [report["host"]["bases"], planned["host"]["bases"]],
        "nvme_results": [report["nvme"]["results"], planned["nvme"]["results"]],
        "nvme_snapshots": [report["nvme"]["snapshots"], planned["nvme"]["snapshots"]],
    }
    return {
        "model": "olmo2-shaped d64, 2 layers, MLP 176, vocab 512, max_preconditioner_dim 64",
        "memory_report": {t: report[t] for t in ("device", "host", "nvme")},
        "planned": planned,
        "report_vs_planned": checks,
        "report_matches_plan": all(a == b for a, b in checks.values()),
        "report_matches_allocated": report["device"]["factors"] == allocated["factors"]
        and report["device"]["moments"] == allocated["moments"]
        and report["host"]["bases"] == allocated["bases"],
        "native_device_bytes": native_device,
        "asteria_device_bytes": asteria_device,
        "device_ratio": asteria_device / native_device,
    }


def accounting(directory: str, max_dim: int) -> dict[str, object]:
    out: dict[str, object] = {"max_preconditioner_dim": max_dim, "models": {}, "measured": {}}
    rows = []
    for model in MODELS:
        for name in OPTIMIZERS:
            a = analytical(model, name, max_dim)
            out["models"].setdefault(model, {})[name] = a
            rows.append(
                [f"{model} {name}", a["native"]["device_gib"],
                 a["asteria_unified"]["device_gib"], a["device_ratio"],
                 a["device_ratio_discrete_window"]]
            )  # fmt: skip
    print_table(
        ["model optimizer", "native dev GiB", "asteria dev GiB", "ratio (unified)",
         "ratio (window)"], rows,
    )  # fmt: skip
    rows = []
    out["largest_model"] = {}
    for gpu, size in GPUS.items():
        for model in MODELS:
            for name in OPTIMIZERS:
                fit = largest_fitting(model, name, max_dim, size)
                out["largest_model"].setdefault(gpu, {}).setdefault(model, {})[name] = fit
                rows.append(
                    [f"{gpu} {model} widths {name}", fit["native"]["params"] / 1e9,
                     fit["asteria_window"]["params"] / 1e9, fit["asteria_window"]["vs_native"],
                     fit["asteria_auto"]["params"] / 1e9, fit["asteria_unified"]["params"] / 1e9]
                )  # fmt: skip
    print_table(
        ["largest model on one GPU", "native B params", "window B params", "window/native",
         "auto B params", "unified B params"], rows,
    )  # fmt: skip
    rows = []
    for name in OPTIMIZERS:
        m = measured(name, directory)
        out["measured"][name] = m
        rows.append([name, m["native_device_bytes"], m["asteria_device_bytes"], m["device_ratio"],
                     m["report_matches_plan"], m["report_matches_allocated"]])  # fmt: skip
    print_table(
        ["measured here", "native dev B", "asteria dev B", "ratio", "report==plan",
         "report==allocated"], rows,
    )  # fmt: skip
    return out


# ---- measured mode: device bytes on a real GPU --------------------------------------------------


def cuda_skip_reason() -> str | None:
    """Why the measured mode cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def _cuda_run(kind: str, name: str, args: argparse.Namespace) -> dict[str, object]:
    """Train ``--measure-steps`` steps on the GPU with no optimizer (``kind="none"``), the native
    optimizer ``name`` or it under the runtime; the peak and resident bytes beyond what was
    allocated before the model was built."""
    device = torch.device("cuda")
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    preset = get_preset(args.model)
    if args.layers is not None:
        preset = dataclasses.replace(preset, num_layers=args.layers)
    model = build_model(preset, vocab_size=VOCAB_SIZE, max_seq_len=args.seq_len, seed=0).to(device)
    model_bytes = torch.cuda.memory_allocated(device) - before
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB_SIZE, (args.batch_size, args.seq_len), generator=gen)
    tokens = tokens.to(device)
    opt = rt = report = None
    if kind != "none":
        opt = measured_optimizer(name, model.parameters())
    try:
        if kind in ("asteria", "window"):  # window: the bases behind it, whatever is free
            placement = {"bases": "host"} if kind == "window" else "auto"
            config = RuntimeConfig(
                staleness=args.staleness, workers=args.workers, placement=placement
            )
            rt = Runtime(model, opt, config)
        for _ in range(args.measure_steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
            del loss
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        resident = torch.cuda.memory_allocated(device) - before - model_bytes
        if rt is not None:
            report = rt.memory_report()
    finally:
        if rt is not None:
            rt.close()
        del opt, model, tokens
    out: dict[str, object] = {"peak_bytes": peak, "resident_bytes": resident}
    out["model_bytes"] = model_bytes
    if report is not None:
        out["memory_report"] = {t: report[t] for t in ("device", "host", "nvme")}
        out["bases_access"] = report["placement"]["bases_access"]
    return out


def measured_summary(runs: dict[str, dict[str, dict[str, object]]]) -> dict[str, object]:
    """From ``runs[optimizer][kind]`` (kind ``none``, ``native``, ``asteria``, each with
    ``peak_bytes`` and ``resident_bytes``, or an ``error``): per optimizer the optimizer's peak
    bytes beyond the no-optimizer baseline, native and Asteria, and ``ratio`` (peak) /
    ``resident_ratio`` (None where a run failed)."""
    out: dict[str, object] = {}

    def minus(a: int | None, b: int | None) -> int | None:
        return None if a is None or b is None else a - b

    for name, per in runs.items():
        base = per["none"].get("peak_bytes")
        native = minus(per["native"].get("peak_bytes"), base)
        asteria = minus(per["asteria"].get("peak_bytes"), base)
        window = minus(per.get("window", {}).get("peak_bytes"), base)
        out[name] = {
            "window_optimizer_peak_bytes": window,
            "window_ratio": ratio(window, native),
            "baseline_peak_bytes": base,
            "native_optimizer_peak_bytes": native,
            "asteria_optimizer_peak_bytes": asteria,
            "ratio": ratio(asteria, native),
            "native_resident_bytes": per["native"].get("resident_bytes"),
            "asteria_resident_bytes": per["asteria"].get("resident_bytes"),
            "resident_ratio": ratio(
                per["asteria"].get("resident_bytes"), per["native"].get("resident_bytes")
            ),
        }
    return out


def measure_cuda_main(args: argparse.Namespace) -> None:
    env = env_header("asteria bench/memory.py --measure-cuda (device bytes, measured)")
    config = {
        k: getattr(args, k)
        for k in (
            "model", "layers", "batch_size", "seq_len", "measure_steps", "staleness", "workers",
            "optimizers",
        )
    }  # fmt: skip
    payload: dict[str, object] = {"benchmark": "memory", "mode": "measure_cuda", "env": env}
    payload["config"] = config
    reason = cuda_skip_reason()
    if reason is not None:
        print(f"   skipped: {reason}")
        emit_json({**payload, "skipped": reason})
        return
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    runs: dict[str, dict[str, dict[str, object]]] = {}
    errors = {}
    for name in names:
        runs[name] = {}
        for kind in ("none", "native", "window", "asteria"):
            print(f"-- {name} {kind}", flush=True)
            try:
                runs[name][kind] = _cuda_run(kind, name, args)
            except Exception as err:  # e.g. out of memory: record it, measure the rest
                errors[f"{name}/{kind}"] = f"{type(err).__name__}: {err}"
                print(f"   failed: {errors[f'{name}/{kind}']}", flush=True)
                runs[name][kind] = {"error": errors[f"{name}/{kind}"]}
            partial_json({**payload, "runs": runs, "errors": errors})
    summary = measured_summary(runs)

    def mb(nbytes: int | None) -> float | None:
        return None if nbytes is None else nbytes / 1e6

    print_table(
        ["optimizer", "baseline MB", "native opt MB", "window opt MB", "window ratio",
         "auto opt MB", "auto ratio", "native resident MB", "auto resident MB",
         "resident ratio"],
        [[n, mb(s["baseline_peak_bytes"]), mb(s["native_optimizer_peak_bytes"]),
          mb(s["window_optimizer_peak_bytes"]), s["window_ratio"],
          mb(s["asteria_optimizer_peak_bytes"]), s["ratio"], mb(s["native_resident_bytes"]),
          mb(s["asteria_resident_bytes"]), s["resident_ratio"]] for n, s in summary.items()],
    )  # fmt: skip
    payload["device_ratio_window_measured"] = {n: s["window_ratio"] for n, s in summary.items()}
    payload["device"] = torch.cuda.get_device_name()
    payload["runs"] = runs
    payload["measured"] = summary
    payload["device_ratio_measured"] = {n: s["ratio"] for n, s in summary.items()}
    if errors:
        payload["errors"] = errors
    emit_json(payload)
    if errors:
        raise SystemExit(1)


# ---- part 2: spill throughput --------------------------------------------------------------------


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
    parser.add_argument("--max-preconditioner-dim", type=int, default=2048)
    cuda = parser.add_argument_group("measured mode (--measure-cuda)")
    cuda.add_argument(
        "--measure-cuda", action="store_true", help="device bytes from max_memory_allocated"
    )
    cuda.add_argument("--model", default="olmo-150m", help="asteria.train preset")
    cuda.add_argument("--layers", type=int, default=None, help="override the preset's layers")
    cuda.add_argument("--batch-size", type=int, default=8)
    cuda.add_argument("--seq-len", type=int, default=512)
    cuda.add_argument("--measure-steps", type=int, default=24)
    cuda.add_argument("--staleness", type=int, default=5)
    cuda.add_argument("--workers", type=int, default=None, help="pool workers (cores - 1)")
    cuda.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    args = parser.parse_args(argv)
    if args.measure_cuda:
        if args.measure_steps < 1 or args.batch_size < 1 or args.seq_len < 2:
            raise SystemExit("--measure-steps, --batch-size must be >= 1, --seq-len >= 2")
        if args.layers is not None and args.layers < 1:
            raise SystemExit("--layers must be >= 1")
        unknown = sorted({n.strip() for n in args.optimizers.split(",")} - set(OPTIMIZERS))
        if unknown:
            raise SystemExit(f"unknown optimizers {unknown}; choose from {sorted(OPTIMIZERS)}")
        measure_cuda_main(args)
        return
    if args.total_mib < 1 or args.tensor_mib < 1 or args.repeats < 1 or args.io_threads < 1:
        raise SystemExit("--total-mib, --tensor-mib, --io-threads and --repeats must be >= 1")
    if args.tensor_mib > args.total_mib:
        raise SystemExit("--tensor-mib must not exceed --total-mib")
    if not os.path.isdir(args.dir):
        raise SystemExit(f"--dir {args.dir!r} is not a directory")

    env = env_header("asteria bench/memory.py (state per tier; spill store vs plain file I/O)")
    acct = accounting(args.dir, args.max_preconditioner_dim)
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
            "device_ratio": {
                f"{model}/{name}": r["device_ratio"]
                for model, per in acct["models"].items()
                for name, r in per.items()
            },
            "device_ratio_discrete_window": {
                f"{model}/{name}": r["device_ratio_discrete_window"]
                for model, per in acct["models"].items()
                for name, r in per.items()
            },
            "accounting": acct,
            "spill_mode": modes[0],
            "spill_write_ratio": headline["spill_write_ratio"],
            "spill_read_ratio": headline["spill_read_ratio"],
            "modes": per_mode,
        }
    )


if __name__ == "__main__":
    main()
