"""SOAP's step over pieces of blocks: the products with the bases and Adam in the eigenbasis.

Owns: the arithmetic of SOAP's steps 3-4 (``m`` and ``v`` in the eigenbasis, the update rotated
back and applied) for the blocks of a step, stacked per shape group, each elementwise op over
every block at once (Note [Fused elementwise steps]); with the bases read in several pieces
behind a device window, in two passes over the pieces (Note [Two passes over the pieces]).

Must not: decide which blocks step or refresh, or how the blocks are cut into pieces (soap.py
and batched.py do), or know about runtimes, pools or memory tiers (the bases come from
``batched.bases_of``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from asteria._C import soap_update_blocks
from asteria.optim.base import BlockKey
from asteria.optim.batched import (
    bases_of,
    batched_mode_products,
    block_key,
    shape_groups,
    stack,
    tensor_key,
)
from asteria.optim.kron import mode_products


class _BlockStep(NamedTuple):
    """One block's part of a step: its state dict, gradient and weight views, step size, step."""

    key: BlockKey
    block: dict[str, Any]
    grad: torch.Tensor
    weight: torch.Tensor
    step_size: float
    step: int


Chunk = list[tuple[_BlockStep, list]]  # blocks with their bases


def _native_block(c: _BlockStep, bases: list) -> bool:
    """Whether ``asteria._C.soap_update_blocks`` takes the block: 2-D, or without bases."""
    return c.grad.dim() == 2 or all(q is None for q in bases)


def _update_native(blocks: Chunk, group: dict[str, Any]) -> None:
    """Steps 3-4 for 2-D and basis-free blocks, each block's ops issued from C++ (Note [SOAP
    step in C++] in csrc/core/soap_step.cpp: the ops of ``_rotate`` for a group of one)."""
    beta1, beta2 = group["betas"]
    soap_update_blocks(
        [c.grad for c, _ in blocks],
        [q[0] if len(q) == 2 else None for _, q in blocks],
        [q[1] if len(q) == 2 else None for _, q in blocks],
        [c.block["exp_avg"] for c, _ in blocks],
        [c.block["exp_avg_sq"] for c, _ in blocks],
        [c.weight for c, _ in blocks],
        [c.step_size for c, _ in blocks],
        beta1,
        beta2,
        group["eps"],
        group["normalize_grads"],
    )


def _chunk_flops(item: tuple[_BlockStep, list]) -> int:
    """About the flops of a block's update: two products per basis (into it and back), and
    some ten elementwise ops."""
    g, bases = item[0].grad, item[1]
    return 10 * g.numel() + sum(4 * g.numel() * q.shape[0] for q in bases if q is not None)


def _update_batched(blocks: Chunk, group: dict[str, Any]) -> None:
    """Steps 3-4 for any blocks: the products with the bases once per shape group
    (``_rotate``), each elementwise op over all blocks at once (Notes [Batched steps] in
    batched.py, [Fused elementwise steps])."""
    if len(blocks) == 1 and _native_block(*blocks[0]):
        _update_native(blocks, group)  # a piece of one block (a refresher's bases_room)
        return
    steps = [c for c, _ in blocks]
    g_rot = _rotate(blocks, [c.grad for c in steps], transpose=True)
    ratio = _moments(steps, g_rot, group)
    del g_rot
    updates = _rotate(blocks, ratio, transpose=False, normalize=group["normalize_grads"])
    del ratio
    _apply(steps, updates)


