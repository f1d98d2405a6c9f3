"""Blocks of one shape updated together: the launch pattern of the optimizers' per-step math.

Owns: grouping a step's blocks by shape, dtype and device (``shape_groups``); cutting them into
pieces whose bases a refresher can hand out at once, on shape group boundaries where a group
fits (``pieces``, ``group_pieces``, ``Refresher.bases_room``);
mode products and Gram matrices of stacked blocks (a leading batch dim: ``bmm`` per factored
dim instead of one ``mm`` per block); the bases of a piece from the refresher in one call
(``bases_of``).

Must not: hold any algorithm's math. The optimizers' files say what is computed; this module
only says how the products of many blocks of one shape are issued (Note [Batched steps]).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch

import asteria._C  # noqa: F401  (registers torch.ops.asteria.block_mm and aligned_mm)

__all__ = [
    "BATCH_ELEMENTS",
    "aligned",
    "bmm",
    "eigh_each",
    "index_select_each",
    "mm",
    "qr_each",
    "qr_refresh_each",
    "bases_bytes",
    "bases_of",
    "block_key",
    "batched_gram",
    "group_pieces",
    "in_turns",
    "batched_mode_products",
    "pieces",
    "read_batches",
    "shape_groups",
    "stack",
]

T = TypeVar("T")

#: Gradient elements one piece of a step holds at most (a block over it is a piece alone): a
#: batched update keeps some four temporaries of its piece's size (stacked gradients, rotated
#: gradients, ratios, updates), so the extra memory is bounded by this, not by the model.
BATCH_ELEMENTS = 1 << 26

Mats = Sequence[torch.Tensor | None]


# Note [Batched steps]
# ~~~~~~~~~~~~~~~~~~~~
# The math of SOAP, KL-Shampoo and Shampoo is the authors' (docs/fidelity.md); only the
# launch pattern is Asteria's. Per step each block is a handful of products with its bases and
# some elementwise ops: issued block by block, a step dispatches some twenty ATen ops per block
# (715 for SOAP on ``tiny``'s 47 blocks; on a GPU each one a kernel launch). Here:
#   * the blocks of a step are grouped by (shape, dtype, device, which dims have a basis); a
#     group's gradients and bases are stacked (``torch.stack``: one op per list) and every
#     product is one ``bmm`` for the group (``batched_mode_products``, ``batched_gram``);
#   * the elementwise ops run over all blocks of the step at once (``torch._foreach_*``: one
#     dispatch, on CUDA a few multi-tensor launches);
#   * state stays per block, in the state_dict's format (no persistent stacked state: a view
#     of a stacked tensor in a checkpoint would save the whole stack). Stacking costs one copy
#     of the group's gradients and bases per step; measured against the per-block ops it is the
#     cheaper of the two on the CPU (bench/optim_step.py) and the launch count is what a GPU
#     pays for.
# The ops dispatched per step then grow with the number of shape groups (and pieces: a piece
# is cut at ``BATCH_ELEMENTS`` elements, and at the refresher's ``bases_room``), not blocks.
# On the CPU the results are bitwise those of the per-block ops (tests/unit/test_fused_steps.py,
# test_batched_steps.py): ``bmm`` calls the BLAS ``gemm`` that ``mm`` calls, on operands in the
# same layout (``stack`` keeps column-major bases column-major; the general order-k path moves
# dims as kron's ``tensordot`` does), except for products under ``SMALL_BMM`` multiply-adds,
# which ATen's ``bmm`` computes with its own loop, and for blocks of order 3 or more, whose
# Gram matrices ``bmm`` rounds otherwise: on the CPU such blocks run alone (``block_key``; a
# language model has none: its blocks are matrices and vectors). On a
# GPU cuBLAS may choose other kernels for a batched product than for one matrix: there the
# results agree with the per-block ops to rounding (docs/fidelity.md, "Batched steps").
# A group of one block goes through the per-block ops (nothing to stack).


def shape_groups(items: Sequence[T], key: Callable[[T], Hashable]) -> list[list[int]]:
    """Indices of ``items`` grouped by ``key``, each group in order, groups in the order of
    their first item."""
    groups: dict[Hashable, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    return list(groups.values())


def tensor_key(t: torch.Tensor | None) -> Hashable:
    """What must agree for tensors to be stacked: shape, dtype, device, and the layout (a
    stack keeps its first tensor's: ``stack``)."""
    return None if t is None else (tuple(t.shape), t.dtype, t.device, t.stride())


#: On the CPU, ATen's ``bmm`` computes a product of fewer multiply-adds than this (rows x
#: cols x contraction) with its own loop, not BLAS: other roundings than ``mm``'s.
SMALL_BMM = 400


def block_key(t: torch.Tensor) -> Hashable:
    """``tensor_key`` of a block (its gradient), or a key of its own (a group of one, the
    per-block ops) where a CPU ``bmm`` of its products would round otherwise than ``mm``:
    products under ``SMALL_BMM`` multiply-adds (every product of a block with a basis has
    ``numel x d_i``), and blocks of order 3 or more (their Gram matrices, ``d x R`` by
    ``R x d`` products, came out of ``bmm`` in other bits than out of ``mm``: measured over
    shapes up to 16 x 40 x 33)."""
    if t.device.type == "cpu" and (t.dim() > 2 or t.numel() * min(t.shape, default=1) < SMALL_BMM):
        return object()
    return tensor_key(t)


def pieces(
    items: Sequence[T],
    elements: Callable[[T], int],
    nbytes: Callable[[T], int],
    room: int | None,
    limit: int = BATCH_ELEMENTS,
) -> list[list[T]]:
    """``items`` in order, in runs of at most ``limit`` elements and ``room`` bytes of bases
    (``None``: no limit on bases; ``0``: one item a run); an item over either runs alone."""
    out: list[list[T]] = []
    size = used = 0
    for item in items:
        n, b = elements(item), nbytes(item)
        full = size + n > limit or (room is not None and used + b > room)
        if not out or full:
            out.append([])
            size = used = 0
        out[-1].append(item)
        size += n
        used += b
    return out


def group_pieces(
    groups: Sequence[Sequence[T]],
    elements: Callable[[T], int],
    nbytes: Callable[[T], int],
    room: int | None,
    limit: int = BATCH_ELEMENTS,
) -> list[list[T]]:
    """The items of ``groups`` (shape groups) in pieces of at most ``limit`` elements and
    ``room`` bytes (``None``: no limit on bytes) but for an item over either, which runs alone;
    a group that fits a piece lies in one, a larger one is cut into runs as ``pieces`` cuts
    items. Groups are placed first fit, largest first; a piece lists its groups, and each group
    its items, in the order given (Note [Pieces by shape group])."""
    return [_items(piece) for piece in _pack(_sized(groups, elements, nbytes), room, limit)]


def read_batches(
    groups: Sequence[Sequence[T]],
    elements: Callable[[T], int],
    nbytes: Callable[[T], int],
    room: int | None,
    limit: int = BATCH_ELEMENTS,
) -> list[list[list[T]]]:
    """The items of ``groups`` in batches, each a list of reads: a batch is a piece of
    ``group_pieces`` with no limit on bytes (what native mode steps at once), cut into pieces
    of at most ``room`` bytes of bases (its reads: one where the room holds the batch). A batch
    runs its elementwise ops once over all its reads (Note [Two passes over the pieces] in
    soap_step.py); a step in one read per batch is ``group_pieces``'s. Each item is sized once."""
    sized = _sized(groups, elements, nbytes)
    batches = _pack(sized, None, limit)
    if room is None:
        return [[_items(batch)] for batch in batches]
    out = []
    for batch in batches:
        parts = [
            sized[g] if len(items) == len(sized[g][0]) else _sized([items], elements, nbytes)[0]
            for g, items in batch
        ]  # (a group cut across batches, over ``limit`` elements: its runs sized again)
        out.append([_items(piece) for piece in _pack(parts, room, limit)])
    return out


def in_turns(reads: list[T], step: int) -> list[T]:
    """``reads`` forwards at an even ``step``, backwards at an odd one (Note [Reads in turns]
    in shampoo_step.py: a window ring then starts each step with what it still holds)."""
    return reads[::-1] if step % 2 and len(reads) > 1 else reads


Sized = tuple[Sequence[Any], list[int], list[int], int, int]  # items, their sizes, the sums


def _sized(groups: Sequence[Sequence[T]], elements: Callable, nbytes: Callable) -> list[Sized]:
    out = []
    for group in filter(None, groups):  # (an empty group has nothing to place)
        ns, bs = list(map(elements, group)), list(map(nbytes, group))
        out.append((group, ns, bs, sum(ns), sum(bs)))
    return out


def _pack(sized: list[Sized], room: int | None, limit: int) -> list[list[tuple[int, list]]]:
    """``group_pieces`` of groups sized by ``_sized``: per piece, its ``(group index, items)``
    in the order of the groups."""
    if room is None:
        shares = [n / max(limit, 1) for _, _, _, n, _ in sized]
    else:
        shares = [max(n / max(limit, 1), b / max(room, 1)) for _, _, _, n, b in sized]
    bins: list[list] = []  # [elements, bytes, [(group index, items)]], in the order opened
    for g in sorted(range(len(sized)), key=shares.__getitem__, reverse=True):
        group, ns, bs, n, b = sized[g]
        if n <= limit and (room is None or b <= room):  # whole: the first piece it fits
            for piece in bins:
                if piece[0] + n <= limit and (room is None or piece[1] + b <= room):
                    break
            else:
                piece = [0, 0, []]
                bins.append(piece)
            piece[0] += n
            piece[1] += b
            piece[2].append((g, list(group)))
            continue
        piece = None  # cut: runs of its own, each opened where the next item would overflow
        for item, n, b in zip(group, ns, bs):
            if piece is None or piece[0] + n > limit or (room is not None and piece[1] + b > room):
                piece = [0, 0, [(g, [])]]
                bins.append(piece)
            piece[0] += n
            piece[1] += b
            piece[2][0][1].append(item)
    return [sorted(piece[2], key=_first) for piece in bins]


def _items(piece: list[tuple[int, list]]) -> list:
    return [x for _, part in piece for x in part]


def _first(part: tuple) -> Any:
    return part[0]


# Note [Pieces by shape group]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A piece's blocks are stacked per shape group, so a group cut across two pieces costs a second
# set of its stacks and products, and each piece costs its own elementwise ops (a foreach set)
# and, behind a device window, a slot of the window (a fill where the pieces outnumber the
# slots). Packing the groups in their order, greedily, cut them: SOAP's window step on
# ``tiny``@4 stacked five groups where native stacks four. Keeping each group whole but in its
# order cost a piece: three pieces for a two-slot window refilled all three slots at every
# step, where two pieces stayed in the window. So ``group_pieces`` places whole groups first
# fit, largest first (bin packing: the pieces' order does not matter to the blocks, which are
# independent; each piece lists its groups in their given order, so a step of one piece is
# unchanged): a group that fits a piece is never cut, and two pieces of whole groups never fit
# together in one. A group larger than a piece (its elements over ``BATCH_ELEMENTS`` or its
# bases over the room) is cut into runs, each opened where its next item would overflow the
# last, and smaller groups fill its last run.


def bases_bytes(item: Any) -> int:
    """Bytes of the bases of a step's block ``item`` (its ``block["bases"]``, None entries
    apart): what a piece's ``bases_many`` call hands out for it (``group_pieces``'s ``nbytes``)."""
    return sum(q.nbytes for q in item.block["bases"] if q is not None)


def bases_of(refresher: Any, keys: list, blocks: list[dict]) -> list[list]:
    """The bases of ``blocks`` from ``refresher`` in one ``bases_many`` call (one ``bases`` call
    each for a refresher without it), valid together until its next call."""
    many = getattr(refresher, "bases_many", None)
    if many is not None:
        return many(keys, blocks)
    return [refresher.bases(k, b) for k, b in zip(keys, blocks)]


def bases_room(refresher: Any) -> int | None:
    """``refresher.bases_room``; for a refresher without it, unlimited where its bases are
    stable and one block at a time otherwise."""
    if hasattr(refresher, "bases_room"):
        return refresher.bases_room
    return None if refresher.bases_stable else 0


#: ``torch.ops.asteria.block_mm``: ``torch.bmm``, computed on the CPU one matrix at a time by
#: ``mm`` on aligned operands, so that a block's product has the same bits alone and at any
#: place of any batch (Note [Aligned operands] in csrc/core/aligned.cpp); ``torch.bmm`` on
#: other devices. One operator for the dispatcher, as ``torch.bmm`` was.
bmm = torch.ops.asteria.block_mm.default

#: ``torch.ops.asteria.aligned_mm``: ``torch.mm`` of a block's operands, each a dense row- or
#: column-major copy at a 64-byte boundary where it is not one already (on the CPU): the per-block
#: twin of ``bmm``.
mm = torch.ops.asteria.aligned_mm.default


#: ``torch.ops.asteria.eigh_each`` and ``qr_each``: ``torch.linalg.eigh`` and the Q of
#: ``torch.geqrf`` + ``householder_product`` of a stack, one matrix at a time on the CPU (each on
#: LAPACK's own fresh copy, as a single call would be), one batched call elsewhere.
eigh_each = torch.ops.asteria.eigh_each.default
qr_each = torch.ops.asteria.qr_each.default
#: ``qr_refresh`` of each factor of a list with its basis, CPU only, in one op (Note [Refreshes
#: one by one on the CPU] in csrc/core/aligned.cpp): bases, permutations, and which succeeded.
qr_refresh_each = torch.ops.asteria.qr_refresh_each.default


def _column_major(a: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return a.new_empty((a.shape[0], cols, rows)).mT


@torch.library.register_fake("asteria::eigh_each")
def _eigh_each_fake(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = a.shape[1]
    return a.new_empty((a.shape[0], n)), _column_major(a, n, n)


@torch.library.register_fake("asteria::qr_each")
def _qr_each_fake(a: torch.Tensor) -> torch.Tensor:
    return _column_major(a, a.shape[1], min(a.shape[1], a.shape[2]))


@torch.library.register_fake("asteria::qr_refresh_each")
def _qr_refresh_each_fake(factors, bases, sort: bool, dtype: torch.dtype):
    qs = [f.new_empty(f.shape, dtype=dtype).mT for f in factors]  # column-major, as LAPACK's
    perms = [f.new_empty((f.shape[0] if sort else 0,), dtype=torch.long) for f in factors]
    device = factors[0].device if factors else torch.device("cpu")
    return qs, perms, torch.empty(len(factors), dtype=torch.bool, device=device)


@torch.library.register_fake("asteria::block_mm")
def _block_mm_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


@torch.library.register_fake("asteria::aligned_mm")
def _aligned_mm_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]))


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it in its own memory layout, where ``t`` (on the CPU) does not start at
    a 64-byte boundary or is not dense: what a contraction that is not a product of two matrices
    (``tensordot`` of a block of order other than 2) reads, so that its BLAS calls see the
    operands, in the orientations, a block alone would (Note [Aligned operands])."""
    if t.device.type != "cpu" or (t.data_ptr() % 64 == 0 and _dense(t)):
        return t
    return t.clone(memory_format=torch.preserve_format)  # a dense layout keeps its strides


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory without gaps or overlaps, in any dim order."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def index_select_each(x: torch.Tensor, dim: int, perm: torch.Tensor) -> torch.Tensor:
    """``x[b].index_select(dim, perm[b])`` for every block ``b`` of a stack ``x`` (``perm``:
    ``(B, d)``), as one ``index_select`` of whole rows: ``dim`` moved next to the batch dim and
    merged with it, each block's indices offset by its rows. An exact gather; on the CPU some ten
    times faster than ``take_along_dim``, which gathers element by element after wrapping every
    index with a ``remainder`` (1.2 s of a 12.7 s SOAP refresh step at bench/optim_step.py's
    model in SOAP's install, 0.74 s in ``qr_refresh_many``'s sort: issue 47)."""
    batch, d = x.shape[0], x.shape[dim + 1]
    offsets = torch.arange(0, batch * d, d, device=x.device).unsqueeze(1)
    moved = x.movedim(dim + 1, 1).contiguous()  # a view of x where dim == 0
    picked = moved.reshape(batch * d, -1).index_select(0, (perm + offsets).flatten())
    return picked.view(moved.shape).movedim(1, dim + 1)


def stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack``: the group's tensors along a new leading dim (one op). Column-major
    matrices (the bases: Note [QR layout] in matrix_functions.py) stay column-major in the
    stack, so that each ``bmm`` reads its operands in the layout ``mm`` read them in (BLAS takes
    another path for a transposed operand, with other roundings)."""
    first = tensors[0]
    if first.dim() == 2 and first.stride(0) == 1 and first.stride(1) != 1:
        return torch.stack([t.mT for t in tensors]).mT
    return torch.stack(list(tensors))


