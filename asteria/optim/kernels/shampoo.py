"""Shampoo's step over shape groups, as Meta's Distributed Shampoo computes it.

Owns: the arithmetic of a Shampoo step: the first moment and grafting as ``torch._foreach_*``
ops over the parameter group (``begin``), the factor statistics per shape group
(``statistics``), the roots applied to ``M / (1 - b1^t)`` per group (``into``), grafted and
applied (``between``), and with momentum or a tensor ``lr`` each parameter's direction through
its momentum (``end``, Meta's order). Must not: decide which blocks refresh, or where the roots
come from.
"""

from __future__ import annotations

from typing import Any

import torch

from asteria.optim.batched import batched_gram, batched_mode_products, stack
from asteria.optim.groups import BlockGroup, build
from asteria.optim.kernels import Work
from asteria.optim.kron import gram, mode_products
from asteria.optim.tensors import block_views

__all__ = ["begin", "between", "end", "factor_scales", "into", "passes", "start_step", "statistics"]

#: Meta adds this to the Shampoo direction's norm before the grafting ratio.
GRAFTING_NORM_EPSILON = 1e-16

passes = 1
whole = None  # the weights of a parameter take their decay once, before any block's update


def start_step(hp: dict[str, Any]) -> int:
    """The first preconditioned step: ``start_preconditioning_step``, or the frequency."""
    start = hp["start_preconditioning_step"]
    return hp["precondition_frequency"] if start is None or start == -1 else start


def factor_scales(hp: dict[str, Any], t: int) -> tuple[float, float]:
    """Step ``t``'s ``(scale, weight)`` of the factor update ``L <- scale L + weight G G^T``. With
    ``b2 < 1`` and ``use_bias_correction`` the factors are kept divided by ``c_t = 1 - b2^t``
    (what Meta divides them by before each root): ``L_t / c_t = (b2 c_{t-1}) / c_t * L_{t-1} /
    c_{t-1} + (1 - b2) / c_t * G G^T``."""
    beta2 = hp["betas"][1]
    if beta2 == 1.0:
        return 1.0, 1.0
    if hp["use_bias_correction"]:
        c_prev, c = 1 - beta2 ** (t - 1), 1 - beta2**t
        return beta2 * c_prev / c, (1 - beta2) / c
    return beta2, 1 - beta2


class _Extra:
    """What ``begin`` keeps for ``between`` and ``end``."""

    def __init__(self, per_param, steps, bc1, denoms, m_hat, graft, start) -> None:
        self.per_param, self.steps, self.bc1, self.denoms = per_param, steps, bc1, denoms
        self.m_hat, self.graft, self.start = m_hat, graft, start
        self.directions: dict[Any, torch.Tensor] = {}


def begin(hp: dict[str, Any], updates: list[Any]) -> Work:
    """The first moments and the grafting denominators of every parameter; a parameter not
    preconditioned yet takes the grafting method alone (in ``torch.optim.AdamW``'s operation
    order), a preconditioned one its decay; the step's blocks in shape groups."""
    beta1, lr, wd = hp["betas"][0], hp["lr"], hp["weight_decay"]
    for u in updates:
        u.state["step"] += 1
    steps = [u.state["step"] for u in updates]
    grads, ps = [u.grad for u in updates], [u.p for u in updates]
    exp_avg = [u.state["exp_avg"] for u in updates]
    torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
    denoms = _grafting_denominators(updates, hp, steps)
    bc1 = [1 - beta1**t if hp["use_bias_correction"] else 1.0 for t in steps]
    start = start_step(hp)
    per_param = hp["momentum"] > 0 or isinstance(lr, torch.Tensor)
    pre = [i for i, u in enumerate(updates) if "blocks" in u.state and steps[i] >= start]
    preconditioned = set(pre)
    plain = [i for i in range(len(updates)) if i not in preconditioned]
    if plain and not per_param:
        torch._foreach_mul_([ps[i] for i in plain], 1 - lr * wd)
        for bc in dict.fromkeys([bc1[i] for i in plain]):  # one op per step size
            sub = [i for i in plain if bc1[i] == bc]
            ms, value = [exp_avg[i] for i in sub], -lr / bc
            targets = [ps[i] for i in sub]
            if denoms is None:
                torch._foreach_add_(targets, ms, alpha=value)
            else:
                torch._foreach_addcdiv_(targets, ms, [denoms[i] for i in sub], value=value)
    need = pre if not per_param or hp["momentum"] == 0 else list(range(len(updates)))
    m_hat: list[Any] = [None] * len(updates)
    graft: list[Any] = [None] * len(updates)
    if need:
        ms = torch._foreach_div([exp_avg[i] for i in need], [bc1[i] for i in need])
        gs = ms if denoms is None else torch._foreach_div(ms, [denoms[i] for i in need])
        for i, m, g in zip(need, ms, gs):
            m_hat[i], graft[i] = m, g
    if pre and not per_param:
        torch._foreach_mul_([ps[i] for i in pre], 1 - lr * wd)
    views = {"grad": grads, "m_hat": m_hat, "graft": graft, "weight": ps}
    groups = build(updates, views, "roots")
    extra = _Extra(per_param, steps, bc1, denoms, m_hat, graft, start)
    return Work([g for g in groups if g.step >= start], groups, updates, extra)


