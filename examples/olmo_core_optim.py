"""Asteria's optimizers inside OLMo-core's trainer: ``OptimConfig`` subclasses and a callback.

OLMo-core builds its optimizer from an ``OptimConfig`` (``TransformerTrainModuleConfig(optim=...)``
calls ``optim.build(model)``); every field of the config but ``group_overrides``, ``compile`` and
``fixed_fields`` becomes a keyword of the optimizer class that ``optimizer()`` returns. So an
Asteria optimizer in OLMo-core is a dataclass with its hyperparameters:

    from examples.olmo_core_optim import AsteriaSOAPConfig, AsteriaRuntimeCallback
    train_module_config = TransformerTrainModuleConfig(
        ..., optim=AsteriaSOAPConfig(lr=3e-3, weight_decay=0.1),
    )
    trainer_config = TrainerConfig(...).with_callback("asteria", AsteriaRuntimeCallback())

``AsteriaRuntimeCallback`` switches the optimizer to Asteria mode (refreshes on the C++ workers)
for the length of training. Without it the optimizer runs in native mode. OLMo-core shards the
model with FSDP2 when it has several processes; Asteria's optimizers take unsharded parameters
for now (issue #5), so run them single-process or with data parallelism (DDP) only.

Needs ``ai2-olmo-core`` (not in requirements-test.txt: see requirements-examples.txt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from olmo_core.optim import OptimConfig
from olmo_core.train.callbacks import Callback

import asteria
from asteria.optim import SOAP, KLShampoo, Shampoo


@dataclass
class AsteriaSOAPConfig(OptimConfig):
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
class AsteriaKLShampooConfig(OptimConfig):
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
class AsteriaShampooConfig(OptimConfig):
    """``asteria.optim.Shampoo`` (Adam grafting) as an OLMo-core optimizer config."""

    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 1.0)
    precondition_frequency: int = 10
    grafting: str = "adam"

    @classmethod
    def optimizer(cls) -> type[Shampoo]:
        return Shampoo


@dataclass
class AsteriaRuntimeCallback(Callback):
    """Attach an ``asteria.Runtime`` to the train module's optimizer before training, detach it
    after (``staleness``/``workers``: ``asteria.RuntimeConfig``'s, None for the default)."""

    staleness: int | None = None
    workers: int | None = None

    def __post_init__(self) -> None:
        self.runtime: asteria.Runtime | None = None

    def runtime_config(self) -> asteria.RuntimeConfig:
        given: dict[str, Any] = {"staleness": self.staleness, "workers": self.workers}
        return asteria.RuntimeConfig(**{k: v for k, v in given.items() if v is not None})

    def attach(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.runtime = asteria.Runtime(model, optim, self.runtime_config())

    def detach(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None

    def pre_train(self) -> None:
        module = self.trainer.train_module
        self.attach(module.model, module.optim)

    def post_train(self) -> None:
        self.detach()
