"""KL-Shampoo's step for many blocks at once (Note [Batched steps] in batched.py).

Owns: the launch pattern of kl_shampoo.py's per-block ops over a step's blocks: the update
(``_update_block``) and the statistics of matrix blocks (``_update_statistics``, order 2) once
per shape group (stacked, ``bmm``), their elementwise ops over the group's stack, the first
moments of a step's blocks in one ``torch._foreach_lerp_``; AdamW for the group's vectors as
``torch._foreach_*`` ops (``adamw_update``'s ops, in its order). Per element the ops are
kl_shampoo.py's.

Must not: hold KL-Shampoo's math of its own (kl_shampoo.py says what is computed: order 3 keeps
the authors' statistics order there) or know about runtimes.
"""

from __future__ import annotations

from typing import Any

import torch

from asteria.optim.base import Update, adamw_update
from asteria.optim.batched import (
    batched_gram,
    batched_mode_products,
    block_key,
    bmm,
    shape_groups,
    stack,
    tensor_key,
)

__all__ = ["adamw_group", "first_moments", "statistics_2d", "update_group"]


def adamw_group(updates: list[Update], group: dict[str, Any]) -> None:
    """``base.adamw_update`` of every update (vectors), each op over all of them."""
    if not updates:
        return
    lr, (beta1, beta2) = group["lr"], group["betas"]
    if isinstance(lr, torch.Tensor):  # a tensor lr: its step sizes are tensors, one op each
        for u in updates:
            adamw_update(u.p, u.grad, u.state, lr, (beta1, beta2), group["eps"],
                         group["weight_decay"])  # fmt: skip
        return
    for u in updates:
        u.state["step"] += 1
    steps = [u.state["step"] for u in updates]
    ps, grads = [u.p for u in updates], [u.grad for u in updates]
    m, v = [u.state["exp_avg"] for u in updates], [u.state["exp_avg_sq"] for u in updates]
    torch._foreach_mul_(ps, 1 - lr * group["weight_decay"])
    torch._foreach_lerp_(m, grads, 1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, [(1 - beta2**t) ** 0.5 for t in steps])
    torch._foreach_add_(denom, group["eps"])
    torch._foreach_addcdiv_(ps, m, denom, [-(lr / (1 - beta1**t)) for t in steps])


def _outer(s: list[torch.Tensor]) -> torch.Tensor:
    """``kl_shampoo._outer`` of every block of a stack: ``s[j]`` is ``(B, d_j)``."""
    k = len(s)
    out = s[0].view([s[0].shape[0], -1] + [1] * (k - 1))
    for j in range(1, k):
        shape = [s[j].shape[0]] + [1] * k
        shape[j + 1] = -1
        out = out * s[j].view(shape)
    return out if k > 1 else out.clone()


def first_moments(blocks: list, beta1: float) -> None:
    """The first part of ``kl_shampoo._update_block`` for every block (``_KLBlock``s):
    ``M <- lerp(M, G, 1 - beta1)`` in one op (it reads no bases: one op for a step's pieces)."""
    if blocks:
        exp_avg = [k.block["exp_avg"] for k in blocks]
        torch._foreach_lerp_(exp_avg, [k.grad for k in blocks], 1 - beta1)


def update_group(blocks: list, lr: float, eps: float) -> None:
    """The rest of ``kl_shampoo._update_block`` (``_project_update``) for every block, after
    ``first_moments``: per shape group ``W -= lr * Q (Q^T M Q * s) Q^T`` on stacks."""
    for idx in shape_groups(blocks, _update_key):
        group = [blocks[i] for i in idx]
        if len(group) == 1:
            from asteria.optim.kl_shampoo import _project_update

            k = group[0]
            _project_update(k.block, k.weight, k.bases, lr, eps)
            continue
        mats = [stack([k.bases[d] for k in group]) for d in range(len(group[0].bases))]
        projected = batched_mode_products(stack([k.block["exp_avg"] for k in group]), mats, True)
        s = _outer([stack([k.block["eigen_sqrt_inv"][d] for k in group]) for d in range(len(mats))])
        if eps > 0.0:
            s.div_(1.0 + s * eps)
        update = batched_mode_products(projected * s, mats, False)
        torch._foreach_add_([k.weight for k in group], list(update.unbind(0)), alpha=-lr)


def _update_key(k: Any) -> tuple:
    return (block_key(k.grad), *(tensor_key(q) for q in k.bases))


def statistics_key(k: Any) -> tuple | None:
    """The shape group of a block's statistics: matrix blocks of one shape (and bases layout);
    ``None`` for the others (order 3 keeps the authors' order, per block)."""
    if k.grad.dim() != 2:
        return None
    return _update_key(k)


def statistics_2d(
    blocks: list[dict], bases: list[list], grads: list[torch.Tensor], numel: int, beta: float,
    max_clamp_value: float,
) -> None:  # fmt: skip
    """``KLShampoo._update_statistics`` of matrix blocks of one shape: the factor and
    eigenvalue EMAs, each product one ``bmm`` for the group, each elementwise op one op on the
    group's stack; the new estimates copied into the blocks' own tensors (one op)."""
    from asteria.optim.kl_shampoo import _clamp_max, _new_sqrt_inv

    g = stack(grads)
    q0, q1 = stack([q[0] for q in bases]), stack([q[1] for q in bases])
    s = [stack([b["eigen_sqrt_inv"][i] for b in blocks]) for i in range(2)]
    rotated1 = bmm(q0.transpose(1, 2), g)  # Q_a^T G: S_b's statistics and the projection
    projected = bmm(rotated1, q1)
    xs = [bmm(g, q1), rotated1]
    whiten = [s[1].unsqueeze(1), s[0].unsqueeze(2)]  # dim i whitened along the other dim
    for i in range(2):
        h = xs[i] * whiten[i]
        xs[i] = None
        d_other = numel // g.shape[i + 1]
        fs = [b["factors"][i] for b in blocks]
        torch._foreach_mul_(fs, beta)
        torch._foreach_add_(fs, list(batched_gram(h, i).unbind(0)), alpha=(1 - beta) / d_other)
    diags = [torch.mean((projected * whiten[i]) ** 2, dim=[2 - i]) for i in range(2)]
    for i in range(2):
        new = _new_sqrt_inv(s[i], diags[i], beta, _clamp_max(g.shape[i + 1], max_clamp_value))
        torch._foreach_copy_([b["eigen_sqrt_inv"][i] for b in blocks], list(new.unbind(0)))
