"""asteria.train: the main job. Train a small OLMo-2-style LM and compare optimizers.

``python -m asteria.train`` (or ``asteria-train``) runs it; ``--help`` lists the options.
Modules: data (byte-level corpus, token files and batches), models (presets), optimizers (name ->
constructor and default learning rates, run specs like ``soap:asteria``), loop (the training loop),
checkpoint (save and resume), distributed (FSDP2/HSDP under torchrun), energy (NVML and RAPL),
report (output files and plots), env (machine facts), cli (arguments).
"""

from asteria.train.data import VOCAB_SIZE, Corpus, load_corpus
from asteria.train.loop import RunResult, TrainConfig, train
from asteria.train.models import PRESETS, build_model, get_preset
from asteria.train.optimizers import OPTIMIZERS, build_optimizer

__all__ = [
    "OPTIMIZERS",
    "PRESETS",
    "VOCAB_SIZE",
    "Corpus",
    "RunResult",
    "TrainConfig",
    "build_model",
    "build_optimizer",
    "get_preset",
    "load_corpus",
    "train",
]
