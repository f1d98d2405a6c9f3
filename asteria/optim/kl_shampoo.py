"""KL-Shampoo (Lin et al., arXiv 2509.03378): Shampoo's factors estimated under a two-sided KL.

Owns: KL-Shampoo's math for one block, as the authors' code defines it (yorkerlin/KL-Methods,
``optim/kl_opt.py``, ``KLOpt`` with ``using_klsoap=False``; docs/fidelity.md): factors coupled
through the other factors' bases and eigenvalue estimates, per-factor eigenvalue estimates
re-estimated every step in the current basis, the ``-1/2`` exponent per factor, the update's
damping ``s / (1 + eps * s)``, no Adam and no grafting, bases refreshed by one power iteration +
QR every ``precondition_frequency`` steps; the authors' 2-D and 3-D paths to the operation order
(3-D: dims 2 and 1's eigenvalues updated before dim 0 reads them, ``_statistics_3d``).

Beyond the authors' code: order >= 4 tensors (the 2-D rule), 1-D parameters on AdamW with the
group's options, dims split into blocks of at most ``max_preconditioner_dim`` (a block's clamp
uses its dim), fp32 state (the authors' bf16 but for QR/eigh). Not implemented: the authors'
non-default ``using_damping=True``, ``using_clamping=False``, ``normalize_grads=True`` and
KL-SOAP. heavyball's ``KLShampoo`` differs from the authors' algorithm (eigenvalues from
``diag(Q^T S Q)``, ``init_factor * I`` factors, a debiased ``shampoo_beta``); Asteria follows
the authors.

Must not: know about runtimes, pools or memory tiers.
"""

from __future__ import annotations

from typing import Any

import torch

from asteria.optim import matrix_functions as mf
from asteria.optim.base import KroneckerOptimizer, ParamsT
from asteria.optim.blocking import ParamLayout, make_layout
from asteria.optim.checks import check_betas, check_range, check_shampoo_beta
from asteria.optim.kernels import kl_shampoo as kernel
from asteria.optim.kernels import shampoo_beta
from asteria.optim.kernels.kl_shampoo import whitening_gain
from asteria.optim.kron import gram
from asteria.optim.refresher import QRRefresh, RefreshJob
from asteria.optim.tensors import basis_zeros, block_views, state_dtype

__all__ = ["KLShampoo"]


