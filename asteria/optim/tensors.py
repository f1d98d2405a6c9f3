"""Tensor helpers the Kronecker-factored optimizers share: the state dtype of a parameter, DTensor
local shards, the block views of a parameter's layout, zero bases and placeholders of state, and
moving loaded state to a parameter's device.

Owns: small functions on tensors and layouts, free of any optimizer's state or math.
Must not: know an optimizer class or the runtime. asteria.optim.base re-exports the public ones.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from asteria.optim.blocking import ParamLayout


def state_dtype(param: torch.Tensor) -> torch.dtype:
    """Optimizer state is at least fp32: bf16/fp16 parameters get fp32 state."""
    return _promoted(param.dtype)


@functools.cache
def _promoted(dtype: torch.dtype) -> torch.dtype:
    # once per dtype: ``torch.promote_types`` is an ATen op, dispatched (and counted by a
    # dispatch mode) at every call, and the step asks for every parameter
    return torch.promote_types(dtype, torch.float32)


#: The device types whose autocast ``no_autocast`` turns off (Note [Autocast]); where it is
#: off on all of them (as usual), callers skip the context manager and its Python calls.
AUTOCAST_DEVICES = ("cuda", "cpu")


@contextlib.contextmanager
def no_autocast() -> Iterator[None]:
    """Autocast off on every device type where the caller turned it on (Note [Autocast])."""
    with contextlib.ExitStack() as stack:
        for device_type in AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


# Note [Autocast]
# ~~~~~~~~~~~~~~~
# Under ``torch.autocast`` products run in the lower precision, but the optimizers' math is in
# their state dtype: an install from a forward pre-hook inside the model's autocast stored
# SOAP's rotated ``exp_avg`` in bf16, and the next step raised a dtype mismatch (the first H200
# run). So ``KroneckerOptimizer.step`` (after its closure) and the runtime's installs run with
# autocast off (where it is on: ``AUTOCAST_DEVICES``); the pool, the lane and the stream never
# inherit it (per thread).


#: Bytes: gradient shards not aligned to this are copied before use (``KroneckerOptimizer._step``).
_ALIGNMENT = 64


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (an FSDP2 / HSDP parameter or gradient), else ``t`` itself.

    Note [Local shards]: the optimizers work on local shards (under ``no_grad`` ``to_local()`` is
    the shard's own storage, so in-place updates reach the parameter): blocks, factors, moments and
    results are the local shard's, state holds plain tensors, and a ``state_dict`` loads back on the
    same sharding."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


#: The ``"step"`` of a placeholder state (Note [State-initialisation probe]); real steps are >= 0.
PLACEHOLDER_STEP = -1


def _is_placeholder(state: dict[str, Any]) -> bool:
    return state.get("step") == PLACEHOLDER_STEP


def basis_zeros(d: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """A ``d x d`` zero matrix in column-major order, the layout of the bases the refreshes
    return (Note [QR layout] in matrix_functions.py): a placeholder's basis."""
    return torch.zeros(d, d, dtype=dtype, device=device).T


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device=device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    return value


def block_views(t: torch.Tensor, layout: ParamLayout) -> list[torch.Tensor]:
    """Views of ``t`` (viewed with the layout's shape) for every block, in layout order."""
    v = layout.view(t)
    return [v[b.index] for b in layout.blocks]
