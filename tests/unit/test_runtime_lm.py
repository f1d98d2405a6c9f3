"""SOAP orchestrated with a staleness budget of 5 converges like native SOAP on a small LM.

With S = 5 and refreshes installed as soon as they are ready, this machine installs them at
staleness 0 or 1 (the pool finishes a small model's refresh within a step); how many land at 1
depends on timing, and so does the loss. The test pins that typical case down deterministically:
budget 5, every refresh installed exactly 1 step late. Measured here (validation loss after 300
steps, native 2.383): delay 1 +0.37 %; forced delays 2, 3 and 5 give +1.26 %, +1.39 % and +1.15 %,
so the worst case the budget allows is not within 1 % on this small model.
"""

from __future__ import annotations

import torch

from asteria.optim import SOAP
from asteria.runtime import Runtime, RuntimeConfig
from asteria.train.data import VOCAB_SIZE, load_corpus, train_batches, val_batches
from asteria.train.loop import evaluate
from asteria.train.models import ModelPreset, build_model

# A smaller OLMo-2-style decoder than the ``tiny`` preset, so 2 x 300 steps fit in ~25 s.
MICRO = ModelPreset("micro", 64, 2, 2, 64, "test-only")
SEQ, BATCH, STEPS = 64, 8, 300


def _train(corpus, staleness: int | None) -> tuple[float, dict | None]:
    model = build_model(MICRO, vocab_size=VOCAB_SIZE, max_seq_len=SEQ, seed=0)
    opt = SOAP(model.parameters(), lr=3e-3, precondition_frequency=10)
    runtime = None
    if staleness is not None:
        runtime = Runtime(model, opt, RuntimeConfig(staleness=staleness, fixed_delay=1, workers=1))
    batches = train_batches(corpus, batch_size=BATCH, seq_len=SEQ, seed=0)
    for _ in range(STEPS):
        tokens = next(batches)
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    stats = None
    if runtime is not None:
        stats = runtime.stats()
        runtime.close()
    val = val_batches(corpus, batch_size=BATCH, seq_len=SEQ, max_batches=8)
    return evaluate(model, val), stats


def test_soap_with_staleness_5_ends_within_two_percent_of_native():
    corpus = load_corpus(max_bytes=400_000, min_tokens=SEQ + 1)
    native, _ = _train(corpus, None)
    orchestrated, stats = _train(corpus, 5)
    assert stats["installs"] >= 2 * 29 * 2  # 29 refreshes of >= 2 factored blocks each
    assert stats["max_staleness"] <= 5
    # One seed, one deterministic run: within 1% on the EPYC it was set on, 1.5% on a Xeon
    # (2.4072 against 2.3714, the same code at c1d5682: round-off differs by machine). The 1%
    # goal over seeds is bench/time_to_target.py's (issue 24, item 6); this bound catches a
    # broken runtime (a starved or wrong install is tens of percent), not that goal.
    assert abs(orchestrated - native) <= 0.02 * native, (orchestrated, native)
    assert native < 0.8 * torch.log(torch.tensor(float(VOCAB_SIZE))).item()  # it did learn
