"""The training loop of `asteria.train`: one model, one optimizer, a fixed number of steps.

Owns: the run configuration, the loop (seeded model init and data order, warmup + cosine LR,
gradient clipping, per-step loss / step time / optimizer time, validation at an interval) and the
per-step records it returns. Must not: write files, parse arguments, or pick hyperparameters
(the optimizer table does).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from asteria.train.data import Corpus, train_batches, val_batches
from asteria.train.models import build_model, get_preset
from asteria.train.optimizers import build_optimizer, get_spec


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that decides a run's result; two runs with equal configs train identically."""

    model: str = "tiny"
    optimizer: str = "adamw"
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


@dataclass
class RunResult:
    """What one run produced: per-step records and the summary figures.

    A run whose loss stops being finite is ``diverged``: it ends at that step, the others go on.
    """

    config: TrainConfig
    num_params: int
    records: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    diverged: bool = False

    def summary(self) -> dict:
        losses = [r["loss"] for r in self.records]
        vals = [r["val_loss"] for r in self.records if "val_loss" in r]
        tail = losses[-min(10, len(losses)) :]
        refresh = [r["opt_ms"] for r in self.records[1:] if r.get("refresh")]
        return {
            "config": asdict(self.config),
            "lr": self.config.peak_lr,
            "num_params": self.num_params,
            "final_loss": losses[-1],
            "final_loss_mean10": statistics.fmean(tail),
            "final_val_loss": vals[-1] if vals else None,
            "median_step_ms": statistics.median(r["step_ms"] for r in self.records),
            "median_opt_ms": statistics.median(r["opt_ms"] for r in self.records),
            "median_refresh_opt_ms": statistics.median(refresh) if refresh else None,
            "wall_s": self.wall_s,
            "diverged": self.diverged,
        }


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over ``warmup_frac`` of the steps, then cosine decay to 10 % of the peak."""
    warmup = max(1, round(cfg.warmup_frac * cfg.steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    """Mean next-byte cross-entropy over ``batches`` (nats per byte)."""
    model.eval()
    losses = [model(input_ids=x, labels=x).loss.item() for x in batches]
    model.train()
    return statistics.fmean(losses)


def train(
    cfg: TrainConfig,
    corpus: Corpus,
    *,
    vocab_size: int,
    on_record: Callable[[dict], None] | None = None,
    progress: bool = True,
) -> RunResult:
    """Train ``cfg.model`` with ``cfg.optimizer`` on ``corpus``; ``on_record`` sees every step.

    The progress bar shows only on a terminal (``progress=False`` turns it off there too).
    """
    model = build_model(
        get_preset(cfg.model), vocab_size=vocab_size, max_seq_len=cfg.seq_len, seed=cfg.seed
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(cfg.optimizer, params, cfg.peak_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    batches = train_batches(corpus, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
    val_set = val_batches(
        corpus, batch_size=cfg.batch_size, seq_len=cfg.seq_len, max_batches=cfg.val_batches
    )
    is_refresh = getattr(opt, "is_refresh_step", None)
    result = RunResult(config=cfg, num_params=sum(p.numel() for p in params))
    bar = tqdm(
        range(cfg.steps), desc=cfg.optimizer, disable=None if progress else True, leave=False
    )
    start = time.perf_counter()
    for step in bar:
        x = next(batches)
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        refresh = bool(is_refresh()) if is_refresh is not None else None
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        rec = {"optimizer": cfg.optimizer, "step": step + 1, "loss": loss.item()}
        rec |= {"lr": sched.get_last_lr()[0], "step_ms": 1e3 * (t2 - t0), "opt_ms": 1e3 * (t2 - t1)}
        if refresh is not None:
            rec["refresh"] = refresh
        sched.step()
        result.diverged = not math.isfinite(rec["loss"])
        if not result.diverged and ((step + 1) % cfg.val_every == 0 or step + 1 == cfg.steps):
            rec["val_loss"] = evaluate(model, val_set)
        result.records.append(rec)
        if on_record is not None:
            on_record(rec)
        if result.diverged:
            break
        bar.set_postfix(loss=f"{rec['loss']:.3f}", step_ms=f"{rec['step_ms']:.0f}")
    result.wall_s = time.perf_counter() - start
    return result
