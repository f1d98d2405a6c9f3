"""bench/freshness.py --quick (issue 19, item 2): every variant, its fields and the arithmetic of
the goals. The figures themselves are measured by the full run, never asserted here."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from bench import freshness


@pytest.fixture(scope="module")
def quick() -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        freshness.main(["--quick", "--optimizers", "soap"])
    return json.loads(out.getvalue().strip().splitlines()[-1])


def test_quick_run_has_every_variant_and_field(quick):
    results = quick["results"]
    assert list(results) == freshness.variants(["soap"])
    for v, r in results.items():
        assert r["median_ms"] > 0 and r["p95_ms"] >= r["median_ms"]
        assert r["vs_adamw_median"] == pytest.approx(r["median_ms"] / results["adamw"]["median_ms"])
        assert quick["ratios"][f"{v}_vs_adamw_median"] == r["vs_adamw_median"]
        assert r["curve"][-1]["step"] == quick["config"]["steps"]
        assert r["final_val_loss"] == r["curve"][-1]["val_loss"]
    assert results["soap_native_f1"]["interval"] == {
        "mean": 1,
        "max": 1,
        "source": "native schedule",
    }
    cont = results["soap_asteria_continuous"]
    assert cont["interval"]["source"] == "measured" and cont["interval"]["max"] <= 10 + 5
    assert cont["basis_age_within_bound"] and cont["placement_jobs"]["pool"] > 0


def test_quick_run_time_to_native_loss_and_goals_add_up(quick):
    results, steps = quick["results"], quick["config"]["steps"]
    cont, native = results["soap_asteria_continuous"], results["soap_native_f10"]
    reach = freshness.first_reach(cont["curve"], native["final_val_loss"])
    want = None if reach is None else reach[0] / steps
    assert cont["continuous_steps_to_native_f10_loss_ratio"] == want
    if reach is not None:
        assert cont["continuous_time_to_native_f10_loss_ratio"] == reach[1] / native["train_s"]
    goals = quick["goals"]
    assert goals["soap_effective_interval_le_3"] == (cont["interval"]["mean"] <= 3)
    assert goals["soap_continuous_vs_adamw_median_le_1.25"] == (cont["vs_adamw_median"] <= 1.25)
    assert quick["ratios"]["soap_continuous_vs_adamw_median"] == cont["vs_adamw_median"]


def test_first_reach_is_the_first_point_at_or_below_the_target():
    curve = [
        {"step": 4, "train_s": 1.0, "val_loss": 3.0},
        {"step": 8, "train_s": 2.0, "val_loss": 2.0},
    ]
    assert freshness.first_reach(curve, 2.5) == (8, 2.0)
    assert freshness.first_reach(curve, 3.0) == (4, 1.0)
    assert freshness.first_reach(curve, 1.0) is None
