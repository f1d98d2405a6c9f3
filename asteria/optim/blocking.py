"""How a parameter is cut into preconditioner blocks.

Owns: the pure mapping from a parameter's shape (and the blocking options of its group) to a
:class:`ParamLayout`: the shape the parameter is viewed as (size-1 dims squeezed, small dims
merged), and the blocks of that view, each with at most ``max_preconditioner_dim`` entries per
factored dim, the way Distributed Shampoo splits large dims.

Must not: touch tensors' values or optimizer state. Layouts are derived, never saved: a
``state_dict`` holds per-block state in the order of ``ParamLayout.blocks``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

__all__ = ["BlockSpec", "ParamLayout", "make_layout", "merge_small_dims"]


@dataclass(frozen=True)
class BlockSpec:
    """One block of a parameter's view: where it is, its shape, which dims carry a factor."""

    index: tuple[slice, ...]
    shape: tuple[int, ...]
    factored: tuple[bool, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParamLayout:
    """The view shape of a parameter and its blocks (in a fixed, documented order)."""

    view_shape: tuple[int, ...]
    blocks: tuple[BlockSpec, ...]

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a parameter or its gradient) seen with ``view_shape``."""
        return t.view(self.view_shape) if t.is_contiguous() else t.reshape(self.view_shape)


def merge_small_dims(shape: tuple[int, ...], max_dim: int) -> tuple[int, ...]:
    """Merge consecutive dims while their product stays ``<= max_dim`` (SOAP's ``merge_dims``)."""
    merged: list[int] = []
    current = 1
    for d in shape:
        if current * d <= max_dim:
            current *= d
        else:
            if current > 1:
                merged.append(current)
            current = d
    if current > 1 or not merged:
        merged.append(current)
    return tuple(merged)


def _chunks(d: int, size: int) -> list[slice]:
    return [slice(s, min(s + size, d)) for s in range(0, d, size)]


def make_layout(
    shape: tuple[int, ...] | torch.Size,
    max_preconditioner_dim: int,
    *,
    squeeze: bool,
    merge_dims: bool = False,
    block_large_dims: bool = True,
    factor_1d: bool = True,
) -> ParamLayout:
    """The layout of a parameter of ``shape``.

    ``squeeze`` drops size-1 dims (KL-Shampoo, Shampoo: a 1x1 factor would change the root
    order). ``merge_dims`` merges small consecutive dims first (SOAP). Dims larger than
    ``max_preconditioner_dim`` are split into chunks of that size when ``block_large_dims``;
    otherwise they stay whole and carry no factor (the SOAP authors' rule). A 1-D view gets a
    factor only when ``factor_1d``. A 0-d parameter is viewed as shape ``(1,)``.
    """
    view = tuple(int(d) for d in shape)
    if squeeze:
        view = tuple(d for d in view if d != 1)
    if merge_dims and len(view) > 1:
        view = merge_small_dims(view, max_preconditioner_dim)
    if len(view) == 0:
        view = (1,)
    can_factor = factor_1d or len(view) > 1

    per_dim: list[list[slice]] = []
    factored: list[bool] = []
    for d in view:
        if d <= max_preconditioner_dim:
            per_dim.append([slice(0, d)])
            factored.append(can_factor)
        elif block_large_dims:
            per_dim.append(_chunks(d, max_preconditioner_dim))
            factored.append(can_factor)
        else:
            per_dim.append([slice(0, d)])
            factored.append(False)

    blocks = tuple(
        BlockSpec(
            index=tuple(idx),
            shape=tuple(s.stop - s.start for s in idx),
            factored=tuple(factored),
        )
        for idx in itertools.product(*per_dim)
    )
    return ParamLayout(view_shape=view, blocks=blocks)
