"""Shape groups: the blocks of a step that one product and one elementwise op can take together.

Owns: ``BlockGroup`` (blocks of one shape, dtype, layout, factor and basis layout and step, with
their keys, states and per-block views of the step's tensors), ``build`` (a step's blocks in
shape groups, from the cached layouts, with no Python call per block), ``batches`` (groups cut at
``BATCH_ELEMENTS``), ``pack`` (groups in pieces of at most a number of elements and bytes: Note
[Pieces by shape group]), and the keys that say which tensors may be stacked (``tensor_key``,
``block_key``).

Must not: hold any algorithm's math (the kernels do: asteria/optim/kernels/), or know who
hands out the bases (a refresher cuts a step's groups into its pieces with ``pack``).

Note [Batched steps]: the math is the authors' (docs/fidelity.md); only the launch pattern is
Asteria's. A group's tensors are stacked (``batched.stack``), every product is one
``batched.bmm`` a group, every elementwise op one ``torch._foreach_*`` over a batch's blocks;
state stays per block. The host work per step grows with the shape groups, not the blocks:
groups are built in one frame, a kernel's calls are per group, and the per-parameter work of a
step (its state, checks, working copies) makes no Python call per parameter. On the CPU the
results are bitwise the per-block ops (``bmm`` is one aligned ``mm`` per matrix: Note [Aligned
operands] in csrc/core/aligned.cpp; tests/unit/test_batched_steps.py); blocks a CPU ``bmm``
would round otherwise (order 3 or more, products under ``SMALL_BMM``) are groups of one
(``block_key``). On a GPU cuBLAS may pick other kernels: equal to rounding (docs/fidelity.md).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch

from asteria.optim.batched import SMALL_BMM

__all__ = [
    "BATCH_ELEMENTS",
    "BlockGroup",
    "batches",
    "block_key",
    "build",
    "keys_of",
    "pack",
    "shape_groups",
    "tensor_key",
]

T = TypeVar("T")

#: Gradient elements one batch of a step holds at most (a block over it is a batch alone): a
#: batched update keeps some four temporaries of its batch's size, so the extra memory is
#: bounded by this, not by the model.
BATCH_ELEMENTS = 1 << 26


class BlockGroup:
    """Blocks of one shape group of a step (see module docstring): ``keys`` and ``blocks`` (the
    blocks' state dicts), ``step`` (the optimizer step of every one), ``views`` (per name, the
    blocks' views of the step's tensors: ``"grad"``, ``"weight"``, ...), ``numel`` (a block's
    elements), ``factored`` (whether its blocks have a factor), ``tag`` (what ``build`` was told
    of their parameter), ``scale`` and ``tmp`` (a kernel's per-group scalar and per-block
    intermediate results)."""

    __slots__ = (
        "key",
        "keys",
        "blocks",
        "step",
        "views",
        "numel",
        "factored",
        "tag",
        "scale",
        "tmp",
    )

    def __init__(self, key, keys, blocks, step, views, numel, factored, tag=None) -> None:
        self.key, self.keys, self.blocks, self.step = key, keys, blocks, step
        self.views: dict[str, list[torch.Tensor]] = views
        self.numel: int = numel
        self.factored: bool = factored
        self.tag: Any = tag
        self.scale: Any = None
        self.tmp: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def take(self, idx: Sequence[int]) -> BlockGroup:
        """The blocks of ``idx`` (in that order) as a group of their own."""
        views, keys, blocks = {}, [], []
        for i in idx:  # (loops: no call per block)
            keys.append(self.keys[i])
            blocks.append(self.blocks[i])
        for n, v in self.views.items():
            views[n] = picked = []
            for i in idx:
                picked.append(v[i])
        sub = BlockGroup(
            self.key, keys, blocks, self.step, views, self.numel, self.factored, self.tag
        )
        sub.scale = self.scale
        return sub


def tensor_key(t: torch.Tensor | None) -> Hashable:
    """What must agree for tensors to be stacked: shape, dtype, device, and the layout (a
    stack keeps its first tensor's: ``batched.stack``)."""
    return None if t is None else (tuple(t.shape), t.dtype, t.device, t.stride())


def block_key(t: torch.Tensor) -> Hashable:
    """``tensor_key`` of a block, or a key of its own (a group of one) where a CPU ``bmm`` of
    its products would round otherwise than ``mm`` (Note [Batched steps])."""
    if t.device.type == "cpu" and (t.dim() > 2 or t.numel() * min(t.shape, default=1) < SMALL_BMM):
        return object()
    return tensor_key(t)


def build(
    updates: Sequence[Any],
    tensors: dict[str, Sequence[torch.Tensor | None]],
    field: str,
    tags: Sequence[Hashable] | None = None,
) -> list[BlockGroup]:
    """The blocks of ``updates`` (``Update``s whose state has ``"blocks"``) in shape groups, in
    block order, groups in the order of their first block. ``tensors[name][i]`` is a tensor of
    ``updates[i]``'s parameter cut per block (None: no views); ``field`` the bases field;
    ``tags[i]`` joins the key. One Python frame whatever the blocks (Note [Batched steps])."""
    found: dict[Any, list] = {}
    names = list(tensors)
    first = names[0]
    for i, u in enumerate(updates):
        blocks = u.state.get("blocks")
        if blocks is None:
            continue
        layout, step = u.layout, u.state["step"]
        shape = layout.view_shape
        views = {}
        for name in names:
            t = tensors[name][i]
            if t is None:
                views[name] = None
                continue
            v = t.view(shape) if t.is_contiguous() else t.reshape(shape)
            cut = []
            for spec in layout.blocks:
                cut.append(v[spec.index])
            views[name] = cut
        tag = None if tags is None else tags[i]
        for bi in range(len(blocks)):
            g = views[first][bi]
            block = blocks[bi]
            numel = g.numel()
            if g.device.type == "cpu" and (
                g.dim() > 2 or numel * min(g.shape, default=1) < SMALL_BMM
            ):
                key: Any = object()  # a group of one (``block_key``)
            else:
                layouts = []
                for q in block[field]:
                    layouts.append(None if q is None else (q.shape, q.dtype, q.stride()))
                for f in block["factors"]:
                    layouts.append(None if f is None else (f.shape, f.dtype, f.stride()))
                key = (g.shape, g.dtype, g.device, g.stride(), step, tag, tuple(layouts))
            entry = found.get(key)
            if entry is None:
                factored = block["factors"].count(None) != len(block["factors"])
                views_of = {n: [] for n in names}
                entry = found[key] = [key, [], [], step, views_of, numel, factored, tag]
            entry[1].append((u.pid, bi))
            entry[2].append(block)
            for name in names:
                cut = views[name]
                entry[4][name].append(None if cut is None else cut[bi])
    return [BlockGroup(*entry) for entry in found.values()]


def keys_of(groups: Sequence[BlockGroup]) -> list:
    """Every block key of ``groups``, in order."""
    return [k for g in groups for k in g.keys]


def shape_groups(items: Sequence[T], key: Callable[[T], Hashable]) -> list[list[int]]:
    """Indices of ``items`` grouped by ``key``, each group in order, groups in the order of
    their first item."""
    groups: dict[Hashable, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    return list(groups.values())


def batches(groups: list[BlockGroup], limit: int | None = None) -> list[list[BlockGroup]]:
    """``groups`` in batches of at most ``limit`` (``BATCH_ELEMENTS``) gradient elements, a
    group that fits whole in one (``pack``)."""
    limit = BATCH_ELEMENTS if limit is None else limit
    if sum([g.numel * len(g.keys) for g in groups]) <= limit:
        return [groups] if groups else []
    return pack(groups, None, limit, lambda g: 0)


def pack(
    groups: Sequence[BlockGroup],
    room: int | None,
    limit: int,
    nbytes: Callable[[BlockGroup], int],
) -> list[list[BlockGroup]]:
    """``groups`` in pieces of at most ``limit`` elements and ``room`` bytes (``nbytes`` of a
    group of one block: its bases'; None: no limit on bytes) but for a block over either, which
    is a piece alone. Groups are placed first fit, largest first; a group larger than a piece is
    cut into runs, each opened where its next block would overflow the last. Each piece lists its
    groups in the order given (Note [Pieces by shape group])."""
    sized = []
    for g in groups:
        n = g.numel * len(g.keys)
        b = 0 if room is None else nbytes(g)
        sized.append((g, n, b))
    if room is None:
        shares = [n / max(limit, 1) for _, n, _ in sized]
    else:
        shares = [max(n / max(limit, 1), b / max(room, 1)) for _, n, b in sized]
    bins: list[list] = []  # [elements, bytes, [(order, group)]], in the order opened
    for at in sorted(range(len(sized)), key=shares.__getitem__, reverse=True):
        g, n, b = sized[at]
        if n <= limit and (room is None or b <= room):  # whole: the first piece it fits
            for piece in bins:
                if piece[0] + n <= limit and (room is None or piece[1] + b <= room):
                    break
            else:
                piece = [0, 0, []]
                bins.append(piece)
            piece[0] += n
            piece[1] += b
            piece[2].append((at, g))
            continue
        one_n, one_b = g.numel, b // max(len(g.keys), 1)  # cut: runs of its own
        piece, run = None, []
        for i in range(len(g.keys)):
            if (
                piece is None
                or piece[0] + one_n > limit
                or (room is not None and piece[1] + one_b > room)
            ):
                if run:
                    piece[2].append((at, g.take(run)))
                piece, run = [0, 0, []], []
                bins.append(piece)
            piece[0] += one_n
            piece[1] += one_b
            run.append(i)
        piece[2].append((at, g.take(run)))
    out = []
    for piece in bins:  # (loops: no call per piece)
        out.append(
            [g for _, g in sorted(piece[2], key=_FIRST)] if len(piece[2]) > 1 else [piece[2][0][1]]
        )
    return out


_FIRST = operator.itemgetter(0)


# Note [Pieces by shape group]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A piece's blocks are stacked per shape group, so a group cut across pieces costs a second set
# of stacks and products. Packing greedily in order cut groups (five stacks where native has
# four); whole groups in order cost a piece. So ``pack`` places whole groups first fit, largest
# first (the blocks are independent; each piece lists its groups in the order given): a group
# that fits is never cut, and a group larger than a piece is cut into runs, smaller groups
# filling its last run.
