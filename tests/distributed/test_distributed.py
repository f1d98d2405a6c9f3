"""Asteria under torch.distributed: 2 processes, gloo on the CPU (marker ``distributed``).

Each test launches the ranks of one scenario of ``_workers.py`` and asserts on what they wrote.
The equality tests train the same global batches on 2 ranks and on one process:

* DDP and HSDP (2 replicas x 1 shard): blocks are replicated; the 2-rank parameters equal the
  single-process ones bit for bit, natively and with the runtime at ``staleness=0`` (blocks
  owned by one rank each, results sent to the other; also with the 2 ranks as 2 simulated
  nodes, ``ranks_per_node=1``).
* FSDP2 (``fully_shard`` over 2 ranks): the definition is the blocking of the local shards: the
  single-process reference's optimizer sees each parameter as its 2 dim-0 chunks (FSDP2's
  shards) as separate parameters, and each rank's shards equal the reference's chunks bit for
  bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed._launch import launch

pytestmark = pytest.mark.distributed

OPTIMIZERS = ("soap", "kl_shampoo", "shampoo")


def _run(scenario: str, tmp_path: Path, timeout_s: float = 90.0):
    codes, results, logs, wall = launch(scenario, tmp_path, timeout_s=timeout_s)
    assert codes == [0, 0], logs
    assert all(r is not None for r in results), logs
    return results


def test_ddp_matches_one_process_natively_and_at_staleness_zero(tmp_path: Path) -> None:
    results = _run("ddp", tmp_path)
    for name in OPTIMIZERS:
        for mode in ("native", "runtime", "runtime_2nodes"):
            case = results[0][f"{name}/{mode}"]
            assert case["equal"], (name, mode, case["max_diff"])
            for r in results:
                assert r[f"{name}/{mode}"]["replicas_agree"], (name, mode)
        for mode in ("runtime", "runtime_2nodes"):
            stats = [r[f"{name}/{mode}"]["distributed"] for r in results]
            assert all(s["owned_blocks"] > 0 for s in stats), "both ranks must own blocks"
            assert sum(s["owned_refreshes"] for s in stats) > 0
            assert all(set(r[f"{name}/{mode}"]["histogram"]) == {"0"} for r in results)
            # every block is installed at its deadline: no module hook would do anything
            assert all(r[f"{name}/{mode}"]["hooks"] == 0 for r in results)
        one_node = [r[f"{name}/runtime"]["distributed"] for r in results]
        two_nodes = [r[f"{name}/runtime_2nodes"]["distributed"] for r in results]
        assert sum(s["inter_node_bytes"] for s in one_node) == 0
        assert sum(s["intra_node_bytes"] for s in one_node) > 0
        assert sum(s["inter_node_bytes"] for s in two_nodes) > 0
        assert sum(s["intra_node_bytes"] for s in two_nodes) == 0


def test_fsdp2_local_shards_match_one_process_with_shards_as_parameters(tmp_path: Path) -> None:
    results = _run("fsdp", tmp_path)
    for rank, r in enumerate(results):
        for name in OPTIMIZERS:
            for mode in ("native", "runtime"):
                case = r[f"{name}/{mode}"]
                assert case["dtensor"]
                assert case["equal"], (rank, name, mode, case["max_diff"])
            # plain FSDP2 shards are not replicated: no owner, no sync
            assert r[f"{name}/runtime"]["distributed"]["replicated_blocks"] == 0
            assert r[f"{name}/runtime"]["hooks"] > 0  # local blocks install early on signals
        # a NaN in one rank's shard: every rank skips the parameter, nothing else
        assert r["nonfinite"] == {"skipped": 1, "first_unchanged": True, "others_changed": True}


def test_hsdp_replicated_shards_match_one_process(tmp_path: Path) -> None:
    results = _run("hsdp", tmp_path)
    for rank, r in enumerate(results):
        for name in OPTIMIZERS:
            for mode in ("native", "runtime"):
                case = r[f"{name}/{mode}"]
                assert case["dtensor"] and case["replicas_agree"]
                assert case["equal"], (rank, name, mode, case["max_diff"])
            stats = r[f"{name}/runtime"]["distributed"]
            assert stats["replicated_blocks"] > 0 and stats["owned_blocks"] > 0
            assert r[f"{name}/runtime"]["hooks"] == 0
        assert r["nonfinite"] == {"skipped": 1, "first_unchanged": True, "others_changed": True}


def test_hsdp_on_a_2x2_mesh_across_two_simulated_nodes(tmp_path: Path) -> None:
    """4 ranks (heavier on 2 cores): each shard's replicas are on different nodes, so every
    sync crosses nodes and none stays inside one."""
    codes, results, logs, wall = launch("hsdp4", tmp_path, world=4, timeout_s=150.0)
    assert codes == [0, 0, 0, 0] and all(r is not None for r in results), logs
    for rank, r in enumerate(results):
        for name in OPTIMIZERS:
            case = r[name]
            assert case["equal"], (rank, name, case["max_diff"])
            stats = case["distributed"]
            assert stats["replicated_blocks"] > 0 and stats["nodes"] == 2
            assert stats["intra_node_bytes"] == 0
    for name in OPTIMIZERS:
        assert sum(r[name]["distributed"]["inter_node_bytes"] for r in results) > 0


def test_slow_workers_on_one_rank_never_break_the_staleness_budget(tmp_path: Path) -> None:
    results = _run("slow", tmp_path, timeout_s=120.0)
    for r in results:
        assert r["installs"] > 0 and r["replicas_agree"]
        assert r["max_staleness"] <= 5 and set(r["histogram"]) == {"5"}
        assert r["oldest_pending"] < 5
    # rank 0 waited for the blocks whose owner (rank 1) was slowed down: every install is at its
    # deadline (5 steps after the request), so the first at or after window + 5 is that of a
    # refresh rank 1 requested inside the window, which cannot be done before window + SLOW_S;
    # rank 0's step there ended only after that, however fast or slow the machine
    zero, one = results
    assert one["distributed"]["owned_blocks"] > 0
    assert len(one["slowed_from"]) == len(one["slow_windows"])
    for window, began in zip(one["slow_windows"], one["slowed_from"]):
        deadline = min(t for t in zero["install_steps"] if t >= window + 5)
        assert zero["step_end"][deadline] >= began + one["slow_s"], (window, deadline)


def test_a_killed_rank_makes_the_others_fail_with_the_timeout_error(tmp_path: Path) -> None:
    codes, results, logs, wall = launch("kill", tmp_path, timeout_s=60.0)
    assert codes[1] == 3, logs
    assert codes[0] == 0 and results[0] is not None, logs
    message = results[0]["error"]
    assert message is not None, logs
    assert "block '" in message and "owner rank" in message and "at step 7" in message
    # the runtime's barrier_timeout_s (4 s), not gloo's 60 s: the bound only tells them apart
    assert results[0]["elapsed_s"] < 30.0


def test_a_hung_rank_makes_the_others_fail_after_the_barrier_timeout(tmp_path: Path) -> None:
    codes, results, logs, wall = launch("hang", tmp_path, timeout_s=60.0)
    assert codes[1] == 3 and codes[0] == 0 and results[0] is not None, logs
    message = results[0]["error"]
    assert message is not None, logs
    assert "block '" in message and "(owner rank " in message and "at step 7" in message
    assert "barrier_timeout_s=4" in message
    # it waited the timeout (not gloo's 60 s: the upper bound only tells them apart)
    assert 3.5 <= results[0]["elapsed_s"] < 30.0


def test_checkpoint_on_two_ranks_gives_the_same_continuation(tmp_path: Path) -> None:
    results = _run("checkpoint", tmp_path)
    for r in results:
        assert r["in_flight_at_save"] == 0
        assert r["equal"], r["max_diff"]
        assert r["replicas_agree"]


def test_dcp_checkpoint_with_refreshes_in_flight_resumes_bitwise(tmp_path: Path) -> None:
    """asteria.checkpoint (DCP) on 2 ranks, FSDP2 and HSDP, loaded on 2 ranks; then the FSDP2
    checkpoints on 1 rank: the model reshards, the optimizer refuses with a clear error."""
    results = _run("dcp", tmp_path)
    for r in results:
        for layout in ("fsdp", "hsdp"):
            for name in OPTIMIZERS:
                case = r[f"{layout}/{name}"]
                assert case["in_flight_at_save"] > 0, (layout, name)
                assert case["extra"] == {"step": 7}
                assert case["equal"], (layout, name, case["max_diff"])
    codes, one, logs, _ = launch("dcp_one_rank", tmp_path, world=1)
    assert codes == [0], logs
    for name in OPTIMIZERS:
        case = one[0][name]
        assert case["equal"], (name, case["max_diff"])
        assert case["error"] is not None and "saved by 2 ranks" in case["error"]
        assert "cannot be loaded on 1" in case["error"] and "optimizer=None" in case["error"]


def test_bad_settings_fail_on_every_rank_at_attach(tmp_path: Path) -> None:
    results = _run("bad", tmp_path, timeout_s=60.0)
    expected = {
        "bad_staleness": "staleness: rank 0 has 2, rank 1 has 3",
        "bad_hyper": "param_groups",
        "bad_topology": "ranks_per_node=3 (from ranks_per_node) must be a positive integer",
        "bad_devices": "rank 1: the optimizer's parameters are on mixed devices",
    }
    for r in results:
        for case, message in expected.items():
            assert r[case] is not None and message in r[case], (case, r[case])
        assert r["good"] is None


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", ["interrupt", "interrupt_resume"])
def test_an_interrupt_on_one_rank_ends_every_rank_with_an_error_naming_it(
    tmp_path: Path, world: int, scenario: str
) -> None:
    """Note [A fault on one rank]: Ctrl-C on rank 1 only, inside step 7's sync; rank 1 leaves
    (``interrupt``) or catches it and trains on (``interrupt_resume``: its repair paired with the
    other rank's next sync, and the replicas parted without an error). Every rank now ends
    within the collective timeout (4 s) with an error, the others' naming rank 1 and why."""
    codes, results, logs, wall = launch(scenario, tmp_path, world=world, timeout_s=180.0)
    assert codes == [0] * world and all(r is not None for r in results), logs
    for rank, r in enumerate(results):
        errors = r["errors"]
        if rank == 1:
            assert errors[0] == "KeyboardInterrupt", errors
            if scenario == "interrupt_resume":  # its next step: at once, no collective
                assert errors[1].startswith("CoherenceBrokenError: Asteria (rank 1)"), errors
                assert "stopped before its end" in errors[1]
            continue
        assert len(errors) == 1 and errors[0].startswith("CoherenceTimeoutError"), errors
        assert "at step 7" in errors[0] and f"failed on rank {rank}" in errors[0]
        assert "rank 1 reported: rank 1's step stopped before its end" in errors[0], errors
        assert r["elapsed_s"] < 4.0 + 6.0, r  # the timeout, and slack for a loaded machine
