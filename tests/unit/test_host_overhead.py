"""bench/host_overhead.py (issue 37, item 3): what its counters count, and its two passes.

* The profiler counts the Python calls of the code it watches, never the bench's own (the
  ``INSTRUMENTATION`` it skips), however deep the tags nest.
* Note [Two passes]: the ops pass and the calls pass are put together step by step only where
  the steps are the same kind (installs, requests, signals); otherwise the bench fails.
* A run of one variant on a small model: every field of both passes, one module signal a step
  (Note [Disarmed signals] in asteria/runtime/hooks.py), the same quiet steps in both passes.

The figures themselves are measured by the full run, never asserted here.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import host_overhead as ho


def _leaf() -> int:
    return 1


@settings(max_examples=30, deadline=None)
@given(calls=st.lists(st.integers(0, 6), min_size=1, max_size=4))
def test_the_profiler_counts_the_watched_calls_not_the_bench(calls):
    """Tags nested ``len(calls)`` deep through the bench's wrapper, the body at depth ``d``
    calling ``_leaf`` ``calls[d]`` times: each tag counts its body's calls and those of the
    tags inside it, nothing of the wrapper, ``begin``, ``end`` or ``add``."""
    counts = ho.Counts(ops=False, calls=True)
    wrapped = []

    def body(d: int) -> None:
        for _ in range(calls[d]):
            _leaf()
        if d + 1 < len(calls):
            wrapped[d + 1](d + 1)

    wrapped += [ho._counted(counts, f"t{d}", "entered", body) for d in range(len(calls))]
    gc.disable()  # a collection inside the tags would run earlier tests' finalizers there
    try:
        wrapped[0](0)
    finally:
        gc.enable()
    assert not counts.active
    for d in range(len(calls)):
        expected = sum(1 + calls[k] for k in range(d, len(calls)))  # bodies and leaves
        assert counts.get(f"t{d}", "py_calls") == expected
        assert counts.get(f"t{d}", "entered") == len(calls) - d  # (nested tags count too)


ROW_KEYS = ho.PASS_KEYS["ops"] + ho.PASS_KEYS["calls"] + ho.AGREE


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(
        st.fixed_dictionaries({k: st.integers(0, 5) for k in ROW_KEYS}), min_size=1, max_size=8
    ),
    change=st.none() | st.tuples(st.integers(0, 7), st.sampled_from(ho.AGREE)),
)
def test_the_passes_are_put_together_only_where_their_steps_agree(rows, change):
    ops = [{k: r[k] for k in ho.PASS_KEYS["ops"] + ho.AGREE} for r in rows]
    calls = [{k: r[k] for k in ho.PASS_KEYS["calls"] + ho.AGREE} for r in rows]
    if change is not None and change[0] < len(rows):
        i, key = change
        calls[i][key] += 1
        with pytest.raises(RuntimeError, match=f"step {i + 2} is not the same kind"):
            ho.merge_passes(ops, calls, "v")
        return
    merged = ho.merge_passes(ops, calls, "v")
    assert merged == [{k: r[k] for k in ROW_KEYS} for r in rows]
    with pytest.raises(RuntimeError, match="steps in the ops pass"):
        ho.merge_passes(ops, calls[:-1], "v")


@pytest.mark.parametrize("opt,mode", [("adamw", "native"), ("shampoo", "window")])
def test_a_variant_has_both_passes_figures_on_the_same_steps(opt, mode):
    args = argparse.Namespace(
        seed=0, device="cpu", seq_len=16, batch=1, steps=4, workers=1, device_free_gib=70.0
    )
    preset = dataclasses.replace(ho.get_preset("nano"), num_layers=1)
    result = ho.run_variant(opt, mode, preset, args)
    steps = result["steps"]
    assert len(steps) == args.steps - 1
    for row in steps:
        assert set(row) == set(ROW_KEYS)
        assert row["py_calls"] > 0 and (row["ops"] > 0 or opt == "shampoo")
        # Note [Disarmed signals]: one signal a step after a step that left a refresh in flight
        assert row["signals"] == 0 if mode == "native" else row["signals"] in (0, 1)
    summary = ho.summarize(result)
    assert summary["quiet_steps"] + summary["install_steps"] + summary["request_steps"] == len(
        steps
    )
