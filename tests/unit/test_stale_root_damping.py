"""Shampoo's ``rel_epsilon`` (Meta's name): roots damped relative to the factor's scale, the
same natively and under the runtime (issue 24, item 6; Note [Damping stale roots] in
asteria/optim/shampoo.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asteria.optim import Shampoo
from asteria.optim.refresher import RefreshJob, RootRefresh
from asteria.runtime import Runtime, RuntimeConfig


@settings(max_examples=40, derandomize=True, deadline=None)
@given(
    d=st.integers(1, 12),
    rank=st.integers(0, 12),
    log_scale=st.integers(-8, 8),
    rel=st.sampled_from([0.0, 1e-6, 1e-4, 1e-2]),
    root=st.sampled_from([2.0, 4.0, 6.0]),
)
def test_the_root_amplifies_no_direction_more_than_rel_epsilon_allows(
    d, rank, log_scale, rel, root
):
    gen = torch.Generator().manual_seed(d * 100 + rank)
    g = torch.randn(d, min(rank, d), generator=gen, dtype=torch.float64)
    factor = (g @ g.T) * 10.0**log_scale  # rank-deficient where rank < d, at any scale
    job = RootRefresh(factor, root=root, epsilon=1e-12, dtype=torch.float64, rel_epsilon=rel)
    bound = float(factor.abs().sum(1).max())
    assert job.damping(factor) == pytest.approx(max(1e-12, rel * bound), rel=1e-12)
    evals = torch.linalg.eigvalsh(job.run())
    assert torch.all(evals > 0)
    if rel > 0 and bound > 0:
        # |lambda| <= ||L||_inf: the root's condition number is <= ((1 + rel) / rel)^(1/root)
        assert float(evals.max() / evals.min()) <= ((1 + rel) / rel) ** (1 / root) * (1 + 1e-9)
    restored = RefreshJob.from_options(job.options())
    assert (restored.rel_epsilon, restored.epsilon, restored.root) == (rel, 1e-12, root)


def _train(rel: float, runtime: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = Shampoo(model.parameters(), lr=1e-2, precondition_frequency=2, rel_epsilon=rel)
    rt = Runtime(model, opt, RuntimeConfig(staleness=0, workers=1)) if runtime else None
    data = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(7):
        model(data).square().mean().backward()
        opt.step()
        opt.zero_grad()
    if rt is not None:
        rt.close()
    return [p.detach().clone() for p in model.parameters()]


def test_rel_epsilon_roots_are_the_same_natively_and_under_the_runtime() -> None:
    native = _train(1e-3, runtime=False)
    assert all(torch.equal(a, b) for a, b in zip(native, _train(1e-3, runtime=True)))
    assert not all(torch.equal(a, b) for a, b in zip(native, _train(0.0, runtime=False)))
