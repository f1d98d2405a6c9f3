"""The public low-level API, ``asteria.lowlevel`` (issue 18, item 1; docs/api.md).

Every public name is documented and listed in docs/api.md; the pool's results equal torch.linalg
in float64 and the synchronous functions; futures time out, resolve in deadline order, and are
cancelled (queued) or not (running, finished); errors are the documented types; results and
host memory live as long as what references them; the staging path copies, fences and gives
slots back; the CUDA-only parts raise ``CudaUnavailableError`` on a CPU-only build.
"""

from __future__ import annotations

import gc
import inspect
import re
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import asteria
from asteria import _C
from asteria import lowlevel as ll
from asteria.memory.copies import HostCopies, HostEvent

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = settings(max_examples=10, deadline=None, derandomize=True)
CPU_BUILD = not _C.cuda_enabled()


def _psd(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.randn(n, n + 2, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return g @ g.T / (n + 2)


def _busy(pool: ll.WorkerPool, n: int = 900, jobs: int = 1) -> list[ll.RefreshFuture]:
    """Jobs that keep a worker busy for a while (fp64 eigh of n x n each)."""
    big = _psd(n, 99)
    futures = [pool.submit_eigh(f"busy{i}", big, dtype=torch.float64) for i in range(jobs)]
    while futures[0].status() == "queued":
        time.sleep(0.001)
    return futures


def _idle(pool: ll.WorkerPool) -> None:
    deadline = time.monotonic() + 120
    while pool.stats()["queued"] or pool.stats()["running"]:
        assert time.monotonic() < deadline, pool.stats()
        time.sleep(0.001)


@pytest.fixture
def pool():
    with ll.WorkerPool(workers=1) as p:
        yield p


# ---- the names ------------------------------------------------------------------------------


def test_all_names_exist_are_documented_and_listed_in_docs_api():
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert len(ll.__all__) == len(set(ll.__all__))
    for name in ll.__all__:
        assert not name.startswith("_")
        obj = getattr(ll, name)
        if callable(obj) and not isinstance(obj, type(tuple[int])):
            assert inspect.getdoc(obj), f"{name} has no docstring"
        assert re.search(rf"`{name}\b", text), f"docs/api.md does not list {name}"
    assert "_C" not in ll.__all__ and "lowlevel" in asteria.__all__


def test_public_functions_are_typed():
    for name in ll.__all__:
        obj = getattr(ll, name)
        members = [obj] if inspect.isfunction(obj) else []
        if inspect.isclass(obj):
            members = [m for k, m in vars(obj).items() if inspect.isfunction(m) and k[0] != "_"]
        for fn in members:
            sig = inspect.signature(fn)
            assert sig.return_annotation is not inspect.Signature.empty, f"{name}.{fn.__name__}"
            for p in sig.parameters.values():
                if p.name != "self":
                    assert p.annotation is not inspect.Parameter.empty, f"{fn.__qualname__}"


# ---- the pool: results ------------------------------------------------------------------------


@EXAMPLES
@given(n=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_pool_eigh_equals_torch_linalg_in_float64(n, seed):
    a = _psd(n, seed)
    with ll.WorkerPool(workers=1) as pool:
        evals, evecs = pool.submit_eigh("b", a, dtype=torch.float64).result(timeout=60)
    scale = 1.0 + float(a.abs().max())
    tol = 100 * n * torch.finfo(torch.float64).eps * scale
    assert torch.allclose(evals, torch.linalg.eigvalsh(a).flip(0), rtol=0, atol=tol)
    assert torch.allclose(evecs @ torch.diag(evals) @ evecs.T, a, rtol=0, atol=tol)
    assert torch.equal(evecs, ll.eigh_descending(a, torch.float64)[1])


@EXAMPLES
@given(n=st.integers(1, 40), seed=st.integers(0, 2**16), sort=st.booleans())
def test_pool_qr_refresh_equals_the_synchronous_function(n, seed, sort):
    a, basis = _psd(n, seed), ll.eigh_descending(_psd(n, seed + 1), torch.float64)[1]
    with ll.WorkerPool(workers=1) as pool:
        future = pool.submit_qr_refresh("b", a, basis, sort=sort, dtype=torch.float64)
        q, perm = future.result(timeout=60)
    ref_q, ref_perm = ll.qr_refresh(a, basis, sort=sort, dtype=torch.float64)
    assert torch.equal(q, ref_q)
    assert (perm is None and ref_perm is None) if not sort else torch.equal(perm, ref_perm)
    assert torch.allclose(q.T @ q, torch.eye(n, dtype=torch.float64), atol=100 * n * 1e-16)


@EXAMPLES
@given(n=st.integers(1, 40), seed=st.integers(0, 2**16), root=st.sampled_from([1, 2, 4]))
def test_pool_inverse_root_equals_torch_linalg_in_float64(n, seed, root):
    a = _psd(n, seed) + 0.1 * torch.eye(n, dtype=torch.float64)
    with ll.WorkerPool(workers=1) as pool:
        future = pool.submit_inverse_root("b", a, root, epsilon=1e-12, dtype=torch.float64)
        out = future.result(timeout=60)
    assert torch.allclose(torch.linalg.matrix_power(out, root), torch.linalg.inv(a), atol=1e-8)
    assert torch.equal(out, ll.inverse_root(a, root, 1e-12, dtype=torch.float64))


def test_pool_settings_and_defaults():
    with ll.WorkerPool(workers=2, lapack_threads=2, nice=5) as pool:
        assert (pool.workers, pool.lapack_threads) == (2, 2)
    with ll.WorkerPool() as pool:
        assert pool.workers == ll.capabilities(probe_o_direct=False).default_workers
    for kwargs, what in [
        ({"workers": 0}, "workers"),
        ({"lapack_threads": 0}, "lapack_threads"),
        ({"nice": 20}, "nice"),
    ]:
        with pytest.raises(ValueError, match=what):
            ll.WorkerPool(**{"workers": 1, **kwargs})


@pytest.mark.skipif(
    not ll.capabilities(probe_o_direct=False).per_worker_lapack_threads,
    reason="LAPACK threads are process-wide in this build",
)
def test_lapack_threads_are_the_workers_own():
    before = torch.get_num_threads()
    with ll.WorkerPool(workers=1, lapack_threads=3) as pool:
        pool.submit_eigh("b", _psd(64), dtype=torch.float64).result(timeout=60)
        assert torch.get_num_threads() == before  # the caller's thread count is untouched


# ---- futures: timeouts, order, cancellation, errors -------------------------------------------


def test_result_times_out_and_the_job_goes_on(pool):
    busy = _busy(pool)
    queued = pool.submit_eigh("b", _psd(8), dtype=torch.float64)
    with pytest.raises(ll.FutureTimeoutError):
        queued.result(timeout=0.0)
    assert isinstance(ll.FutureTimeoutError("x"), TimeoutError)
    busy[0].result(timeout=120)
    assert queued.result(timeout=60)[0].shape == (8,) and queued.status() == "succeeded"
    assert queued.started_at is not None and queued.finished_at >= queued.started_at


def test_jobs_run_in_deadline_order(pool):
    busy = _busy(pool)
    futures = {d: pool.submit_eigh(f"b{d}", _psd(16, d), deadline=d) for d in (30, 10, 20)}
    assert all(f.status() == "queued" for f in futures.values())
    busy[0].result(timeout=120)
    for f in futures.values():
        f.result(timeout=60)
    started = sorted(futures, key=lambda d: futures[d].started_at)
    assert started == [10, 20, 30]


def test_cancel_a_queued_job(pool):
    busy = _busy(pool)
    job = pool.submit_inverse_root("b", _psd(16), 2, deadline=5, version=7)
    before = pool.stats()
    assert job.cancel() and job.cancelled() and job.status() == "cancelled" and job.done()
    with pytest.raises(ll.CancelledError, match="block 'b' \\(version 7\\)"):
        job.result(timeout=10)
    after = pool.stats()
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["submitted"] == before["submitted"] + 1  # the superseding 1x1 job
    assert job.cancel() is True  # already cancelled, as concurrent.futures says
    with pytest.raises(ValueError, match="older than its queued version 7"):
        pool.submit_eigh("b", _psd(4), version=6)  # the 1x1 job waits for the busy worker
    busy[0].result(timeout=120)
    assert not busy[0].cancel()  # finished: not cancelled
    _idle(pool)
    assert pool.stats()["completed"] == after["completed"] + 2  # busy, then the 1x1 job first
    again = pool.submit_eigh("b", _psd(4), version=0)  # the block takes any version again
    assert again.result(timeout=60)[0].shape == (4,)


def test_a_running_job_is_not_cancelled(pool):
    (busy,) = _busy(pool)
    assert busy.status() == "running"
    assert not busy.cancel()
    assert busy.result(timeout=120)[0].shape == (900,)


def test_a_newer_job_supersedes_an_older_queued_one(pool):
    busy = _busy(pool)
    old = pool.submit_eigh("b", _psd(8), version=1)
    new = pool.submit_eigh("b", _psd(8, 1), version=2)
    assert old.cancelled() and old.cancel()
    busy[0].result(timeout=120)
    assert torch.equal(new.result(timeout=60)[1], ll.eigh_descending(_psd(8, 1))[1])


def test_job_errors_name_block_and_version(pool):
    with pytest.raises(ValueError, match="block 'sq' \\(version 3\\).*square"):
        pool.submit_eigh("sq", torch.ones(2, 3), version=3).result(timeout=60)
    bad = _psd(4)
    bad[1, 1] = float("inf")
    with pytest.raises(ll.MatrixFunctionError, match="block 'nan'"):
        pool.submit_inverse_root("nan", bad, 2).result(timeout=60)
    with pytest.raises(TypeError, match="block must be a str"):
        pool.submit_eigh(3, _psd(2))  # type: ignore[arg-type]
    assert pool.stats()["failed"] == 2
    pool.shutdown()
    assert pool.is_shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit_eigh("late", _psd(2))


def test_shutdown_cancels_queued_jobs_and_lets_running_ones_finish():
    pool = ll.WorkerPool(workers=1)
    (busy,) = _busy(pool)
    queued = pool.submit_eigh("q", _psd(8))
    pool.shutdown(wait=True)
    assert busy.status() == "succeeded" and queued.cancelled()
    assert queued.cancel()  # cancelled already
    assert not busy.cancel()


# ---- lifetimes --------------------------------------------------------------------------------


def test_the_pool_keeps_no_future_or_result():
    with ll.WorkerPool(workers=1) as pool:
        future = pool.submit_eigh("b", _psd(32))
        evals, _ = future.result(timeout=60)
        ref, result_ref = weakref.ref(future), weakref.ref(evals)
        del future, evals, _
        gc.collect()
        assert ref() is None and result_ref() is None
        assert "b" not in pool._newest  # the block's entry went with its future


def test_inputs_are_copied_at_submission(pool):
    busy = _busy(pool)
    a = _psd(16)
    want = ll.eigh_descending(a.clone(), torch.float64)
    future = pool.submit_eigh("b", a, dtype=torch.float64)
    a.fill_(float("nan"))  # changed while the job is queued
    busy[0].result(timeout=120)
    assert torch.equal(future.result(timeout=60)[1], want[1])


def test_host_memory_lives_as_long_as_its_tensors():
    gc.collect()
    blocks = ll.host_memory_stats()["live_blocks"]
    t = ll.host_empty((64, 64), torch.float64)
    view = t[3:5]
    assert ll.is_host_tensor(view) and ll.host_tensor_info(t)["block_bytes"] == 64 * 64 * 8
    del t
    gc.collect()
    assert ll.host_memory_stats()["live_blocks"] == blocks + 1  # the view holds it
    view.fill_(1.0)
    del view
    gc.collect()
    assert ll.host_memory_stats()["live_blocks"] == blocks
    c = ll.host_copy(torch.arange(6.0).reshape(2, 3).T)
    assert torch.equal(c, torch.arange(6.0).reshape(2, 3).T) and ll.is_host_tensor(c)


# ---- the staging path ---------------------------------------------------------------------------


def test_snapshot_copies_into_ring_slots_and_gives_them_back():
    a, b = _psd(8), torch.arange(10, dtype=torch.int64)
    ring = ll.StagingRing(slots=2, slot_bytes=a.nbytes)
    copies = ll.copy_stream("cpu")
    with ll.snapshot([a, b], ring, copies, timeout=1) as snap:
        assert snap.ready()
        host_a, host_b = snap.wait(timeout=1)
        assert torch.equal(host_a, a) and torch.equal(host_b, b)
        assert all(ll.host_tensor_info(t)["staging_slot"] for t in (host_a, host_b))
        assert ring.stats()["leased"] == 2
        with pytest.raises(ll.WaitTimeoutError, match="leased"):
            ll.snapshot([a], ring, copies, timeout=0.0)  # no slot left
        snap.fence()
    assert ring.stats()["leased"] == 0 and ring.stats()["held_by_views"] == 2
    del host_a, host_b, snap
    gc.collect()
    with ll.snapshot([a, a], ring, copies, timeout=0.0) as again:  # both slots free again
        assert torch.equal(again.tensors[1], a)
    with pytest.raises(ValueError, match="more than a slot"):
        ll.snapshot([torch.zeros(ring.slot_bytes + 1, dtype=torch.uint8)], ring, copies)
    assert ring.stats()["leased"] == 0  # a refused snapshot holds no slot


def test_snapshot_copies_wait_for_the_main_stream():
    """The reader fence: with the stand-in's events completed by hand, the copy runs only after
    the main-stream event recorded at the snapshot, and ``fence`` refuses to wait for a copy that
    cannot run yet (the main stream would deadlock)."""
    copies = HostCopies(auto_complete=False)
    ring = ll.StagingRing(slots=1, slot_bytes=4096)
    src = torch.ones(4)
    snap = ll.snapshot([src], ring, copies, timeout=1)
    assert not snap.ready() and copies.pending() == 1
    with pytest.raises(RuntimeError, match="stand-in"):
        snap.fence()
    src.fill_(2.0)  # issued before the event completes: the copy sees it, as on a device
    reader = copies.log[0][1]
    reader.complete()
    copies.run()
    assert snap.ready() and torch.equal(snap.wait(timeout=1)[0], torch.full((4,), 2.0))
    snap.fence()
    snap.release()


def test_a_released_snapshot_still_waits_for_its_copies():
    """``release`` gives the slots back early (the runtime releases at once); ``wait`` then
    waits on the copy itself: a timeout while it is queued, the tensors once it ran."""
    copies = HostCopies(auto_complete=False)
    ring = ll.StagingRing(slots=1, slot_bytes=4096)
    snap = ll.snapshot([torch.arange(3.0)], ring, copies, timeout=1)
    snap.release()
    with pytest.raises(ll.WaitTimeoutError, match="not landed"):
        snap.wait(timeout=0.01)
    with pytest.raises(RuntimeError, match="never completes"):
        snap.wait()  # the stand-in cannot block on a copy that cannot run
    copies.log[0][1].complete()
    copies.run()
    assert torch.equal(snap.wait(timeout=1)[0], torch.arange(3.0)) and snap.wait()[0][2] == 2.0


class _DeviceLikeCopies(HostCopies):
    """Copies that, like a device's, hold no reference to their sources while in flight: each
    runs at once but its event stays pending (the device still reading) until completed."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[HostEvent] = []

    def copy(self, dsts, srcs, waits):
        for dst, src in zip(dsts, srcs):
            dst.copy_(src)
        self.events.append(HostEvent(-1))
        return self.events[-1]


def test_a_snapshot_keeps_host_sources_alive_until_its_copy_landed():
    """Host memory (and device views of it) is not the caching allocator's, so ``record_stream``
    does not keep it from being freed under a copy in flight: the snapshot keeps it, also past
    the Snapshot object, until the copy's event completes."""
    copies = _DeviceLikeCopies()
    ring = ll.StagingRing(slots=2, slot_bytes=4096)
    src = torch.arange(4.0)
    alive = weakref.ref(src)
    snap = ll.snapshot([src], ring, copies, timeout=1)
    snap.release()
    del src, snap
    gc.collect()
    assert alive() is not None, "the source was freed under its copy"
    copies.events[0].complete()
    ll.snapshot([torch.zeros(1)], ring, copies, timeout=1).release()  # drops what landed
    gc.collect()
    assert alive() is None, "the source outlived its copy"


def test_copy_stream_refuses_other_devices():
    with pytest.raises(ValueError, match="'cuda' or 'cpu'"):
        ll.copy_stream("meta")


# ---- the spill store --------------------------------------------------------------------------


def test_spill_store_round_trip_and_errors(tmp_path):
    a = _psd(16)
    with ll.SpillStore(tmp_path, 1 << 20) as store:
        assert store.mode in ("direct", "buffered") and store.mode_reason
        assert store.put("L", a).result(timeout=10) is None
        assert store.prefetch(["L"]) == 1
        assert torch.equal(store.get("L", timeout=10), a)
        with pytest.raises(KeyError):
            store.get("absent")
        with pytest.raises(TypeError):
            store.put(1, a)  # type: ignore[arg-type]
        with pytest.raises(ll.SpillIOError) as full:
            store.put("big", torch.zeros(2 << 20, dtype=torch.uint8))
        assert isinstance(full.value, OSError)
    assert not any(tmp_path.iterdir())  # the file is deleted at close


# ---- capabilities and CUDA-only parts ---------------------------------------------------------


def test_capabilities_describe_this_build(tmp_path):
    caps = ll.capabilities(spill_dir=tmp_path)
    info = _C.build_info()
    assert caps.cuda_build == bool(info["cuda"]) and caps.cuda_device == torch.cuda.is_available()
    gpu = caps.cuda_build and caps.cuda_device
    assert caps.pinned_memory == caps.mapped_memory == caps.cuda_copy_stream == gpu
    assert caps.lapack_backend == info["lapack_backend"] and caps.eigh_path == _C.eigh_path()
    assert set(caps.custom_ops) == set(asteria.ops.OPS)
    assert isinstance(caps.o_direct, bool) and caps.o_direct_reason
    assert caps.spill_dir == str(tmp_path) and not any(tmp_path.iterdir())  # probe cleaned up
    with ll.SpillStore(tmp_path, 4096) as store:  # the probe says what a store gets
        assert (store.mode == "direct") == caps.o_direct
    skipped = ll.capabilities(probe_o_direct=False)
    assert skipped.o_direct is None and skipped.spill_dir is None
    assert caps.as_dict()["default_workers"] == caps.default_workers


@pytest.mark.no_gpu  # a CPU-only build, or a CUDA build on a machine without a GPU
@pytest.mark.parametrize(
    "call",
    [
        lambda: ll.host_empty(4, pinned=True),
        lambda: ll.host_empty_like(torch.zeros(2), pinned=True),
        lambda: ll.host_copy(torch.zeros(2), pinned=True),
        lambda: ll.device_view(ll.host_empty(4)),
        lambda: ll.copy_stream("cuda"),
    ],
    ids=["host_empty", "host_empty_like", "host_copy", "device_view", "copy_stream"],
)
def test_cuda_only_parts_say_so_on_a_cpu_build(call):
    missing = "this asteria build has no CUDA" if CPU_BUILD else "torch sees no CUDA device"
    with pytest.raises(ll.CudaUnavailableError, match=missing):
        call()
    assert issubclass(ll.CudaUnavailableError, RuntimeError)


def test_info_lists_the_capabilities(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "asteria.info", "--spill-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    rows = dict(
        re.split(r"\s{2,}", line, maxsplit=1) for line in out.stdout.splitlines() if "  " in line
    )
    caps = ll.capabilities(spill_dir=tmp_path)
    gpu = caps.cuda_build and caps.cuda_device
    assert rows["api: CUDA"] == ("yes" if gpu else "no")
    assert rows["api: mapped memory (device_view)"].startswith("yes" if gpu else "no")
    assert rows["api: O_DIRECT spill store"].startswith(
        f"{'yes' if caps.o_direct else 'no'} in {tmp_path}: {caps.o_direct_reason}"
    )
    assert rows["api: LAPACK path"] == f"{caps.lapack_backend}, eigh via {caps.eigh_path}"
    assert rows["api: torch.ops"] == ", ".join(asteria.ops.OPS)
    assert not any(tmp_path.iterdir())
