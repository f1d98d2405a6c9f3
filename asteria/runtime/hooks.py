"""Module hooks as scheduling signals: the only place Asteria registers hooks.

Owns: two hooks on every module that directly owns parameters the optimizer updates. Each tells
the runtime "these parameters' blocks are about to be used": the runtime flushes refreshes that
are ready (installs them) and, on devices where results must travel, starts their transfer.
  * a forward pre-hook: the module's forward is about to run;
  * a backward signal: a forward hook registers a gradient hook on the module's output, which
    fires when the gradient with respect to that output is complete, that is, just before the
    module's own backward. It is what ``register_full_backward_pre_hook`` signals, without its
    cost (Note [Backward signals]).
The runtime asks for the forward signals only: it installs a step's finished refreshes in one
batch at the first signal after the step (Note [One install batch per step] in runtime.py), which
is a forward pre-hook, so a backward signal would only ever return at the flag, after costing a
forward hook, a gradient-hook registration and a call per module per step.
That first signal disarms the forward pre-hooks until the step's end arms them again (Note
[Disarmed signals]): a step's signals cost O(1) Python calls, not one per module.
The hooks are signals, never math: removing them changes when a ready refresh is installed,
never what is computed, and never the staleness bound.

Also a gradient hook on every parameter, for the statistics lane (lane.py): it runs before the
backward accumulates a new gradient into ``.grad`` and waits until the lane no longer reads the
previous one. That hook is a guard, not a signal: it is what makes reading gradients in place
safe when ``.grad`` is accumulated instead of replaced (Note [Gradient guards]).

Note [Gradient guards]
~~~~~~~~~~~~~~~~~~~~~~
The lane reads the gradient tensors of its step. The next backward overwrites them only where it
writes into an existing ``.grad``: gradient accumulation, or ``zero_grad(set_to_none=False)``
(which waits for the lane itself). After ``zero_grad()`` sets ``.grad`` to None the backward
writes new tensors and the lane keeps the old ones alive, so the guard waits only where ``.grad``
is not None, and the backward runs beside the lane's statistics. On bench/step_time.py's tiny LM
at batch 4, where the lane's KL-Shampoo statistics outlast the forward and backward, that took the
forward and backward from 280 to 169 ms (AdamW's step: 160 ms). In a distributed run the guard
always waits: DDP with ``gradient_as_bucket_view=True`` writes the new gradient into the bucket
that is the old ``.grad``'s storage, outside autograd, whatever ``.grad`` holds when the hook
fires. The cost is memory: a parameter's old gradient lives until the lane is done with it.

Must not: touch optimizer state directly (the runtime does, under its lock).

Note [Backward signals]
~~~~~~~~~~~~~~~~~~~~~~~
``register_full_backward_pre_hook`` wraps a module's inputs and outputs in a
``BackwardHookFunction`` on every forward. Two costs follow:
  * time: on a 64-96-96-32 MLP (batch 64, one thread) forward + backward took 0.48 ms with it on
    the three Linears against 0.31 ms without, more than the optimizer's own step overhead;
  * breakage: an in-place op on the wrapped output, as in ``Linear`` then ``ReLU(inplace=True)``,
    raises "Output 0 of BackwardHookFunction is a view and is being modified inplace".
A gradient hook on the output tensor fires at the same moment (the output's gradient is complete,
the module's backward has not started) and costs one hook registration per forward: 0.35 ms on
the same MLP, and in-place ops after the module work. An output that needs no gradient (a forward
under ``no_grad``, a frozen module) registers nothing: no backward will run through it. A module
whose output holds several tensors signals on the first one that needs a gradient. A hook
registered on an output lives as long as that output's graph, so ``remove()`` cannot take it
back; after ``close()`` it calls a runtime that ignores it.

Note [Disarmed signals]
~~~~~~~~~~~~~~~~~~~~~~~
The runtime needs at most one forward signal a step (Note [One install batch per step] in
runtime.py): every later one returned at its flag, after a forward pre-hook,
``torch.compiler.is_compiling`` and the runtime's weak reference, about six Python calls per
module and step on a GPU's host (issue 37). So the first signal of a step disarms the hooks
(``disarm``: each taken out of its module's ``_forward_pre_hooks``, dict operations, no Python
call), and the step's end arms them again (``arm``) where a refresh is in flight (with none,
there is nothing to install before the next step's plan): the modules after the first run their
forward as without hooks (PyTorch's path for a module with none), and a step's signals cost O(1)
Python calls, none in a step with nothing in flight. A hook put back goes to the end of its
module's hooks (after any the user registered since); a signal never changes what is computed,
so the order does not either. ``remove`` takes them out for good.

Note [Signals under torch.compile]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A signal calls into the runtime (a weak reference, its lock, its pending refreshes), which dynamo
cannot trace: traced, each module's forward pre-hook broke the compiled graph once (2 breaks on a
model of two Linears). Both module hooks therefore return at once while dynamo traces
(``torch.compiler.is_compiling()``), so the compiled forward and backward hold nothing of
Asteria's and the module signals are off there. That changes only when a ready refresh is
installed (at the optimizer's block boundaries, as with ``RuntimeConfig(hooks=False)``), never
what is computed. Modules that run eagerly still signal. The gradient guards are tensor hooks
on the parameters, which run in the eager autograd engine after a compiled backward, as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch

__all__ = ["GradientGuards", "ModuleSignals"]

Signal = Callable[[tuple[int, ...], str], None]


class ModuleSignals:
    """Hooks on ``model``'s modules that call ``signal(param_ids, event)``.

    ``param_ids`` are the ``id()`` of the module's own parameters that are in ``tracked``;
    ``event`` is ``"forward"`` or ``"backward"`` (``backward=False``: the forward signals only).
    ``remove()`` detaches every hook.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tracked: Iterable[int],
        signal: Signal,
        backward: bool = True,
    ) -> None:
        tracked = set(tracked)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        #: the forward pre-hooks, as ``disarm``/``arm`` take them out and put them back:
        #: (the module's ``_forward_pre_hooks``, the hook's id there, the hook)
        self._forward_hooks: list[tuple[dict, int, Callable]] = []
        #: whether the forward pre-hooks are in their modules (Note [Disarmed signals])
        self.armed = True
        for module in model.modules():
            ids = tuple(id(p) for p in module.parameters(recurse=False) if id(p) in tracked)
            if not ids:
                continue
            hook = self._forward(signal, ids)
            handle = module.register_forward_pre_hook(hook)
            self._handles.append(handle)
            self._forward_hooks.append((module._forward_pre_hooks, handle.id, hook))
            if backward:
                self._handles.append(module.register_forward_hook(self._arm_backward(signal, ids)))

    def disarm(self) -> None:
        """Take the forward pre-hooks out of their modules until ``arm``: the modules' forwards
        run as without hooks (Note [Disarmed signals])."""
        if self.armed:
            self.armed = False
            for hooks, hook_id, _ in self._forward_hooks:
                hooks.pop(hook_id, None)

    def arm(self) -> None:
        """Put the forward pre-hooks back (after ``disarm``; nothing once removed)."""
        if not self.armed and self._handles:
            self.armed = True
            for hooks, hook_id, hook in self._forward_hooks:
                hooks[hook_id] = hook

    @staticmethod
    def _forward(signal: Signal, ids: tuple[int, ...]):
        def hook(module, args):
            if torch.compiler.is_compiling():
                return  # Note [Signals under torch.compile]
            signal(ids, "forward")

        return hook

    @staticmethod
    def _arm_backward(signal: Signal, ids: tuple[int, ...]):
        def on_grad(grad: torch.Tensor) -> None:
            signal(ids, "backward")  # returns None: the gradient passes unchanged

        def hook(module, args, output):
            if torch.compiler.is_compiling():
                return  # Note [Signals under torch.compile]
            out = _first_differentiable(output)
            if out is not None:
                out.register_hook(on_grad)

        return hook

    def __len__(self) -> int:
        return len(self._handles)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._forward_hooks.clear()


class GradientGuards:
    """Tensor hooks that make the backward wait for ``lane`` before it writes into a ``.grad``
    the lane may read (Note [Gradient guards]); ``always``: before writing any gradient."""

    def __init__(self, params: Iterable[torch.Tensor], lane: object, always: bool = False) -> None:
        self._handles = [
            p.register_hook(self._guard(weakref.ref(p), lane, always))
            for p in params
            if p.requires_grad
        ]

    @staticmethod
    def _guard(param: weakref.ref, lane: object, always: bool):
        def hook(grad: torch.Tensor) -> None:
            if not always:
                p = param()
                if p is None or p.grad is None:
                    return  # a new tensor: the lane keeps reading the old one
            if lane.pending():  # the lane is nearly always done by the next backward
                lane.wait_all()

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _first_differentiable(output: object) -> torch.Tensor | None:
    """The first tensor in ``output`` (a tensor, or a tuple, list or dict of them, nested) that
    requires a gradient, or None."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        for item in output:
            found = _first_differentiable(item)
            if found is not None:
                return found
    return None
