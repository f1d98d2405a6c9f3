"""Asteria's optimizers inside the Hugging Face ``Trainer``.

The Trainer takes any ``torch.optim.Optimizer`` through ``optimizers=(optimizer, scheduler)``;
Asteria's SOAP / KLShampoo / Shampoo are ordinary optimizers, so native mode needs nothing more.
For Asteria mode (refreshes on the C++ workers, off the critical path) a small callback attaches
an ``asteria.Runtime`` when training begins and detaches it when training ends.

    python examples/hf_trainer.py --optimizer soap --mode asteria --steps 30

The model is a small OLMo-2 built from a config (nothing downloaded) and the data is the
byte-level corpus of ``asteria.train`` (Python's own standard library sources).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import asteria
from asteria.train.data import VOCAB_SIZE, load_corpus, train_batches
from asteria.train.models import build_model, get_preset


class AsteriaRuntimeCallback(TrainerCallback):
    """Run an Asteria optimizer in Asteria mode for the length of ``trainer.train()``."""

    def __init__(self, config: asteria.RuntimeConfig | None = None) -> None:
        self.config = config
        self.runtime: asteria.Runtime | None = None
        self.stats: dict | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        # The Trainer hands over Accelerate's wrapper; the Asteria optimizer is inside it.
        inner = getattr(optimizer, "optimizer", optimizer)
        self.runtime = asteria.Runtime(model, inner, self.config)

    def on_train_end(self, args, state, control, **kwargs):
        if self.runtime is not None:
            self.stats = self.runtime.stats()
            self.runtime.close()
            self.runtime = None


class ByteWindows(torch.utils.data.Dataset):
    """``size`` fixed training windows from the seeded stream (the Trainer shuffles them)."""

    def __init__(self, size: int, seq_len: int, seed: int = 0) -> None:
        corpus = load_corpus(max_bytes=500_000, min_tokens=seq_len)
        stream = train_batches(corpus, batch_size=size, seq_len=seq_len, seed=seed)
        self.windows = next(stream)

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def make_optimizer(name: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "soap":
        return asteria.optim.SOAP(params, lr=lr, betas=(0.95, 0.95), weight_decay=0.01)
    if name == "kl-shampoo":
        return asteria.optim.KLShampoo(params, lr=lr, shampoo_beta=0.9, weight_decay=0.01)
    if name == "shampoo":
        return asteria.optim.Shampoo(params, lr=lr, grafting="adam")
    raise ValueError(f"unknown optimizer {name!r}; choose from soap, kl-shampoo, shampoo")


def run(
    optimizer: str = "soap",
    mode: str = "native",
    steps: int = 30,
    lr: float = 3e-3,
    output_dir: str | None = None,
    model_name: str = "nano",
) -> tuple[list[float], AsteriaRuntimeCallback | None]:
    """Train ``steps`` steps; returns the logged training losses and the runtime callback."""
    torch.manual_seed(0)
    model = build_model(get_preset(model_name), vocab_size=VOCAB_SIZE, max_seq_len=64, seed=0)
    opt = make_optimizer(optimizer, model, lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    callback = AsteriaRuntimeCallback(asteria.RuntimeConfig(staleness=2, workers=1))
    args = TrainingArguments(
        output_dir=output_dir or tempfile.mkdtemp(prefix="asteria-hf-"),
        max_steps=steps,
        per_device_train_batch_size=8,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        max_grad_norm=1.0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=ByteWindows(size=8 * steps, seq_len=64),
        optimizers=(opt, sched),
        callbacks=[callback] if mode == "asteria" else [],
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return losses, callback if mode == "asteria" else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--optimizer", default="soap", choices=["soap", "kl-shampoo", "shampoo"])
    p.add_argument("--mode", default="native", choices=["native", "asteria"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    a = p.parse_args()
    losses, callback = run(a.optimizer, a.mode, a.steps, a.lr)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    if callback is not None and callback.stats is not None:
        print(f"staleness histogram: {callback.stats['staleness_histogram']}")


if __name__ == "__main__":
    main()
