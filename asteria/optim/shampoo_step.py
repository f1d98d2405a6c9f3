"""Shampoo's step for a group's parameters at once (Note [Batched steps] in batched.py).

Owns: the launch pattern of ``Shampoo._update_param`` over many parameters: the first moment,
the grafting method and the updates as ``torch._foreach_*`` ops over the group's parameters,
the factor statistics and the root applications once per shape group (stacked, ``bmm``), the
grafting norms per block in one ``_foreach_norm``. Per element the ops are those of
``_update_param``, in its order.

Must not: hold Shampoo's math of its own (shampoo.py says what is computed; this file issues
the same ops for many blocks at once) or know about runtimes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from asteria.optim.base import BlockEnd, BlockKey, Update, block_views
from asteria.optim.batched import (
    bases_of,
    bases_room,
    batched_gram,
    batched_mode_products,
    block_key,
    in_turns,
    read_batches,
    shape_groups,
    stack,
    tensor_key,
)
from asteria.optim.kron import gram, mode_products

if TYPE_CHECKING:
    from asteria.optim.shampoo import Shampoo

__all__ = ["update_group"]

#: Meta adds this to the Shampoo direction's norm before the grafting ratio (shampoo.py's).
GRAFTING_NORM_EPSILON = 1e-16


class _Block(NamedTuple):
    """One preconditioned block of a step: its key and state, its views of ``M / (1 - b1^t)``,
    of the grafting direction and of the parameter."""

    key: BlockKey
    block: dict[str, Any]
    m_hat: torch.Tensor
    graft: torch.Tensor
    weight: torch.Tensor


def update_group(opt: Shampoo, group: dict[str, Any], updates: list[Update]) -> None:
    """``opt._update_param`` of every update of ``group`` (no momentum: with it, each
    parameter goes through ``_update_param``)."""
    beta1, lr, wd = group["betas"][0], group["lr"], group["weight_decay"]
    for u in updates:
        u.state["step"] += 1
    steps = [u.state["step"] for u in updates]
    exp_avg = [u.state["exp_avg"] for u in updates]
    torch._foreach_lerp_(exp_avg, [u.grad for u in updates], 1 - beta1)
    denoms = _grafting_denominators(updates, group, steps)
    bc1 = [1 - beta1**t if group["use_bias_correction"] else 1.0 for t in steps]

    _end_blocks(opt, group, updates, steps)

    start = opt._start(group)
    pre = [i for i, u in enumerate(updates) if "blocks" in u.state and steps[i] >= start]
    plain = [i for i in range(len(updates)) if i not in set(pre)]
    if plain:  # the grafting method alone, in torch.optim.AdamW's operation order
        torch._foreach_mul_([updates[i].p for i in plain], 1 - lr * wd)
        for idx in shape_groups(plain, lambda i: bc1[i]):  # one op per step size
            sub = [plain[j] for j in idx]
            ps, ms, value = (
                [updates[i].p for i in sub],
                [exp_avg[i] for i in sub],
                -lr / bc1[sub[0]],
            )
            if denoms is None:
                torch._foreach_add_(ps, ms, alpha=value)
            else:
                torch._foreach_addcdiv_(ps, ms, [denoms[i] for i in sub], value=value)
    if pre:
        _precondition(opt, group, [updates[i] for i in pre], [exp_avg[i] for i in pre],
                      None if denoms is None else [denoms[i] for i in pre],
                      [bc1[i] for i in pre])  # fmt: skip


def _grafting_denominators(
    updates: list[Update], group: dict[str, Any], steps: list[int]
) -> list[torch.Tensor] | None:
    """``Shampoo._grafting_denominator`` of every update, each op over all of them."""
    grafting = group["grafting"]
    if grafting in ("sgd", "none"):
        return None
    v = [u.state["exp_avg_sq"] for u in updates]
    grads = [u.grad for u in updates]
    eps = group["grafting_epsilon"]
    if grafting == "adagrad":
        torch._foreach_addcmul_(v, grads, grads, value=1.0)
    else:
        b2 = group["grafting_beta2"]
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
    denom = torch._foreach_sqrt(v)
    if grafting == "adam":
        torch._foreach_div_(denom, [(1 - group["grafting_beta2"] ** t) ** 0.5 for t in steps])
    torch._foreach_add_(denom, eps)
    return denom


def _end_blocks(opt: Shampoo, group: dict[str, Any], updates: list[Update], steps: list[int]):
    """Every block's statistics and boundary, in block order, as ``_update_param`` hands them
    to the refresher; the statistics of a shape group (and step) in one call
    (``_group_factors``) at its first block."""
    items = []
    for u, t in zip(updates, steps):
        blocks = u.state.get("blocks")
        if blocks is None:
            continue
        due = opt._due_now_or_ahead(u.state, group, blocks, t)
        for bi, (b, g) in enumerate(zip(blocks, block_views(u.grad, u.layout))):
            items.append(((u.pid, bi), b, g, t, due))
    stats: dict[BlockKey, tuple] = {}
    for idx in shape_groups(items, lambda it: (block_key(it[2]), it[3])):
        first_key = items[idx[0]][0]
        blocks = [items[i][1] for i in idx]
        grads = [items[i][2] for i in idx]
        stats[first_key] = (_group_factors, (blocks, grads, group, items[idx[0]][3]))
        for i in idx[1:]:
            stats[items[i][0]] = (_after_group, ())
    ends = (BlockEnd(key, b, t, due, *stats[key]) for key, b, _, t, due in items)
    opt._end_blocks(group, ends)


def _group_factors(blocks: list[dict], grads: list[torch.Tensor], group: dict, t: int) -> None:
    """``Shampoo._update_factors`` of blocks of one shape at one step: the Gram matrices of
    a factored dim in one ``bmm`` (one block: ``kron.gram``), each EMA op over the blocks."""
    from asteria.optim.shampoo import factor_scales

    scale, weight = factor_scales(group, t)
    g = stack(grads) if len(grads) > 1 else None
    for i in range(len(blocks[0]["factors"])):
        fs = [b["factors"][i] for b in blocks]
        grams = [gram(grads[0], i)] if g is None else list(batched_gram(g, i).unbind(0))
        if scale != 1.0:
            torch._foreach_mul_(fs, scale)
        torch._foreach_add_(fs, grams, alpha=weight)


def _after_group() -> None:
    """The statistics of a block whose shape group's first block updated them all."""


