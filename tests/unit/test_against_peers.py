"""Asteria's optimizers against peer implementations where their semantics coincide.

* SOAP against pytorch-optimizer's ``SOAP`` (a port that keeps the authors' signature).
* Shampoo with preconditioning not started against ``torch.optim.AdamW``: exactly equal.

Note [Degenerate eigenbases]: SOAP runs Adam in the eigenbasis of its factors. When a factor has a
repeated eigenvalue (a rank-deficient first factor, or a gradient that repeats the one the factor
was built from), the basis of that eigenspace is arbitrary and Adam normalises round-off there,
so any two correct implementations drift apart. The problems below draw fresh gradient noise every
step and use shapes whose first factors have at most a one-dimensional null space (a sign flip of
one basis vector leaves the update unchanged).
"""

from __future__ import annotations

import pytest
import torch

from asteria.optim import SOAP, Shampoo
from tests.problems import StochasticQuartic, max_rel_diff

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")

SHAPES = [(6, 6), (5, 6), (4, 3, 2), (8,)]
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


class PeerSOAPWithRefreshInFactorDtype(pytorch_optimizer.SOAP):
    """pytorch-optimizer's SOAP with its QR refresh computed in the factors' dtype.

    The peer hard-codes float32 for the QR (``power_iter.to(torch.float32)``) while computing
    everything else in the parameter dtype; this override computes the same steps (estimated
    eigenvalues, argsort, permutation of ``exp_avg_sq``, one power iteration, QR) in the factors'
    dtype, so a float64 run of the peer is float64 throughout, as Asteria's is with
    ``refresh_dtype=torch.float64``. In float32 the override is the peer's own arithmetic.
    """

    def get_orthogonal_matrix_qr(self, state, max_precondition_dim=10000, merge_dims=False):
        exp_avg_sq = state["exp_avg_sq"]
        original_shape = exp_avg_sq.shape
        if merge_dims:
            exp_avg_sq = self.merge_dims(exp_avg_sq, max_precondition_dim)
        bases = []
        for dim, (factor, basis) in enumerate(zip(state["GG"], state["Q"])):
            if len(factor) == 0:
                bases.append([])
                continue
            product = factor @ basis
            order = torch.argsort((basis * product).sum(dim=0), descending=True)
            exp_avg_sq = exp_avg_sq.index_select(dim, order)
            bases.append(torch.linalg.qr(product.index_select(1, order))[0])
        state["exp_avg_sq"] = exp_avg_sq.reshape(original_shape)
        return bases


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "options",
    [
        dict(precondition_1d=True),
        dict(precondition_1d=False, correct_bias=False, betas=(0.9, 0.99)),
        dict(precondition_1d=True, shampoo_beta=0.9, weight_decay=0.0),
        dict(merge_dims=True, max_preconditioner_dim=8),
    ],
    ids=["default", "no-bias-correction", "shampoo-beta", "merge-dims"],
)
def test_soap_matches_pytorch_optimizer(dtype, options):
    steps = 120  # 12 refreshes at precondition_frequency=10
    # pytorch-optimizer's merge_small_dims breaks on 1-D tensors (it reshapes (8,) to (1,)), so
    # the merge_dims case compares tensors of order >= 2 only, whose dims do get merged.
    shapes = [(6, 6), (4, 3, 2), (2, 3, 4)] if options.get("merge_dims") else SHAPES
    problem = StochasticQuartic(shapes, steps, dtype)
    ours_kw = dict(lr=3e-3, betas=(0.95, 0.95), weight_decay=0.01, precondition_frequency=10)
    ours_kw.update(options)
    peer_kw = dict(ours_kw)
    peer_kw["max_precondition_dim"] = peer_kw.pop("max_preconditioner_dim", 10000)

    ours = problem.run(lambda ps: SOAP(ps, refresh_dtype=dtype, **ours_kw))
    peer = problem.run(lambda ps: PeerSOAPWithRefreshInFactorDtype(ps, **peer_kw))
    assert max_rel_diff(ours, peer) <= TOLERANCE[dtype]
    # The run moved the parameters well beyond the tolerance: the comparison is not vacuous.
    assert max_rel_diff(ours, problem.init) > 1e3 * TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_shampoo_before_preconditioning_is_adamw_exactly(dtype, weight_decay):
    steps = 60
    problem = StochasticQuartic([(6, 5), (7,), (3, 4, 2)], steps, dtype)
    lr, betas, eps = 1e-2, (0.9, 0.99), 1e-8
    ours = problem.run(
        lambda ps: Shampoo(
            ps,
            lr=lr,
            betas=(betas[0], 1.0),
            grafting_epsilon=eps,
            weight_decay=weight_decay,
            grafting="adam",
            grafting_beta2=betas[1],
            start_preconditioning_step=steps + 1,
        )
    )
    adamw = problem.run(
        lambda ps: torch.optim.AdamW(
            ps, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
        )
    )
    for a, b in zip(ours, adamw):
        assert torch.equal(a, b)


def test_shampoo_preconditioning_changes_the_update():
    """Guard for the test above: once preconditioning starts, Shampoo is no longer AdamW."""
    problem = StochasticQuartic([(6, 5)], 20, torch.float64)
    ours = problem.run(lambda ps: Shampoo(ps, lr=1e-2, start_preconditioning_step=5))
    adamw = problem.run(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    )
    assert max_rel_diff(ours, adamw) > 1e-4
