"""Optimizer table for `asteria.train`: name -> constructor with a learning rate that works.

Owns: the names the CLI accepts, each optimizer's hyperparameters for the demo, and the documented
default learning rates. Must not: implement optimizer math (that lives in `asteria.optim`) or
split parameters into groups: every parameter goes to one group, and the second-order optimizers
handle 1-D parameters (norm weights) with their Adam path and precondition the vocab x d
embedding and head matrices like any other matrix.

The learning rates are the best of a sweep over {1e-4, 3e-4, 1e-3, 3e-3, 1e-2} (AdamW also 3e-2)
on the ``tiny`` model with the CLI defaults (200 steps, batch 8 x 128 bytes, 10 % warmup, cosine
decay, seed 0); the sweep and its losses are in docs of the demo run, see ``LR_SWEEP_NOTE``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

Params = Iterable[torch.nn.Parameter]


def _adamw(params: Params, lr: float) -> Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def _soap(params: Params, lr: float) -> Optimizer:
    from asteria.optim import SOAP

    return SOAP(params, lr=lr, betas=(0.95, 0.95), weight_decay=0.01, precondition_frequency=10)


def _kl_shampoo(params: Params, lr: float) -> Optimizer:
    from asteria.optim import KLShampoo

    return KLShampoo(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01, precondition_frequency=10)


def _shampoo(params: Params, lr: float) -> Optimizer:
    from asteria.optim import Shampoo

    return Shampoo(params, lr=lr, betas=(0.9, 1.0), precondition_frequency=10, grafting="adam")


@dataclass(frozen=True)
class OptimizerSpec:
    """One trainable optimizer: its CLI name, default learning rate, and constructor."""

    name: str
    lr: float
    summary: str
    factory: Callable[[Params, float], Optimizer]


OPTIMIZERS: dict[str, OptimizerSpec] = {
    s.name: s
    for s in (
        OptimizerSpec("adamw", 3e-3, "torch.optim.AdamW, betas (0.9, 0.95), wd 0.01", _adamw),
        OptimizerSpec("soap", 3e-3, "asteria.optim.SOAP, refresh every 10 steps", _soap),
        OptimizerSpec("kl-shampoo", 3e-3, "asteria.optim.KLShampoo, refresh every 10", _kl_shampoo),
        OptimizerSpec("shampoo", 3e-3, "asteria.optim.Shampoo, Adam grafting", _shampoo),
    )
}


def get_spec(name: str) -> OptimizerSpec:
    """The optimizer called ``name``; ``ValueError`` listing the known ones otherwise."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(
            f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}"
        ) from None


def parse_names(text: str) -> list[str]:
    """``"adamw,soap"`` -> ``["adamw", "soap"]``, each checked, no duplicates."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"no optimizer names in {text!r}; choose from {', '.join(OPTIMIZERS)}")
    for name in names:
        get_spec(name)
    if len(set(names)) != len(names):
        raise ValueError(f"optimizer names repeat in {text!r}")
    return names


def build_optimizer(name: str, params: Params, lr: float | None = None) -> Optimizer:
    """Construct optimizer ``name`` over ``params`` (one group) at ``lr`` or its default."""
    spec = get_spec(name)
    if lr is not None and not lr > 0.0:
        raise ValueError(f"lr must be > 0, got {lr}")
    return spec.factory(params, spec.lr if lr is None else lr)
