"""Module hooks as scheduling signals: the only place Asteria registers hooks.

Owns: a forward pre-hook and a full backward pre-hook on every module that directly owns
parameters the optimizer updates. Each tells the runtime "these parameters' blocks are about to
be used": the runtime flushes refreshes that are ready (installs them) and, on devices where
results must travel, starts their transfer. The hooks are signals, never math: removing them
changes when a ready refresh is installed, never what is computed, and never the staleness bound.

Also a gradient hook on every parameter, for the statistics lane (lane.py): it runs before the
backward accumulates a new gradient into ``.grad`` and waits until the lane no longer reads the
previous one. That hook is a guard, not a signal: it is what makes reading gradients in place
safe when ``.grad`` is accumulated instead of replaced.

Must not: touch optimizer state directly (the runtime does, under its lock).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch

__all__ = ["GradientGuards", "ModuleSignals"]

Signal = Callable[[tuple[int, ...], str], None]


class ModuleSignals:
    """Hooks on ``model``'s modules that call ``signal(param_ids, event)``.

    ``param_ids`` are the ``id()`` of the module's own parameters that are in ``tracked``;
    ``event`` is ``"forward"`` or ``"backward"``. ``remove()`` detaches every hook.
    """

    def __init__(self, model: torch.nn.Module, tracked: Iterable[int], signal: Signal) -> None:
        tracked = set(tracked)
        # The backward pre-hook of a model's first layer fires although its input needs no
        # gradient; torch warns about that on every backward. For a signal it is exactly right.
        warnings.filterwarnings(
            "ignore",
            message="Full backward hook is firing when gradients are computed with respect to "
            "module outputs",
        )
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        for module in model.modules():
            ids = tuple(id(p) for p in module.parameters(recurse=False) if id(p) in tracked)
            if not ids:
                continue
            self._handles.append(module.register_forward_pre_hook(self._forward(signal, ids)))
            self._handles.append(
                module.register_full_backward_pre_hook(self._backward(signal, ids))
            )

    @staticmethod
    def _forward(signal: Signal, ids: tuple[int, ...]):
        def hook(module, args):
            signal(ids, "forward")

        return hook

    @staticmethod
    def _backward(signal: Signal, ids: tuple[int, ...]):
        def hook(module, grad_output):
            signal(ids, "backward")

        return hook

    def __len__(self) -> int:
        return len(self._handles)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class GradientGuards:
    """Tensor hooks that make the backward wait for ``lane`` before writing any ``.grad``."""

    def __init__(self, params: Iterable[torch.Tensor], lane: object) -> None:
        self._handles = [p.register_hook(self._guard(lane)) for p in params if p.requires_grad]

    @staticmethod
    def _guard(lane: object):
        def hook(grad: torch.Tensor) -> None:
            if lane.pending():  # the lane is nearly always done by the next backward
                lane.wait_all()

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