class KLShampoo(KroneckerOptimizer):
    """KL-Shampoo with the authors' defaults.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: ``(beta1, beta2)``: beta1 for the gradient EMA, beta2 the default ``shampoo_beta``.
        shampoo_beta: EMA coefficient of factors and eigenvalues; ``None`` means ``betas[1]``.
        eps: the damping of the update, ``s / (1 + eps * s)`` (the authors' ``klshampoo_update``
            passes the group's eps), and AdamW's epsilon for 1-D parameters.
        weight_decay: decoupled weight decay.
        precondition_frequency: refresh the eigenbases every this many steps.
        max_preconditioner_dim: largest factor dim; larger dims are split into blocks.
        init_factor: initial eigenvalue estimate of every factor.
        max_clamp_value: ``lambda^{-1/2}`` is clamped to ``max(10, min(d, max_clamp_value))``.
        refresh_dtype: precision of the eigh / QR refreshes (float32, as the authors).
    """

    kernel = kernel
    phases = ("update_statistics", "plan")  # the statistics read the update's bases
    install_reads_bases = False

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.98),
        shampoo_beta: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_preconditioner_dim: int = 10000,
        init_factor: float = 0.1,
        max_clamp_value: float = 4000,
        refresh_dtype: torch.dtype = torch.float32,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, (list, tuple)) else betas,
            shampoo_beta=shampoo_beta,
            eps=eps,
            weight_decay=weight_decay,
            precondition_frequency=precondition_frequency,
            max_preconditioner_dim=max_preconditioner_dim,
            init_factor=init_factor,
            max_clamp_value=max_clamp_value,
            refresh_dtype=refresh_dtype,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        check_betas(group["betas"])
        check_shampoo_beta(group["shampoo_beta"])
        check_range("init_factor", group["init_factor"], 0.0, low_inclusive=False)
        check_range("max_clamp_value", group["max_clamp_value"], 0.0, low_inclusive=False)

    def _layout(self, p: torch.Tensor, group: dict[str, Any]) -> ParamLayout:
        return make_layout(p.shape, group["max_preconditioner_dim"], squeeze=True, factor_1d=False)

    def _gain_options(self, group: dict[str, Any]) -> Any:
        return (group["max_preconditioner_dim"], group["max_clamp_value"])

    def _statistics_gain(self, p: torch.Tensor, group: dict[str, Any]) -> float:
        """The factors and eigenvalue estimates see the gradient whitened along the other dims
        by ``lambda^{-1/2} <= clamp`` (Note [Overflowing gradients] in overflow.py)."""
        shapes = tuple(b.shape for b in self.layout(p, group).blocks)
        return whitening_gain(shapes, float(group["max_clamp_value"]))

    # -- the algorithm ------------------------------------------------------------------------

    def _init_param(self, pid, p, grad, group, state, layout) -> None:
        if not layout.blocks[0].factored[0]:  # a vector: AdamW
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(grad)
            state["exp_avg_sq"] = torch.zeros_like(grad)
            return True  # its first step updates it too
        # First gradient: factors and bases only, no parameter update (the authors' rule).
        beta = shampoo_beta(group)
        state["step"] = 0
        blocks = []
        for spec, g in zip(layout.blocks, block_views(grad, layout)):
            factors = []
            for i, d in enumerate(spec.shape):
                f = torch.zeros(d, d, dtype=grad.dtype, device=grad.device)
                f.mul_(beta).add_(gram(g, i), alpha=(1 - beta) / (spec.numel // d))
                factors.append(f)
            bases = [
                mf.eigh_descending(f, group["refresh_dtype"])[1].to(grad.dtype) for f in factors
            ]
            s0 = (1.0 / torch.sqrt(torch.tensor(group["init_factor"], dtype=grad.dtype))).item()
            blocks.append(
                {
                    "exp_avg": torch.zeros(spec.shape, dtype=grad.dtype, device=grad.device),
                    "factors": factors,
                    "bases": bases,
                    "eigen_sqrt_inv": [
                        torch.full((d,), s0, dtype=grad.dtype, device=grad.device)
                        for d in spec.shape
                    ],
                }
            )
        state["blocks"] = blocks

    def _state_template(self, p, group, layout) -> dict[str, Any]:
        dtype, device = state_dtype(p), p.device

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        if not layout.blocks[0].factored[0]:  # a vector: AdamW
            return {"exp_avg": zeros(*p.shape), "exp_avg_sq": zeros(*p.shape)}
        return {
            "blocks": [
                {
                    "exp_avg": zeros(*spec.shape),
                    "factors": [zeros(d, d) for d in spec.shape],
                    "bases": [basis_zeros(d, dtype, device) for d in spec.shape],
                    "eigen_sqrt_inv": [zeros(d) for d in spec.shape],
                }
                for spec in layout.blocks
            ]
        }

    # -- the refresh, split so that a runtime can run it elsewhere ---------------------------

    def refresh_jobs(self, block: dict[str, Any], group: dict[str, Any]) -> list[RefreshJob]:
        """New bases: one power iteration + QR per factor, no sorting (the authors' rule)."""
        dtype, jobs = group["refresh_dtype"], []
        for f, q in zip(block["factors"], block["bases"]):  # (a loop: no call per request)
            jobs.append(QRRefresh(f, q, sort=False, dtype=dtype))
        return jobs

    def install_refresh(self, block: dict[str, Any], results: list[Any]) -> None:
        """Install new bases; the eigenvalue estimates carry over unchanged, as the authors do."""
        self.install_refresh_many([block], [results])

    def install_refresh_many(self, blocks: list[dict[str, Any]], results: list[list]) -> None:
        """``install_refresh`` of each block (loops: no call per block)."""
        for block, result in zip(blocks, results):
            bases = []
            for (q, _), f in zip(result, block["factors"]):
                bases.append(q.to(dtype=f.dtype, device=f.device))
            block["bases"] = bases
