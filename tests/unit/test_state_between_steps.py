"""``optimizer.state`` between steps with the statistics lane on (issue 40, item 5; Note [State
between steps] in asteria/runtime/lane.py).

With the lane, a step returns while the lane still updates that step's factor statistics in
``opt.state``. ``Runtime.sync()`` is the one call that settles it: once it returns, ``opt.state``
holds still until the next ``step()`` (or forward, whose module hooks may install a refresh).
The property reads deep copies of ``opt.state`` at arbitrary moments after ``sync()``, the lane
slowed down by a drawn delay so that its work is still running when ``step()`` returns; the
companion test shows that without ``sync()`` the same reads see the state move, so the property
fails if ``sync()`` stops settling the lane.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.runtime import Runtime, RuntimeConfig
from asteria.runtime.testing import wrapped_statistics
from tests.problems import StochasticQuartic

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}
SHAPES = [(8, 4), (5, 6), (3, 2, 2)]


def _state_copy(opt: torch.optim.Optimizer) -> list[tuple[int, str, object]]:
    """A deep copy of ``opt.state``, in parameter order (the keys are the parameters)."""
    order = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
    items = sorted(opt.state.items(), key=lambda kv: order[id(kv[0])])
    return [(order[id(p)], k, copy.deepcopy(v)) for p, s in items for k, v in sorted(s.items())]


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _slowed(delay_s: float):
    """A statistics update that starts ``delay_s`` late: still running when ``step()`` returns."""

    def wrap(key, update, *args):
        time.sleep(delay_s)
        update(*args)

    return wrap


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    staleness=st.integers(0, 3),
    fixed_delay=st.booleans(),
    split_updates=st.booleans(),
    frequency=st.integers(1, 4),
    delay_ms=st.sampled_from([0, 2, 10]),
    reads=st.lists(st.floats(0.0, 0.02), min_size=1, max_size=4),
    steps=st.integers(2, 6),
)
def test_state_holds_still_after_sync(
    name, staleness, fixed_delay, split_updates, frequency, delay_ms, reads, steps
):
    """After ``step()`` and ``sync()``, every read of ``opt.state`` until the next step gives the
    same deep copy, whatever the optimizer, schedule, split and lane delay."""
    problem = StochasticQuartic(SHAPES, steps, torch.float32)
    params = problem.params()
    opt = OPTIMIZERS[name](params, precondition_frequency=frequency)
    config = RuntimeConfig(
        staleness=staleness,
        fixed_delay=min(1, staleness) if fixed_delay else None,
        workers=1,
        statistics_lane=True,
        split_updates=split_updates,
    )
    with Runtime(None, opt, config) as rt, wrapped_statistics(_slowed(delay_ms / 1e3)):
        for t in range(steps):
            opt.zero_grad()
            problem.loss(params, t).backward()
            opt.step()
            rt.sync()
            first = _state_copy(opt)
            for pause in reads:
                time.sleep(pause)
                assert _same(_state_copy(opt), first), f"opt.state moved after step {t + 1}"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_without_sync_the_lane_moves_the_state(name):
    """The hazard the property guards: ``step()`` returns while the lane still writes the
    step's statistics into ``opt.state`` (held here until the first read is taken)."""
    problem = StochasticQuartic(SHAPES, 3, torch.float32)
    params = problem.params()
    opt = OPTIMIZERS[name](params, precondition_frequency=2)
    release = threading.Event()

    def held(key, update, *args):
        assert release.wait(60)
        update(*args)

    config = RuntimeConfig(staleness=2, fixed_delay=2, workers=1, statistics_lane=True)
    with Runtime(None, opt, config) as rt:
        for t in range(2):  # the first step makes the factors; the second updates them
            opt.zero_grad()
            problem.loss(params, t).backward()
            if t == 0:
                opt.step()
                rt.sync()
                continue
            with wrapped_statistics(held):
                opt.step()
                before = _state_copy(opt)  # the lane holds this step's statistics
                release.set()
                rt.sync()
            assert not _same(_state_copy(opt), before)
