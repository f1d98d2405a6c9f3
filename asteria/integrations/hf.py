"""Asteria's optimizers and runtime in the Hugging Face ``Trainer``.

The Trainer takes any ``torch.optim.Optimizer`` (``optimizers=(optimizer, scheduler)``), so
native mode needs an Asteria optimizer only; Asteria mode adds a callback that attaches an
``asteria.Runtime`` when training begins and closes it when it ends. ``trainer_kwargs`` gives
both::

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      **trainer_kwargs(model, "soap", lr=3e-3))  # doctest: +SKIP

Checkpoints need nothing: ``optimizer.state_dict()`` carries the refreshes in flight (Note
[Runtime state in the optimizer's checkpoint] in asteria/optim/state_io.py), loaded before
``on_train_begin``. examples/hf_trainer.py trains with it (tests/unit/test_train_examples.py).

Owns: ``make_optimizer``, ``AsteriaRuntimeCallback`` and ``trainer_kwargs``. Must not: import
transformers before this module is imported, or change the Trainer's own loop.
"""

from __future__ import annotations

from typing import Any

import torch

from asteria.integrations._frameworks import require
from asteria.optim import SOAP, KLShampoo, KroneckerOptimizer, Shampoo
from asteria.runtime import Runtime, RuntimeConfig

_transformers = require("transformers", "asteria.integrations.hf", "transformers accelerate")

__all__ = ["OPTIMIZERS", "AsteriaRuntimeCallback", "make_optimizer", "trainer_kwargs"]

#: The optimizers by the names ``make_optimizer`` takes.
OPTIMIZERS: dict[str, type[KroneckerOptimizer]] = {
    "soap": SOAP,
    "kl-shampoo": KLShampoo,
    "shampoo": Shampoo,
}


def make_optimizer(
    model: torch.nn.Module, optimizer: str | type[KroneckerOptimizer] = "soap", **options: Any
) -> KroneckerOptimizer:
    """An Asteria optimizer (a name of ``OPTIMIZERS`` or a class) over ``model``'s trainable
    parameters, by name (``param_names`` in its state_dict; names in its messages), with
    ``options`` as its keyword arguments."""
    cls = OPTIMIZERS.get(optimizer) if isinstance(optimizer, str) else optimizer
    if not (isinstance(cls, type) and issubclass(cls, KroneckerOptimizer)):
        raise ValueError(
            f"optimizer must be one of {', '.join(OPTIMIZERS)} or an Asteria optimizer class, "
            f"got {optimizer!r}"
        )
    return cls([(n, p) for n, p in model.named_parameters() if p.requires_grad], **options)


class AsteriaRuntimeCallback(_transformers.TrainerCallback):
    """Runs the Trainer's Asteria optimizer in Asteria mode for the length of
    ``trainer.train()``: ``runtime`` is the ``asteria.Runtime`` while it trains, ``stats`` its
    ``stats()`` once training has ended."""

    def __init__(self, config: RuntimeConfig | None = None) -> None:
        self.config = config
        self.runtime: Runtime | None = None
        self.stats: dict[str, Any] | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)  # inside Accelerate's wrapper
        if not isinstance(inner, KroneckerOptimizer):
            raise ValueError(
                "AsteriaRuntimeCallback needs the Trainer's optimizer to be an Asteria optimizer "
                f"(optimizers=(make_optimizer(model), None)), got {type(inner).__name__}"
            )
        self.runtime = Runtime(model, inner, self.config)

    def on_train_end(self, args, state, control, **kwargs):
        if self.runtime is not None:
            self.stats = self.runtime.stats()
            self.runtime.close()
            self.runtime = None


def trainer_kwargs(
    model: torch.nn.Module,
    optimizer: str | type[KroneckerOptimizer] = "soap",
    *,
    runtime: RuntimeConfig | bool = True,
    scheduler: Any = None,
    **options: Any,
) -> dict[str, Any]:
    """What ``Trainer(...)`` takes for Asteria: ``optimizers=(make_optimizer(model, optimizer,
    **options), scheduler)`` (``scheduler=None``: the Trainer makes its own from its arguments;
    or a function of the optimizer that returns an LR scheduler) and, unless ``runtime=False``
    (native mode), ``callbacks=[AsteriaRuntimeCallback(config)]`` (``runtime=True``: the default
    ``RuntimeConfig()``)."""
    if not isinstance(runtime, (bool, RuntimeConfig)):
        raise ValueError(f"runtime must be True, False or a RuntimeConfig, got {runtime!r}")
    opt = make_optimizer(model, optimizer, **options)
    sched = scheduler(opt) if scheduler is not None else None
    out: dict[str, Any] = {"optimizers": (opt, sched)}
    if runtime is not False:
        out["callbacks"] = [AsteriaRuntimeCallback(None if runtime is True else runtime)]
    return out