def update_in_passes(refresher: Any, reads: list[list[_BlockStep]], group: dict[str, Any]) -> None:
    """Steps 3-4 for the blocks of ``reads``, pieces whose bases ``refresher`` hands out one
    piece at a time (valid until its next read): the products into the bases piece by piece,
    the elementwise ops once over every block, the products back piece by piece in the reverse
    order (the last piece's bases read once for both), and the weights' update once (Note [Two
    passes over the pieces]). Bitwise ``_update_batched`` of each piece."""
    steps = [c for piece in reads for c in piece]
    g_rot: list[torch.Tensor] = []
    for piece in reads:
        chunk = _with_bases(refresher, piece)
        g_rot.extend(_rotate(chunk, [c.grad for c in piece], True))
    ratio = _moments(steps, g_rot, group)
    del g_rot
    updates: list[torch.Tensor] = [None] * len(steps)  # type: ignore[list-item]
    end = len(steps)
    for piece in reversed(reads):
        at = end - len(piece)
        if piece is not reads[-1]:  # (the last piece's bases are still valid: no read since)
            chunk = _with_bases(refresher, piece)
        back = _rotate(chunk, ratio[at:end], transpose=False, normalize=group["normalize_grads"])
        updates[at:end] = back
        end = at
    del ratio
    _apply(steps, updates)


def _with_bases(refresher: Any, piece: list[_BlockStep]) -> Chunk:
    """The blocks of ``piece`` with their bases, read in one ``bases_many``."""
    return list(zip(piece, bases_of(refresher, [c.key for c in piece], [c.block for c in piece])))


def _moments(steps: list[_BlockStep], g_rot: list[torch.Tensor], group: dict[str, Any]) -> list:
    """Adam's moments in the eigenbasis from the rotated gradients ``g_rot``, each op over every
    block at once; returns ``m / (sqrt(v) + eps)`` per block."""
    beta1, beta2 = group["betas"]
    exp_avg = [c.block["exp_avg"] for c in steps]
    exp_avg_sq = [c.block["exp_avg_sq"] for c in steps]
    torch._foreach_mul_(exp_avg, beta1)
    torch._foreach_add_(exp_avg, g_rot, alpha=1 - beta1)
    torch._foreach_mul_(exp_avg_sq, beta2)
    torch._foreach_add_(exp_avg_sq, torch._foreach_pow(g_rot, 2), alpha=1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sq)
    torch._foreach_add_(denom, group["eps"])
    return list(torch._foreach_div(exp_avg, denom))


def _apply(steps: list[_BlockStep], updates: list[torch.Tensor]) -> None:
    """``W <- W - step_size * update`` per block, one op per step size."""
    for idx in shape_groups(steps, lambda c: c.step_size):
        weights = [steps[i].weight for i in idx]
        torch._foreach_add_(weights, [updates[i] for i in idx], alpha=-steps[idx[0]].step_size)


def _rotate(
    blocks: Chunk, xs: list[torch.Tensor], transpose: bool, normalize: bool = False
) -> list[torch.Tensor]:
    """``mode_products(x, bases, transpose)`` of every block, stacked per shape group (a group
    of one: the per-block products); with ``normalize``, each result divided by ``1e-30 +``
    its RMS (the authors' ``normalize_grads``)."""
    out = list(xs)
    for idx in shape_groups(
        blocks, lambda item: (block_key(item[0].grad), *map(tensor_key, item[1]))
    ):
        qs = blocks[idx[0]][1]
        if len(idx) == 1:
            i = idx[0]
            y = mode_products(xs[i], qs, transpose)
            out[i] = y / (1e-30 + torch.mean(y**2) ** 0.5) if normalize else y
            continue
        if all(q is None for q in qs) and not normalize:
            continue
        mats = [
            None if q is None else stack([blocks[i][1][d] for i in idx]) for d, q in enumerate(qs)
        ]
        y = batched_mode_products(stack([xs[i] for i in idx]), mats, transpose)
        if normalize:
            dims = tuple(range(1, y.dim()))
            y = y / (1e-30 + torch.mean(y**2, dim=dims, keepdim=True) ** 0.5)
        for j, i in enumerate(idx):
            out[i] = y[j]
    return out


