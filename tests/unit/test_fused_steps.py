"""SOAP's fused elementwise steps (Note [Fused elementwise steps] in asteria/optim/kernels/soap.py).

The fused step must give bitwise the parameters and state of the per-block ops it replaces, for
any chunking, across parameter groups, working copies (bf16 parameters) and parameters without
gradients.
"""

from __future__ import annotations

import pytest
import torch

from asteria import _C
from asteria.optim import SOAP
from asteria.optim import groups as grouping
from asteria.optim.kernels import shampoo_beta
from asteria.optim.kernels.soap import accumulate_factors
from asteria.optim.kron import mode_products
from asteria.optim.tensors import block_views
from tests.problems import state_tensors


def refresh_alone(opt, key, block, group, step, due) -> None:
    """The synchronous algorithm one block at a time: a due refresh computed alone and
    installed at once, as before Note [Batched refreshes]."""
    if due:
        results = [None if j is None else j.run() for j in opt.refresh_jobs(block, group)]
        opt.install_refresh(block, results)


class PerBlockSOAP(SOAP):
    """The oracle: steps 3-6 of SOAP one block and one op at a time (the authors' formulation),
    then each block's statistics and refresh alone."""

    def _run_group(self, group, updates):
        beta1, beta2 = group["betas"]
        for u in updates:
            u.state["step"] += 1
            t = u.state["step"]
            step_size = group["lr"] * (1 - beta2**t) ** 0.5 / (1 - beta1**t)
            blocks = u.state["blocks"]
            for b, g, w in zip(blocks, block_views(u.grad, u.layout), block_views(u.p, u.layout)):
                g_rot = mode_products(g, b["bases"], transpose=True)
                b["exp_avg"].mul_(beta1).add_(g_rot, alpha=1 - beta1)
                b["exp_avg_sq"].mul_(beta2).add_(g_rot.square(), alpha=1 - beta2)
                denom = b["exp_avg_sq"].sqrt().add_(group["eps"])
                update = mode_products(b["exp_avg"] / denom, b["bases"], transpose=False)
                w.add_(update, alpha=-step_size)
            u.p.add_(u.p, alpha=-group["lr"] * group["weight_decay"])
            beta = shampoo_beta(group)
            for bi, (b, g) in enumerate(zip(blocks, block_views(u.grad, u.layout))):
                accumulate_factors(b["factors"], g, beta)
                factored = any(f is not None for f in b["factors"])
                due = factored and t % group["precondition_frequency"] == 0
                refresh_alone(self, (u.pid, bi), b, group, t, due)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv1d(3, 6, 3),  # a 3-D weight
        torch.nn.Flatten(),
        torch.nn.Linear(36, 20),
        torch.nn.Tanh(),
        torch.nn.Linear(20, 4),
    )
    model[4].to(torch.bfloat16)  # updated through fp32 working copies, alone
    model.unused = torch.nn.Parameter(torch.ones(3))  # never gets a gradient
    return model


def _train(
    opt_cls, steps: int = 25, max_dim: int = 12
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model = _model()
    groups = [
        {"params": [model[0].weight, model[0].bias, model.unused]},
        {"params": [model[2].weight, model[2].bias], "lr": 3e-3, "betas": (0.9, 0.99)},
        {"params": list(model[4].parameters()), "weight_decay": 0.0},
    ]
    opt = opt_cls(groups, lr=1e-2, precondition_frequency=4, max_preconditioner_dim=max_dim)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 3, 8, generator=gen)
        hidden = model[3](model[2](model[1](model[0](x))))
        loss = model[4](hidden.to(torch.bfloat16)).float().square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = list(model.parameters())
    return [p.detach().clone() for p in params], list(state_tensors([opt.state[p] for p in params]))


@pytest.mark.parametrize("limit", [grouping.BATCH_ELEMENTS, 0, 300])
def test_batched_step_is_bitwise_the_per_block_ops_on_the_cpu(monkeypatch, limit):
    """Note [Batched steps]: on the CPU ``bmm`` sums as ``mm`` does, so the batched step is
    bitwise the per-block ops, cut into pieces of any size (0: one block a piece)."""
    expected = _train(PerBlockSOAP)
    monkeypatch.setattr(grouping, "BATCH_ELEMENTS", limit)
    got = _train(SOAP)
    for want, have in zip(expected, got):
        assert len(want) == len(have)
        for a, b in zip(want, have):
            assert a.dtype == b.dtype and torch.equal(a, b)
    # The run moves and refreshes (the comparison is not between two untouched models).
    assert not torch.equal(got[0][2], _model()[2].weight.detach())


