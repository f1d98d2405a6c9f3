"""bench/profile_step.py: its variant names, and a short CPU run's JSON (the GPU check runs it on
the tiny preset: bench/gpu_check.sh's profile phase)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench import profile_step


@given(
    name=st.sampled_from(["soap", "kl_shampoo", "shampoo"]),
    options=st.lists(st.sampled_from(sorted(profile_step.OPTIONS)), max_size=3, unique=True),
)
def test_an_asteria_variant_takes_any_set_of_options_and_merges_their_settings(name, options):
    opt, mode, extra = profile_step.parse_variant("+".join([f"{name}_asteria", *options]))
    assert (opt, mode) == (name.replace("_", "-"), "asteria")
    expected: dict = {}
    for o in options:
        expected.update(profile_step.OPTIONS[o])
    assert extra == expected


@pytest.mark.parametrize(
    "variant, message",
    [
        ("soap", "unknown variant"),
        ("lion_native", "unknown optimizer"),
        ("soap_native+no_hooks", "needs an asteria variant"),
        ("soap_asteria+fast", "unknown option"),
    ],
)
def test_bad_variant_names_are_refused_before_anything_trains(variant, message):
    with pytest.raises(ValueError, match=message):
        profile_step.parse_variant(variant)
    with pytest.raises(ValueError, match=message):
        profile_step.parse_args(["--variants", variant])


def test_a_short_cpu_run_reports_the_step_the_profiles_and_the_ratio_to_native():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        payload = profile_step.main(
            [
                "--device", "cpu", "--model", "nano", "--batch-size", "2", "--seq-len", "16",
                "--steps", "3", "--skip", "1", "--profile-steps", "1", "--top", "4",
                "--variants", "soap_native,soap_asteria+no_hooks", "--workers", "1",
                "--data-bytes", "100000",
            ]
        )  # fmt: skip
    last = json.loads(out.getvalue().strip().splitlines()[-1])
    assert last["ratios"] == payload["ratios"]
    for v in ("soap_native", "soap_asteria+no_hooks"):
        r = last["results"][v]
        assert len(r["step_ms"]) == 3 and r["median_ms"] > 0
        assert 0 < len(r["top_ops"]) <= 4 and all(o["calls"] > 0 for o in r["top_ops"])
        assert r["top_device"] == [] and r["device_busy_ms"] == 0  # nothing ran on a device
        assert r["top_python"] and r["top_python"][0]["own_ms"] >= r["top_python"][-1]["own_ms"]
    asteria = last["results"]["soap_asteria+no_hooks"]
    assert asteria["options"] == {"hooks": False}
    assert asteria["placement"]["bases_access"] == "direct"  # the CPU: no window
    assert all(e["function"].startswith("asteria/") for e in asteria["asteria_cumulative"])
    assert last["ratios"]["soap_asteria+no_hooks_vs_soap_native_median"] == pytest.approx(
        asteria["median_ms"] / last["results"]["soap_native"]["median_ms"]
    )
