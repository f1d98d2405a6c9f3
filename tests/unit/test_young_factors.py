"""Note [Young factors] (asteria/runtime/schedule.py): while the last refresh interval brought a
quarter or more of a Shampoo factor's statistics, a late root misses that much of it, and the
runtime refreshes the block at its step, as natively; afterwards the block takes the budget.

Two properties. ``new_mass_share`` is the share that an independent count of the accumulation's
weights gives, over ``betas[1]``, the frequency and the step. And over the frequency, ``betas[1]``,
the budget, the refresh mode, the lead and ``fixed_delay``: full-rank blocks (never rank-deficient
after their first step) train bitwise as natively through their youth, every young refresh after
the first roots counted in ``urgent_waits``, and where the share settles below the threshold
(``1 - b2^f < 1/4``) the later refreshes take the budget (an age of 1 or more).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asteria.optim import Shampoo
from asteria.optim.shampoo import YOUNG_SHARE, new_mass_share
from asteria.runtime import Runtime, RuntimeConfig

SHAPES = [(8, 8), (6, 4)]  # full rank from the first step; unmerged
CAP = 48  # steps: the youth of the slowest settings below ends within it or never


def _counted_share(step: int, frequency: int, b2: float) -> float:
    """The weights of ``L_t = b2 L_{t-1} + (1 - b2) G G^T`` (the sum at ``b2 = 1``), term by
    term: the share of the last ``frequency`` gradients."""
    weights = [1.0 if b2 >= 1.0 else (1 - b2) * b2 ** (step - i) for i in range(1, step + 1)]
    return sum(weights[-frequency:]) / sum(weights)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    frequency=st.integers(1, 30),
    b2=st.sampled_from([1.0, 0.9999, 0.999, 0.99, 0.95, 0.9, 0.5]),
    step=st.integers(1, 400),
)
def test_new_mass_share_counts_the_weights(frequency, b2, step):
    group = {"precondition_frequency": frequency, "betas": (0.9, b2)}
    assert new_mass_share(step, group) == pytest.approx(
        _counted_share(step, frequency, b2), rel=1e-9, abs=1e-12
    )


def _train(make, steps: int, seed: int) -> tuple[list[torch.Tensor], Shampoo]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = make(params)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params], opt


def _young_rounds(frequency: int, b2: float, steps: int) -> list[int]:
    group = {"precondition_frequency": frequency, "betas": (0.9, b2)}
    return [
        t
        for t in range(2 * frequency, steps + 1, frequency)
        if new_mass_share(t, group) >= YOUNG_SHARE
    ]


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(
    frequency=st.integers(1, 6),
    b2=st.sampled_from([1.0, 0.999, 0.99, 0.9, 0.7]),
    staleness=st.integers(1, 5),
    refresh=st.sampled_from(["interval", "staggered", "continuous"]),
    lead=st.booleans(),
    fixed=st.booleans(),
)
def test_young_factors_train_as_natively(frequency, b2, staleness, refresh, lead, fixed):
    kw = dict(precondition_frequency=frequency, betas=(0.9, b2), merge_dims=False)
    settled = 1 - b2**frequency < YOUNG_SHARE
    young = _young_rounds(frequency, b2, CAP)
    # the last young refresh's step: after it a staggered or continuous runtime may install
    # a refresh before native's next one (its schedule, within the budget)
    youth = (young[-1] if young else frequency) if settled else CAP
    made: list[Runtime] = []

    def orchestrated(steps: int):
        config = RuntimeConfig(
            staleness=staleness,
            fixed_delay=staleness if fixed else None,
            workers=1,
            statistics_lane=False,
            refresh_lead=lead,
            refresh=refresh,
            wait_first_refresh=True if fixed else None,
        )

        def make(ps):
            opt = Shampoo(ps, **kw)
            made.append(Runtime(None, opt, config))
            return opt

        return _train(make, steps, seed=frequency)[0]

    native, _ = _train(lambda ps: Shampoo(ps, **kw), youth, seed=frequency)
    try:
        waited = orchestrated(youth)
        young_stats = made[-1].stats()
        if settled:
            orchestrated(youth + 3 * frequency + staleness)
            later = made[-1].stats()
    finally:
        for r in made:
            r.close()
    assert all(torch.equal(a, b) for a, b in zip(waited, native))
    rounds = sum(1 for t in young if t <= youth)
    assert young_stats["jobs"]["urgent_waits"] == rounds * len(SHAPES)
    assert young_stats["max_staleness"] == 0
    if settled:
        assert later["max_staleness"] >= 1


def test_the_youth_of_metas_defaults_is_four_intervals():
    """At ``betas[1] = 1`` (Meta's default, the sum) the share is ``f / t``: the refreshes of
    steps ``2f``, ``3f`` and ``4f`` are young, at any frequency."""
    for f in (1, 5, 10, 100):
        assert _young_rounds(f, 1.0, 10 * f) == [2 * f, 3 * f, 4 * f]
    assert math.isclose(new_mass_share(40, {"precondition_frequency": 10, "betas": (0, 1.0)}), 0.25)
