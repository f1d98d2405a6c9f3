"""Shampoo (Gupta et al., 2018) with grafting, as in Meta's Distributed Shampoo.

Owns: Shampoo's math for one block (../shared/ALGORITHMS.md): Kronecker factors
``L_i = b2 L_i + (1 - b2) G_(i) G_(i)^T`` (plain sums when ``b2 == 1``), inverse roots
``L_i^{-1/(2k)}`` for an order-k block, recomputed every ``precondition_frequency`` steps, the
first-moment EMA of the gradient as the preconditioned quantity, per-block grafting of the step
size, momentum and decoupled weight decay. Before ``start_preconditioning_step`` the grafting
method alone drives the update; with Adam grafting and no momentum that is exactly
``torch.optim.AdamW`` (same operations, same order).

Choices stated: size-1 dims are squeezed before blocking (a 1x1 factor would change the root
order); 1-D parameters are never preconditioned (grafting direction only); the eigenvalues are
clamped at zero before ``epsilon`` is added (negative ones are round-off of a PSD factor); a block
whose roots have not been computed yet takes the grafting direction, as every block does before
``start_preconditioning_step``. Meta's code never meets that case (it requires the start to be at
least ``precondition_frequency``, so the first roots exist before they are used); here it happens
when the start precedes the first refresh, and under an ``asteria.Runtime``, whose first roots
arrive up to ``S`` steps after they are requested. Identity roots instead (the block's ``M_hat``
rescaled to the grafting norm) put the whole step of an embedding on its few frequent rows: one
such step on the ``tiny`` LM took the loss from 3.3 to 5.1.

Must not: know about runtimes, pools or memory tiers.
"""

from __future__ import annotations

from typing import Any

import torch

from asteria.optim.base import (
    KroneckerOptimizer,
    ParamsT,
    RefreshJob,
    block_views,
    check_betas,
    check_range,
    state_dtype,
)
from asteria.optim.blocking import ParamLayout, make_layout
from asteria.optim.kron import gram, mode_products

__all__ = ["Shampoo", "GRAFTINGS"]

GRAFTINGS = ("adam", "rmsprop", "adagrad", "sgd", "none")


