"""Memory tiers: the placement policy (pure), the runtime's spill tier and its accounting.

Training runs are a small MLP (several preconditioner blocks per weight through
``max_preconditioner_dim=16``) under ``fixed_delay``, where finished refreshes wait for their
install step and the policy spills them to NVMe (pytest's temporary directory) when the host
budget binds. Spilling, failed writes and corrupt slots must leave the parameters bitwise equal to
an unspilled run.
"""

from __future__ import annotations

import errno
import os
import warnings

import pytest
import torch

from asteria import _C
from asteria.memory.accounting import estimate_blocks
from asteria.memory.tiers import Arch, BlockSizes, plan
from asteria.optim import SOAP, KLShampoo
from asteria.runtime import Runtime, RuntimeConfig
from tests.problems import mlp_24_32_32_4

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo}
STEPS = 36
FIXED = RuntimeConfig(staleness=4, fixed_delay=4, workers=1)


@pytest.fixture(autouse=True)
def _no_injected_failures():
    yield
    _C._testing_io_fail_next(0, 0, "write")


# ---- the policy -------------------------------------------------------------------------------


def _blocks(n: int = 4, size: int = 100) -> list[BlockSizes]:
    return [
        BlockSizes(f"b{i}", i, factors=size, moments=2 * size, bases=size, results=size,
                   snapshots=2 * size)
        for i in range(n)
    ]  # fmt: skip


def test_auto_keeps_factors_and_moments_on_device_and_bases_in_host():
    blocks = _blocks()
    cpu = plan(blocks, Arch(cuda=False))
    assert cpu.tiers == {"factors": "device", "moments": "device", "bases": "host",
                         "results": "host"}  # fmt: skip
    assert cpu.bases_access == "direct" and not cpu.spilled
    assert cpu.bytes["device"] == {"factors": 400, "moments": 800, "bases": 0}
    assert cpu.bytes["host"] == {"bases": 400, "staging": 0, "results": 400}
    unified = plan(blocks, Arch(cuda=True, unified_memory=True))
    assert unified.bases_access == "mapped" and unified.bytes["device"]["bases"] == 0
    window = plan(blocks, Arch(cuda=True), bases_window=True, window_blocks=2)
    assert window.bases_access == "window" and window.bytes["device"]["bases"] == 200
    # a discrete GPU whose optimizer cannot read bases through a window keeps them on the device
    discrete = plan(blocks, Arch(cuda=True))
    assert discrete.tiers["bases"] == "device" and discrete.bytes["device"]["bases"] == 400
    assert "window" in discrete.notes[0]


def test_the_host_budget_spills_the_coldest_blocks_last_in_access_order():
    blocks = _blocks()
    p = plan(blocks, Arch(cuda=False), host_budget_bytes=400 + 150, nvme=True)
    assert p.spilled == {"b1", "b2", "b3"}  # b0 is installed first: it stays in host memory
    assert p.results_tier("b0") == "host" and p.results_tier("b3") == "nvme"
    assert p.bytes["host"]["results"] == 100
    assert p.bytes["nvme"] == {"results": 300, "snapshots": 600}
    assert not plan(blocks, Arch(cuda=False), host_budget_bytes=800).spilled
    explicit = plan(blocks, Arch(cuda=False), placement={"results": "nvme"}, nvme=True)
    assert explicit.spilled == {"b0", "b1", "b2", "b3"}
    native = plan(blocks, Arch(cuda=False), placement={"bases": "device"})
    assert native.bytes["device"]["bases"] == 400 and native.bytes["host"]["bases"] == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(device_budget_bytes=1199), r"device_budget_bytes=1199 is smaller than the 1200"),
        (
            dict(device_budget_bytes=1500, placement={"bases": "device"}),
            r"placement=\{'bases': 'host'\}",
        ),
        (dict(host_budget_bytes=399), r"host_budget_bytes=399 .* at least 400.*'device'"),
        (dict(host_budget_bytes=450), r"set nvme_path .* at least 800"),
        (dict(placement={"results": "nvme"}), r"nvme_path is not set"),
        (dict(placement={"factors": "host"}), r"'factors' cannot live in 'host'"),
        (dict(placement={"optimizer": "host"}), r"unknown state kind 'optimizer'"),
        (dict(placement="fast"), r"placement must be 'auto' or a dict"),
        (dict(host_budget_bytes=-1), r"host_budget_bytes must be None or an integer"),
    ],
)
def test_the_policy_says_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(_blocks(), Arch(cuda=False), **kwargs)


