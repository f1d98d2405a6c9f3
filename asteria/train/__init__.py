"""asteria.train: the main job. Train a small OLMo-2-style LM and compare optimizers.

``python -m asteria.train`` (or ``asteria-train``) runs it; ``--help`` lists the options. It needs
the ``train`` extra (Note [The train extra] in extra.py): the names below are imported on first
use, after a check naming any missing package. Modules: data, corpus, models, optimizers, loop,
checkpoint, distributed, energy, report, env, cli, extra (each says what it owns).
"""

from __future__ import annotations

import importlib
from typing import Any

from asteria.train.extra import require

#: Public name -> the module of asteria.train that defines it.
_EXPORTS = {
    "VOCAB_SIZE": "data",
    "Corpus": "data",
    "load_corpus": "data",
    "RunResult": "loop",
    "TrainConfig": "loop",
    "train": "loop",
    "PRESETS": "models",
    "build_model": "models",
    "get_preset": "models",
    "OPTIMIZERS": "optimizers",
    "build_optimizer": "optimizers",
}

__all__ = sorted(_EXPORTS)


#: The job's modules, imported on first use as attributes too (``asteria.train.loop``).
_MODULES = ("checkpoint", "cli", "corpus", "data", "distributed", "energy", "env", "loop",
            "models", "optimizers", "plots", "report", "targets")  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None and name not in _MODULES:
        raise AttributeError(f"module 'asteria.train' has no attribute {name!r}")
    require()  # MissingExtraError: which package is missing, and the extra to install
    if module is None:
        return importlib.import_module(f"asteria.train.{name}")
    value = getattr(importlib.import_module(f"asteria.train.{module}"), name)
    globals()[name] = value
    return value