class Shampoo(KroneckerOptimizer):
    """Shampoo with Meta's Distributed Shampoo defaults.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: ``(beta1, beta2)``: beta1 for the gradient's first moment, beta2 for the factors
            (``1.0`` means plain sums, Meta's default).
        eps: epsilon of the grafting method's denominator.
        weight_decay: decoupled weight decay.
        precondition_frequency: recompute the inverse roots every this many steps.
        max_preconditioner_dim: largest factor dim; larger dims are split into blocks.
        epsilon: added to the factors' eigenvalues before the root.
        grafting: ``"adam"``, ``"rmsprop"``, ``"adagrad"``, ``"sgd"`` or ``"none"``.
        grafting_beta2: second-moment EMA coefficient of Adam / RMSprop grafting.
        momentum: heavy-ball momentum on the grafted direction.
        start_preconditioning_step: first step that uses the Shampoo direction; ``None`` means
            ``precondition_frequency`` (Meta's default).
        refresh_dtype: precision of the root computation.
    """

    bases_field = "roots"
    reads_bases_through_refresher = True
    install_reads_bases = False
    refresh_precedes_update = True

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 1.0),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        precondition_frequency: int = 1,
        max_preconditioner_dim: int = 1024,
        epsilon: float = 1e-12,
        grafting: str = "adam",
        grafting_beta2: float = 0.999,
        momentum: float = 0.0,
        start_preconditioning_step: int | None = None,
        refresh_dtype: torch.dtype = torch.float32,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, (list, tuple)) else betas,
            eps=eps,
            weight_decay=weight_decay,
            precondition_frequency=precondition_frequency,
            max_preconditioner_dim=max_preconditioner_dim,
            epsilon=epsilon,
            grafting=grafting,
            grafting_beta2=grafting_beta2,
            momentum=momentum,
            start_preconditioning_step=start_preconditioning_step,
            refresh_dtype=refresh_dtype,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        check_betas(group["betas"], second_may_be_one=True)
        check_range("epsilon", group["epsilon"], 0.0, low_inclusive=False)
        if group["grafting"] not in GRAFTINGS:
            raise ValueError(f"grafting must be one of {GRAFTINGS}, got {group['grafting']!r}")
        check_range("grafting_beta2", group["grafting_beta2"], 0.0, 1.0, high_inclusive=False)
        check_range("momentum", group["momentum"], 0.0, 1.0, high_inclusive=False)
        start = group["start_preconditioning_step"]
        if start is not None:
            check_range("start_preconditioning_step", start, 1, integer=True)

    def _layout(self, p: torch.Tensor, group: dict[str, Any]) -> ParamLayout:
        return make_layout(p.shape, group["max_preconditioner_dim"], squeeze=True, factor_1d=False)

    @staticmethod
    def _start(group: dict[str, Any]) -> int:
        start = group["start_preconditioning_step"]
        return group["precondition_frequency"] if start is None else start

    # -- the algorithm ------------------------------------------------------------------------

    def _init_param(self, pid, p, grad, group, state, layout) -> None:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(grad)
        if group["grafting"] in ("adam", "rmsprop", "adagrad"):
            state["exp_avg_sq"] = torch.zeros_like(grad)
        if group["momentum"] > 0:
            state["momentum_buffer"] = torch.zeros_like(grad)
        if layout.blocks[0].factored[0]:
            state["blocks"] = [
                {
                    "factors": [
                        torch.zeros(d, d, dtype=grad.dtype, device=grad.device) for d in spec.shape
                    ],
                    "roots": [None] * len(spec.shape),
                }
                for spec in layout.blocks
            ]
        self._update_param(pid, p, grad, group, state, layout)

    def _state_template(self, p, group, layout) -> dict[str, Any]:
        dtype, device = state_dtype(p), p.device
        state = {"exp_avg": torch.zeros(p.shape, dtype=dtype, device=device)}
        if group["grafting"] in ("adam", "rmsprop", "adagrad"):
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype, device=device)
        if group["momentum"] > 0:
            state["momentum_buffer"] = torch.zeros(p.shape, dtype=dtype, device=device)
        if layout.blocks[0].factored[0]:
            state["blocks"] = [
                {
                    "factors": [torch.zeros(d, d, dtype=dtype, device=device) for d in spec.shape],
                    "roots": [torch.zeros(d, d, dtype=dtype, device=device) for d in spec.shape],
                }
                for spec in layout.blocks
            ]
        return state

    def _update_param(self, pid, p, grad, group, state, layout) -> None:
        beta1 = group["betas"][0]
        lr, wd, grafting = group["lr"], group["weight_decay"], group["grafting"]
        state["step"] += 1
        t = state["step"]
        exp_avg = state["exp_avg"]
        exp_avg.lerp_(grad, 1 - beta1)
        bias_correction1 = 1 - beta1**t
        denom = self._grafting_denominator(state, grad, group, t)

        blocks = state.get("blocks")
        if blocks is not None:
            # a runtime may request the refresh of step t + lead now (Note [Refresh lead])
            due = self._refresh_due(state, group, next_step=self._refresher.lead > 0)
            for bi, (b, g) in enumerate(zip(blocks, block_views(grad, layout))):
                self._refresher.accumulate(self, (pid, bi), self._update_factors, b, g, group)
                self._refresher.block_boundary(self, (pid, bi), b, group, t, due)
        preconditioning = blocks is not None and t >= self._start(group)

        if not preconditioning and group["momentum"] == 0:
            # The grafting method alone, in torch.optim.AdamW's exact operation order.
            p.mul_(1 - lr * wd)
            if denom is None:
                p.add_(exp_avg, alpha=-lr / bias_correction1)
            else:
                p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
            return

        m_hat = exp_avg / bias_correction1
        graft = m_hat if denom is None else m_hat / denom
        if preconditioning:
            direction = torch.empty_like(m_hat)
            for bi, (b, m_b, g_b, out) in enumerate(
                zip(
                    blocks,
                    block_views(m_hat, layout),
                    block_views(graft, layout),
                    block_views(direction, layout),
                )
            ):
                roots = self._refresher.bases(self, (pid, bi), b)  # b["roots"], or device copies
                if all(r is None for r in roots):
                    out.copy_(g_b)  # no roots yet: the grafting direction, as before the start
                    continue
                pre = mode_products(m_b, roots, transpose=False)
                if grafting != "none":
                    norm = torch.linalg.vector_norm(pre)
                    pre = pre * torch.where(norm > 0, torch.linalg.vector_norm(g_b) / norm, 1.0)
                out.copy_(pre)
        else:
            direction = graft
        if group["momentum"] > 0:
            buf = state["momentum_buffer"]
            buf.mul_(group["momentum"]).add_(direction)
            direction = buf
        p.mul_(1 - lr * wd)
        p.add_(direction, alpha=-lr)

    @staticmethod
    def _grafting_denominator(state, grad, group, t: int) -> torch.Tensor | None:
        grafting = group["grafting"]
        if grafting in ("sgd", "none"):
            return None
        v = state["exp_avg_sq"]
        if grafting == "adagrad":
            v.addcmul_(grad, grad, value=1.0)
            return v.sqrt().add_(group["eps"])
        b2 = group["grafting_beta2"]
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        if grafting == "rmsprop":
            return v.sqrt().add_(group["eps"])
        return (v.sqrt() / (1 - b2**t) ** 0.5).add_(group["eps"])

    @staticmethod
    def _update_factors(block: dict[str, Any], g: torch.Tensor, group: dict[str, Any]) -> None:
        beta2 = group["betas"][1]
        for i, f in enumerate(block["factors"]):
            if beta2 == 1.0:
                f.add_(gram(g, i))
            else:
                f.mul_(beta2).add_(gram(g, i), alpha=1 - beta2)

    # -- the refresh, split so that a runtime can run it elsewhere ---------------------------

    def refresh_jobs(self, block: dict[str, Any], group: dict[str, Any]) -> list[RefreshJob]:
        """``L_i^{-1/(2k)}`` for every factor of an order-k block."""
        root = 2 * len(block["factors"])
        return [
            RefreshJob("root", f, root=root, epsilon=group["epsilon"], dtype=group["refresh_dtype"])
            for f in block["factors"]
        ]

    def install_refresh(self, block: dict[str, Any], results: list[Any]) -> None:
        block["roots"] = [
            r.to(dtype=f.dtype, device=f.device) for r, f in zip(results, block["factors"])
        ]