def _precondition(
    opt: Shampoo,
    group: dict[str, Any],
    updates: list[Update],
    exp_avg: list[torch.Tensor],
    denoms: list[torch.Tensor] | None,
    bc1: list[float],
) -> None:
    """The preconditioned step of ``updates``: ``W (1 - lr wd) - lr P`` with ``P`` per block
    the roots applied to ``M / (1 - b1^t)``, grafted to the grafting direction's norm."""
    lr, wd = group["lr"], group["weight_decay"]
    m_hat = torch._foreach_div(exp_avg, bc1)
    graft = m_hat if denoms is None else torch._foreach_div(m_hat, denoms)
    work: list[_Block] = []
    for u, m, gr in zip(updates, m_hat, graft):
        views = zip(u.state["blocks"], block_views(m, u.layout), block_views(gr, u.layout),
                    block_views(u.p, u.layout))  # fmt: skip
        work.extend(_Block((u.pid, bi), b, mb, gb, w) for bi, (b, mb, gb, w) in enumerate(views))
    torch._foreach_mul_([u.p for u in updates], 1 - lr * wd)
    grouped = [[work[i] for i in idx] for idx in shape_groups(work, _roots_key)]
    graft = group["grafting"] != "none"
    room = bases_room(opt._refresher)
    for reads in read_batches(grouped, lambda w: w.m_hat.numel(), _roots_bytes, room):
        reads = in_turns(reads, updates[0].state["step"])  # Note [Reads in turns]
        batch: list[_Block] = []
        products: list[torch.Tensor] = []
        rooted: list[int] = []
        for read in reads:
            roots = bases_of(opt._refresher, [w.key for w in read], [w.block for w in read])
            out, idx = _products(read, roots)
            rooted += [len(batch) + i for i in idx]
            batch += read
            products += out
        direction = _grafted(batch, products, rooted, graft)
        torch._foreach_add_([w.weight for w in batch], direction, alpha=-lr)


def _products(piece: list[_Block], roots: list[list]) -> tuple[list[torch.Tensor], list[int]]:
    """Per block: the roots applied to its ``m_hat`` (stacked per shape group), or its grafting
    direction where it has no roots yet; and the indices of the blocks with roots."""
    out: list[torch.Tensor] = [w.graft for w in piece]
    rooted = [i for i, rs in enumerate(roots) if not all(r is None for r in rs)]
    key = lambda i: (block_key(piece[i].m_hat), *map(tensor_key, roots[i]))  # noqa: E731
    for idx in shape_groups(rooted, lambda i: key(i)):
        members = [rooted[j] for j in idx]
        rs = roots[members[0]]
        if len(members) == 1:
            out[members[0]] = mode_products(piece[members[0]].m_hat, rs, transpose=False)
            continue
        mats = [None if r is None else stack([roots[i][d] for i in members])
                for d, r in enumerate(rs)]  # fmt: skip
        y = batched_mode_products(stack([piece[i].m_hat for i in members]), mats, False)
        for j, i in enumerate(members):
            out[i] = y[j]
    return out, rooted


def _grafted(
    piece: list[_Block], out: list[torch.Tensor], rooted: list[int], graft: bool
) -> list[torch.Tensor]:
    """``out``, its blocks of ``rooted`` grafted in place to the norm of their grafting direction
    (each op over all of them at once)."""
    if graft and rooted:
        pre = [out[i] for i in rooted]
        norms = torch._foreach_add(torch._foreach_norm(pre), GRAFTING_NORM_EPSILON)
        ratios = torch._foreach_div(torch._foreach_norm([piece[i].graft for i in rooted]), norms)
        for i, grafted in zip(rooted, torch._foreach_mul(pre, ratios)):
            out[i] = grafted
    return out


def _roots_key(w: _Block) -> tuple:
    return (block_key(w.m_hat), *(tensor_key(f) for f in w.block["factors"]))


def _roots_bytes(w: _Block) -> int:
    return sum(f.nbytes for f in w.block["factors"])


# Note [Reads in turns]
# ~~~~~~~~~~~~~~~~~~~~~
# Behind a device window that cannot hold every shape group of a step, the roots are read a
# piece at a time, and the step applies each piece's roots while they are valid; the grafting
# and the weights' update need no roots, so they run once over the whole batch (``_grafted``),
# as native mode's. A window of ``k`` slots, least recently used first, that the pieces read
# in the same order at every step would refill every slot at every step (the first piece was
# evicted last). So the pieces are read in turns, forwards on even steps and backwards on odd
# ones: each step starts with the pieces the last one ended with, which the ring still holds,
# and fills ``n - k`` slots of its ``n`` pieces. The blocks are independent, so the order does
# not change their bits (tests/unit/test_two_passes.py). KL-Shampoo's step, whose pieces each
# complete their products and statistics (Note [KL steps in pieces] in kl_shampoo.py), reads
# them in turns too.
