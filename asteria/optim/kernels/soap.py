"""SOAP's step over shape groups: Adam in the eigenbasis, the factor statistics.

Owns: the arithmetic of SOAP's steps 3-6 for a parameter group's blocks: ``g`` into the bases
(``into``), Adam's moments in the eigenbasis, each elementwise op over every block at once
(``between``), the ratio back (``back``) and applied (``after``); all in one call for a batch of
one piece (``whole``); the factor EMAs (``statistics``). Note [Fused elementwise steps]. Must
not: decide which blocks step or refresh, or where the bases come from.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from asteria._C import soap_accumulate
from asteria.optim.batched import batched_gram, batched_mode_products, stack
from asteria.optim.groups import BlockGroup, build
from asteria.optim.kernels import Work
from asteria.optim.kron import gram, mode_products

__all__ = ["after", "back", "begin", "between", "end", "into", "passes", "statistics", "whole"]

#: The update reads the bases twice: into the eigenbasis, and back (Note [Two passes]).
passes = 2


class _Normalized:
    """The blocks' updates of the parameters of several blocks under ``normalize_grads``,
    applied at ``end`` (the authors normalize a parameter's whole update, which batches may
    hold parts of): the tag of their groups."""

    def __init__(self) -> None:
        self.parts: list[tuple] = []


def begin(hp: dict[str, Any], updates: list[Any]) -> Work:
    """Every parameter's step counted; its blocks in shape groups, each with its step size
    (``scale``); a parameter of several blocks under ``normalize_grads`` tagged (the authors
    normalize its whole update: ``end``)."""
    beta1, beta2 = hp["betas"]
    normalized, tags = _Normalized(), []
    for u in updates:
        u.state["step"] += 1
        tags.append(normalized if hp["normalize_grads"] and len(u.state["blocks"]) > 1 else None)
    grads, weights = [u.grad for u in updates], [u.p for u in updates]
    groups = build(updates, {"grad": grads, "weight": weights}, "bases", tags)
    for g in groups:
        t, step_size = g.step, hp["lr"]
        if hp["correct_bias"]:
            step_size = step_size * (1 - beta2**t) ** 0.5 / (1 - beta1**t)
        g.scale = step_size
    return Work(groups, [g for g in groups if g.factored], updates, normalized)


def whole(groups: list[BlockGroup], bases: list, hp: dict[str, Any]) -> None:
    """Steps 3-4 for a batch whose bases are read at once: ``into``, ``between``, ``back``,
    ``after``."""
    into(groups, bases, hp)
    between(None, groups, hp)
    back(groups, bases, hp)
    after(None, groups, hp)


def into(groups: list[BlockGroup], bases: list, hp: dict[str, Any]) -> None:
    """The gradients in the eigenbasis (``g.tmp``)."""
    for g, qs in zip(groups, bases):
        g.tmp = _rotate(g, qs, g.views["grad"], True)


def between(work: Work | None, groups: list[BlockGroup], hp: dict[str, Any]) -> None:
    """Adam's moments in the eigenbasis from the rotated gradients, each op over every block at
    once; ``g.tmp`` becomes ``m / (sqrt(v) + eps)``."""
    beta1, beta2 = hp["betas"]
    exp_avg = [b["exp_avg"] for g in groups for b in g.blocks]
    exp_avg_sq = [b["exp_avg_sq"] for g in groups for b in g.blocks]
    g_rot = [t for g in groups for t in g.tmp]
    torch._foreach_mul_(exp_avg, beta1)
    torch._foreach_add_(exp_avg, g_rot, alpha=1 - beta1)
    torch._foreach_mul_(exp_avg_sq, beta2)
    torch._foreach_add_(exp_avg_sq, torch._foreach_pow(g_rot, 2), alpha=1 - beta2)
    del g_rot
    denom = torch._foreach_sqrt(exp_avg_sq)
    torch._foreach_add_(denom, hp["eps"])
    ratio = torch._foreach_div(exp_avg, denom)
    at = 0
    for g in groups:
        g.tmp = ratio[at : at + len(g.keys)]
        at += len(g.keys)


def back(groups: list[BlockGroup], bases: list, hp: dict[str, Any]) -> None:
    """The ratios back from the eigenbasis (``g.tmp``), each divided by ``1e-30 +`` its RMS under
    ``normalize_grads`` (a tagged group's by its parameter's, in ``after``)."""
    normalize = hp["normalize_grads"]
    for g, qs in zip(groups, bases):
        g.tmp = _rotate(g, qs, g.tmp, False, normalize and g.tag is None)


def after(work: Work | None, groups: list[BlockGroup], hp: dict[str, Any]) -> None:
    """``W <- W - step_size * update`` per block, one op per step size; a tagged parameter's
    blocks kept for ``end``."""
    by_size: dict[float, tuple[list, list]] = {}
    for g in groups:
        if g.tag is not None:
            g.tag.parts.extend(zip(g.keys, g.views["weight"], g.tmp, [g.scale] * len(g.keys)))
            g.tmp = None
            continue
        weights, updates = by_size.setdefault(g.scale, ([], []))
        weights.extend(g.views["weight"])
        updates.extend(g.tmp)
        g.tmp = None
    for step_size, (weights, updates) in by_size.items():
        torch._foreach_add_(weights, updates, alpha=-step_size)


_FIRST = operator.itemgetter(0)


def _apply_normalized(parts: list[tuple]) -> None:
    """Per parameter (``parts``: its blocks' ``(key, weight, update, step_size)`` in block
    order), every block divided by ``1e-30 + RMS`` of the parameter's whole update."""
    by_param: dict[int, list[tuple]] = {}
    for part in parts:
        by_param.setdefault(part[0][0], []).append(part)
    for blocks in by_param.values():
        numel = sum([u.numel() for _, _, u, _ in blocks])
        rms = (torch.stack([u.square().sum() for _, _, u, _ in blocks]).sum() / numel) ** 0.5
        for _, w, u, step_size in blocks:
            w.add_(u / (1e-30 + rms), alpha=-step_size)


