"""Kronecker algebra on one block: mode products and factor statistics.

Owns: the few tensor contractions every algorithm needs, with a fast path for matrices (plain
matmuls) and the general order-k path (``tensordot`` over one dim at a time).

Must not: keep state or know any algorithm's hyperparameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asteria.optim.batched import aligned, mm

__all__ = ["mode_products", "gram", "mode_scale"]

Mats = Sequence[torch.Tensor | None]


def mode_products(x: torch.Tensor, mats: Mats, transpose: bool) -> torch.Tensor:
    """Multiply every dim ``i`` of ``x`` by ``mats[i]`` (``None``: identity): ``mats[i]^T`` with
    ``transpose`` (into an eigenbasis: ``Q_L^T X Q_R``), else ``mats[i]`` (back: ``Q_L X Q_R^T``).
    """
    if mats.count(None) == len(mats):
        return x  # an unfactored block (SOAP's 1-D ones without precondition_1d)
    if x.dim() == 2:
        left, right = mats
        if left is not None:
            x = mm(left.T if transpose else left, x)
        if right is not None:
            x = mm(x, right if transpose else right.T)
        return x
    contract = 0 if transpose else 1
    for m in mats:
        if m is None:
            x = x.permute(*range(1, x.dim()), 0)
        else:
            x = torch.tensordot(aligned(x), aligned(m), dims=([0], [contract]))
    return x


def gram(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``X_(dim) X_(dim)^T``: the contraction of ``x`` with itself over every dim but ``dim``."""
    if x.dim() == 2:
        return mm(x, x.T) if dim == 0 else mm(x.T, x)
    if x.dim() == 1:
        return torch.outer(x, x)
    others = [d for d in range(x.dim()) if d != dim]
    x = aligned(x)
    return torch.tensordot(x, x, dims=(others, others))


def mode_scale(x: torch.Tensor, scales: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """``x`` times the outer product of ``scales`` (``None``: 1 along that dim)."""
    out = x
    for i, s in enumerate(scales):
        if s is None:
            continue
        shape = [1] * x.dim()
        shape[i] = -1
        out = out * s.view(shape)
    return out
