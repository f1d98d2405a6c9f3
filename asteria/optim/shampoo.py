"""Shampoo (Gupta et al., 2018) with grafting, as Meta's Distributed Shampoo computes it.

Owns: Shampoo's math for one block, with Meta's option names, meanings and defaults
(facebookresearch/optimizers ``DistributedShampoo`` with ``RootInvShampooPreconditionerConfig``;
docs/fidelity.md): the parameter's view (size-1 dims squeezed, small dims merged from the last
down while their product stays ``<= max_preconditioner_dim``: Meta's ``merge_small_dims``; then
blocks of at most that: ``multi_dim_split``; 1-D views a full factor with exponent ``1/2``); the
factors ``L_i = b2 L_i + (1 - b2) G_(i) G_(i)^T`` (sums at ``b2 == 1``), kept bias-corrected with
``use_bias_correction``; the roots ``L_i^{-1/(2k)}`` (Meta's shift below ``epsilon``: Note
[Singular factors] in matrix_functions.py) at ``start_preconditioning_step`` and every multiple of
the frequency after it; the preconditioned first moment ``M`` (bias-corrected), grafted per block
(``P * ||graft|| / (||P|| + 1e-16)``; the grafting method alone before the start); decoupled
weight decay before momentum (Meta's ``ClassicMomentumConfig``), then ``W -= lr P``: before the
start with Adam grafting exactly ``torch.optim.AdamW``.

Where Asteria differs from Meta (docs/fidelity.md has the table and the reasons): Adam grafting
by default (``grafting="none"`` is Meta's default exactly); a block without roots yet takes the
grafting direction (Meta: identity roots); a ``start_preconditioning_step`` below the frequency
is allowed; a failed root keeps all the block's previous roots, and ``max_consecutive_failures``
in a row raise (Note [Refresh failures] in refresher.py); step counts are per parameter;
``"rmsprop"`` grafting takes ``grafting_beta2`` 0.999; ``refresh_dtype`` is Meta's
``factor_matrix_dtype``.

Must not: know about runtimes, pools or memory tiers.
"""

from __future__ import annotations

from typing import Any

import torch

from asteria.optim.base import KroneckerOptimizer, ParamsT
from asteria.optim.blocking import ParamLayout, make_layout
from asteria.optim.checks import check_betas, check_range
from asteria.optim.kernels import shampoo as kernel
from asteria.optim.refresher import RefreshJob, RootRefresh
from asteria.optim.tensors import state_dtype

__all__ = ["Shampoo", "GRAFTINGS", "merge_small_dims_reversed"]

GRAFTINGS = ("adam", "rmsprop", "adagrad", "sgd", "none")

#: Note [Young factors] in asteria/runtime/schedule.py: a root that misses this share of its
#: factor's statistics or more is refreshed at its step.
YOUNG_SHARE = 0.25


def new_mass_share(step: int, group: dict[str, Any]) -> float:
    """The share of a factor's statistics at ``step`` the last ``precondition_frequency`` steps
    brought, gradients of equal size assumed: ``1 - b2^f m(t - f) / m(t)`` with ``m(t) = sum_{i<t}
    b2^i`` (``f / t`` at ``b2 = 1``, 1 for ``t <= f``); bias correction leaves it unchanged."""
    f = group["precondition_frequency"]
    if step <= f:
        return 1.0
    b2 = group["betas"][1]
    if b2 >= 1.0:
        return f / step
    return 1.0 - b2**f * (1.0 - b2 ** (step - f)) / (1.0 - b2**step)


