"""SOAP: Adam in the eigenbasis of Shampoo's factors (Vyas et al., 2024, arXiv 2409.11321).

Owns: SOAP's math for one block, as the authors define it (nikhilvyas/SOAP's soap.py): the first
step only initialises factors and bases; the first moment lives in the eigenbasis; the second
moment is permuted (not rotated) when a refresh re-orders the basis; refreshes are one
warm-started power iteration + QR, every ``precondition_frequency`` steps.

Where Asteria differs from the authors' code (same math, different arithmetic):
  * the authors take the first moment back to the original space and project it again on every
    step; Asteria rotates it only when a basis actually changes (``m <- R_L^T m R_R`` with
    ``R = Q_old^T Q_new``), which is the same in exact arithmetic and saves four matmuls a step;
  * a dim larger than ``max_preconditioner_dim`` is split into blocks (Distributed Shampoo's
    rule) instead of being left unrotated; ``block_large_dims=False`` restores the authors' rule.
    Blocking preconditions both dims of an embedding (the authors' rule leaves the vocab dim to
    Adam) and is the layout Asteria's memory tiers and benchmarks assume; at the authors' default
    ``max_preconditioner_dim=10000`` it costs a 10000 x 10000 factor and basis per block (a 50k-row
    embedding: five, 4 GB in fp32, and five such QRs per refresh), so large models set 2048 or
    ``block_large_dims=False`` (docs/fidelity.md);
  * ``normalize_grads`` rescales the update of the whole parameter to unit RMS, as the authors
    do, also when the parameter is split into blocks;
  * the refresh runs in ``refresh_dtype`` (float32 as the authors; float64 on request).

Must not: know about runtimes, pools or memory tiers.
"""

from __future__ import annotations

from typing import Any

import torch

