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
import warnings
from dataclasses import dataclass

import torch

__all__ = [
    "FACTOR_BUDGET_DIM",
    "FACTOR_BUDGET_RATIO",
    "BlockSpec",
    "FactorBudgetWarning",
    "ParamLayout",
    "make_layout",
    "merge_small_dims",
    "over_budget",
    "warn_over_budget",
    "without_factors",
]


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
    #: Dims of the view left without a factor because it would be over the factor budget
    #: (Note [Factor budget]); the optimizer warns once.
    over_budget: tuple[int, ...] = ()

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


#: Note [Factor budget]: the widest factor built whatever its block.
FACTOR_BUDGET_DIM = 2048
#: ... and how many times its block's elements a wider factor may hold.
FACTOR_BUDGET_RATIO = 16


class FactorBudgetWarning(UserWarning):
    """A dim of a parameter was left without a factor: its factor would be over the budget
    (Note [Factor budget] in asteria/optim/blocking.py)."""


# Note [Factor budget]
# ~~~~~~~~~~~~~~~~~~~~
# A ``d x d`` factor costs ``d^2`` elements (and a basis as large) and ``O(d^3)`` per refresh (one
# thread on the project's EPYC: a QR refresh 0.14 s at 1024, 6.1 s at 4096; an eigh 11 s at 4096,
# 160 s at 10000). Blocking a ``(1, 100000)`` parameter at 10000 made ten 10000-wide factors for a
# rank-one gradient: 4 GB, no first step within 100 s. So a dim's factor is built only within
# the budget: at most ``FACTOR_BUDGET_DIM`` (2048) wide, or at most ``FACTOR_BUDGET_RATIO`` (16)
# times the elements of its block. A dim over it is left unpreconditioned and not split (the SOAP
# authors' rule: Adam along it), with one ``FactorBudgetWarning``; KL-Shampoo and Shampoo factor
# every dim of a block or none, so there the parameter goes without factors (AdamW, grafting).
# At the defaults no square-ish block is affected (tests/unit/test_layouts.py).


def without_factors(layout: ParamLayout) -> ParamLayout:
    """``layout`` with no factor on any dim (an optimizer that factors every dim of a block or
    none, KL-Shampoo and Shampoo, where a dim is over the budget: Note [Factor budget])."""
    blocks = tuple(
        BlockSpec(b.index, b.shape, tuple(False for _ in b.factored)) for b in layout.blocks
    )
    return ParamLayout(layout.view_shape, blocks, layout.over_budget)


def over_budget(width: int, block_numel: int) -> bool:
    """Whether a ``width x width`` factor of a block of ``block_numel`` elements is over the
    budget (Note [Factor budget])."""
    return width > FACTOR_BUDGET_DIM and width * width > FACTOR_BUDGET_RATIO * block_numel


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
    factor only when ``factor_1d``. A 0-d parameter is viewed as shape ``(1,)``. A dim whose
    factor would be over the budget stays whole without one (Note [Factor budget]).
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
    # Note [Factor budget]: judged on the largest block (the first chunk of every dim)
    numel = math.prod(chunks[0].stop for chunks in per_dim)
    over = tuple(
        i
        for i, (chunks, f) in enumerate(zip(per_dim, factored))
        if f and over_budget(chunks[0].stop, numel)
    )
    for i in over:
        per_dim[i], factored[i] = [slice(0, view[i])], False

    blocks = tuple(
        BlockSpec(
            index=tuple(idx),
            shape=tuple(s.stop - s.start for s in idx),
            factored=tuple(factored),
        )
        for idx in itertools.product(*per_dim)
    )
    return ParamLayout(view_shape=view, blocks=blocks, over_budget=over)


def warn_over_budget(
    optimizer: str, name: str, p: torch.Tensor, layout: ParamLayout, group: dict, some_dims: bool
) -> None:
    """Note [Factor budget]: the warning, once per optimizer, for the first parameter (``name``,
    ``p`` its local tensor) a dim of which is left without a factor (every dim where the
    optimizer factors all dims of a block or none: ``some_dims`` False)."""
    dims = ", ".join(
        f"dim {i} ({layout.view_shape[i]}: a factor of up to "
        f"{min(layout.view_shape[i], group['max_preconditioner_dim'])} wide)"
        for i in layout.over_budget
    )
    every = f"(every dim: {optimizer} factors all dims of a block or none) for {dims}"
    where = f"along {dims}" if some_dims else every
    warnings.warn(
        f"{optimizer}: parameter '{name}' of shape {tuple(p.shape)} (viewed as "
        f"{layout.view_shape}) is left unpreconditioned {where}, as the SOAP authors "
        f"leave a dim above max_precond_dim: the factor would be wider than "
        f"{FACTOR_BUDGET_DIM} and hold more than {FACTOR_BUDGET_RATIO} times the elements of "
        "the block it preconditions (Note [Factor budget] in asteria/optim/blocking.py: "
        "about 90 s a refresh and 400 MB at 10000 wide on a CPU). To precondition it, "
        "reshape the parameter so that no dim is much longer than the others. Shown once "
        "per optimizer.",
        FactorBudgetWarning,
        stacklevel=4,
    )
