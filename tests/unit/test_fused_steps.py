"""SOAP's fused elementwise steps (Note [Fused elementwise steps] in asteria/optim/soap.py).

The fused step must give bitwise the parameters and state of the per-block ops it replaces, for
any chunking, across parameter groups, working copies (bf16 parameters) and parameters without
gradients.
"""

from __future__ import annotations

import pytest
import torch

from asteria.optim import SOAP, soap
from asteria.optim.base import block_views
from asteria.optim.kron import mode_products
from tests.problems import state_tensors


class PerBlockSOAP(SOAP):
    """The oracle: steps 3-6 of SOAP one block and one op at a time (the authors' formulation),
    refresh and statistics through SOAP's own code."""

    def _update_params(self, group, updates):
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
            beta = soap.shampoo_beta(group)
            for bi, (b, g) in enumerate(zip(blocks, block_views(u.grad, u.layout))):
                soap._accumulate_factors(b["factors"], g, beta)
                due = t % group["precondition_frequency"] == 0
                self._refresher.block_boundary(self, (u.pid, bi), b, group, t, due)


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


def _train(opt_cls, steps: int = 25) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model = _model()
    groups = [
        {"params": [model[0].weight, model[0].bias, model.unused]},
        {"params": [model[2].weight, model[2].bias], "lr": 3e-3, "betas": (0.9, 0.99)},
        {"params": list(model[4].parameters()), "weight_decay": 0.0},
    ]
    opt = opt_cls(groups, lr=1e-2, precondition_frequency=4, max_preconditioner_dim=16)
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


@pytest.mark.parametrize("limit", [soap.FUSED_ELEMENTS, 0, 100])
def test_fused_step_is_bitwise_the_per_block_ops(monkeypatch, limit):
    expected = _train(PerBlockSOAP)
    monkeypatch.setattr(soap, "FUSED_ELEMENTS", limit)
    got = _train(SOAP)
    for want, have in zip(expected, got):
        assert len(want) == len(have)
        for a, b in zip(want, have):
            assert a.dtype == b.dtype and torch.equal(a, b)
    # The run moves and refreshes (the comparison is not between two untouched models).
    assert not torch.equal(got[0][2], _model()[2].weight.detach())


def test_chunks_cut_at_the_element_limit():
    items = [(None, None, torch.empty(n)) for n in (3, 4, 10, 2, 1)]
    sizes = lambda chunks: [[item[2].numel() for item in c] for c in chunks]  # noqa: E731
    assert sizes(soap._chunks(items, 7)) == [[3, 4], [10], [2, 1]]
    assert sizes(soap._chunks(items, 0)) == [[3], [4], [10], [2], [1]]
    assert sizes(soap._chunks(items, 100)) == [[3, 4, 10, 2, 1]]
    assert soap._chunks([], 5) == []
