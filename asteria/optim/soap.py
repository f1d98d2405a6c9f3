"""SOAP: Adam in the eigenbasis of Shampoo's factors (Vyas et al., 2024, arXiv 2409.11321).

Owns: SOAP's math for one block, as the authors define it (nikhilvyas/SOAP's soap.py): the first
step only initialises factors and bases; the first moment lives in the eigenbasis; the second
moment is permuted (not rotated) when a refresh re-orders the basis; refreshes are one
warm-started power iteration + QR, every ``precondition_frequency`` steps.

Where Asteria differs from the authors' code (docs/fidelity.md): the first moment is rotated only
when a basis changes (``m <- R_L^T m R_R``, ``R = Q_old^T Q_new``: the same in exact arithmetic,
four matmuls a step fewer); dims above ``max_preconditioner_dim`` are split into blocks
(Distributed Shampoo's rule; ``block_large_dims=False`` leaves them unrotated, the authors' rule;
at the default 10000 a large embedding's blocks are costly, so large models set 2048);
``normalize_grads`` rescales the whole parameter's update, blocks included; the refresh runs in
``refresh_dtype``.

Must not: know about runtimes, pools or memory tiers.
"""

from __future__ import annotations

from typing import Any

import torch

from asteria.optim import matrix_functions as mf
from asteria.optim.base import KroneckerOptimizer, ParamsT
from asteria.optim.batched import (
    SMALL_BMM,
    batched_mode_products,
    bmm,
    index_select_each,
    mm,
    stack,
)
from asteria.optim.blocking import ParamLayout, make_layout
from asteria.optim.checks import check_betas, check_shampoo_beta
from asteria.optim.groups import block_key, shape_groups, tensor_key
from asteria.optim.kernels import shampoo_beta
from asteria.optim.kernels import soap as kernel
from asteria.optim.kron import gram, mode_products
from asteria.optim.refresher import QRRefresh, RefreshJob
from asteria.optim.tensors import basis_zeros, block_views, state_dtype

__all__ = ["SOAP"]