def _update_normalized(refresher, blocks: list[_BlockStep], group: dict[str, Any]) -> None:
    """Steps 3-4 for parameters split into blocks, with ``normalize_grads``: each block's
    update as ``_update_fused`` computes it, then every block of a parameter divided by
    ``1e-30 + RMS`` of the parameter's whole update (the authors normalize per parameter)."""
    beta1, beta2 = group["betas"]
    by_param: dict[int, list[tuple[_BlockStep, torch.Tensor]]] = {}
    for c in blocks:
        q = refresher.bases(c.key, c.block)
        g_rot = mode_products(c.grad, q, transpose=True)
        c.block["exp_avg"].mul_(beta1).add_(g_rot, alpha=1 - beta1)
        c.block["exp_avg_sq"].mul_(beta2).add_(g_rot.pow(2), alpha=1 - beta2)
        ratio = c.block["exp_avg"] / c.block["exp_avg_sq"].sqrt().add_(group["eps"])
        by_param.setdefault(c.key[0], []).append((c, mode_products(ratio, q, transpose=False)))
    for parts in by_param.values():
        numel = sum(u.numel() for _, u in parts)
        rms = (torch.stack([u.square().sum() for _, u in parts]).sum() / numel) ** 0.5
        for c, u in parts:
            c.weight.add_(u / (1e-30 + rms), alpha=-c.step_size)


# Note [Fused elementwise steps]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# SOAP's step is some twenty small ops per block, and on small blocks their dispatch costs more
# than their arithmetic. So the step runs over pieces of blocks, not one block at a time
# (``_update_batched``): the products with the bases once per shape group (stacked, ``bmm``:
# Note [Batched steps] in batched.py), each elementwise op over every block of the piece in one
# ``torch._foreach_*`` call (on CUDA a few multi-tensor kernel launches per op instead of one
# per block), and the factor statistics one ``bmm`` per shape group and factored dim
# (``_group_statistics``). The arithmetic per block is unchanged: on the CPU parameters and
# state are bitwise those of the per-block ops of the authors' formulation
# (tests/unit/test_fused_steps.py). A piece is cut at ``batched.BATCH_ELEMENTS`` gradient
# elements (the stacks and foreach lists hold a few temporaries of its size) and at the
# refresher's ``bases_room``; a piece of one 2-D or basis-free block (a device window's one
# block at a time) is one C++ call (``_update_native``: Note [SOAP step in C++] in
# csrc/core/soap_step.cpp). On the ``tiny`` LM's 47 blocks an ordinary step went from 715 ATen
# ops to 74 (bench/optim_step.py --count; docs/benchmarks.md).


# Note [Two passes over the pieces]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Behind a device window that cannot hold every shape group of a step (OLMo-150m's widths:
# three groups, a ring of two slots of the largest), the refresher hands out the bases a piece
# at a time, each valid until its next read. A piece that completed its whole update while its
# bases were valid paid its own set of the elementwise ops (nine ``_foreach`` ops and the
# weights' update) and its own fill of a slot: 96 ATen ops a quiet step against native's 74.
# Only the products need the bases, and the elementwise ops need none: so the pieces are read
# twice, in two passes, the products into the bases in order, then those back in the reverse
# order (``update_in_passes``), with every elementwise op once between them over all blocks of
# the batch, as native mode does. The reverse order is what makes the second read cheap: the
# last pieces of the first pass are still in the ring (the very last is not read again: no read
# came since its own, so its bases are still valid; a step of P0 P1 P2 reads P0 P1 P2 P1 P0),
# so a step of ``n`` pieces in a ring of ``k`` slots fills ``2 (n - k)`` slots, not ``2 n``
# (OLMo-150m: two fills a step; the window
# prefetches each while the piece before it runs: Note [Prefetch by position] in
# asteria/runtime/window_bases.py). The temporaries are those of native's one batch (the
# rotated gradients, then the ratios: ``read_batches`` keeps a batch to ``BATCH_ELEMENTS``),
# and each block's arithmetic is ``_update_batched``'s: bitwise, on the CPU, a step of one
# piece (tests/unit/test_two_passes.py).
