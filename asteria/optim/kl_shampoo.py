"""KL-Shampoo (Lin et al., arXiv 2509.03378): Shampoo's factors estimated under a two-sided KL.

Owns: KL-Shampoo's math for one block, as the authors' code defines it (yorkerlin/KL-Methods,
``optim/kl_opt.py``, ``KLOpt`` with ``using_klsoap=False``; docs/fidelity.md): factors coupled
through the other factors' bases and eigenvalue estimates, per-factor eigenvalue estimates
re-estimated every step in the current (possibly stale) basis, the ``-1/2`` exponent per factor,
the update's damping ``s / (1 + eps * s)`` (``s`` the outer product of the factors'
``lambda^{-1/2}``, ``eps`` the group's eps: the authors' ``klshampoo_update``), no Adam and no
grafting, bases refreshed by one power iteration + QR every ``precondition_frequency`` steps.

The authors' code has a 2-D and a 3-D path; both are followed to the operation order:
  * 2-D: every factor and eigenvalue update of a step reads the bases and eigenvalues from
    before that step;
  * 3-D: the authors update the eigenvalues of dims 2 and 1 before the factor and eigenvalue of
    dim 0 read them (``_statistics_3d``: which estimate each statistic reads, old or new).

Where Asteria goes beyond the authors' code (their code has no such path):
  * tensors of order >= 4 (the authors assert order 2 or 3): every factor and eigenvalue update
    reads the bases and eigenvalues from before the step, the 2-D rule;
  * 1-D parameters run AdamW with the group's lr, betas, eps and weight decay (the authors hand
    them to a separate AdamW; their ``KLOpt`` cannot take them);
  * large dims are split into blocks of at most ``max_preconditioner_dim``, each block its own
    KL-Shampoo (the authors precondition every dim whole); a block's clamp uses the block's dim;
  * state and arithmetic are fp32, or the parameter's dtype when wider (the authors default to
    bf16 everywhere except QR/eigh, which run in fp32; ``refresh_dtype`` chooses here).
Not implemented: the authors' non-default options ``using_damping=True`` (a damping of the
curvature estimates), ``using_clamping=False``, ``normalize_grads=True`` and KL-SOAP.

How it differs from heavyball's ``KLShampoo``: heavyball takes the eigenvalues from
``diag(Q^T S Q)`` at each step instead of a separate EMA, seeds the factors with
``init_factor * I``, debiases ``shampoo_beta`` and balances the factors' scales; none of that is
in the authors' algorithm, so Asteria follows the authors.

Must not: know about runtimes, pools or memory tiers.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch

from asteria.optim import matrix_functions as mf
from asteria.optim.base import (
    BlockEnd,
    BlockKey,
    KroneckerOptimizer,
    ParamsT,
    QRRefresh,
    RefreshJob,
    Update,
    adamw_update,
    basis_zeros,
    block_views,
    check_betas,
    check_range,
    check_shampoo_beta,
    shampoo_beta,
    state_dtype,
)
from asteria.optim.batched import (
    bases_bytes,
    bases_of,
    bases_room,
    block_key,
    group_pieces,
    in_turns,
    mm,
    shape_groups,
    tensor_key,
)
from asteria.optim.blocking import ParamLayout, make_layout
from asteria.optim.kl_step import (
    adamw_group,
    first_moments,
    statistics_2d,
    statistics_key,
    update_group,
)
from asteria.optim.kron import gram, mode_products, mode_scale

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

    reads_bases_through_refresher = True
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
        return _whitening_gain(shapes, float(group["max_clamp_value"]))

    # -- the algorithm ------------------------------------------------------------------------

    def _init_param(self, pid, p, grad, group, state, layout) -> None:
        if not layout.blocks[0].factored[0]:  # a vector: AdamW
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(grad)
            state["exp_avg_sq"] = torch.zeros_like(grad)
            self._update_param(pid, p, grad, group, state, layout)
            return
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

    def _update_params(self, group: dict[str, Any], updates: list[Update]) -> None:
        """The group's updates in pieces of blocks (Note [KL steps in pieces]): the waits for
        each block's statistics (in the training thread); per piece, its bases in one call, its
        blocks' updates (split by flops, so that the refresher may run half of them on another
        thread: Note [Split updates] in asteria/runtime/lane.py) and their statistics while
        those bases are valid; then each block's refresh decision, in the per-parameter path's
        block order. Per block, the same ops on the same tensors as ``_update_param``; a
        refresher whose bases are valid only until its next ``bases`` call and that cannot hand
        out several at once (no ``bases_many``) gets that path instead."""
        refresher = self._refresher
        if not refresher.bases_stable and not hasattr(refresher, "bases_many"):
            super()._update_params(group, updates)
            return
        beta1, lr, eps = group["betas"][0], group["lr"], group["eps"]
        adamw_group([u for u in updates if "blocks" not in u.state], group)
        work: list[_KLBlock] = []
        for u in updates:
            if "blocks" not in u.state:
                continue
            u.state["step"] += 1
            for bi, (spec, b, g, w) in enumerate(
                zip(
                    u.layout.blocks,
                    u.state["blocks"],
                    block_views(u.grad, u.layout),
                    block_views(u.p, u.layout),
                )
            ):
                key = (u.pid, bi)
                refresher.block_begin(key, b)  # the last step's statistics are in
                work.append(_KLBlock(key, b, g, w, [], spec.numel, u))
        beta, clamp = shampoo_beta(group), group["max_clamp_value"]
        first_moments(work, beta1)  # (reads no bases: one op for every piece)
        grouped = [[work[i] for i in idx] for idx in shape_groups(work, _piece_key)]
        pieces = group_pieces(grouped, _elements, bases_bytes, bases_room(refresher))
        step = work[0].update.state["step"] if work else 0
        for piece in in_turns(pieces, step):  # Note [Reads in turns] in shampoo_step.py
            bases = bases_of(refresher, [k.key for k in piece], [k.block for k in piece])
            piece = [k._replace(bases=list(q)) for k, q in zip(piece, bases)]
            self._run_split(_update_blocks, piece, _update_flops, lr, eps)
            # the statistics read the piece's bases: handed over before the next bases_many
            for key, (fn, args) in self._statistics(piece, beta, clamp).items():
                refresher.accumulate(key, fn, *args)
        freq = group["precondition_frequency"]
        self._end_blocks(group, (_boundary(k, freq) for k in work))
        if group["weight_decay"] > 0.0:
            ps = [u.p for u in updates if "blocks" in u.state]
            if ps:
                torch._foreach_add_(ps, ps, alpha=-lr * group["weight_decay"])

    def _statistics(self, work: list[_KLBlock], beta: float, clamp: float) -> dict:
        """Per block, its statistics ``(fn, args)``: matrix blocks of one shape together
        (``kl_step.statistics_2d`` at the group's first block, ``_after_group`` at the others,
        which a refresher runs after it: Note [Batched steps]); the others their own."""
        out: dict[BlockKey, tuple] = {}
        for idx in shape_groups(work, statistics_key):
            group = [work[i] for i in idx]
            k = group[0]
            if len(group) == 1 or statistics_key(k) is None:
                for k in group:
                    out[k.key] = (self._update_statistics, (k.block, k.bases, k.grad, k.numel,
                                                            beta, clamp))  # fmt: skip
                continue
            args = ([c.block for c in group], [c.bases for c in group], [c.grad for c in group],
                    k.numel, beta, clamp)  # fmt: skip
            out[k.key] = (statistics_2d, args)
            for c in group[1:]:
                out[c.key] = (_after_group, ())
        return out

    def _update_param(self, pid, p, grad, group, state, layout) -> None:
        if "blocks" not in state:
            adamw_update(
                p, grad, state, group["lr"], group["betas"], group["eps"], group["weight_decay"]
            )
            return
        beta1 = group["betas"][0]
        beta = shampoo_beta(group)
        state["step"] += 1
        refresh = state["step"] % group["precondition_frequency"] == 0
        views = zip(
            layout.blocks, state["blocks"], block_views(grad, layout), block_views(p, layout)
        )

        def ends():  # each block is updated, then ended, before the next one is updated
            for bi, (spec, b, g, w) in enumerate(views):
                key = (pid, bi)
                self._refresher.block_begin(key, b)  # the last step's statistics are in
                bases = self._refresher.bases(key, b)  # b["bases"], or device copies
                _update_block(b, g, w, bases, beta1, group["lr"], group["eps"])
                # The statistics read this step's bases: a list of them travels with the
                # update, so a refresh installed at the boundary cannot change what they read.
                args = (b, list(bases), g, spec.numel, beta, group["max_clamp_value"])
                yield BlockEnd(key, b, state["step"], refresh, self._update_statistics, args)

        self._end_blocks(group, ends())
        if group["weight_decay"] > 0.0:
            p.add_(p, alpha=-group["lr"] * group["weight_decay"])

    @staticmethod
    def _update_statistics(
        b: dict[str, Any],
        bases: list[torch.Tensor],
        g: torch.Tensor,
        numel: int,
        beta: float,
        max_clamp_value: float,
    ) -> None:
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
            s[i] = _new_sqrt_inv(s[i], diags[i], beta, _clamp_max(g.shape[i], max_clamp_value))

    # -- the refresh, split so that a runtime can run it elsewhere ---------------------------

    def refresh_jobs(self, block: dict[str, Any], group: dict[str, Any]) -> list[RefreshJob]:
        """New bases: one power iteration + QR per factor, no sorting (the authors' rule)."""
        return [
            QRRefresh(f, q, sort=False, dtype=group["refresh_dtype"])
            for f, q in zip(block["factors"], block["bases"])
        ]

    def install_refresh(self, block: dict[str, Any], results: list[Any]) -> None:
        """Install new bases; the eigenvalue estimates carry over unchanged, as the authors do."""
        block["bases"] = [
            q.to(dtype=f.dtype, device=f.device) for (q, _), f in zip(results, block["factors"])
        ]


# Note [KL steps in pieces]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A step's matrix blocks are updated per shape group (Note [Batched steps] in batched.py), in
# pieces: the shape groups in order, cut at ``BATCH_ELEMENTS`` and at the refresher's
# ``bases_room`` (``group_pieces``: a group that fits a piece lies in one). With the bases in
# the blocks' own tensors (native mode, the runtime's device bases) the room is unlimited and
# the step is one piece. Behind a device window the bases one ``bases_many`` call hands out are
# valid only until the next call (their slot is refilled), so a piece's statistics, which read
# them (the rotations of the gradient, the projection), are handed to the refresher in the
# piece, right after its update; ``accumulate`` runs them at once, as no statistics lane runs
# with the window (asteria/runtime/attach.py). The refresh decisions (``block_boundary``) come
# after every piece, in the blocks' order: the blocks are independent, and each block's
# statistics still precede its own boundary, as in the per-parameter path. An install at a
# boundary cannot change what a statistics call reads: the call holds the list of bases its
# update read (an install replaces the block's list entries, never a tensor in place), every
# statistics call of the step was issued before the first boundary, and the window refills a
# slot only after the event recorded after its last reader (Note [Bases window] in
# asteria/memory/window.py); KL-Shampoo's install reads no bases (``install_reads_bases``), so
# the window's ``install_many`` fills no slot for it. On the CPU the results are bitwise the
# per-block path's (tests/unit/test_kl_window.py). The first moments read no bases: one
# ``_foreach_lerp_`` for every piece of the step, before them. What a piece costs beyond
# native's single piece is then its ``bases_many`` (a window fill, one grouped copy and one
# event, where the window does not hold the piece already) and, for a shape group cut across
# two pieces (one larger than the window's slot), that group's stacks and products again.


class _KLBlock(NamedTuple):
    """One matrix block's part of a step: its key and state, gradient and weight views, the
    bases its update and statistics read, its element count, and its parameter's update."""

    key: BlockKey
    block: dict[str, Any]
    grad: torch.Tensor
    weight: torch.Tensor
    bases: list[torch.Tensor]
    numel: int
    update: Update


def _boundary(k: _KLBlock, freq: int) -> BlockEnd:
    """A block's refresh decision (its statistics were handed over with its piece)."""
    step = k.update.state["step"]
    return BlockEnd(k.key, k.block, step, step % freq == 0, None, ())


def _piece_key(k: _KLBlock) -> tuple:
    """The shape group a block's piece keeps together: its gradient's and its bases' layouts
    (``kl_step`` groups a piece's blocks by the bases it was handed)."""
    return (block_key(k.grad), *(tensor_key(q) for q in k.block["bases"]))


def _elements(k: _KLBlock) -> int:
    return k.numel


def _update_flops(k: _KLBlock) -> float:
    """About the flops of a block's update: a product into and out of each basis."""
    return float(k.grad.numel() * (4 * sum(q.shape[0] for q in k.bases) + 4))


def _update_block(
    b: dict[str, Any],
    g: torch.Tensor,
    w: torch.Tensor,
    bases: list[torch.Tensor],
    beta1: float,
    lr: float,
    eps: float,
) -> None:
    """The update part of a step for one block (the authors' ``klshampoo_update``):
    ``M <- lerp(M, G, 1 - beta1)``; ``s = s_0 o s_1 o ...`` damped to ``s / (1 + eps * s)``;
    ``W -= lr * (Q^T M Q * s) in the original basis``."""
    b["exp_avg"].lerp_(g, 1 - beta1)
    _project_update(b, w, bases, lr, eps)


def _project_update(
    b: dict[str, Any], w: torch.Tensor, bases: list[torch.Tensor], lr: float, eps: float
) -> None:
    """``_update_block`` after the first moment's EMA."""
    projected = mode_products(b["exp_avg"], bases, True)
    s = _outer(b["eigen_sqrt_inv"])
    if eps > 0.0:
        s.div_(1.0 + s * eps)
    w.add_(mode_products(projected * s, bases, False), alpha=-lr)


def _update_blocks(blocks: list[_KLBlock], lr: float, eps: float) -> None:
    """``_update_block`` for every block after its first moment's EMA, per shape group
    (``kl_step.update_group``)."""
    update_group(blocks, lr, eps)


def _after_group() -> None:
    """The statistics of a block whose shape group's first block updated them all."""


def _outer(vectors: list[torch.Tensor]) -> torch.Tensor:
    """``v_0 o v_1 o ...``, a new tensor of shape ``(len(v_0), len(v_1), ...)``."""
    k = len(vectors)
    out = vectors[0].view([-1] + [1] * (k - 1))
    for j in range(1, k):
        shape = [1] * k
        shape[j] = -1
        out = out * vectors[j].view(shape)
    return out if k > 1 else out.clone()


@functools.cache
def _whitening_gain(shapes: tuple[tuple[int, ...], ...], max_clamp_value: float) -> float:
    """The largest ``prod_{j != i} clamp_j^2`` over the blocks of ``shapes`` and their dims."""
    gain = 1.0
    for shape in shapes:
        clamps = [_clamp_max(d, max_clamp_value) ** 2 for d in shape]
        for i in range(len(shape) if len(shape) > 1 else 0):
            gain = max(gain, math.prod(c for j, c in enumerate(clamps) if j != i))
    return gain


def _clamp_max(d: int, max_clamp_value: float) -> float:
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


def _statistics_3d(
    b: dict[str, Any],
    bases: list[torch.Tensor],
    g: torch.Tensor,
    numel: int,
    beta: float,
    max_clamp_value: float,
) -> None:
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
        s[i] = _new_sqrt_inv(s[i], diag, beta, _clamp_max(g.shape[i], max_clamp_value))

    projected = mode_products(g, bases, True)
    factor(2, [old[0], old[1], None])
    factor(1, [old[0], None, old[2]])
    estimate(2, [old[0], old[1], None])
    estimate(1, [old[0], None, s[2]])
    factor(0, [None, s[1], old[2]])
    estimate(0, [None, s[1], old[2]])
