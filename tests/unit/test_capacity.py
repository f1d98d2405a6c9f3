"""bench/capacity.py (issue 19, item 4): the block and factor counts of the OLMo-2 presets, and the
arithmetic of its JSON on a --quick run."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from bench import capacity


def test_olmo2_1b_counts_match_the_blocking_by_hand():
    # d 2048, MLP 5504 (OLMo's 8/3 rule), 24 layers, vocab 100352 = 49 x 2048. At 2048 a square
    # projection is one block (two 2048 factors); gate/up (5504 x 2048) and down are 3 blocks
    # each (rows 2048, 2048, 1408); embedding and lm_head 49 blocks each; SOAP and KL-Shampoo
    # give 1-D norms no factor, Shampoo one (its own root).
    shapes = capacity.model_shapes("olmo2-1b", capacity.OLMO2_VOCAB)
    layers = 24
    for name in ("soap", "kl_shampoo"):
        blocks, counts, _ = capacity.count_jobs(name, shapes, 2048)
        assert blocks == layers * (4 + 9) + 2 * 49
        assert counts == {("qr", 2048): layers * (8 + 15) + 4 * 49, ("qr", 1408): layers * 3}
    blocks, counts, _ = capacity.count_jobs("shampoo", shapes, 2048)
    norms = 4 * layers + 1
    assert blocks == layers * (4 + 9) + 2 * 49 + norms
    assert counts == {
        ("root", 2048): layers * (8 + 15) + 4 * 49 + norms,
        ("root", 1408): layers * 3,
    }


def test_olmo2_7b_splits_its_mlp_at_both_max_dims():
    shapes = capacity.model_shapes("olmo2-7b", capacity.OLMO2_VOCAB)
    assert (11008, 4096) in shapes  # OLMo-2 7B's MLP width per projection
    for max_dim in (1024, 2048):
        _, counts, _ = capacity.count_jobs("soap", shapes, max_dim)
        assert set(n for _, n in counts) == {max_dim, 11008 % max_dim}


@pytest.fixture(scope="module")
def quick() -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        capacity.main(["--quick"])
    return json.loads(out.getvalue().strip().splitlines()[-1])


def test_quick_json_adds_up(quick):
    cfg = quick["config"]
    s, f = cfg["staleness"], cfg["frequency"]
    assert cfg["step_times"] == [0.25, 0.5, 1.0, 2.0]
    assert all(v > 0 for v in quick["job_s"].values())
    for max_dims in quick["models"].values():
        assert set(max_dims) == {"32", "64"}
        for by_opt in max_dims.values():
            assert set(by_opt) == {"soap", "kl_shampoo", "shampoo"}
            for entry in by_opt.values():
                core_s = sum(c * quick["job_s"][k] for k, c in entry["factors"].items())
                assert entry["core_s"] == pytest.approx(core_s)
                assert entry["longest_job_s"] == max(quick["job_s"][k] for k in entry["factors"])
                for t, c in entry["cores"].items():
                    t = float(t)
                    assert c["cores_needed"] == math.ceil(entry["core_s"] / (s * t))
                    assert c["cores_for_throughput"] == math.ceil(entry["core_s"] / (f * t))
                    assert c["cores_for_throughput"] <= c["cores_needed"]
                    assert c["longest_job_fits"] == (entry["longest_job_s"] <= s * t)


def test_quick_reports_the_device_only_where_there_is_one(quick):
    import torch

    if torch.cuda.is_available():
        assert set(quick["device_job_s"]) == set(quick["job_s"])
    else:
        assert quick["device_job_s"] is None
        for max_dims in quick["models"].values():
            for by_opt in max_dims.values():
                assert all(e["device_round_s"] is None for e in by_opt.values())
