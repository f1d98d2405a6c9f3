"""The training demo's own settings: SOAP and KL-Shampoo beat AdamW on a tiny OLMo-2-style LM.

This drives `asteria.train` itself (``TrainConfig`` + ``train``: the documented per-model
learning rates of asteria/train/optimizers.py, warmup + cosine schedule, gradient clipping), so
it fails when the demo's configuration stops showing the second-order advantage.
(tests/unit/test_convergence.py checks the optimizers alone, with a hand-written loop.)

Model ``nano`` (d 128, 2 layers; ``tiny`` needs minutes to get past the first 100 steps, where
AdamW still leads), 200 steps of batch 8 x 64 bytes; the same weights and batches for every
optimizer, compared on the fixed validation windows. Measured when written, with one thread as
the suite runs: AdamW 2.097, SOAP 1.973, KL-Shampoo 1.985 (with two threads: 2.097, 1.970,
2.020); ``MARGIN`` is under half of the smallest gap.
"""

from __future__ import annotations

import pytest

from asteria.train.data import VOCAB_SIZE, Corpus, load_corpus
from asteria.train.loop import TrainConfig, train

MODEL, STEPS, BATCH, SEQ_LEN = "nano", 200, 8, 64
MARGIN = 0.03  # nats per byte below AdamW's validation loss


def _val_loss(optimizer: str, corpus: Corpus) -> float:
    cfg = TrainConfig(
        model=MODEL,
        optimizer=optimizer,
        steps=STEPS,
        batch_size=BATCH,
        seq_len=SEQ_LEN,
        val_every=STEPS,
        val_batches=8,
    )
    summary = train(cfg, corpus, vocab_size=VOCAB_SIZE, progress=False).summary()
    assert not summary["diverged"], f"{optimizer} diverged at lr {summary['lr']:g}"
    return summary["final_val_loss"]


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_corpus(min_tokens=SEQ_LEN)


@pytest.fixture(scope="module")
def adamw_val_loss(corpus: Corpus) -> float:
    return _val_loss("adamw", corpus)


@pytest.mark.parametrize("optimizer", ["soap", "kl-shampoo"])
def test_beats_adamw_at_equal_steps(optimizer: str, corpus: Corpus, adamw_val_loss: float) -> None:
    loss = _val_loss(optimizer, corpus)
    assert loss < adamw_val_loss - MARGIN, (
        f"{optimizer} validation loss {loss:.4f} is not {MARGIN} below AdamW's "
        f"{adamw_val_loss:.4f} after {STEPS} steps of {MODEL}"
    )