# ---- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(device_budget_bytes=-5), "device_budget_bytes must be an integer >= 0"),
        (dict(host_budget_bytes=True), "host_budget_bytes must be an integer >= 0"),
        (dict(placement="all-device"), "placement must be 'auto' or a dict"),
        (dict(placement={"bases": "nvme"}), "'bases' cannot live in 'nvme'"),
        (dict(nvme_path=123), "nvme_path must be a directory path"),
    ],
)
def test_bad_memory_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RuntimeConfig(**kwargs)


def test_bad_nvme_paths_say_what_to_change(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="does not exist; create it"):
        RuntimeConfig(nvme_path=tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        RuntimeConfig(nvme_path=tmp_path / "file")
    import asteria.runtime.config as config

    monkeypatch.setattr(config.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match="is not writable by this process"):
        RuntimeConfig(nvme_path=tmp_path)
    monkeypatch.undo()
    full = type("Usage", (), {"free": 4096})()
    monkeypatch.setattr(config.shutil, "disk_usage", lambda path: full)
    with pytest.raises(ValueError, match="is full \\(4096 bytes free\\); free space"):
        RuntimeConfig(nvme_path=tmp_path)


def test_a_disk_too_small_for_the_spill_file_fails_at_start(tmp_path, monkeypatch):
    import asteria.runtime.spill as spill

    config = RuntimeConfig(staleness=4, fixed_delay=4, nvme_path=tmp_path,
                           placement={"results": "nvme"})  # fmt: skip
    opt = SOAP(mlp_24_32_32_4().parameters(), max_preconditioner_dim=16)
    almost_full = type("Usage", (), {"free": 1 << 20})()
    monkeypatch.setattr(spill.shutil, "disk_usage", lambda path: almost_full)
    with pytest.raises(ValueError, match="has 1048576 bytes free, the spill file needs"):
        Runtime(None, opt, config)
    monkeypatch.undo()
    Runtime(None, opt, config).close()  # nothing was attached by the failed start
    assert os.listdir(tmp_path) == []  # and close() deleted the spill file


def test_a_device_budget_below_factors_and_moments_fails_at_start():
    opt = KLShampoo(mlp_24_32_32_4().parameters(), max_preconditioner_dim=16)
    must = sum(b.factors + b.moments for b in estimate_blocks(opt))
    with pytest.raises(ValueError, match=f"smaller than the {must} bytes that must stay"):
        Runtime(None, opt, RuntimeConfig(device_budget_bytes=must - 1))
    Runtime(None, opt, RuntimeConfig(device_budget_bytes=must)).close()


# ---- training with spilling ----------------------------------------------------------------------


def _data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, 16, 24, generator=gen), torch.randn(STEPS, 16, 4, generator=gen)


def _finish_refreshes(rt: Runtime) -> None:
    """Wait until every refresh in flight has its results. The runtime spills a finished refresh
    at the next block boundary before its install step: waiting here before each step makes
    which refreshes are spilled the same on a loaded machine as on an idle one."""
    for e in rt.blocks().values():
        if e.pending is not None:
            for f in e.pending.futures:
                if f is not None:
                    try:
                        f.result(timeout_s=60)
                    except Exception:  # a failed refresh is the runtime's to report
                        pass


def _train(name, config, after_step=None):
    """Train the MLP for STEPS steps under ``config``, each step after the refreshes in flight
    have their results (``_finish_refreshes``); params, memory report, stats."""
    model = mlp_24_32_32_4()
    opt = OPTIMIZERS[name](model.parameters(), precondition_frequency=5, max_preconditioner_dim=16)
    xs, ys = _data()
    rt = Runtime(model, opt, config)
    try:
        for t in range(STEPS):
            _finish_refreshes(rt)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xs[t]), ys[t]).backward()
            opt.step()
            if after_step is not None:
                after_step(rt, t)
        report = rt.memory_report()
        stats = rt.stats()
    finally:
        rt.close()
    return [p.detach().clone() for p in model.parameters()], report, stats


