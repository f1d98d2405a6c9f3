"""Note [Rank-deficient factors] (asteria/runtime/schedule.py): while a Shampoo block's factors may
still be rank-deficient, the runtime refreshes it as native mode does, whatever the budget.

The property, over the frequency, the start step (at and after the frequency), the budget, the
refresh mode, the lead, Shampoo's epsilon and the rank of the gradients: a model whose every
block stays rank-deficient through the run (1-D blocks longer than the run, and a small weight
that Meta's merge makes one) trains bitwise as natively, and each of its refreshes after the
first roots is counted in ``urgent_waits``. Without the wait (``wait_first_refresh=False``) the
same runs part from native's: the roots one gradient short.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asteria.optim import Shampoo
from asteria.runtime import Runtime, RuntimeConfig

SHAPES = [(24,), (30,), (3, 10)]  # the (3, 10) weight is merged into a 1-D block of 30
STEPS = 16  # every factor of dim d >= 24 gains at most one dim of rank a step: deficient


def _train(make, rank: int, seed: int) -> tuple[list[torch.Tensor], Shampoo]:
    """``STEPS`` steps on gradients of rank ``rank`` per block (a fixed basis, fresh
    coefficients every step): the parameters after them, and the optimizer."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    bases = [torch.randn(p.numel(), rank, generator=gen) for p in params]
    opt = make(params)
    for _ in range(STEPS):
        for p, u in zip(params, bases):
            p.grad = (u @ torch.randn(rank, generator=gen)).reshape(p.shape)
        opt.step()
    return [p.detach().clone() for p in params], opt


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    frequency=st.integers(1, 6),
    start_after=st.one_of(st.none(), st.integers(0, 4)),
    staleness=st.integers(1, 6),
    refresh=st.sampled_from(["interval", "staggered", "continuous"]),
    lead=st.booleans(),
    fixed=st.booleans(),
    epsilon=st.sampled_from([1e-12, 1e-8, 1e-6]),
    rank=st.integers(1, 4),
)
def test_rank_deficient_blocks_train_as_natively(
    frequency, start_after, staleness, refresh, lead, fixed, epsilon, rank
):
    start = None if start_after is None else frequency + start_after
    kw = dict(precondition_frequency=frequency, start_preconditioning_step=start, epsilon=epsilon)
    native, _ = _train(lambda ps: Shampoo(ps, **kw), rank, seed=rank)
    made: list[Runtime] = []

    def orchestrated(wait: bool | None):
        config = RuntimeConfig(
            staleness=staleness,
            fixed_delay=staleness if fixed else None,
            workers=1,
            statistics_lane=False,
            refresh_lead=lead,
            refresh=refresh,
            wait_first_refresh=wait,
        )

        def make(ps):
            opt = Shampoo(ps, **kw)
            made.append(Runtime(None, opt, config))
            return opt

        return _train(make, rank, seed=rank)[0]

    try:
        waited = orchestrated(True if fixed else None)  # None: on, but for fixed_delay
        stats = made[-1].stats()
        late = orchestrated(False)
    finally:
        for r in made:
            r.close()
    assert all(torch.equal(a, b) for a, b in zip(waited, native))
    first = frequency if start is None else start
    rounds = sum(1 for t in range(first + 1, STEPS + 1) if t % frequency == 0)
    assert stats["jobs"]["urgent_waits"] == rounds * len(SHAPES)
    assert stats["max_staleness"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(late, native))


def test_full_rank_blocks_keep_the_budget():
    """A 2-D block of full-rank factors from its first step (8 x 8, unmerged) is not rank-
    deficient: once its factors are past their youth (Note [Young factors]: at frequency 2,
    the refreshes of steps 4, 6 and 8, whose last interval brought 2/t >= 1/4 of the factor),
    its refreshes take the lead and the budget (age 1)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 8, generator=gen))]
    opt = Shampoo(params, precondition_frequency=2, merge_dims=False)
    group = opt.param_groups[0]
    assert not opt.refresh_urgent({"factors": [torch.zeros(8, 8)] * 2}, 9, group)
    assert opt.refresh_urgent({"factors": [torch.zeros(8, 8)] * 2}, 7, group)  # due 8: young
    assert opt.refresh_urgent({"factors": [torch.zeros(30, 30)]}, 27, group)  # due 28 < 30
    assert not opt.refresh_urgent({"factors": [torch.zeros(30, 30)]}, 29, group)  # due 30
    with Runtime(None, opt, RuntimeConfig(staleness=2, workers=1, statistics_lane=False)) as rt:
        for _ in range(24):
            params[0].grad = torch.randn(8, 8, generator=gen)
            opt.step()
        stats = rt.stats()
    assert stats["jobs"]["urgent_waits"] == 3
    assert stats["max_staleness"] >= 1
