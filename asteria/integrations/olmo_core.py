"""Asteria's optimizers and runtime in OLMo-core's trainer: ``OptimConfig`` subclasses and a
runtime callback.

OLMo-core builds its optimizer from an ``OptimConfig`` whose fields (but ``group_overrides``,
``compile`` and ``fixed_fields``) become the optimizer's keywords: so an Asteria optimizer there
is a dataclass of its hyperparameters (``AsteriaSOAPConfig``, ``AsteriaKLShampooConfig``,
``AsteriaShampooConfig``), and Asteria mode is a trainer callback, ``AsteriaRuntimeCallback``,
that attaches an ``asteria.Runtime`` for ``trainer.fit()``::

    train_module = TransformerTrainModuleConfig(optim=AsteriaSOAPConfig(lr=3e-3), ...)
    trainer = TrainerConfig(callbacks={"asteria": AsteriaRuntimeCallback()}, ...)

Checkpoints are OLMo-core's (DCP's state-dict API with ``flatten_optimizer_state_dict=True``:
Note [Flat optimizer state] in asteria/optim/state_format.py); the callback's ``state_dict``
carries the refreshes in flight (Note [Checkpoints with work in flight] in
asteria/runtime/state.py). Single-process and DDP only (FSDP2's per-shard state: use
``asteria.checkpoint``). examples/olmo_core_optim.py trains and resumes bit for bit
(tests/unit/test_train_examples.py).

Owns: the configs and the callback. Must not: import OLMo-core before this module is imported,
or hold optimizer or runtime logic of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from asteria.integrations._frameworks import require
from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.runtime import Runtime, RuntimeConfig

_optim = require("olmo_core.optim", "asteria.integrations.olmo_core", "ai2-olmo-core")
_callbacks = require("olmo_core.train.callbacks", "asteria.integrations.olmo_core", "ai2-olmo-core")

__all__ = [
    "CONFIGS",
    "AsteriaKLShampooConfig",
    "AsteriaRuntimeCallback",
    "AsteriaSOAPConfig",
    "AsteriaShampooConfig",
]


@dataclass
class AsteriaSOAPConfig(_optim.OptimConfig):
    """``asteria.optim.SOAP`` as an OLMo-core optimizer config."""

    lr: float = 3e-3
    betas: tuple[float, float] = (0.95, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01
    precondition_frequency: int = 10

    @classmethod
    def optimizer(cls) -> type[SOAP]:
        return SOAP


@dataclass
class AsteriaKLShampooConfig(_optim.OptimConfig):
    """``asteria.optim.KLShampoo`` as an OLMo-core optimizer config."""

    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.98)
    shampoo_beta: float = 0.9
    weight_decay: float = 0.01
    precondition_frequency: int = 10

    @classmethod
    def optimizer(cls) -> type[KLShampoo]:
        return KLShampoo


@dataclass
class AsteriaShampooConfig(_optim.OptimConfig):
    """``asteria.optim.Shampoo`` (Adam grafting) as an OLMo-core optimizer config."""

    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 1.0)
    precondition_frequency: int = 10
    grafting: str = "adam"

    @classmethod
    def optimizer(cls) -> type[Shampoo]:
        return Shampoo


#: The configs by optimizer name.
CONFIGS: dict[str, type[_optim.OptimConfig]] = {
    "soap": AsteriaSOAPConfig,
    "kl-shampoo": AsteriaKLShampooConfig,
    "shampoo": AsteriaShampooConfig,
}


@dataclass
class AsteriaRuntimeCallback(_callbacks.Callback):
    """Attach an ``asteria.Runtime`` to the train module's optimizer before training, detach it
    after (``staleness``/``fixed_delay``/``workers``: ``RuntimeConfig``'s; None: default); ``stats``
    holds its ``stats()`` once detached. Its ``state_dict`` (in OLMo-core's trainer state) is the
    refreshes in flight, kept from a resume's load until the runtime attaches."""

    staleness: int | None = None
    fixed_delay: int | None = None
    workers: int | None = None

    def __post_init__(self) -> None:
        self.runtime: Runtime | None = None
        self.stats: dict[str, Any] | None = None
        self._loaded: dict[str, Any] | None = None

    def runtime_config(self) -> RuntimeConfig:
        given: dict[str, Any] = {
            "staleness": self.staleness,
            "fixed_delay": self.fixed_delay,
            "workers": self.workers,
        }
        return RuntimeConfig(**{k: v for k, v in given.items() if v is not None})

    def attach(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.runtime = Runtime(model, optim, self.runtime_config())
        if self._loaded is not None:
            self.runtime.load_state_dict(self._loaded)
            self._loaded = None

    def detach(self) -> None:
        if self.runtime is not None:
            self.stats = self.runtime.stats()
            self.runtime.close()
            self.runtime = None

    def state_dict(self) -> dict[str, Any]:
        return {} if self.runtime is None else {"runtime": self.runtime.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict.get("runtime")

    def pre_train(self) -> None:
        module = self.trainer.train_module
        self.attach(module.model, module.optim)

    def post_train(self) -> None:
        self.detach()
