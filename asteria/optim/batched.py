"""Products of stacked blocks: how the optimizers' matrix products are issued.

Owns: mode products and Gram matrices of stacked blocks (a leading batch dim: ``bmm`` per
factored dim instead of one ``mm`` per block), ``stack``, and the aligned products and
factorizations of ``torch.ops.asteria`` (``bmm``, ``mm``, ``eigh_each``, ``qr_each``: Note
[Aligned operands] in csrc/core/aligned.cpp) with their fake kernels.

Must not: hold any algorithm's math or group blocks (groups.py does: Note [Batched steps]).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import asteria._C  # noqa: F401  (registers torch.ops.asteria.block_mm and aligned_mm)

__all__ = [
    "SMALL_BMM",
    "aligned",
    "batched_gram",
    "batched_mode_products",
    "bmm",
    "eigh_each",
    "index_select_each",
    "mm",
    "qr_each",
    "qr_refresh_each",
    "stack",
]

Mats = Sequence[torch.Tensor | None]


#: On the CPU, ATen's ``bmm`` computes a product of fewer multiply-adds than this (rows x
#: cols x contraction) with its own loop, not BLAS: other roundings than ``mm``'s.
SMALL_BMM = 400


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
    """``x[b].index_select(dim, perm[b])`` for every block ``b`` of a stack (``perm``: ``(B, d)``)
    as one ``index_select`` of whole rows (``dim`` merged with the batch dim, each block's indices
    offset): an exact gather, some ten times faster on the CPU than ``take_along_dim`` (issue 47).
    """
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
