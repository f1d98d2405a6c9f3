"""examples/lowlevel_shampoo.py, docs/extending.md's example (b): an optimizer on the low-level API
alone (its own pool jobs, statistics snapshotted through the staging ring, installs at the step
boundary it chooses) gives the parameters of the same work done synchronously, bit for bit, over
its settings (hypothesis, derandomized) and with a pool kept busy so that results arrive late."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from examples.lowlevel_shampoo import LowLevelShampoo


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _run(steps: int, busy: bool = False, **options):
    """The parameters after ``steps`` steps, and the optimizer's staging ring figures."""
    model = _model()
    opt = LowLevelShampoo(model.parameters(), lr=0.05, **options)
    if busy:  # the one worker starts with a job that outlasts several steps' requests
        big = torch.randn(500, 500, dtype=torch.float64)
        opt.pool.submit_eigh("busy", big @ big.T, dtype=torch.float64, deadline=0)
    for step in range(steps):
        x = torch.randn(32, 10, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(x).sin().square().mean().backward()
        opt.step()
    ring = None if opt.ring is None else opt.ring.stats()
    opt.close()
    return [p.detach().clone() for p in model.parameters()], ring


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    frequency=st.integers(1, 5),
    delay_fraction=st.floats(0.0, 1.0),
    workers=st.integers(1, 2),
    momentum=st.sampled_from([0.0, 0.9]),
    busy=st.booleans(),
)
def test_the_pool_gives_what_the_synchronous_work_gives(
    frequency, delay_fraction, workers, momentum, busy
):
    delay = 1 + round(delay_fraction * (frequency - 1))
    options = dict(precondition_frequency=frequency, delay=delay, momentum=momentum)
    steps = 3 * frequency + delay + 2
    synchronous, _ = _run(steps, workers=0, **options)
    pooled, ring = _run(steps, busy=busy and workers == 1, workers=workers, **options)
    assert _equal(synchronous, pooled)
    requests = steps // frequency
    assert ring["acquires"] == 4 * requests  # every factor went through a staging slot
    assert ring["leased"] == 0 and ring["held_by_views"] == 0  # and every slot came back


def test_the_refreshes_change_the_steps_and_the_delay_is_where_they_are_used():
    never, _ = _run(12, workers=0, precondition_frequency=100)  # momentum SGD throughout
    soon, _ = _run(12, workers=1, precondition_frequency=4, delay=1)
    late, _ = _run(12, workers=1, precondition_frequency=4, delay=3)
    assert not _equal(never, soon) and not _equal(soon, late)


@pytest.mark.parametrize("bad", [dict(delay=0), dict(delay=11), dict(workers=-1)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="delay|workers"):
        LowLevelShampoo(_model().parameters(), precondition_frequency=10, **bad)