def end(work: Work, hp: dict[str, Any]) -> None:
    """The tagged parameters' updates, each divided by the RMS of the whole (the authors'
    ``normalize_grads``); then decoupled weight decay."""
    if work.extra.parts:
        _apply_normalized(sorted(work.extra.parts, key=_FIRST))
    if hp["weight_decay"] > 0.0:
        ps = [u.p for u in work.updates]
        torch._foreach_add_(ps, ps, alpha=-hp["lr"] * hp["weight_decay"])


def _rotate(
    g: BlockGroup, bases: list, xs: list[torch.Tensor], transpose: bool, normalize: bool = False
) -> list[torch.Tensor]:
    """``mode_products(x, bases, transpose)`` of every block of ``g`` (stacked; a group of one:
    the per-block products); with ``normalize``, each divided by ``1e-30 +`` its RMS."""
    qs = bases[0]
    if len(g.keys) == 1:
        y = mode_products(xs[0], qs, transpose)
        return [y / (1e-30 + torch.mean(y**2) ** 0.5) if normalize else y]
    if qs.count(None) == len(qs) and not normalize:
        return list(xs)
    mats = [None if q is None else stack([b[d] for b in bases]) for d, q in enumerate(qs)]
    y = batched_mode_products(stack(xs), mats, transpose)
    if normalize:
        dims = tuple(range(1, y.dim()))
        y = y / (1e-30 + torch.mean(y**2, dim=dims, keepdim=True) ** 0.5)
    return list(y.unbind(0))


def statistics(groups: list[BlockGroup], hp: dict[str, Any]) -> None:
    """The factor EMAs of the factored ``groups``: ``F_i <- lerp(F_i, G_(i) G_(i)^T, 1 - beta)``,
    a group's Gram matrices of a dim in one ``bmm`` and its EMAs in one foreach op; a block
    alone in one C++ call (matrices) or its own ops."""
    sb = hp["shampoo_beta"]  # (``shampoo_beta``, inline)
    beta = hp["betas"][1] if sb is None or sb < 0 else sb
    for g in groups:
        grads = g.views["grad"]
        if len(g.keys) == 1:
            fs = g.blocks[0]["factors"]
            if grads[0].dim() == 2:
                soap_accumulate(fs, grads[0], beta)
            else:
                accumulate_factors(fs, grads[0], beta)
            continue
        stacked = stack(grads)
        for i, f in enumerate(g.blocks[0]["factors"]):
            if f is not None:
                grams = batched_gram(stacked, i)
                factors = [b["factors"][i] for b in g.blocks]
                torch._foreach_lerp_(factors, list(grams.unbind(0)), 1 - beta)


def accumulate_factors(factors: list[torch.Tensor | None], g: torch.Tensor, beta: float) -> None:
    """One step of a block's factor EMAs: ``F_i <- beta F_i + (1 - beta) G_(i) G_(i)^T``."""
    for i, f in enumerate(factors):
        if f is not None:
            f.lerp_(gram(g, i), 1 - beta)


# Note [Fused elementwise steps]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# SOAP's step is some twenty small ops per block, whose dispatch costs more than their
# arithmetic on small blocks. So it runs over a batch of blocks: the products once per shape
# group (``bmm``: Note [Batched steps] in groups.py), each elementwise op one
# ``torch._foreach_*`` over the batch, the statistics one ``bmm`` per group and dim: bitwise the
# per-block ops on the CPU (tests/unit/test_fused_steps.py; ``tiny``'s ordinary step 715 ATen
# ops -> 74, bench/optim_step.py --count).

# Note [Two passes]
# ~~~~~~~~~~~~~~~~~
# Only the products need the bases. Where a refresher hands out a batch's bases in several pieces
# (each valid until the next is read), the products into the bases run per piece (``into``), the
# elementwise ops once over the batch (``between``), the products back per piece in the reverse
# order (``back``: P0 P1 P2, then P1 P0, the last still valid) and the weights once
# (``after``): bitwise one piece's ``whole`` on the CPU (tests/unit/test_two_passes.py).