class SOAP(KroneckerOptimizer):
    """SOAP with the authors' defaults.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: Adam's ``(beta1, beta2)`` in the eigenbasis, each in ``[0, 1)``.
        shampoo_beta: EMA coefficient of the factors; ``None`` (or a negative value, as in the
            authors' code) means ``betas[1]``.
        eps: Adam's epsilon.
        weight_decay: decoupled weight decay, applied after the update.
        precondition_frequency: refresh the eigenbases every this many steps.
        max_preconditioner_dim: largest factor dim; larger dims are split into blocks.
        merge_dims: merge consecutive small dims of >2-D tensors before blocking.
        precondition_1d: give 1-D parameters a factor (otherwise they run Adam, unrotated).
        normalize_grads: rescale each update to unit RMS.
        correct_bias: Adam's bias correction.
        block_large_dims: split dims above ``max_preconditioner_dim`` (default) or leave them
            unrotated (the authors' behaviour).
        refresh_dtype: precision of the eigh / QR refreshes (float32, as the authors).
    """

    kernel = kernel
    phases = ("update", "statistics", "plan")  # a refresh of step t is used from step t + 1
    factors_some_dims = True  # Note [Factor budget] in blocking.py: the authors' per-dim rule

    def __init__(
        self,
        params: ParamsT,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_preconditioner_dim: int = 10000,
        merge_dims: bool = False,
        precondition_1d: bool = False,
        normalize_grads: bool = False,
        correct_bias: bool = True,
        block_large_dims: bool = True,
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
            merge_dims=merge_dims,
            precondition_1d=precondition_1d,
            normalize_grads=normalize_grads,
            correct_bias=correct_bias,
            block_large_dims=block_large_dims,
            refresh_dtype=refresh_dtype,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        check_betas(group["betas"])
        check_shampoo_beta(group["shampoo_beta"])
        for flag in (
            "merge_dims",
            "precondition_1d",
            "normalize_grads",
            "correct_bias",
            "block_large_dims",
        ):
            if not isinstance(group[flag], bool):
                raise ValueError(f"{flag} must be True or False, got {group[flag]!r}")

    # -- layout and schedule ------------------------------------------------------------------

    def _layout_key(self, p: torch.Tensor, group: dict[str, Any]) -> tuple:
        return super()._layout_key(p, group) + (
            group["merge_dims"],
            group["precondition_1d"],
            group["block_large_dims"],
        )

    def _layout(self, p: torch.Tensor, group: dict[str, Any]) -> ParamLayout:
        return make_layout(
            p.shape,
            group["max_preconditioner_dim"],
            squeeze=False,
            merge_dims=group["merge_dims"],
            block_large_dims=group["block_large_dims"],
            # 1-D parameters are factored only with precondition_1d; a >1-D one merged into a
            # single dim keeps its factor (the authors' merge_dims rule); 0-d never has one.
            factor_1d=group["precondition_1d"] if p.dim() == 1 else p.dim() >= 2,
        )

    # -- the algorithm ------------------------------------------------------------------------

    def _init_param(self, pid, p, grad, group, state, layout) -> None:
        """First gradient: factors and eigenbases only, no parameter update (the authors' rule)."""
        beta = shampoo_beta(group)
        state["step"] = 0
        blocks = []
        for spec, g in zip(layout.blocks, block_views(grad, layout)):
            factors = [
                torch.zeros(d, d, dtype=grad.dtype, device=grad.device) if f else None
                for d, f in zip(spec.shape, spec.factored)
            ]
            for i, f in enumerate(factors):
                if f is not None:
                    f.lerp_(gram(g, i), 1 - beta)
            bases = [
                None
                if f is None
                else mf.eigh_descending(f, group["refresh_dtype"])[1].to(grad.dtype)
                for f in factors
            ]
            blocks.append(
                {
                    "exp_avg": torch.zeros(spec.shape, dtype=grad.dtype, device=grad.device),
                    "exp_avg_sq": torch.zeros(spec.shape, dtype=grad.dtype, device=grad.device),
                    "factors": factors,
                    "bases": bases,
                }
            )
        state["blocks"] = blocks

    def _state_template(self, p, group, layout) -> dict[str, Any]:
        dtype, device = state_dtype(p), p.device
        return {
            "blocks": [
                {
                    "exp_avg": torch.zeros(spec.shape, dtype=dtype, device=device),
                    "exp_avg_sq": torch.zeros(spec.shape, dtype=dtype, device=device),
                    "factors": [
                        torch.zeros(d, d, dtype=dtype, device=device) if f else None
                        for d, f in zip(spec.shape, spec.factored)
                    ],
                    "bases": [
                        basis_zeros(d, dtype, device) if f else None
                        for d, f in zip(spec.shape, spec.factored)
                    ],
                }
                for spec in layout.blocks
            ]
        }

    # -- the refresh, split so that a runtime can run it elsewhere ---------------------------

    def refresh_jobs(self, block: dict[str, Any], group: dict[str, Any]) -> list[RefreshJob | None]:
        """Per factored dim: sort the basis by estimated eigenvalue, one power iteration + QR."""
        dtype, jobs = group["refresh_dtype"], []
        for f, q in zip(block["factors"], block["bases"]):  # (a loop: no call per request)
            jobs.append(None if f is None else QRRefresh(f, q, sort=True, dtype=dtype))
        return jobs

    def install_refresh(
        self, block: dict[str, Any], result: list[tuple[torch.Tensor, torch.Tensor] | None]
    ) -> None:
        """Install new bases: permute ``v`` along each refreshed dim, carry ``m`` over exactly.

        ``m`` lives in the old basis; along dim ``i`` it moves to the new one either through the
        original space (``Q_old`` then ``Q_new^T``: two products with the block's other dims) or
        by ``R_i = Q_old^T Q_new`` (one product plus the ``d_i^3`` to form ``R_i``), whichever
        costs fewer flops: ``R_i`` when ``d_i`` is smaller than the product of the other dims.
        """
        m = block["exp_avg"]
        back: list[torch.Tensor | None] = [None] * m.dim()
        forth: list[torch.Tensor | None] = [None] * m.dim()
        for i, res in enumerate(result):
            if res is None:
                continue
            new_q, perm = res
            v = block["exp_avg_sq"]
            block["exp_avg_sq"] = v.index_select(i, perm.to(v.device))
            new_q = new_q.to(dtype=v.dtype, device=v.device)
            old_q = block["bases"][i]
            if old_q.shape[0] ** 2 < m.numel():  # d_i < numel / d_i
                forth[i] = mm(old_q.T, new_q)
            else:
                back[i], forth[i] = old_q, new_q
            block["bases"][i] = new_q
        if any(b is not None for b in back):
            m = mode_products(m, back, transpose=False)
        block["exp_avg"] = mode_products(m, forth, transpose=True)

    def install_refresh_many(self, blocks: list[dict[str, Any]], results: list[list]) -> None:
        """``install_refresh`` of each block, blocks of one shape and layout together (Note [Batched
        installs]); on the CPU the 2-D blocks in one operator (Note [SOAP installs on the CPU] in
        csrc/core/soap_step.cpp); a block a CPU ``bmm`` would round otherwise installed alone."""
        cpu, rest = ([], []), ([], [])  # (loops: no call per block)
        for block, result in zip(blocks, results):
            v, fits, refreshed = block["exp_avg_sq"], True, False
            if v.device.type == "cpu" and v.dim() == 2:  # what ``soap_install_each`` takes:
                for r in result:  # a refreshed dim, new bases that need no conversion
                    if r is not None:
                        refreshed = True
                        q = r[0]
                        fits = fits and q.dtype == v.dtype and q.device == v.device
                        fits = fits and r[1] is not None
            side = cpu if refreshed and fits else rest
            side[0].append(block)
            side[1].append(result)
        if cpu[0]:
            _install_on_cpu(*cpu)
        blocks, results = rest
        if not blocks:
            return
        for idx in shape_groups(range(len(blocks)), lambda i: _install_key(blocks[i], results[i])):
            if len(idx) == 1:
                for i in idx:
                    self.install_refresh(blocks[i], results[i])
                continue
            _install_group([blocks[i] for i in idx], [results[i] for i in idx])

    def install_cost(self, block: dict[str, Any]) -> float:
        """The rotation of ``m`` as ``install_refresh`` does it, per factored dim (``R_i`` or
        back and forth, whichever is cheaper), and the permutation of ``v``."""
        numel = block["exp_avg"].numel()
        cost = 0.0
        for f in block["factors"]:
            if f is not None:
                d = f.shape[0]
                cost += min(d**3 + numel * d, 2 * numel * d) + numel
        return float(cost)


#: SOAP.install_refresh of 2-D CPU blocks, one op (Note [SOAP installs on the CPU]).
soap_install_each = torch.ops.asteria.soap_install_each.default


@torch.library.register_fake("asteria::soap_install_each")
def _soap_install_each_fake(exp_avgs, exp_avg_sqs, *bases_and_perms):
    return [m.new_empty(m.shape) for m in exp_avgs], [v.new_empty(v.shape) for v in exp_avg_sqs]


def _install_on_cpu(blocks: list[dict[str, Any]], results: list[list]) -> None:
    """``SOAP.install_refresh`` of 2-D CPU blocks in one operator (Note [SOAP installs on the
    CPU] in csrc/core/soap_step.cpp)."""
    old, new, perm, ms, vs = ([], []), ([], []), ([], []), [], []
    for b, r in zip(blocks, results):  # (a loop: no call per block)
        ms.append(b["exp_avg"])
        vs.append(b["exp_avg_sq"])
        for d in (0, 1):
            res = r[d]
            old[d].append(None if res is None else b["bases"][d])
            new[d].append(None if res is None else res[0])
            perm[d].append(None if res is None else res[1])
    ms, vs = soap_install_each(ms, vs, *old, *new, *perm)
    for b, r, m, v in zip(blocks, results, ms, vs):
        b["exp_avg"], b["exp_avg_sq"] = m, v
        for d in (0, 1):
            if r[d] is not None:
                b["bases"][d] = r[d][0]


def _install_key(block: dict[str, Any], result: list) -> Any:
    """What must agree for blocks to be installed together: ``m``'s and ``v``'s shape, dtype
    and layout, and per dim whether it was refreshed and the layouts of its old and new bases;
    a key of its own (installed alone) where a CPU ``bmm`` would round otherwise, or where the
    new bases need a conversion."""
    m, v = block["exp_avg"], block["exp_avg_sq"]
    key = [block_key(m), tensor_key(v)]
    for res, q in zip(result, block["bases"]):
        if res is None:
            key.append(None)
            continue
        new_q, perm = res
        small = m.device.type == "cpu" and q.shape[0] ** 3 < SMALL_BMM
        if small or perm is None or new_q.dtype != v.dtype or new_q.device != v.device:
            return object()
        key.append((tensor_key(q), tensor_key(new_q)))
    return tuple(key)


def _install_group(blocks: list[dict[str, Any]], results: list[list]) -> None:
    """``SOAP.install_refresh`` of blocks of one ``_install_key``, each op once for the group
    (Note [Batched installs])."""
    v = torch.stack([b["exp_avg_sq"] for b in blocks])
    m = stack([b["exp_avg"] for b in blocks])
    n = m.dim() - 1
    back: list[torch.Tensor | None] = [None] * n
    forth: list[torch.Tensor | None] = [None] * n
    for i, res in enumerate(results[0]):
        if res is None:
            continue
        v = index_select_each(v, i, torch.stack([r[i][1] for r in results]).to(v.device))
        old_q = [b["bases"][i] for b in blocks]
        new_q = [r[i][0] for r in results]
        if old_q[0].shape[0] ** 2 < blocks[0]["exp_avg"].numel():  # d_i < numel / d_i
            forth[i] = bmm(stack([q.T for q in old_q]), stack(new_q))
        else:
            back[i], forth[i] = stack(old_q), stack(new_q)
        for b, q in zip(blocks, new_q):
            b["bases"][i] = q
    if any(b is not None for b in back):
        m = batched_mode_products(m, back, transpose=False)
    m = batched_mode_products(m, forth, transpose=True)
    torch._foreach_copy_([b["exp_avg_sq"] for b in blocks], list(v.unbind(0)))
    torch._foreach_copy_([b["exp_avg"] for b in blocks], list(m.unbind(0)))


# Note [Batched installs]
# ~~~~~~~~~~~~~~~~~~~~~~~
# ``install_refresh_many`` installs blocks whose moments and bases agree in shape, dtype and
# layout together: ``v``'s permutations one exact gather per dim (``index_select_each``), ``m``'s
# rotation one ``bmm`` per dim (``R = Q_old^T Q_new``, or back and forth), copied back into each
# block's own ``m`` and ``v`` (one ``_foreach_copy_`` each); on the CPU the 2-D blocks are one
# operator (``soap_install_each``). Bitwise ``install_refresh`` of each block on the CPU
# (tests/unit/test_batched_roots.py, test_batched_steps.py); a block a CPU ``bmm`` would round
# otherwise (``block_key``) is installed alone. Native mode and the runtime both install so.