def _spill_config(tmp_path, **kw) -> RuntimeConfig:
    return RuntimeConfig(staleness=4, fixed_delay=4, workers=1, nvme_path=tmp_path, **kw)


def _bases_bytes(name: str):
    model = mlp_24_32_32_4()
    opt = OPTIMIZERS[name](model.parameters(), max_preconditioner_dim=16)
    blocks = estimate_blocks(opt)
    return sum(b.bases for b in blocks), blocks


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_spilling_under_a_host_budget_is_bitwise_equal_to_no_spilling(name, tmp_path):
    reference, _, ref_stats = _train(name, FIXED)
    bases, blocks = _bases_bytes(name)
    budget = bases + blocks[0].results  # room for the first block's results only
    spilled, report, stats = _train(name, _spill_config(tmp_path, host_budget_bytes=budget))
    for a, b in zip(spilled, reference):
        assert torch.equal(a, b)
    spill = report["spill"]
    with_results = [b for b in blocks if b.results]
    assert len(report["placement"]["spilled_blocks"]) == len(with_results) - 1
    assert "0.weight[0]" not in report["placement"]["spilled_blocks"]
    assert spill["spilled_refreshes"] > 4 * (len(with_results) - 1)
    assert spill["paged_in"] > 0 and spill["prefetch_hits"] == spill["paged_in"]
    assert spill["write_failures"] == spill["checksum_failures"] == 0
    assert stats["staleness_histogram"] == ref_stats["staleness_histogram"]
    assert set(stats["staleness_histogram"]) == {4}
    assert os.listdir(tmp_path) == []  # close() deleted the spill file


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_failed_spill_write_keeps_the_results_in_host_and_warns_once(code, tmp_path):
    reference, _, _ = _train("soap", FIXED)

    def fail_writes(rt, t):
        if t == 6:
            _C._testing_io_fail_next(60, code, "write")  # a whole refresh round's writes

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params, report, _ = _train(
            "soap", _spill_config(tmp_path, placement={"results": "nvme"}), fail_writes
        )
    spill_warnings = [w for w in caught if "spill file" in str(w.message)]
    assert len(spill_warnings) == 1, [str(w.message) for w in caught]
    assert "nothing is" in str(spill_warnings[0].message)
    assert report["spill"]["write_failures"] >= 2
    for a, b in zip(params, reference):
        assert torch.equal(a, b)


def _flip_once(kind: str, flipped: list):
    """After a step: flip one byte in the first spilled refresh not yet paged in (its first
    result slot; with ``kind="snapshots"`` every slot of its inputs too)."""

    def flip(rt, t):
        if flipped:
            return
        for e in rt.blocks().values():
            p = e.pending
            if p is None or p.spilled is None or p.spilled.paged:
                continue
            rt.spill.settle(p)
            keys = p.spilled.keys()[:1] + (p.inputs.keys() if kind == "snapshots" else [])
            store = rt.spill.store
            for key in keys:
                offset, _ = store._store.extent(key)
                with open(store.path, "r+b") as f:
                    f.seek(offset + 5)
                    byte = f.read(1)
                    f.seek(offset + 5)
                    f.write(bytes([byte[0] ^ 0x10]))
                    f.flush()
                    os.fsync(f.fileno())
            flipped.extend(keys)
            return

    return flip


@pytest.mark.parametrize("lane", [False, True])  # inputs kept by the statistics lane, or here
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_corrupt_spill_slot_is_recomputed_from_its_inputs_bitwise(name, lane, tmp_path):
    reference, _, _ = _train(name, FIXED)
    flipped: list[str] = []
    with pytest.warns(RuntimeWarning, match="could not be read back.*same result"):
        params, report, stats = _train(
            name,
            _spill_config(tmp_path, placement={"results": "nvme"}, statistics_lane=lane),
            _flip_once("results", flipped),
        )  # fmt: skip
    assert len(flipped) == 1
    spill = report["spill"]
    assert spill["checksum_failures"] == 1 and spill["recomputed_from_snapshot"] == 1
    assert set(stats["staleness_histogram"]) == {4}  # installed at the same step
    for a, b in zip(params, reference):
        assert torch.equal(a, b)