class Shampoo(KroneckerOptimizer):
    """Shampoo with Meta's Distributed Shampoo option names and defaults.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: ``(beta1, beta2)``: the first moment's, the factors' (``1.0``: sums, Meta's).
        epsilon: added to the factors' eigenvalues before the root.
        rel_epsilon: where larger, ``rel_epsilon * ||L||_inf`` is added instead (Meta's
            ``CoupledHigherOrderConfig.rel_epsilon``; ``0.0``: Meta's ``EigenConfig``). Note
            [Damping stale roots].
        weight_decay: decoupled weight decay, added to the direction before momentum.
        max_preconditioner_dim: largest factor dim; larger dims are split, small ones merged.
        precondition_frequency: recompute the inverse roots every this many steps.
        start_preconditioning_step: the first step on the Shampoo direction (its roots computed
            then); ``-1`` or ``None``: ``precondition_frequency``.
        use_bias_correction: divide the first moment by ``1 - b1^t`` and ``b2 < 1`` factors by
            ``1 - b2^t``.
        grafting: ``"adam"`` (not Meta's default: the module docstring), ``"rmsprop"``,
            ``"adagrad"``, ``"sgd"`` or ``"none"`` (Meta's ``grafting_config``).
        grafting_beta2, grafting_epsilon: the grafting method's second-moment EMA and epsilon.
        momentum: momentum on the direction (Meta's ``ClassicMomentumConfig``).
        merge_dims: merge small dims as Meta does (``False``: only squeeze size-1 dims).
        refresh_dtype: precision of the root computation.
    """

    kernel = kernel
    phases = ("statistics", "plan", "update")  # the roots of step t precondition step t
    bases_field = "roots"
    install_reads_bases = False

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 1.0),
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int | None = -1,
        use_bias_correction: bool = True,
        grafting: str = "adam",
        grafting_beta2: float = 0.999,
        grafting_epsilon: float = 1e-10,
        momentum: float = 0.0,
        merge_dims: bool = True,
        refresh_dtype: torch.dtype = torch.float32,
        rel_epsilon: float = 0.0,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, (list, tuple)) else betas,
            epsilon=epsilon,
            rel_epsilon=rel_epsilon,
            weight_decay=weight_decay,
            max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step,
            use_bias_correction=use_bias_correction,
            grafting=grafting,
            grafting_beta2=grafting_beta2,
            grafting_epsilon=grafting_epsilon,
            momentum=momentum,
            merge_dims=merge_dims,
            refresh_dtype=refresh_dtype,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        check_betas(group["betas"], second_may_be_one=True)
        check_range("epsilon", group["epsilon"], 0.0, low_inclusive=False)
        check_range("rel_epsilon", group.get("rel_epsilon", 0.0), 0.0)
        if group["grafting"] not in GRAFTINGS:
            raise ValueError(f"grafting must be one of {GRAFTINGS}, got {group['grafting']!r}")
        check_range("grafting_beta2", group["grafting_beta2"], 0.0, 1.0, high_inclusive=False)
        check_range("grafting_epsilon", group["grafting_epsilon"], 0.0)
        check_range("momentum", group["momentum"], 0.0, 1.0, high_inclusive=False)
        start = group["start_preconditioning_step"]
        if start is not None and not (isinstance(start, int) and start == -1):
            check_range("start_preconditioning_step (or -1)", start, 1, integer=True)
        for flag in ("use_bias_correction", "merge_dims"):
            if not isinstance(group[flag], bool):
                raise ValueError(f"{flag} must be True or False, got {group[flag]!r}")

    def _layout_key(self, p: torch.Tensor, group: dict[str, Any]) -> tuple:
        return super()._layout_key(p, group) + (group["merge_dims"],)

    def _sums_statistics(self, group: dict[str, Any]) -> bool:
        """Factors are plain sums at ``betas[1] == 1`` (Meta's default); Adagrad grafting sums
        squared gradients (Note [Overflowing gradients] in overflow.py)."""
        return group["betas"][1] == 1.0 or group["grafting"] == "adagrad"

    def _largest_summed(self, p, state, group) -> float:
        largest = [torch.zeros(())]
        if group["betas"][1] == 1.0:  # a PSD factor's largest entry is on its diagonal
            largest += [f.diagonal().max() for b in state.get("blocks", ()) for f in b["factors"]]
        if group["grafting"] == "adagrad":
            largest.append(state["exp_avg_sq"].max())
        return float(torch.stack([x.float().cpu() for x in largest]).max())

    def _layout(self, p: torch.Tensor, group: dict[str, Any]) -> ParamLayout:
        max_dim = group["max_preconditioner_dim"]
        shape = tuple(int(d) for d in p.shape)
        if group["merge_dims"]:
            view = merge_small_dims_reversed(shape, max_dim)
        else:
            view = tuple(d for d in shape if d != 1) or (1,)
        return make_layout(view, max_dim, squeeze=False, factor_1d=True)

    def refresh_due(self, step: int, group: dict[str, Any]) -> bool:
        """Meta's ``perform_amortized_computation``: at the start, and at every multiple of the
        frequency after it."""
        start = group["start_preconditioning_step"]  # (``kernel.start_step``, inline)
        start = group["precondition_frequency"] if start is None or start == -1 else start
        return step > 0 and (
            step == start or (step > start and step % group["precondition_frequency"] == 0)
        )

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
        return True  # the first step updates the parameter too

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

    # Note [Damping stale roots]: a root of L_s used at a later step t amplifies the directions
    # of the gradients since s that L_s lacks by up to epsilon^{-1/(2k)}, and the grafting puts
    # the block's whole step on them; native Shampoo meets this between its refreshes, a
    # runtime's late roots on more steps. ``rel_epsilon`` damps relative to the factor's scale,
    # off by default (Meta's 0.0): with Meta's shifts the gap late roots cost is the lateness,
    # which the runtime's schedule removes instead (Notes [Staggered refresh], [First roots] in
    # asteria/runtime/schedule.py). The runs: docs/benchmarks.md, "Shampoo's gap to native".

    # -- the refresh, split so that a runtime can run it elsewhere ---------------------------

    def refresh_urgent(self, block: dict[str, Any], step: int, group: dict[str, Any]) -> bool:
        """Judged at the refresh due at or after ``step`` (``t``): a factor that may still be
        rank-deficient (a block of ``n`` elements gains at most ``n / d_i`` dims of rank a step: ``t
        * n / d_i < d_i``), or factors the last interval brought a large share of
        (``new_mass_share(t) >= YOUNG_SHARE``: Note [Young factors])."""
        f = group["precondition_frequency"]
        t = -(-step // f) * f  # the refresh due at or after ``step``
        if new_mass_share(t, group) >= YOUNG_SHARE:
            return True
        numel = 1
        for factor in block["factors"]:
            numel *= factor.shape[0]
        for factor in block["factors"]:  # (loops: no call per block)
            d = factor.shape[0]
            if t * (numel // d) < d:
                return True
        return False

    def refresh_jobs(self, block: dict[str, Any], group: dict[str, Any]) -> list[RefreshJob]:
        """``L_i^{-1/(2k)}`` for every factor of an order-k block (``1/2`` for 1-D blocks)."""
        factors, jobs = block["factors"], []
        eps, dtype, rel = group["epsilon"], group["refresh_dtype"], group.get("rel_epsilon", 0.0)
        root = 2 * len(factors)
        for f in factors:  # (a loop: no call per request)
            jobs.append(RootRefresh(f, root=root, epsilon=eps, dtype=dtype, rel_epsilon=rel))
        return jobs

    def install_refresh(self, block: dict[str, Any], results: list[Any]) -> None:
        self.install_refresh_many([block], [results])

    def install_refresh_many(self, blocks: list[dict[str, Any]], results: list[list]) -> None:
        """The new roots, in the factors' dtype and device (loops: no call per block)."""
        for block, result in zip(blocks, results):
            roots = []
            for r, f in zip(result, block["factors"]):
                roots.append(r.to(dtype=f.dtype, device=f.device))
            block["roots"] = roots


def merge_small_dims_reversed(shape: tuple[int, ...], max_dim: int) -> tuple[int, ...]:
    """Meta's ``merge_small_dims`` (``target_parameter_dimensionality=1``): size-1 dims dropped
    (all of them: ``(1,)``), then from the last dim to the first, each dim merged into the one
    after it while their product stays ``<= max_dim``. ``(2, 5)`` at 10 -> ``(10,)``;
    ``(32, 3, 64, 64)`` at 8192 -> ``(96, 4096)``."""
    dims = [d for d in reversed(shape) if d != 1] or [1]
    merged = [dims[0]]
    for d in dims[1:]:
        if merged[-1] * d <= max_dim:
            merged[-1] *= d
        else:
            merged.append(d)
    return tuple(reversed(merged))
