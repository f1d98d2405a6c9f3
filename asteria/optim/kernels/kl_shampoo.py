"""KL-Shampoo's step over shape groups, as the authors' code computes it.

Owns: AdamW for the group's vectors and the blocks' first moments as ``torch._foreach_*`` ops
(``begin``); the update ``W -= lr * Q (Q^T M Q * s) Q^T`` per shape group (``whole``); the factor
and eigenvalue EMAs (``statistics``: the authors' ``update_2d_preconditioner`` per group of
matrices, ``update_3d_preconditioner``'s order per order-3 block), reading the update's bases.
Must not: decide which blocks refresh, or where the bases come from.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from asteria.optim.batched import batched_gram, batched_mode_products, bmm, mm, stack
from asteria.optim.groups import BlockGroup, build
from asteria.optim.kernels import Work
from asteria.optim.kron import gram, mode_products, mode_scale

__all__ = ["adamw_update", "begin", "end", "passes", "statistics", "whole"]

passes = 1


def adamw_update(param, grad, state, lr, betas, eps, weight_decay) -> None:
    """One AdamW step with exactly ``torch.optim.AdamW``'s operations (single-tensor path) on
    ``param`` (the working copy), ``state`` holding ``exp_avg``, ``exp_avg_sq`` and the int
    ``step``."""
    beta1, beta2 = betas
    state["step"] += 1
    step = state["step"]
    param.mul_(1 - lr * weight_decay)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def begin(hp: dict[str, Any], updates: list[Any]) -> Work:
    """AdamW for the vectors (``adamw_update``'s ops, each over all of them); the blocks' step
    counted, in shape groups, and their first moments ``M <- lerp(M, G, 1 - beta1)`` in one op
    (they read no bases)."""
    _adamw_group([u for u in updates if "blocks" not in u.state], hp)
    mats = [u for u in updates if "blocks" in u.state]
    for u in mats:
        u.state["step"] += 1
    groups = build(mats, {"grad": [u.grad for u in mats], "weight": [u.p for u in mats]}, "bases")
    if groups:
        exp_avg = [b["exp_avg"] for g in groups for b in g.blocks]
        grads = [x for g in groups for x in g.views["grad"]]
        torch._foreach_lerp_(exp_avg, grads, 1 - hp["betas"][0])
    return Work(groups, groups, mats)


def _adamw_group(updates: list[Any], hp: dict[str, Any]) -> None:
    if not updates:
        return
    lr, (beta1, beta2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    if isinstance(lr, torch.Tensor):  # a tensor lr: its step sizes are tensors, one op each
        for u in updates:
            adamw_update(u.p, u.grad, u.state, lr, (beta1, beta2), eps, wd)
        return
    for u in updates:
        u.state["step"] += 1
    steps = [u.state["step"] for u in updates]
    ps, grads = [u.p for u in updates], [u.grad for u in updates]
    m, v = [u.state["exp_avg"] for u in updates], [u.state["exp_avg_sq"] for u in updates]
    torch._foreach_mul_(ps, 1 - lr * wd)
    torch._foreach_lerp_(m, grads, 1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, [(1 - beta2**t) ** 0.5 for t in steps])
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(ps, m, denom, [-(lr / (1 - beta1**t)) for t in steps])


def whole(groups: list[BlockGroup], bases: list, hp: dict[str, Any]) -> None:
    """The authors' ``klshampoo_update`` after the first moment, per shape group:
    ``s = s_0 o s_1 o ...`` damped to ``s / (1 + eps * s)``, ``W -= lr * Q (Q^T M Q * s) Q^T``."""
    lr, eps = hp["lr"], hp["eps"]
    for g, qs in zip(groups, bases):
        weights = g.views["weight"]
        if len(g.keys) == 1:
            project_update(g.blocks[0], weights[0], qs[0], lr, eps)
            continue
        mats = [stack([q[d] for q in qs]) for d in range(len(qs[0]))]
        m = stack([b["exp_avg"] for b in g.blocks])
        projected = batched_mode_products(m, mats, True)
        s = _outer([stack([b["eigen_sqrt_inv"][d] for b in g.blocks]) for d in range(len(mats))])
        if eps > 0.0:
            s.div_(1.0 + s * eps)
        update = batched_mode_products(projected * s, mats, False)
        torch._foreach_add_(weights, list(update.unbind(0)), alpha=-lr)


into = whole


def between(work: Work | None, groups: list[BlockGroup], hp: dict[str, Any]) -> None:
    """Nothing: a piece's update is whole."""


def project_update(
    b: dict[str, Any], w: torch.Tensor, bases: list[torch.Tensor], lr: float, eps: float
) -> None:
    """One block's update after the first moment's EMA."""
    projected = mode_products(b["exp_avg"], bases, True)
    s = outer(b["eigen_sqrt_inv"])
    if eps > 0.0:
        s.div_(1.0 + s * eps)
    w.add_(mode_products(projected * s, bases, False), alpha=-lr)


def end(work: Work, hp: dict[str, Any]) -> None:
    """Decoupled weight decay of the preconditioned parameters, after the update."""
    if hp["weight_decay"] > 0.0 and work.updates:
        ps = [u.p for u in work.updates]
        torch._foreach_add_(ps, ps, alpha=-hp["lr"] * hp["weight_decay"])


def outer(vectors: list[torch.Tensor]) -> torch.Tensor:
    """``v_0 o v_1 o ...``, a new tensor of shape ``(len(v_0), len(v_1), ...)``."""
    k = len(vectors)
    out = vectors[0].view([-1] + [1] * (k - 1))
    for j in range(1, k):
        shape = [1] * k
        shape[j] = -1
        out = out * vectors[j].view(shape)
    return out if k > 1 else out.clone()


def _outer(s: list[torch.Tensor]) -> torch.Tensor:
    """``outer`` of every block of a stack: ``s[j]`` is ``(B, d_j)``."""
    k = len(s)
    out = s[0].view([s[0].shape[0], -1] + [1] * (k - 1))
    for j in range(1, k):
        shape = [s[j].shape[0]] + [1] * k
        shape[j + 1] = -1
        out = out * s[j].view(shape)
    return out if k > 1 else out.clone()


def statistics(groups: list[BlockGroup], bases: list, hp: dict[str, Any]) -> None:
    """The factor and eigenvalue EMAs of a piece's blocks, from the bases its update read:
    matrix blocks of one shape together (``_statistics_2d``), the others their own."""
    sb, clamp = hp["shampoo_beta"], hp["max_clamp_value"]  # (``shampoo_beta``, inline)
    beta = hp["betas"][1] if sb is None or sb < 0 else sb
    for g, qs in zip(groups, bases):
        grads = g.views["grad"]
        if len(g.keys) > 1 and grads[0].dim() == 2:
            _statistics_2d(g.blocks, qs, grads, g.numel, beta, clamp)
            continue
        for b, q, grad in zip(g.blocks, qs, grads):
            update_statistics(b, list(q), grad, g.numel, beta, clamp)


def update_statistics(b, bases, g, numel, beta, max_clamp_value) -> None:
    """Factor and eigenvalue EMAs of one step (the authors' ``update_2d_preconditioner`` /
    ``update_3d_preconditioner``): for an order-k block but 3, all from the bases and
    eigenvalues before the step; for order 3 in the authors' order (``_statistics_3d``)."""
    s = b["eigen_sqrt_inv"]
    k = g.dim()
    if k == 3:
        _statistics_3d(b, bases, g, numel, beta, max_clamp_value)
        return
    # rotated[i]: G in every basis but dim i's; projected: G in every basis.
    rotated: list[torch.Tensor | None] = [None] * k
    if k == 2:  # Q_a^T G serves both S_b's statistics and the projection: one product less
        rotated[1] = mm(bases[0].T, g)  # = mode_products(g, [Q_a, None], True)
        projected = mm(rotated[1], bases[1])  # = mode_products(g, bases, True), bit for bit
    else:
        projected = mode_products(g, bases, True)
    # S_i += (1-beta)/d_other * H H^T with H = G whitened along every other dim.
    for i in range(k):
        x = rotated[i]
        if x is None:
            x = mode_products(g, [None if j == i else bases[j] for j in range(k)], True)
        rotated[i] = None
        h = mode_scale(x, [None if j == i else s[j] for j in range(k)])
        del x
        d_other = numel // g.shape[i]
        b["factors"][i].mul_(beta).add_(gram(h, i), alpha=(1 - beta) / d_other)
    # lambda_i EMA: mean over the other dims of (Q^T G Q * s_others)^2.
    diags = []
    for i in range(k):
        others = [None if j == i else s[j] for j in range(k)]
        dims = [j for j in range(k) if j != i]
        diags.append(torch.mean(mode_scale(projected, others) ** 2, dim=dims))
    for i in range(k):
        s[i] = _new_sqrt_inv(s[i], diags[i], beta, clamp_max(g.shape[i], max_clamp_value))


def _statistics_2d(blocks, bases, grads, numel, beta, max_clamp_value) -> None:
    """``update_statistics`` of matrix blocks of one shape: each product one ``bmm`` for the
    group, each elementwise op one op on the group's stack; the new estimates copied into the
    blocks' own tensors (one op)."""
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
        new = _new_sqrt_inv(s[i], diags[i], beta, clamp_max(g.shape[i + 1], max_clamp_value))
        torch._foreach_copy_([b["eigen_sqrt_inv"][i] for b in blocks], list(new.unbind(0)))


@functools.cache
def whitening_gain(shapes: tuple[tuple[int, ...], ...], max_clamp_value: float) -> float:
    """The largest ``prod_{j != i} clamp_j^2`` over the blocks of ``shapes`` and their dims."""
    gain = 1.0
    for shape in shapes:
        clamps = [clamp_max(d, max_clamp_value) ** 2 for d in shape]
        for i in range(len(shape) if len(shape) > 1 else 0):
            gain = max(gain, math.prod(c for j, c in enumerate(clamps) if j != i))
    return gain


def clamp_max(d: int, max_clamp_value: float) -> float:
    """The authors' clamp of ``lambda^{-1/2}`` for a factor of dim ``d``."""
    return max(10, min(d, max_clamp_value))


def _new_sqrt_inv(s_i: torch.Tensor, diag: torch.Tensor, beta: float, clamp: float) -> torch.Tensor:
    """One step of a factor's eigenvalue EMA, on ``s_i = lambda_i^{-1/2}`` (the authors'
    ``update_eigen_value``): ``lambda = lerp(1/s_i^2, diag, 1 - beta)``, back to
    ``lambda^{-1/2}`` with NaN/Inf -> 0 on both ways, clamped to ``<= clamp``."""
    eig = (1.0 / s_i**2).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    eig.lerp_(diag, 1 - beta)
    new_s = (1.0 / torch.sqrt(eig)).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    return new_s.clamp_(max=clamp)


def _statistics_3d(b, bases, g, numel, beta, max_clamp_value) -> None:
    """The statistics of an order-3 block in the authors' order (``update_3d_preconditioner``).

    With ``s_j`` the estimates before the step and ``s_j'`` after: ``S_2`` reads ``s_0, s_1``;
    ``S_1`` reads ``s_0, s_2``; then ``s_2'`` from ``s_0, s_1``; ``s_1'`` from ``s_0, s_2'``;
    ``S_0`` reads ``s_1', s_2``; ``s_0'`` from ``s_1', s_2``. Every one reads the bases from
    before the step (a refresh comes after them).
    """
    s = b["eigen_sqrt_inv"]
    old = list(s)
    factors = b["factors"]

    def factor(i: int, scales: list[torch.Tensor | None]) -> None:
        x = mode_products(g, [None if j == i else bases[j] for j in range(3)], True)
        h = mode_scale(x, scales)
        factors[i].mul_(beta).add_(gram(h, i), alpha=(1 - beta) / (numel // g.shape[i]))

    def estimate(i: int, scales: list[torch.Tensor | None]) -> None:
        dims = [j for j in range(3) if j != i]
        diag = torch.mean(mode_scale(projected, scales) ** 2, dim=dims)
        s[i] = _new_sqrt_inv(s[i], diag, beta, clamp_max(g.shape[i], max_clamp_value))

    projected = mode_products(g, bases, True)
    factor(2, [old[0], old[1], None])
    factor(1, [old[0], None, old[2]])
    estimate(2, [old[0], old[1], None])
    estimate(1, [old[0], None, s[2]])
    factor(0, [None, s[1], old[2]])
    estimate(0, [None, s[1], old[2]])