def _grafting_denominators(
    updates: list[Any], hp: dict[str, Any], steps: list[int]
) -> list[torch.Tensor] | None:
    """The grafting method's denominator of every update, each op over all of them."""
    grafting = hp["grafting"]
    if grafting in ("sgd", "none"):
        return None
    v = [u.state["exp_avg_sq"] for u in updates]
    grads = [u.grad for u in updates]
    if grafting == "adagrad":
        torch._foreach_addcmul_(v, grads, grads, value=1.0)
    else:
        b2 = hp["grafting_beta2"]
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
    denom = torch._foreach_sqrt(v)
    if grafting == "adam":
        torch._foreach_div_(denom, [(1 - hp["grafting_beta2"] ** t) ** 0.5 for t in steps])
    torch._foreach_add_(denom, hp["grafting_epsilon"])
    return denom


def statistics(groups: list[BlockGroup], hp: dict[str, Any]) -> None:
    """The factor updates of a step: a shape group's Gram matrices of a dim in one ``bmm`` (a
    group of one: ``kron.gram``), each EMA op over the group."""
    for g in groups:
        scale, weight = factor_scales(hp, g.step)
        grads = g.views["grad"]
        stacked = stack(grads) if len(grads) > 1 else None
        for i in range(len(g.blocks[0]["factors"])):
            fs = [b["factors"][i] for b in g.blocks]
            if stacked is None:
                grams = [gram(grads[0], i)]
            else:
                grams = list(batched_gram(stacked, i).unbind(0))
            if scale != 1.0:
                torch._foreach_mul_(fs, scale)
            torch._foreach_add_(fs, grams, alpha=weight)


def into(groups: list[BlockGroup], bases: list, hp: dict[str, Any]) -> None:
    """Per block: its roots applied to its ``M / (1 - b1^t)`` (blocks whose roots agree in
    layout stacked), or its grafting direction where it has no roots yet (``g.tmp``: the
    directions and the indices of the blocks with roots)."""
    for g, roots in zip(groups, bases):
        m_hat = g.views["m_hat"]
        out = list(g.views["graft"])
        by: dict[tuple, list[int]] = {}
        for i, rs in enumerate(roots):
            if rs[0] is None:
                continue
            layout = []
            for r in rs:
                layout.append((r.shape, r.dtype, r.stride()))
            by.setdefault(tuple(layout), []).append(i)
        for members in by.values():
            rs = roots[members[0]]
            if len(members) == 1:
                out[members[0]] = mode_products(m_hat[members[0]], rs, transpose=False)
                continue
            mats = [stack([roots[i][d] for i in members]) for d in range(len(rs))]
            y = batched_mode_products(stack([m_hat[i] for i in members]), mats, False)
            for i, yi in zip(members, y.unbind(0)):
                out[i] = yi
        g.tmp = [out, [i for ms in by.values() for i in ms]]


def between(work: Work, groups: list[BlockGroup], hp: dict[str, Any]) -> None:
    """The directions of the blocks with roots grafted to their grafting direction's norm
    (each op over all of them at once), and applied: ``W -= lr P`` per block (the decay was
    applied in ``begin``), or kept for ``end`` under momentum or a tensor ``lr``."""
    outs = [o for g in groups for o in g.tmp[0]]
    rooted, at = [], 0
    for g in groups:
        rooted.extend([at + i for i in g.tmp[1]])
        at += len(g.keys)
    if hp["grafting"] != "none" and rooted:
        grafts = [gr for g in groups for gr in g.views["graft"]]
        pre = [outs[i] for i in rooted]
        norms = torch._foreach_add(torch._foreach_norm(pre), GRAFTING_NORM_EPSILON)
        ratios = torch._foreach_div(torch._foreach_norm([grafts[i] for i in rooted]), norms)
        for i, grafted in zip(rooted, torch._foreach_mul(pre, ratios)):
            outs[i] = grafted
    for g in groups:
        g.tmp = None
    if work.extra.per_param:
        work.extra.directions.update(zip([k for g in groups for k in g.keys], outs))
        return
    weights = [w for g in groups for w in g.views["weight"]]
    torch._foreach_add_(weights, outs, alpha=-hp["lr"])


def end(work: Work, hp: dict[str, Any]) -> None:
    """Under momentum or a tensor ``lr``, each parameter's step as Meta takes it: the direction
    (its blocks' from ``between``, or the grafting direction), the decay added to it before the
    momentum (``P + wd W``), then ``W -= lr P``."""
    x = work.extra
    if not x.per_param:
        return
    lr, wd, momentum = hp["lr"], hp["weight_decay"], hp["momentum"]
    for i, u in enumerate(work.updates):
        p, t = u.p, x.steps[i]
        preconditioning = "blocks" in u.state and t >= x.start
        denom = None if x.denoms is None else x.denoms[i]
        if not preconditioning and momentum == 0:
            p.mul_(1 - lr * wd)
            if denom is None:
                p.add_(u.state["exp_avg"], alpha=-lr / x.bc1[i])
            else:
                p.addcdiv_(u.state["exp_avg"], denom, value=-lr / x.bc1[i])
            continue
        if preconditioning:
            direction = torch.empty_like(x.m_hat[i])
            for bi, out in enumerate(block_views(direction, u.layout)):
                out.copy_(x.directions.pop((u.pid, bi)))
        else:
            direction = x.graft[i]
        if momentum > 0:
            if wd > 0:
                direction = direction + wd * p  # Meta: the decay goes through the momentum
            buf = u.state["momentum_buffer"]
            buf.mul_(momentum).add_(direction)
            p.add_(buf, alpha=-lr)
            continue
        p.mul_(1 - lr * wd)
        p.add_(direction, alpha=-lr)
