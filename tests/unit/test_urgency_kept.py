"""The runtime's urgency per block, kept over an interval (``Plan.urgent`` in
asteria/runtime/plan.py: Notes [Rank-deficient factors] and [Young factors] in schedule.py).

Under a runtime that waits for urgent refreshes, a plan asks whether a block is
``refresh_urgent`` wherever it decides; the answer is kept per block, due step, frequency and
betas. The property: whatever the steps, shapes, frequency, betas and changes of betas, the
kept answer is the one asked afresh, and ``refresh_urgent`` is not asked again within an
interval at unchanged betas.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asteria.optim import Shampoo
from asteria.runtime import Runtime, RuntimeConfig

SHAPE = st.lists(st.integers(1, 40), min_size=1, max_size=2).map(tuple)
EVENT = st.sampled_from(["step", "step", "step", "betas"])


def _block(shape: tuple[int, ...]) -> dict:
    return {"factors": [torch.zeros(d, d) for d in shape], "roots": [None] * len(shape)}


@settings(max_examples=60, deadline=None)
@given(
    dims=st.lists(SHAPE, min_size=1, max_size=4),
    freq=st.integers(1, 12),
    b2=st.sampled_from([1.0, 0.999, 0.99, 0.9]),
    events=st.lists(st.tuples(EVENT, st.integers(1, 7)), min_size=1, max_size=40),
)
def test_the_kept_urgency_is_the_answer_asked_afresh(dims, freq, b2, events):
    opt = Shampoo(
        [torch.nn.Parameter(torch.zeros(2))], precondition_frequency=freq, betas=(0.9, b2)
    )
    group = opt.param_groups[0]
    blocks = [_block(d) for d in dims]
    asked = [0]
    original = opt.refresh_urgent

    def counted(block, step, g):
        asked[0] += 1
        return original(block, step, g)

    opt.refresh_urgent = counted
    with Runtime(None, opt, RuntimeConfig(staleness=2, workers=1)) as rt:
        plan = rt._plan
        t = 1
        last: dict[int, tuple] = {}  # block -> the interval and betas it was last asked at
        for kind, n in events:
            if kind == "betas":
                group["betas"] = (0.9, [1.0, 0.95, b2][n % 3])
            else:
                t += n
            for i, block in enumerate(blocks):
                before = asked[0]
                assert plan.urgent((0, i), block, t, group) == original(block, t, group)
                key = (-(-t // group["precondition_frequency"]), tuple(group["betas"]))
                if last.get(i) == key:
                    assert asked[0] == before  # kept over the interval: nothing asked again
                last[i] = key
