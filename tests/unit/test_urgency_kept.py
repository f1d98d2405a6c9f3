"""Shampoo's urgency per parameter, kept over an interval (issue 37, ``Shampoo._urgent_now``).

Under a runtime that waits for urgent refreshes, Shampoo asks at every step whether a block of a
parameter has no roots yet or is ``refresh_urgent`` (Note [Young factors] in
asteria/runtime/schedule.py). The answer is kept per parameter and due step once every root
exists; the property: whatever the steps, shapes, frequency, betas, changes of betas, new roots
and replaced states, the kept answer is the one asked afresh, and ``refresh_urgent`` is not asked
again within an interval (at unchanged betas) of a parameter whose roots exist.
"""

from __future__ import annotations

import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asteria.optim import Shampoo


def _blocks(dims: list[tuple[int, ...]], rooted: bool) -> list[dict]:
    return [
        {
            "factors": [torch.zeros(d, d) for d in shape],
            "roots": [torch.zeros(d, d) if rooted else None for d in shape],
        }
        for shape in dims
    ]


def _afresh(urgent, group: dict, blocks: list[dict], t: int) -> bool:
    """The answer asked of every block (``urgent``: ``Shampoo.refresh_urgent``)."""
    if any(r is None for b in blocks for r in b["roots"]):
        return True
    return any(urgent(b, t, group) for b in blocks)


class _Refresher:
    """A runtime's leads where urgency decides (``first_lead`` 0, ``lead`` 1)."""

    first_lead, lead = 0, 1


def _urgent(opt: Shampoo, group: dict, blocks: list[dict], t: int) -> bool:
    """The urgency ``_due_now_or_ahead`` decided the parameter's lead with (the kept entry it
    read or made)."""
    opt._due_now_or_ahead({"step": t, "blocks": blocks}, group, blocks, t)
    return opt._urgency[id(blocks)].urgent


SHAPE = st.lists(st.integers(1, 40), min_size=1, max_size=2).map(tuple)
EVENT = st.sampled_from(["step", "step", "step", "root", "betas", "reload"])


@settings(max_examples=60, deadline=None)
@given(
    dims=st.lists(st.lists(SHAPE, min_size=1, max_size=3), min_size=1, max_size=3),
    freq=st.integers(1, 12),
    b2=st.sampled_from([1.0, 0.999, 0.99, 0.9]),
    events=st.lists(st.tuples(EVENT, st.integers(1, 7)), min_size=1, max_size=40),
)
def test_the_kept_urgency_is_the_answer_asked_afresh(dims, freq, b2, events):
    opt = Shampoo(
        [torch.nn.Parameter(torch.zeros(2))], precondition_frequency=freq, betas=(0.9, b2)
    )
    opt._refresher = _Refresher()
    group = opt.param_groups[0]
    params = [_blocks(d, rooted=False) for d in dims]
    replaced = []  # (kept alive: a new state's list never takes a replaced one's id)
    asked = [0]
    original = opt.refresh_urgent

    def counted(block, step, g):
        asked[0] += 1
        return original(block, step, g)

    opt.refresh_urgent = counted
    t = 1
    last: dict[int, tuple] = {}  # id of a parameter's blocks -> what it was last asked at
    for kind, n in events:
        if kind == "root":  # a parameter's roots arrive (one block's, or all)
            blocks = params[n % len(params)]
            for b in blocks[: 1 + n % 2 * len(blocks)]:
                b["roots"] = [torch.zeros_like(f) for f in b["factors"]]
        elif kind == "betas":
            group["betas"] = (0.9, [1.0, 0.95, b2][n % 3])
        elif kind == "reload":  # a loaded state: other tensors, the same shapes
            i = n % len(params)
            replaced.append(params[i])
            params[i] = _blocks(dims[i], rooted=n % 2 == 0)
        else:
            t += n
        for blocks in params:
            before = asked[0]
            got = _urgent(opt, group, blocks, t)
            assert got == _afresh(original, group, blocks, t)
            rooted = all(r is not None for b in blocks for r in b["roots"])
            key = (-(-t // group["precondition_frequency"]), tuple(group["betas"]), rooted)
            if rooted and last.get(id(blocks)) == key:
                assert asked[0] == before  # kept over the interval: nothing asked again
            last[id(blocks)] = key


@settings(max_examples=40, deadline=None)
@given(
    dims=st.lists(st.lists(SHAPE, min_size=1, max_size=3), min_size=1, max_size=3),
    freq=st.integers(1, 12),
    b2=st.sampled_from([1.0, 0.999, 0.9]),
    t=st.integers(1, 200),
)
def test_a_kept_answer_is_read_without_a_python_call(dims, freq, b2, t):
    """Per parameter and step, a kept answer (every root there, the same interval and betas)
    costs ``_due_now_or_ahead`` no Python call of its own (the due step compared inline): it
    calls ``_refresh_due``, as without a runtime, and nothing else (issue 37)."""
    opt = Shampoo(
        [torch.nn.Parameter(torch.zeros(2))], precondition_frequency=freq, betas=(0.9, b2)
    )
    opt._refresher = _Refresher()
    group = opt.param_groups[0]
    called: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            called.append(frame.f_code.co_name)

    def calls(fn, *args, **kwargs) -> list[str]:
        called.clear()
        sys.setprofile(profile)
        try:
            fn(*args, **kwargs)
        finally:
            sys.setprofile(None)
        return list(called)

    for blocks in [_blocks(d, rooted=True) for d in dims]:
        first = -(-t // freq) * freq - freq + 1  # the interval's first step
        urgent = _urgent(opt, group, blocks, first)  # kept
        state = {"step": t, "blocks": blocks}
        got = calls(opt._due_now_or_ahead, state, group, blocks, t)
        lead = _Refresher.first_lead if urgent else _Refresher.lead
        native = calls(opt._refresh_due, state, group, next_step=lead > 0)
        assert got == ["_due_now_or_ahead", *native], got
