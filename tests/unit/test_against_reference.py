"""Asteria's optimizers against tests/reference.py, step for step.

tests/reference.py is a plain, slow implementation written from the papers and the authors'
code (its docstring names them), independently of asteria/optim. Every comparison runs >= 100
steps that include refreshes, with fresh gradient noise every step (see Note [Degenerate
eigenbases] in test_against_peers.py).
Tolerances: relative parameter difference <= 1e-10 in float64 (with float64 refreshes on both
sides) and <= 1e-5 in float32.
"""

from __future__ import annotations

import pytest
import torch

from asteria.optim import SOAP, KLShampoo, Shampoo
from tests.problems import StochasticQuartic, max_rel_diff
from tests.reference import RefKLShampoo, RefShampoo, RefSOAP

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
STEPS = 110


def _run_reference(problem: StochasticQuartic, make_ref) -> list[torch.Tensor]:
    params = [t.clone() for t in problem.init]
    ref = make_ref(params)
    for t in range(problem.steps):
        ref.step(problem.grads(params, t))
    return params


CASES = {
    "soap": (SOAP, RefSOAP, [(6, 6), (5, 6), (4, 3, 2), (8,)], dict(precondition_1d=True)),
    "soap-adam-1d": (SOAP, RefSOAP, [(6, 5), (7,)], dict(betas=(0.9, 0.99), shampoo_beta=0.9)),
    "soap-merge": (
        SOAP,
        RefSOAP,
        [(2, 3, 4), (6, 6)],
        dict(merge_dims=True, max_preconditioner_dim=8),
    ),
    "soap-normalize": (
        SOAP,
        RefSOAP,
        [(6, 6), (4, 5)],
        dict(normalize_grads=True, correct_bias=False),
    ),
    "kl_shampoo": (KLShampoo, RefKLShampoo, [(6, 6), (5, 6), (4, 3, 2), (7,)], dict(lr=3e-3)),
    "kl_shampoo-clamp": (
        KLShampoo,
        RefKLShampoo,
        [(6, 5), (3, 4, 2)],
        dict(lr=1e-3, init_factor=1e-4, max_clamp_value=20),
    ),
    # eps large enough that the update's damping s / (1 + eps s) changes every coordinate
    "kl_shampoo-damping": (
        KLShampoo,
        RefKLShampoo,
        [(6, 5), (4, 3, 2), (3, 4, 5)],
        dict(lr=3e-3, eps=1e-1, weight_decay=0.1, precondition_frequency=2),
    ),
    # Shampoo: first roots once every factor has had as many gradients as its dim (Note
    # [Well-posed comparisons] in test_against_meta.py); small dims are merged (Meta's rule)
    "shampoo": (
        Shampoo,
        RefShampoo,
        [(2, 5), (5, 6), (4, 3, 2), (7,)],
        dict(lr=1e-2, grafting="adam", precondition_frequency=5, start_preconditioning_step=30),
    ),
    "shampoo-no-merge": (
        Shampoo,
        RefShampoo,
        [(6, 5), (3, 4, 2), (1, 7)],
        dict(lr=1e-2, grafting="adam", merge_dims=False, precondition_frequency=7),
    ),
    "shampoo-ema-momentum": (
        Shampoo,
        RefShampoo,
        [(6, 5), (3, 4, 2)],
        dict(
            lr=1e-2,
            betas=(0.9, 0.99),
            grafting="adam",
            momentum=0.5,
            weight_decay=0.01,
            merge_dims=False,
            precondition_frequency=7,
            start_preconditioning_step=9,
        ),
    ),
    "shampoo-blocked-rmsprop": (
        Shampoo,
        RefShampoo,
        [(9, 7)],
        dict(
            lr=1e-2,
            grafting="rmsprop",
            max_preconditioner_dim=4,
            precondition_frequency=5,
            start_preconditioning_step=5,
        ),
    ),
    # a start below the frequency (Meta refuses it): roots at 3, then 10, 20, ...
    "shampoo-early-start": (
        Shampoo,
        RefShampoo,
        [(3, 2), (2, 1, 2)],
        dict(lr=1e-2, grafting="adam", precondition_frequency=10, start_preconditioning_step=6),
    ),
    "shampoo-adagrad": (
        Shampoo,
        RefShampoo,
        [(6, 6)],
        dict(lr=1e-2, grafting="adagrad", merge_dims=False, precondition_frequency=6),
    ),
    "shampoo-sgd": (
        Shampoo,
        RefShampoo,
        [(6, 6)],
        dict(lr=1e-3, grafting="sgd", merge_dims=False, precondition_frequency=6),
    ),
    "shampoo-none": (
        Shampoo,
        RefShampoo,
        [(6, 6)],
        dict(lr=1e-2, grafting="none", epsilon=1e-6, merge_dims=False, precondition_frequency=6),
    ),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(case, dtype):
    ours_cls, ref_cls, shapes, options = CASES[case]
    problem = StochasticQuartic(shapes, STEPS, dtype)
    kw = dict(options, refresh_dtype=dtype)
    ours = problem.run(lambda ps: ours_cls(ps, **kw))
    ref = _run_reference(problem, lambda ps: ref_cls(ps, **kw))
    assert max_rel_diff(ours, ref) <= TOLERANCE[dtype]
    assert max_rel_diff(ours, problem.init) > 1e3 * TOLERANCE[dtype], "the run must move"


def test_soap_float64_params_with_authors_float32_refresh():
    """The authors' setting: float64 parameters, float32 eigh/QR.

    Asteria carries the first moment between bases only at a refresh; the authors take it back
    and forth through the original space every step. With a basis orthogonal only to float32
    precision (~1e-7) those differ at that level, so the bound here is float32's.
    """
    problem = StochasticQuartic([(6, 6), (4, 3, 2)], STEPS, torch.float64)
    ours = problem.run(lambda ps: SOAP(ps, refresh_dtype=torch.float32))
    ref = _run_reference(problem, lambda ps: RefSOAP(ps, refresh_dtype=torch.float32))
    assert max_rel_diff(ours, ref) <= 1e-5


# KL-Shampoo against RefKLShampoo (a re-derivation of the authors' KLOpt) in float64, to the
# spread a 1e-15 nudge of one initial weight gives Asteria itself: every path of the authors'
# code (2-D and 3-D blocks, the first step, factor and eigenvalue updates, QR refreshes,
# clamping, the update's damping, weight decay).
KL_FLOOR_CASES = {
    "2d-3d": ([(6, 6), (5, 6), (4, 3, 2), (3, 4, 5)], dict(lr=3e-3, precondition_frequency=2)),
    "clamp": (
        [(6, 5), (3, 4, 2)],
        dict(lr=3e-3, init_factor=1e-4, max_clamp_value=20, precondition_frequency=3),
    ),
    "damping-wd": (
        [(6, 5), (4, 3, 2)],
        dict(lr=3e-3, eps=1e-1, weight_decay=0.1, precondition_frequency=2),
    ),
}


@pytest.mark.parametrize("case", sorted(KL_FLOOR_CASES))
def test_kl_shampoo_matches_the_authors_within_the_nudge_floor(case):
    shapes, options = KL_FLOOR_CASES[case]
    kw = dict(options, refresh_dtype=torch.float64)
    problem = StochasticQuartic(shapes, 60, torch.float64)
    ours = problem.run(lambda ps: KLShampoo(ps, **kw))
    ref = _run_reference(problem, lambda ps: RefKLShampoo(ps, **kw))
    nudged = StochasticQuartic(shapes, 60, torch.float64)
    nudged.init[0].view(-1)[0] += 1e-15
    floor = max_rel_diff(ours, nudged.run(lambda ps: KLShampoo(ps, **kw)))
    assert max_rel_diff(ours, ref) <= max(4 * floor, 1e-15), (max_rel_diff(ours, ref), floor)
    assert max_rel_diff(ours, problem.init) > 1e-2, "the run must move"


def test_soap_normalizes_a_split_parameter_as_a_whole():
    """normalize_grads: the authors divide a parameter's whole update by its RMS; a parameter
    split into blocks (block_large_dims) is normalized the same, not block by block."""
    problem = StochasticQuartic([(9, 4)], 12, torch.float64)
    params = problem.params()
    opt = SOAP(
        params,
        lr=1e-2,
        weight_decay=0.0,
        correct_bias=False,
        normalize_grads=True,
        max_preconditioner_dim=4,
        block_large_dims=True,
        precondition_frequency=3,
    )
    assert len(opt.layout(params[0], opt.param_groups[0]).blocks) == 3
    block_rms = []
    for t in range(12):
        before = params[0].detach().clone()
        opt.zero_grad()
        problem.loss(params, t).backward()
        opt.step()
        if t == 0:
            continue  # the first step only initialises
        delta = (before - params[0].detach()) / 1e-2
        assert abs(float(delta.square().mean().sqrt()) - 1.0) < 1e-12
        block_rms.append(float(delta[:4].square().mean().sqrt()))
    assert max(abs(r - 1.0) for r in block_rms) > 1e-3, "the blocks are not normalized apart"
