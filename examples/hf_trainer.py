"""Asteria's optimizers inside the Hugging Face ``Trainer``, through ``asteria.integrations.hf``.

The Trainer takes any ``torch.optim.Optimizer`` through ``optimizers=(optimizer, scheduler)``;
Asteria's SOAP / KLShampoo / Shampoo are ordinary optimizers, so native mode needs nothing more.
For Asteria mode (refreshes on the C++ workers, off the critical path) the integration's
callback attaches an ``asteria.Runtime`` when training begins and detaches it when training ends;
``asteria.integrations.hf.trainer_kwargs`` gives both.

    python examples/hf_trainer.py --optimizer soap --mode asteria --steps 30

The model is a small OLMo-2 built from a config (nothing downloaded) and the data is the
byte-level corpus of ``asteria.train`` (Python's own standard library sources).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import Trainer, TrainingArguments

import asteria
from asteria.integrations.hf import AsteriaRuntimeCallback, trainer_kwargs
from asteria.train.data import VOCAB_SIZE, load_corpus, train_batches
from asteria.train.models import build_model, get_preset

#: Each optimizer's options here (the rest are its defaults).
OPTIONS = {
    "soap": {"betas": (0.95, 0.95), "weight_decay": 0.01},
    "kl-shampoo": {"shampoo_beta": 0.9, "weight_decay": 0.01},
    "shampoo": {"grafting": "adam"},
}


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


def _warmup(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))


def run(
    optimizer: str = "soap",
    mode: str = "native",
    steps: int = 30,
    lr: float = 3e-3,
    output_dir: str | None = None,
    model_name: str = "nano",
) -> tuple[list[float], AsteriaRuntimeCallback | None]:
    """Train ``steps`` steps; returns the logged training losses and the runtime callback."""
    if optimizer not in OPTIONS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIONS)}")
    torch.manual_seed(0)
    model = build_model(get_preset(model_name), vocab_size=VOCAB_SIZE, max_seq_len=64, seed=0)
    asteria_kwargs = trainer_kwargs(
        model,
        optimizer,
        runtime=asteria.RuntimeConfig(staleness=2, workers=1) if mode == "asteria" else False,
        scheduler=_warmup,
        lr=lr,
        **OPTIONS[optimizer],
    )
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
        **asteria_kwargs,
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    callbacks = asteria_kwargs.get("callbacks", [None])
    return losses, callbacks[0]


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