def test_when_the_inputs_are_corrupt_too_the_refresh_uses_the_current_factors(tmp_path):
    """What holds then: detected, recomputed from the factors at the install step and installed
    at that same step; the basis is fresher than the lost one, so the run leaves the unspilled
    trajectory (and stays finite)."""
    reference, _, _ = _train("soap", FIXED)
    flipped: list[str] = []
    with pytest.warns(RuntimeWarning, match="current factors"):
        params, report, stats = _train(
            "soap", _spill_config(tmp_path, placement={"results": "nvme"}),
            _flip_once("snapshots", flipped),
        )  # fmt: skip
    assert len(flipped) >= 2
    spill = report["spill"]
    assert spill["checksum_failures"] == 2 and spill["recomputed_from_factors"] == 1
    assert set(stats["staleness_histogram"]) == {4}
    assert all(torch.isfinite(p).all() for p in params)
    assert any(not torch.equal(a, b) for a, b in zip(params, reference))


# ---- accounting ----------------------------------------------------------------------------------


def _state_bytes(opt) -> dict[str, int]:
    """Sum of nbytes of the optimizer's state tensors, by kind, counted here independently."""
    out = {"factors": 0, "moments": 0, "bases": 0}
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out["moments"] += value.nbytes
            if key != "blocks":
                continue
            for block in value:
                for field, v in block.items():
                    kind = {"factors": "factors", "bases": "bases"}.get(field, "moments")
                    for t in v if isinstance(v, list) else [v]:
                        out[kind] += 0 if t is None else t.nbytes
    return out


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_memory_report_matches_the_tensors_allocated(name, tmp_path):
    model = mlp_24_32_32_4()
    opt = OPTIMIZERS[name](model.parameters(), precondition_frequency=5, max_preconditioner_dim=16)
    xs, ys = _data()
    with Runtime(model, opt, _spill_config(tmp_path, placement={"results": "nvme"})) as rt:
        for t in range(13):  # refreshes requested at step 10 wait, spilled, for step 14
            _finish_refreshes(rt)  # so that the next step's boundary spills them
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xs[t]), ys[t]).backward()
            opt.step()
        for e in rt.blocks().values():
            if e.pending is not None and e.pending.spilled is not None:
                rt.spill.settle(e.pending)
        report = rt.memory_report()
        allocated = _state_bytes(opt)
        store = rt.spill.store
        slots = {k: store.nbytes(k) for k in store.keys()}
        planned = report["planned"]
    assert report["device"]["factors"] == allocated["factors"] == planned["device"]["factors"]
    assert report["device"]["moments"] == allocated["moments"] == planned["device"]["moments"]
    assert report["host"]["bases"] == allocated["bases"] == planned["host"]["bases"]
    assert report["device"]["bases"] == 0
    # every block with a factor has a refresh waiting in the spill store: results and inputs
    assert report["nvme"]["results"] == sum(v for k, v in slots.items() if "/r" in k)
    assert report["nvme"]["snapshots"] == sum(v for k, v in slots.items() if "/s" in k)
    assert report["nvme"]["results"] == planned["nvme"]["results"] > 0
    assert report["nvme"]["snapshots"] == planned["nvme"]["snapshots"] > 0
    # once written, a spilled result is not also kept in host memory (its futures were dropped)
    assert report["host"]["results"] == 0


def test_memory_report_without_spilling_counts_waiting_results_in_host():
    model = mlp_24_32_32_4()
    opt = SOAP(model.parameters(), precondition_frequency=5, max_preconditioner_dim=16)
    xs, ys = _data()
    with Runtime(model, opt, FIXED) as rt:
        for t in range(12):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xs[t]), ys[t]).backward()
            opt.step()
        for e in rt.blocks().values():
            if e.pending is not None:
                for f in e.pending.futures:
                    if f is not None:
                        f.result()
        report = rt.memory_report()
        waiting = sum(
            t.nbytes
            for e in rt.blocks().values()
            if e.pending is not None
            for f in e.pending.futures
            if f is not None
            for t in f.result()
            if t is not None
        )
    assert report["nvme"] == dict.fromkeys(report["nvme"], 0) and report["spill"] is None
    # the results waiting in their futures are all the host holds of them (the pool keeps none)
    assert report["host"]["results"] == waiting == report["planned"]["host"]["results"]
    assert report["device"]["factors"] == _state_bytes(opt)["factors"]