from asteria._C import soap_accumulate
from asteria.optim import matrix_functions as mf
from asteria.optim.base import (
    BlockEnd,
    BlockKey,
    KroneckerOptimizer,
    ParamsT,
    QRRefresh,
    RefreshJob,
    Update,
    basis_zeros,
    block_views,
    check_betas,
    check_shampoo_beta,
    shampoo_beta,
    state_dtype,
)
from asteria.optim.batched import (
    SMALL_BMM,
    bases_bytes,
    bases_of,
    bases_room,
    batched_gram,
    batched_mode_products,
    block_key,
    bmm,
    index_select_each,
    mm,
    read_batches,
    shape_groups,
    stack,
    tensor_key,
)
from asteria.optim.blocking import ParamLayout, make_layout
from asteria.optim.kron import gram, mode_products
from asteria.optim.soap_step import (
    _BlockStep,
    _chunk_flops,
    _update_batched,
    _update_normalized,
    update_in_passes,
)

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

    reads_bases_through_refresher = True
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

    def _refresh_due(self, state: dict[str, Any], group: dict[str, Any], next_step: bool) -> bool:
        t = state["step"] + (1 if next_step else 0)
        return (
            t > 0
            and t % group["precondition_frequency"] == 0
            and any(q is not None for b in state["blocks"] for q in b["bases"])
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

    def _update_params(self, group: dict[str, Any], updates: list[Update]) -> None:
        """SOAP's steps 3-6 for a group's parameters, over pieces of blocks (Note
        [Fused elementwise steps])."""
        beta1, beta2 = group["betas"]
        work: list[_BlockStep] = []
        for u in updates:
            u.state["step"] += 1
            t = u.state["step"]
            step_size = group["lr"]
            if group["correct_bias"]:
                step_size = step_size * (1 - beta2**t) ** 0.5 / (1 - beta1**t)
            grads, weights = block_views(u.grad, u.layout), block_views(u.p, u.layout)
            for bi, (b, g, w) in enumerate(zip(u.state["blocks"], grads, weights)):
                work.append(_BlockStep((u.pid, bi), b, g, w, step_size, t))

        if group["normalize_grads"]:
            # a parameter split into blocks is normalized as a whole (the authors' rule)
            split = {u.pid for u in updates if len(u.state["blocks"]) > 1}
            if split:
                whole = [c for c in work if c.key[0] in split]
                work_fused = [c for c in work if c.key[0] not in split]
                _update_normalized(self._refresher, whole, group)
            else:
                work_fused = work
        else:
            work_fused = work
        refresher = self._refresher
        # Note [Batched steps] in batched.py: blocks of one shape together, in batches whose
        # bases the refresher hands out at once, or in pieces that it does (Note [Two passes
        # over the pieces] in soap_step.py)
        grouped = [[work_fused[i] for i in idx] for idx in shape_groups(work_fused, _shape_key)]
        for reads in read_batches(grouped, _elements, bases_bytes, bases_room(refresher)):
            if len(reads) > 1:
                update_in_passes(refresher, reads, group)
                continue
            piece = reads[0]
            qs = bases_of(refresher, [c.key for c in piece], [c.block for c in piece])
            self._run_split(_update_batched, list(zip(piece, qs)), _chunk_flops, group)
        if group["weight_decay"] > 0.0:
            ps = [u.p for u in updates]
            torch._foreach_add_(ps, ps, alpha=-group["lr"] * group["weight_decay"])

        beta = shampoo_beta(group)
        freq = group["precondition_frequency"]
        stats = _statistics(work, beta)
        self._end_blocks(group, (_block_end(c, freq, stats) for c in work))

    # -- the refresh, split so that a runtime can run it elsewhere ---------------------------

    def refresh_jobs(self, block: dict[str, Any], group: dict[str, Any]) -> list[RefreshJob | None]:
        """Per factored dim: sort the basis by estimated eigenvalue, one power iteration + QR."""
        return [
            None if f is None else QRRefresh(f, q, sort=True, dtype=group["refresh_dtype"])
            for f, q in zip(block["factors"], block["bases"])
        ]

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
        """``install_refresh`` of each block, blocks of one shape and layout together (Note
        [Batched installs]); a block alone of its kind, or whose products a CPU ``bmm`` would
        round otherwise (``batched.block_key``), is installed alone. On the CPU the 2-D blocks
        are one operator, unstacked (Note [SOAP installs on the CPU] in
        csrc/core/soap_step.cpp)."""
        on_cpu = [i for i in range(len(blocks)) if _cpu_installable(blocks[i], results[i])]
        if on_cpu:
            _install_on_cpu([blocks[i] for i in on_cpu], [results[i] for i in on_cpu])
            done = set(on_cpu)
            blocks = [b for i, b in enumerate(blocks) if i not in done]
            results = [r for i, r in enumerate(results) if i not in done]
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


def _cpu_installable(block: dict[str, Any], result: list) -> bool:
    """Whether ``soap_install_each`` takes the block: 2-D moments on the CPU, at least one
    refreshed dim, and new bases that need no conversion."""
    v = block["exp_avg_sq"]
    if v.device.type != "cpu" or v.dim() != 2 or all(r is None for r in result):
        return False
    return all(
        r is None or (r[0].dtype == v.dtype and r[0].device == v.device and r[1] is not None)
        for r in result
    )


def _install_on_cpu(blocks: list[dict[str, Any]], results: list[list]) -> None:
    """``SOAP.install_refresh`` of 2-D CPU blocks in one operator (Note [SOAP installs on the
    CPU] in csrc/core/soap_step.cpp)."""
    old = [
        [None if r[d] is None else b["bases"][d] for b, r in zip(blocks, results)] for d in (0, 1)
    ]
    new = [[None if r[d] is None else r[d][0] for r in results] for d in (0, 1)]
    perm = [[None if r[d] is None else r[d][1] for r in results] for d in (0, 1)]
    ms, vs = soap_install_each(
        [b["exp_avg"] for b in blocks], [b["exp_avg_sq"] for b in blocks], *old, *new, *perm
    )
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
# Natively the due blocks of a step are installed together (Note [Batched refreshes] in
# refresher.py): per group of blocks whose moments and bases agree in shape, dtype and layout,
# ``v``'s permutations are one ``index_select`` of rows per dim (``batched.index_select_each``: an
# exact gather, as each block's own ``index_select``), ``m``'s rotation is one ``bmm`` per dim for
# ``R = Q_old^T Q_new`` or the back-and-forth ``batched_mode_products`` (Note [Batched steps] in
# batched.py: ``bmm`` on operands in ``mm``'s layouts), and the results are copied into each block's
# own ``m`` and ``v`` (one ``_foreach_copy_`` each: state stays per block). On the CPU every block's
# state is bitwise ``install_refresh``'s (tests/unit/test_batched_roots.py, test_batched_steps.py);
# blocks whose products ``bmm`` would round otherwise (``block_key``) are installed alone. A runtime
# installs block by block (``install_refresh``), at the boundaries its schedule picks.


def _block_end(c: _BlockStep, freq: int, stats: dict[BlockKey, tuple]) -> BlockEnd:
    """A block's factor statistics (none for an unfactored block; its shape group's, or
    ``_after_group``, for the others: ``_statistics``) and refresh decision."""
    fn, args = stats.get(c.key, (None, ()))
    return BlockEnd(c.key, c.block, c.step, c.step % freq == 0, fn, args)


def _statistics(work: list[_BlockStep], beta: float) -> dict[BlockKey, tuple]:
    """Per factored block, its statistics update ``(fn, args)``: a shape group's first block
    updates the factors of the whole group (``_group_statistics``: one ``bmm`` per factored
    dim), the group's other blocks then have ``_after_group``. A refresher runs them in block
    order (now, or in order on its lane), so every block's factors are updated before its
    boundary, as when each block updated its own (Note [Batched steps] in batched.py)."""
    factored = [c for c in work if any(f is not None for f in c.block["factors"])]
    out: dict[BlockKey, tuple] = {}
    for idx in shape_groups(factored, _factors_key):
        group = [factored[i] for i in idx]
        first = group[0]
        if len(group) == 1:
            fs = first.block["factors"]
            fn = soap_accumulate if first.grad.dim() == 2 else _accumulate_factors
            out[first.key] = (fn, (fs, first.grad, beta))
            continue
        args = ([c.block["factors"] for c in group], [c.grad for c in group], beta)
        out[first.key] = (_group_statistics, args)
        for c in group[1:]:
            out[c.key] = (_after_group, ())
    return out


def _group_statistics(factors: list[list], grads: list[torch.Tensor], beta: float) -> None:
    """``_accumulate_factors`` of a shape group's blocks: ``F_i <- lerp(F_i, G_(i) G_(i)^T,
    1 - beta)``, the Gram matrices of all blocks in one ``bmm``, the EMAs in one foreach op."""
    g = stack(grads)
    for i, f in enumerate(factors[0]):
        if f is not None:
            grams = batched_gram(g, i)
            torch._foreach_lerp_([fs[i] for fs in factors], list(grams.unbind(0)), 1 - beta)


def _after_group() -> None:
    """The statistics of a block whose shape group's first block updated them all."""


def _factors_key(c: _BlockStep) -> tuple:
    return (block_key(c.grad), tuple(f is not None for f in c.block["factors"]))


def _shape_key(c: _BlockStep) -> tuple:
    return (block_key(c.grad), tuple(tensor_key(q) for q in c.block["bases"]))


def _elements(c: _BlockStep) -> int:
    return c.grad.numel()


def _accumulate_factors(factors: list[torch.Tensor | None], g: torch.Tensor, beta: float) -> None:
    """One step of the factor EMAs: ``F_i <- beta F_i + (1 - beta) G_(i) G_(i)^T``."""
    for i, f in enumerate(factors):
        if f is not None:
            f.lerp_(gram(g, i), 1 - beta)