def batched_mode_products(x: torch.Tensor, mats: Mats, transpose: bool) -> torch.Tensor:
    """``kron.mode_products`` of every block of a stack: ``x`` is ``(B, d_0, ..., d_{k-1})`` and
    ``mats[i]`` ``(B, d_i, d_i)`` or ``None`` (identity). ``transpose=True`` applies ``M^T``
    (into the bases), ``False`` applies ``M`` (back)."""
    if x.dim() == 3:  # matrices: Q_L^T X Q_R (or Q_L X Q_R^T) as kron's fast path
        left, right = mats
        if left is not None:
            x = bmm(left.transpose(1, 2) if transpose else left, x)
        if right is not None:
            x = bmm(x, right if transpose else right.transpose(1, 2))
        return x
    # kron's general path per block: one dim at a time, the processed dim moved last (tensordot
    # over dim 0), so that each bmm reads its operands in the layout each mm read them in
    batch = x.shape[0]
    for m in mats:
        moved = x.movedim(1, -1)
        if m is None:
            x = moved
            continue
        rest = moved.shape[1:-1]
        flat = moved.reshape(batch, -1, moved.shape[-1])
        out = bmm(flat, m if transpose else m.transpose(1, 2))
        x = out.reshape(batch, *rest, m.shape[-1])
    return x


def batched_gram(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``kron.gram`` of every block of a stack ``x`` (``(B, ...)``) along block dim ``dim``."""
    if x.dim() == 3:
        return bmm(x, x.transpose(1, 2)) if dim == 0 else bmm(x.transpose(1, 2), x)
    if x.dim() == 2:  # vectors: outer products (one exact multiply per entry, at any address)
        return torch.bmm(x.unsqueeze(2), x.unsqueeze(1))
    # kron's tensordot over the other dims: both operands reshaped from permutations (copies
    # where not contiguous), so that each bmm reads them in the layout each mm read them in
    batch, d = x.shape[0], x.shape[dim + 1]
    left = x.movedim(dim + 1, 1).reshape(batch, d, -1)
    right = x.movedim(dim + 1, -1).reshape(batch, -1, d)
    return bmm(left, right)
