"""The training loop of `asteria.train`: one model, one optimizer, a fixed number of steps.

Owns: the run configuration, the loop (seeded model init and data order, warmup + cosine LR,
gradient clipping, per-step records, validation at an interval), the Asteria runtime around a
second-order optimizer in ``asteria`` mode, stopping cleanly between two steps (Ctrl-C, or after
a number of steps) with a checkpoint, and resuming from one. Must not: write anything but its
checkpoint, parse arguments, or pick hyperparameters (the optimizer table does).

Per-step record (a line of ``metrics.jsonl``): ``optimizer``, ``seed``, ``step``, ``loss``,
``lr``, ``step_ms`` (forward, backward and optimizer: targets.py's training time), ``opt_ms``,
``barrier_wait_ms`` (``null`` without the runtime), ``tokens_per_s``, ``elapsed_s``, ``memory``
(optimizer state by tier), ``refresh`` (a refresh was due), ``installs`` and ``staleness``
(asteria mode), ``basis_age`` (the oldest basis the step read: Note [Staleness contract]),
``energy_j`` (cumulative, per source), ``val_loss`` at validation steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from asteria.train import checkpoint as ckpt
from asteria.train import distributed as dist_util
from asteria.train.data import Corpus, TrainBatches, val_batches
from asteria.train.distributed import DistContext
from asteria.train.energy import EnergyMeter
from asteria.train.models import build_model, get_preset
from asteria.train.optimizers import (
    MODES,
    MUON_COOLDOWN_FRAC,
    RUNTIME_MODES,
    RunSpec,
    build_optimizer,
    get_spec,
    hidden_matrices,
)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that decides a run's result; two runs with equal configs train identically
    (asteria mode: up to when each refresh lands, unless the runtime's fixed_delay is set)."""

    model: str = "tiny"
    optimizer: str = "adamw"
    mode: str = "native"
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 128
    lr: float | None = None
    seed: int = 0
    warmup_frac: float = 0.1
    grad_clip: float = 1.0
    val_every: int = 50
    val_batches: int = 4

    def __post_init__(self) -> None:
        preset = get_preset(self.model)
        get_spec(self.optimizer)
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        for name in ("steps", "batch_size", "seq_len", "val_every", "val_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.warmup_frac < 1.0:
            raise ValueError(f"warmup_frac must be in [0, 1), got {self.warmup_frac}")
        if self.lr is not None and not self.lr > 0.0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.seq_len > preset.max_seq_len:
            raise ValueError(
                f"seq_len {self.seq_len} exceeds model {self.model!r}'s maximum "
                f"{preset.max_seq_len}"
            )

    @property
    def peak_lr(self) -> float:
        return get_spec(self.optimizer).lr_for(self.model) if self.lr is None else self.lr

    @property
    def label(self) -> str:
        return RunSpec(self.optimizer, self.mode).label


@dataclass
class RunResult:
    """What one run produced: per-step records and the summary figures. ``status``: ``"finished"``,
    ``"stopped"`` (Ctrl-C or ``stop_after``: a checkpoint holds the state) or ``"diverged"`` (the
    loss stopped being finite: the run ends there, the others go on)."""

    config: TrainConfig
    num_params: int
    records: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    status: str = "finished"
    energy_j: dict[str, float] = field(default_factory=dict)
    runtime_stats: dict[str, Any] | None = None

    @property
    def diverged(self) -> bool:
        return self.status == "diverged"

    def summary(self) -> dict:
        recs = self.records
        losses = [r["loss"] for r in recs]
        vals = [r["val_loss"] for r in recs if "val_loss" in r]
        tail = losses[-min(10, len(losses)) :]
        refresh = [r["opt_ms"] for r in recs[1:] if r.get("refresh")]
        step_ms = [r["step_ms"] for r in recs]
        waits = [r["barrier_wait_ms"] for r in recs if r.get("barrier_wait_ms") is not None]
        tiers: dict[str, int] = {}
        for r in recs:
            for tier, nbytes in r.get("memory", {}).items():
                tiers[tier] = max(tiers.get(tier, 0), nbytes)
        out = {
            "label": self.config.label,
            "config": asdict(self.config),
            "status": self.status,
            "steps_done": len(recs),
            "lr": self.config.peak_lr,
            "num_params": self.num_params,
            "final_loss": losses[-1] if losses else None,
            "final_loss_mean10": statistics.fmean(tail) if tail else None,
            "final_val_loss": vals[-1] if vals else None,
            "median_step_ms": statistics.median(step_ms) if step_ms else None,
            "p95_step_ms": _quantile(step_ms, 0.95),
            "max_step_ms": max(step_ms) if step_ms else None,
            "median_opt_ms": statistics.median(r["opt_ms"] for r in recs) if recs else None,
            "median_refresh_opt_ms": statistics.median(refresh) if refresh else None,
            "barrier_wait_ms_total": sum(waits) if waits else None,
            "median_tokens_per_s": (
                statistics.median(r["tokens_per_s"] for r in recs) if recs else None
            ),
            "peak_memory_bytes": tiers,
            "wall_s": self.wall_s,
            "energy_j": dict(self.energy_j),
            "diverged": self.diverged,
        }
        if self.runtime_stats is not None:
            out["runtime"] = self.runtime_stats
        return out

    @classmethod
    def from_checkpoint(cls, cfg: TrainConfig, payload: dict) -> RunResult:
        """The result a finished (or diverged) run's checkpoint holds."""
        return cls(
            config=cfg,
            num_params=int(payload["num_params"]),
            records=list(payload["records"]),
            wall_s=float(payload["wall_s"]),
            status=str(payload["status"]),
            energy_j=dict(payload.get("energy_j", {})),
            runtime_stats=payload.get("runtime"),
        )


def runtime_summary(stats: dict[str, Any]) -> dict[str, Any]:
    """The part of ``Runtime.stats()`` a summary keeps (JSON-ready, string keys)."""
    refresh, placement = stats.get("refresh") or {}, stats.get("placement") or {}
    return {
        # how often blocks installed, and where refreshes ran (Notes [Continuous refresh],
        # [Refresh placement])
        "refresh": {k: refresh.get(k) for k in ("mode", "interval_mean", "interval_max")},
        "placement": {"jobs": dict(placement.get("jobs", {})), "device": placement.get("device")},
        "staleness_histogram": {str(k): v for k, v in stats["staleness_histogram"].items()},
        "max_staleness": stats["max_staleness"],
        "installs": stats["installs"],
        "jobs": dict(stats["jobs"]),
        "basis_age": {
            **stats["basis_age"],
            "histogram": {str(k): v for k, v in stats["basis_age"]["histogram"].items()},
        },
        # given at attach, e.g. no core left for the refreshes (Note [No spare core])
        "warnings": list(stats.get("warnings", [])),
    }


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """The optimizer's schedule (its table entry's ``schedule``): ``"warmup-cosine"``, linear
    warmup over ``warmup_frac`` of the steps, then cosine decay to 10 % of the peak; or
    ``"stable-cooldown"`` (Muon, Note [Muon as people use it] in optimizers.py), the peak from the
    first step, then over the last 40 % of the steps a linear cooldown to 10 % of it."""
    if get_spec(cfg.optimizer).schedule == "stable-cooldown":
        x = step / cfg.steps
        if x < 1.0 - MUON_COOLDOWN_FRAC:
            return 1.0
        w = (1.0 - x) / MUON_COOLDOWN_FRAC
        return w + (1.0 - w) * 0.1
    warmup = max(1, round(cfg.warmup_frac * cfg.steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, batches: list[torch.Tensor], device: torch.device | None = None
) -> float:
    """Mean next-token cross-entropy over ``batches`` (nats per token; per byte for bytes)."""
    model.eval()
    losses = []
    for x in batches:  # every rank evaluates every batch (FSDP: the forwards run together)
        if device is not None:
            x = x.to(device)
        with _autocast(device or x.device):
            losses.append(model(input_ids=x, labels=x).loss.item())
    model.train()
    return statistics.fmean(losses)


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# -- memory by tier ---------------------------------------------------------------------------


def _state_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return local.numel() * local.element_size()
    if isinstance(value, dict):
        return sum(_state_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_state_bytes(v) for v in value)
    return 0


TIERS = ("device", "host", "nvme")


def _numeric_sum(value: Any) -> int | None:
    """Bytes in a report entry: a number, or the sum of the numbers in a (nested) dict."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, dict):
        parts = [n for v in value.values() if (n := _numeric_sum(v)) is not None]
        return sum(parts) if parts else None
    return None


def memory_by_tier(opt: torch.optim.Optimizer, runtime: Any | None) -> dict[str, int]:
    """Optimizer-state bytes by tier (``device``, ``host``, ``nvme``): the totals of the runtime's
    ``memory_report()`` where it has one (asteria mode), else every optimizer state tensor
    counted on ``device`` (the tier the training runs on; on a CPU-only machine, host RAM)."""
    report = getattr(runtime, "memory_report", None) if runtime is not None else None
    if callable(report) and not getattr(runtime, "_asteria_train_no_report", False):
        try:
            raw = report()
        except Exception as err:  # a report that fails must not stop training: count state
            print(f"asteria.train: runtime.memory_report() failed ({err!r}); counting optimizer "
                  "state tensors as 'device' instead", file=sys.stderr)  # fmt: skip
            runtime._asteria_train_no_report = True
            raw = None
        tiers = raw.get("tiers", raw) if isinstance(raw, dict) else {}
        out = {t: n for t in TIERS if (n := _numeric_sum(tiers.get(t))) is not None}
        if out:
            return out
    return {"device": _state_bytes(opt.state)}


# -- stopping between steps ---------------------------------------------------------------------


class StopFlag:
    """Set by the first Ctrl-C (SIGINT): the loop stops after the step in progress and saves a
    checkpoint. A second Ctrl-C raises ``KeyboardInterrupt`` at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            "\nasteria.train: Ctrl-C: stopping after this step and saving a checkpoint "
            "(Ctrl-C again to abort without one)",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


# -- the progress bar ---------------------------------------------------------------------------


def _progress_bar(total: int, initial: int, desc: str, enabled: bool) -> Any:
    """tqdm's bar (a package of the train extra), shown on a terminal only (``disable=None``)."""
    if not enabled:
        return None
    return tqdm(total=total, initial=initial, desc=desc, disable=None, leave=False)


# -- the loop -----------------------------------------------------------------------------------


def train(
    cfg: TrainConfig,
    corpus: Corpus,
    *,
    vocab_size: int | None = None,
    runtime_config: Any | None = None,
    on_record: Callable[[dict], None] | None = None,
    progress: bool = True,
    checkpoint: Path | None = None,
    resume: dict | None = None,
    stop: StopFlag | None = None,
    stop_after: int | None = None,
    checkpoint_every: int = 0,
    energy: EnergyMeter | None = None,
    device: torch.device | str = "cpu",
    ctx: DistContext | None = None,
) -> RunResult:
    """Train ``cfg.model`` with ``cfg.optimizer`` in ``cfg.mode`` on ``corpus``. ``on_record`` sees
    every record; ``checkpoint``: where this run's goes (at the end, every ``checkpoint_every``
    steps, at an early stop); ``resume``: a loaded one to continue; the run stops between two steps
    on ``stop`` (Ctrl-C) or after ``stop_after`` steps; ``ctx``: the FSDP/HSDP context (rank 0 alone
    measures energy, shows progress, writes); ``progress``: the bar, on a terminal only."""
    device = torch.device(ctx.device if ctx is not None else device)
    is_main = ctx is None or ctx.is_main
    vocab = corpus.vocab_size if vocab_size is None else vocab_size
    model = build_model(
        get_preset(cfg.model), vocab_size=vocab, max_seq_len=cfg.seq_len, seed=cfg.seed
    )
    num_params = sum(p.numel() for p in model.parameters())
    model.to(device)
    if ctx is not None:
        dist_util.shard_model(model, ctx)
    params = [p for p in model.parameters() if p.requires_grad]
    hidden = hidden_matrices(model) if get_spec(cfg.optimizer).needs_hidden else None
    opt = build_optimizer(cfg.optimizer, params, cfg.peak_lr, hidden=hidden)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    batches = TrainBatches(corpus, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
    val_set = val_batches(
        corpus, batch_size=cfg.batch_size, seq_len=cfg.seq_len, max_batches=cfg.val_batches
    )
    result = RunResult(config=cfg, num_params=num_params)
    first = 0
    wall_before = 0.0
    energy_before: dict[str, float] = {}
    if resume is not None:
        ckpt.load_model_and_optimizer_state(
            model, opt, resume, distributed=ctx is not None, path=checkpoint
        )
        sched.load_state_dict(resume["scheduler"])
        batches.load_state_dict(resume["batches"])
        ckpt.set_rng_state(resume["rng"])
        result.records = list(resume["records"])
        first = int(resume["step"])
        wall_before = float(resume["wall_s"])
        energy_before = dict(resume.get("energy_j", {}))
    runtime = None
    if cfg.mode in RUNTIME_MODES:
        from asteria.runtime import Runtime, RuntimeConfig

        if cfg.mode == "continuous":  # the configuration given, refreshed continuously
            runtime_config = dataclasses.replace(
                runtime_config or RuntimeConfig(), refresh="continuous"
            )
        runtime = Runtime(model, opt, runtime_config)
        if resume is not None:
            ckpt.load_runtime_state(runtime, resume, path=checkpoint)
    is_refresh = getattr(opt, "is_refresh_step", None)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    meter = energy if (energy is not None and energy.measured and is_main) else None
    if meter is not None:
        meter.start()
    bar = _progress_bar(cfg.steps, first, cfg.label, progress and is_main)
    last_hist: dict[int, int] = {}

    def save(status: str) -> None:
        live = None  # a runtime that trains on: its refreshes in flight go in the checkpoint
        if runtime is not None:
            if status == "running":
                live = runtime  # (Note [Checkpoints with work in flight] in asteria/runtime)
            else:
                runtime.close()  # a finished run: install what is in flight
        if checkpoint is None:
            return
        # Collective under FSDP/HSDP: every rank gathers (AdamW) or writes its shard (Asteria's
        # optimizers: model, optimizer and runtime in a directory the file names), rank 0
        # writes the file.
        sharded = runtime_state = None
        if ckpt.per_shard_state(opt, ctx is not None):
            sharded = ckpt.save_sharded(checkpoint, len(result.records), model, opt, live)
            model_state = optim_state = None
        else:
            model_state, optim_state = ckpt.model_and_optimizer_state(model, opt, ctx is not None)
            runtime_state = live.state_dict() if live is not None else None
        if not is_main:
            return
        ckpt.save(
            checkpoint,
            {
                "config": asdict(cfg),
                "status": status,
                "step": len(result.records),
                "model": model_state,
                "optimizer": optim_state,
                "scheduler": sched.state_dict(),
                "batches": batches.state_dict(),
                "rng": ckpt.rng_state(),
                "records": result.records,
                "wall_s": result.wall_s,
                "energy_j": result.energy_j,
                "num_params": num_params,
                "runtime": result.runtime_stats,
                "sharded": sharded,
                "runtime_state": runtime_state,
            },
        )
        if sharded is not None:
            ckpt.prune_sharded(checkpoint, keep=sharded)

    start = time.perf_counter()
    result.status = "finished"
    try:
        for step in range(first, cfg.steps):
            stopping = stop is not None and stop.requested
            if stop_after is not None and step - first >= stop_after:
                stopping = True
            if dist_util.broadcast_flag(stopping, ctx):
                result.status = "stopped"
                break
            x = dist_util.rows(next(batches), ctx).to(device)
            _sync(device)
            t0 = time.perf_counter()
            with _autocast(device):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            refresh = bool(is_refresh()) if is_refresh is not None else None
            _sync(device)
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            t2 = time.perf_counter()
            loss_value = dist_util.mean(loss.item(), ctx)
            rec: dict[str, Any] = {"optimizer": cfg.label, "seed": cfg.seed, "step": step + 1}
            rec["loss"] = loss_value
            rec["lr"] = sched.get_last_lr()[0]
            rec["step_ms"], rec["opt_ms"] = 1e3 * (t2 - t0), 1e3 * (t2 - t1)
            rec["tokens_per_s"] = tokens_per_step / (t2 - t0)
            rec["barrier_wait_ms"] = (
                runtime.per_step["barrier_wait_ms"][-1] if runtime is not None else None
            )
            rec["memory"] = memory_by_tier(opt, runtime)
            if refresh is not None:
                rec["refresh"] = refresh
            if runtime is not None:
                hist = dict(runtime.registry.histogram)
                new = {
                    k: v - last_hist.get(k, 0) for k, v in hist.items() if v > last_hist.get(k, 0)
                }
                last_hist = hist
                rec["installs"] = sum(new.values())
                rec["staleness"] = max(new) if new else None
                # the oldest basis this step's updates read (Note [Staleness contract])
                ages = [e.age for e in runtime.registry.entries.values() if e.bound is not None]
                rec["basis_age"] = max(ages) if ages else None
            sched.step()
            if not math.isfinite(loss_value):
                result.status = "diverged"
            elif (step + 1) % cfg.val_every == 0 or step + 1 == cfg.steps:
                rec["val_loss"] = evaluate(model, val_set, device)
            result.wall_s = wall_before + time.perf_counter() - start
            rec["elapsed_s"] = result.wall_s
            if meter is not None:
                now = meter.read()
                result.energy_j = {k: energy_before.get(k, 0.0) + v for k, v in now.items()}
                rec["energy_j"] = dict(result.energy_j)
            result.records.append(rec)
            if on_record is not None:
                on_record(rec)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"loss {loss_value:.3f}, step {rec['step_ms']:.0f} ms")
            if result.diverged:
                break
            if checkpoint_every and (step + 1) % checkpoint_every == 0 and step + 1 < cfg.steps:
                save("running")
    except BaseException:
        if runtime is not None:
            runtime.close(install_pending=False)
        raise
    finally:
        if bar is not None:
            bar.close()
    result.wall_s = wall_before + time.perf_counter() - start
    if runtime is not None:
        result.runtime_stats = runtime_summary(runtime.stats())
    save("running" if result.status == "stopped" else result.status)
    if runtime is not None:
        runtime.close(install_pending=False)  # stopped: what was in flight is in the checkpoint
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
