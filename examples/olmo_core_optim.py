"""Asteria's optimizers inside OLMo-core's trainer, through ``asteria.integrations.olmo_core``.

OLMo-core builds its optimizer from an ``OptimConfig``; the integration's ``AsteriaSOAPConfig``
(and the KL-Shampoo and Shampoo ones) are such configs, and Asteria mode (refreshes on the C++
workers) is its trainer callback, ``AsteriaRuntimeCallback``, which attaches an
``asteria.Runtime`` for the length of ``trainer.fit()``; without it the optimizer runs in native
mode.

    python examples/olmo_core_optim.py --optimizer soap --mode asteria --steps 20
    python examples/olmo_core_optim.py --work-dir /tmp/olmo --stop-at 10  # then again, without
                                                                          # --stop-at: resumes

``run()`` trains a 2-layer OLMo-2 (OLMo-core's ``olmo2_14M`` with 2 layers, 0.6M parameters) on
the byte-level corpus of ``asteria.train`` (Python's own standard library sources), written as a
token file in OLMo's numpy layout and read by OLMo-core's own dataset and data loader. It runs
single-process; nothing is downloaded.

Checkpoints are OLMo-core's own (``save_folder`` is ``<work_dir>/run``): the trainer saves one
before training and one at the end (``stop_at`` ends a run early, on the LR schedule of ``steps``),
through ``torch.distributed.checkpoint.state_dict`` with OLMo-core's defaults
(``flatten_optimizer_state_dict=True``, ``cpu_offload=True``; Note [Flat optimizer state] in
asteria/optim/base.py), and ``run()`` in the same ``work_dir`` resumes from the latest. In Asteria
mode the runtime callback saves the runtime's refreshes in flight with the trainer state and puts
them back after attaching (Note [Checkpoints with work in flight] in asteria/runtime/state.py).
Single-process and DDP only: under FSDP2 the optimizer state is per local shard, which torch's
state-dict API cannot carry (Asteria refuses it; use ``asteria.checkpoint``).

Needs ``ai2-olmo-core`` (in requirements-test.txt).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import CosWithWarmup
from olmo_core.train import Duration, Trainer, TrainerConfig, seed_all
from olmo_core.train.callbacks import Callback
from olmo_core.train.common import TRAIN_CE_LOSS_METRIC
from olmo_core.train.train_module import TransformerTrainModuleConfig

from asteria.integrations.olmo_core import CONFIGS, AsteriaRuntimeCallback
from asteria.train.data import EOD, VOCAB_SIZE, load_corpus


@dataclass
class LossRecorder(Callback):
    """The training loss of every step the trainer logs (``metrics_collect_interval=1``: all)."""

    losses: dict[int, float] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if TRAIN_CE_LOSS_METRIC in metrics:
            self.losses[step] = float(metrics[TRAIN_CE_LOSS_METRIC])


def write_token_file(path: Path, max_bytes: int = 200_000) -> Path:
    """The byte-level stdlib corpus's training split as a flat uint16 token file (OLMo's layout:
    raw token ids, no header)."""
    corpus = load_corpus(max_bytes=max_bytes)
    corpus.train.numpy().astype(np.uint16).tofile(path)
    return path


def run(
    optimizer: str = "soap",
    mode: str = "native",
    steps: int = 20,
    lr: float | None = None,
    work_dir: str | None = None,
    seq_len: int = 64,
    batch_size: int = 8,
    device: str | None = None,
    stop_at: int | None = None,
    fixed_delay: int | None = None,
) -> tuple[list[float], Trainer]:
    """Train to step ``steps`` (``stop_at``: stop there instead, on the same LR schedule) with
    OLMo-core's trainer, resuming from the latest checkpoint in ``work_dir`` if there is one;
    returns the training losses of the steps this call ran and the trainer
    (``trainer.train_module.optim`` is the Asteria optimizer, and in Asteria mode
    ``trainer.callbacks["asteria"]`` the runtime callback, with ``fixed_delay`` if given)."""
    if optimizer not in CONFIGS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(CONFIGS)}")
    if mode not in ("native", "asteria"):
        raise ValueError(f"unknown mode {mode!r}; choose from native, asteria")
    root = Path(work_dir or tempfile.mkdtemp(prefix="asteria-olmo-core-"))
    root.mkdir(parents=True, exist_ok=True)
    seed_all(0)

    tokens = write_token_file(root / "tokens.npy")
    tokenizer = TokenizerConfig(vocab_size=VOCAB_SIZE, eos_token_id=EOD, pad_token_id=EOD)
    dataset = NumpyFSLDatasetConfig(
        tokenizer=tokenizer,
        paths=[str(tokens)],
        dtype="uint16",
        sequence_length=seq_len,
        work_dir=str(root / "dataset"),
    ).build()
    tokens_per_batch = batch_size * seq_len  # OLMo-core counts batch sizes in tokens
    loader = NumpyDataLoaderConfig(global_batch_size=tokens_per_batch, seed=0).build(dataset)

    model = TransformerConfig.olmo2_14M(vocab_size=VOCAB_SIZE, n_layers=2).build()
    optim = CONFIGS[optimizer]() if lr is None else CONFIGS[optimizer](lr=lr)
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=tokens_per_batch,
        max_sequence_length=seq_len,
        optim=optim,
        max_grad_norm=1.0,
        scheduler=CosWithWarmup(warmup=min(5, steps)),
    ).build(model, device=None if device is None else torch.device(device))

    callbacks: dict[str, Callback] = {"losses": LossRecorder()}
    if mode == "asteria":
        callbacks["asteria"] = AsteriaRuntimeCallback(
            staleness=2, fixed_delay=fixed_delay, workers=1
        )
    trainer = TrainerConfig(
        save_folder=str(root / "run"),
        device=device,
        max_duration=Duration.steps(steps),
        hard_stop=None if stop_at is None else Duration.steps(stop_at),
        metrics_collect_interval=1,
        callbacks=callbacks,
    ).build(train_module, loader)
    trainer.fit()
    # TrainerConfig may copy its callbacks: read the trainer's own.
    recorded = trainer.callbacks["losses"].losses
    return [recorded[s] for s in sorted(recorded)], trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--optimizer", default="soap", choices=list(CONFIGS))
    p.add_argument("--mode", default="native", choices=["native", "asteria"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=None, help="default: the config's")
    p.add_argument("--work-dir", default=None, help="resumes from its latest checkpoint")
    p.add_argument("--stop-at", type=int, default=None, help="stop (and save) at this step")
    a = p.parse_args()
    losses, trainer = run(a.optimizer, a.mode, a.steps, a.lr, a.work_dir, stop_at=a.stop_at)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    callback = trainer.callbacks.get("asteria")
    if callback is not None and callback.stats is not None:
        print(f"staleness histogram: {callback.stats['staleness_histogram']}")


if __name__ == "__main__":
    main()
