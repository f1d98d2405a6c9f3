"""One-sided SOAP: Adam in the eigenbasis of one Kronecker factor (docs/extending.md, example a).

Each parameter is viewed as a matrix (its first dim by the product of the others); its smaller
side gets a factor ``F = EMA(G G^T)`` whose eigenbasis ``Q`` is refreshed every
``precondition_frequency`` steps (SOAP's warm-started power iteration + QR), and Adam runs on
``Q^T G``; 1-D parameters run Adam. This file says what a block holds, how a step updates it
(its kernel, over shape groups of blocks), what a refresh computes and how it is installed;
*when* refreshes run is the base's and the runtime's (native: inside ``step()``; under
``asteria.Runtime``: on the worker pool, within the budget).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from asteria.optim import KroneckerOptimizer
from asteria.optim.blocking import ParamLayout, make_layout
from asteria.optim.checks import check_betas
from asteria.optim.kernels import Kernel
from asteria.optim.kron import gram, mode_products
from asteria.optim.matrix_functions import eigh_descending
from asteria.optim.refresher import QRRefresh
from asteria.optim.tensors import basis_zeros, block_views, state_dtype

__all__ = ["OneSidedSOAP"]


class OneSidedKernel(Kernel):
    """The step's math, per shape group of blocks: the factor EMA, and Adam on ``Q^T G``."""

    def statistics(self, groups, hp) -> None:
        for g in groups:
            for block, grad in zip(g.blocks, g.views["grad"]):
                _accumulate(block["factors"], grad, hp["betas"][1])

    def whole(self, groups, bases, hp) -> None:
        (beta1, beta2), lr = hp["betas"], hp["lr"]
        for g, qs in zip(groups, bases):
            step_size = lr * (1 - beta2**g.step) ** 0.5 / (1 - beta1**g.step)
            for block, q, grad, w in zip(g.blocks, qs, g.views["grad"], g.views["weight"]):
                g_rot = mode_products(grad, q, transpose=True)
                block["exp_avg"].lerp_(g_rot, 1 - beta1)
                block["exp_avg_sq"].mul_(beta2).addcmul_(g_rot, g_rot, value=1 - beta2)
                ratio = block["exp_avg"] / block["exp_avg_sq"].sqrt().add_(hp["eps"])
                w.add_(mode_products(ratio, q, transpose=False), alpha=-step_size)

    def end(self, work, hp) -> None:
        for u in work.updates:
            u.p.mul_(1 - hp["lr"] * hp["weight_decay"])


class OneSidedSOAP(KroneckerOptimizer):
    """Adam in the refreshed eigenbasis of the smaller side's factor of each parameter."""

    kernel = OneSidedKernel()
    phases = ("update", "statistics", "plan")  # a refresh of step t is used from t + 1, as SOAP's
    install_reads_bases = True  # install_refresh rotates m by Q_old^T Q_new

    def __init__(self, params, lr: float = 3e-3, betas=(0.95, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.01, precondition_frequency: int = 10,
                 max_preconditioner_dim: int = 4096,
                 refresh_dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        precondition_frequency=precondition_frequency,
                        max_preconditioner_dim=max_preconditioner_dim,
                        refresh_dtype=refresh_dtype)  # fmt: skip
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)  # lr, eps, weight decay, frequency, dims, refresh dtype
        check_betas(group["betas"])

    # -- layout: a matrix view, one factored side ---------------------------------------------

    def _layout(self, p: torch.Tensor, group: dict[str, Any]) -> ParamLayout:
        shape = (p.shape[0], p[0].numel()) if p.dim() >= 2 else tuple(p.shape)
        layout = make_layout(shape, group["max_preconditioner_dim"], squeeze=False, factor_1d=False)
        if len(layout.view_shape) != 2:
            return layout  # 1-D (or 0-d): no factor, plain Adam
        rows, cols = layout.view_shape
        side = (rows <= cols, rows > cols)  # the smaller side carries the factor
        return replace(layout, blocks=tuple(replace(b, factored=side) for b in layout.blocks))

    def _state_template(self, p, group, layout) -> dict[str, Any]:
        dtype = state_dtype(p)  # every block as _init_param makes it, in zeros
        blocks = [self._block_zeros(b.shape, b.factored, dtype, p.device) for b in layout.blocks]
        return {"blocks": blocks}

    @staticmethod
    def _block_zeros(shape, factored, dtype, device) -> dict[str, Any]:
        def per_dim(make):
            return [make(d) if f else None for d, f in zip(shape, factored)]

        return {
            "exp_avg": torch.zeros(shape, dtype=dtype, device=device),
            "exp_avg_sq": torch.zeros(shape, dtype=dtype, device=device),
            "factors": per_dim(lambda d: torch.zeros(d, d, dtype=dtype, device=device)),
            "bases": per_dim(lambda d: basis_zeros(d, dtype, device)),  # column-major
        }

    # -- the first step ------------------------------------------------------------------------

    def _init_param(self, pid, p, grad, group, state, layout) -> None:
        """The first gradient sets the factor and its eigenbasis; no update (SOAP's rule)."""
        beta2 = group["betas"][1]
        state["step"], state["blocks"] = 0, []
        for spec, g in zip(layout.blocks, block_views(grad, layout)):
            block = self._block_zeros(spec.shape, spec.factored, grad.dtype, grad.device)
            _accumulate(block["factors"], g, beta2)
            block["bases"] = [
                None if f is None else eigh_descending(f, group["refresh_dtype"])[1].to(grad.dtype)
                for f in block["factors"]
            ]
            state["blocks"].append(block)

    # -- the refresh: described as jobs, so that a runtime can run it elsewhere --------------

    def refresh_jobs(self, block, group) -> list[QRRefresh | None]:
        return [
            None if f is None else QRRefresh(f, q, sort=True, dtype=group["refresh_dtype"])
            for f, q in zip(block["factors"], block["bases"])
        ]

    def install_refresh(self, block, results) -> None:
        """New basis ``Q``: ``v`` permuted as ``Q``'s columns were, ``m`` rotated by
        ``Q_old^T Q_new`` (exactly the first moment the new basis would have held)."""
        for i, res in enumerate(results):
            if res is None:
                continue
            q_new, perm = res
            m, v = block["exp_avg"], block["exp_avg_sq"]
            q_new = q_new.to(dtype=m.dtype, device=m.device)
            block["exp_avg_sq"] = v.index_select(i, perm.to(v.device))
            rotation = [None] * m.dim()
            rotation[i] = block["bases"][i].T @ q_new
            block["exp_avg"] = mode_products(m, rotation, transpose=True)
            block["bases"][i] = q_new

    def install_cost(self, block) -> float:
        n, ds = block["exp_avg"].numel(), [f.shape[0] for f in block["factors"] if f is not None]
        return float(sum(d**3 + n * d + n for d in ds))


def _accumulate(factors: list[torch.Tensor | None], g: torch.Tensor, beta: float) -> None:
    """One step of the factor EMA, ``F <- beta F + (1 - beta) G G^T`` along the factored side."""
    for i, f in enumerate(factors):
        if f is not None:
            f.lerp_(gram(g, i), 1 - beta)
