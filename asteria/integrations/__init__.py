"""Asteria inside training frameworks: what each one is handed to get Asteria's optimizers and
runtime.

``asteria.integrations.hf``: the Hugging Face ``Trainer`` (``trainer_kwargs`` gives its
``optimizers=`` and ``callbacks=``). ``asteria.integrations.olmo_core``: OLMo-core's trainer
(``OptimConfig`` subclasses and a runtime callback).

Owns: the glue between a framework's hooks and ``asteria.optim`` / ``asteria.Runtime``. Must not:
import a framework before its module is imported (this package imports none; importing
``asteria`` imports no framework), or hold any optimizer or runtime logic of its own.
"""

from __future__ import annotations

__all__ = ["hf", "olmo_core"]