def _per_block_ops(g, left, right, m, v, w, step, beta1, beta2, eps, normalize):
    """The Python ops the C++ step mirrors (kron.mode_products for a matrix, then SOAP)."""
    g_rot = g if left is None else left.T @ g
    g_rot = g_rot if right is None else g_rot @ right
    m.mul_(beta1).add_(g_rot, alpha=1 - beta1)
    v.mul_(beta2).add_(g_rot.square(), alpha=1 - beta2)
    update = m / v.sqrt().add_(eps)
    update = update if left is None else left @ update
    update = update if right is None else update @ right.T
    if normalize:
        update = update / (1e-30 + torch.mean(update**2) ** 0.5)
    w.add_(update, alpha=-step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("normalize", [False, True])
def test_cpp_step_is_bitwise_the_python_ops(dtype, normalize):
    gen = torch.Generator().manual_seed(3)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype)  # noqa: E731
    basis = lambda d: torch.linalg.qr(rand(d, d))[0].T.contiguous().T  # column-major  # noqa: E731
    cases = [(7, 5, True, True), (7, 5, False, True), (4, 6, True, False), (3, 3, False, False)]
    blocks = [
        (rand(r, c), basis(r) if lft else None, basis(c) if rgt else None)
        for r, c, lft, rgt in cases
    ] + [(rand(9), None, None), (rand(2, 3, 4), None, None)]  # basis-free blocks of any order
    state = [(rand(*g.shape), rand(*g.shape).abs(), rand(*g.shape)) for g, _, _ in blocks]
    want = [tuple(t.clone() for t in s) for s in state]
    steps = [0.1 * (i + 1) for i in range(len(blocks))]
    for (g, left, right), (m, v, w), step in zip(blocks, want, steps):
        _per_block_ops(g, left, right, m, v, w, step, 0.9, 0.95, 1e-8, normalize)
    _C.soap_update_blocks(
        [g for g, _, _ in blocks],
        [left for _, left, _ in blocks],
        [right for _, _, right in blocks],
        [s[0] for s in state],
        [s[1] for s in state],
        [s[2] for s in state],
        steps,
        0.9,
        0.95,
        1e-8,
        normalize,
    )
    for got, expected in zip(state, want):
        for a, b in zip(got, expected):
            assert torch.equal(a, b)

    factors = [rand(7, 7), None]
    expected = factors[0].clone().lerp_(blocks[0][0] @ blocks[0][0].T, 1 - 0.95)
    _C.soap_accumulate(factors, blocks[0][0], 0.95)
    assert torch.equal(factors[0], expected)


def test_cpp_step_rejects_mismatched_blocks():
    g = torch.zeros(4, 3)
    ok = dict(lefts=[None], rights=[None], exp_avgs=[g.clone()], exp_avg_sqs=[g.clone()])
    with pytest.raises(ValueError, match="left basis"):
        _C.soap_update_blocks(
            [g], [torch.eye(3)], [None], [g.clone()], [g.clone()], [g.clone()], [1.0], 0.9,
            0.9, 1e-8, False,
        )  # fmt: skip
    with pytest.raises(ValueError, match="one shape"):
        _C.soap_update_blocks(
            [g], ok["lefts"], ok["rights"], [torch.zeros(3, 4)], [g.clone()], [g.clone()], [1.0],
            0.9, 0.9, 1e-8, False,
        )  # fmt: skip
    with pytest.raises(ValueError, match="one entry per block"):
        _C.soap_update_blocks(
            [g], [], ok["rights"], ok["exp_avgs"], ok["exp_avg_sqs"], [g.clone()], [1.0], 0.9,
            0.9, 1e-8, False,
        )  # fmt: skip
    with pytest.raises(ValueError, match="gram"):
        _C.soap_accumulate([torch.zeros(3, 3), None], g, 0.9)
