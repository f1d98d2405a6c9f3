"""Module hooks as scheduling signals: the only place Asteria registers hooks.

Owns: a forward pre-hook on every module that directly owns parameters the optimizer updates:
the first signal after a step installs every finished refresh in one batch (Note [One install
batch per step] in runtime.py). Signals, never math: without them a ready refresh is installed
later, never differently. And a gradient hook on every parameter for the statistics lane, a
guard: it runs before the backward accumulates into ``.grad`` and waits until the lane no longer
reads the previous one (Note [Gradient guards]).

Must not: touch optimizer state directly (the runtime does, under its lock).

Note [Gradient guards]
~~~~~~~~~~~~~~~~~~~~~~
The next backward overwrites the gradients the lane reads only where it writes into an existing
``.grad`` (accumulation; ``zero_grad(set_to_none=False)`` waits for the lane itself), so the guard
waits only where ``.grad`` is not None, and the backward otherwise runs beside the lane (tiny LM
at batch 4: 280 -> 169 ms). In a distributed run it always waits (DDP's bucket views write into
the old ``.grad``'s storage outside autograd). The cost: an old gradient lives until the lane is
done with it.

Note [Disarmed signals]
~~~~~~~~~~~~~~~~~~~~~~~
Every signal after the first of a step returned at its flag, after about six Python calls per
module. So the first one disarms the hooks (``disarm``: taken out of ``_forward_pre_hooks``,
dict operations only) and a step's end arms them again (``arm``, at the end of each module's
hooks) where a refresh is in flight: a step's signals cost O(1) Python calls, none in a step
with nothing in flight. ``remove`` takes them out for good.

Note [Signals under torch.compile]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Traced, each forward pre-hook broke the compiled graph (it calls into the runtime). So the hooks
return at once while dynamo traces (``torch.compiler.is_compiling()``): the compiled forward and
backward hold nothing of Asteria's, and ready refreshes are installed at the step's plan (as with
``hooks=False``), never differently. The gradient guards run in the eager autograd engine.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch

__all__ = ["GradientGuards", "ModuleSignals"]

Signal = Callable[[], None]


class ModuleSignals:
    """Forward pre-hooks on the modules of ``model`` that hold parameters in ``tracked`` (their
    ``id()``s), each calling ``signal()``. ``remove()`` detaches every hook.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tracked: Iterable[int],
        signal: Signal,
    ) -> None:
        tracked = set(tracked)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        #: the forward pre-hooks, as ``disarm``/``arm`` take them out and put them back:
        #: (the module's ``_forward_pre_hooks``, the hook's id there, the hook)
        self._forward_hooks: list[tuple[dict, int, Callable]] = []
        #: whether the forward pre-hooks are in their modules (Note [Disarmed signals])
        self.armed = True
        for module in model.modules():
            if not any(id(p) in tracked for p in module.parameters(recurse=False)):
                continue
            hook = self._forward(signal)
            handle = module.register_forward_pre_hook(hook)
            self._handles.append(handle)
            self._forward_hooks.append((module._forward_pre_hooks, handle.id, hook))

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
    def _forward(signal: Signal):
        def hook(module, args):
            if torch.compiler.is_compiling():
                return  # Note [Signals under torch.compile]
            signal()

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
