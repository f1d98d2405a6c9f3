"""The NVMe spill store from Python (asteria.memory.nvme.SpillStore) over real files in pytest's
temporary directory: round trips of every dtype and shape in each I/O mode, futures and errors
(ENOSPC/EIO through the test hook, corruption through a flipped byte), O_DIRECT fallback, bad
paths and capacities, page-in ahead of use, and deletion of the file.
"""

from __future__ import annotations

import errno
import gc
import os
import shutil
import threading

import pytest
import torch

from asteria import _C
from asteria.memory import (
    SpillChecksumError,
    SpillIOError,
    SpillStore,
    host_empty,
    host_tensor_info,
)

MiB = 1 << 20


def _direct_supported(path) -> bool:
    store = SpillStore(path, MiB)
    try:
        return store.mode == "direct"
    finally:
        store.close()


@pytest.fixture(params=["auto", "buffered"])
def store(request, tmp_path):
    with SpillStore(tmp_path, 64 * MiB, io_threads=2, mode=request.param) as s:
        yield s


@pytest.fixture(autouse=True)
def _no_injected_failures():
    yield
    for op in ("write", "read", "open_direct"):
        _C._testing_io_fail_next(0, 0, op)


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(33, 65, generator=gen),
        "bf16": torch.randn(1000, generator=gen).to(torch.bfloat16),
        "f64-3d": torch.randn(3, 4, 5, generator=gen, dtype=torch.float64),
        "i64": torch.randint(-(2**40), 2**40, (777,), generator=gen),
        "bool": torch.rand(4099, generator=gen) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "big": torch.randn(3 * MiB // 4 + 5, generator=gen),  # 3 MiB + tail
        "complex": torch.randn(10, dtype=torch.complex64, generator=gen),
        "noncontig": torch.randn(40, 30, generator=gen).t()[::2],
    }


# ---- round trips ------------------------------------------------------------------------------


def test_round_trip_every_dtype_and_shape(store):
    tensors = _tensors()
    futures = [store.put(key, t) for key, t in tensors.items()]
    assert all(f.result(timeout=30) is None for f in futures)
    for key, t in tensors.items():
        back = store.get(key)
        assert back.shape == t.shape and back.dtype == t.dtype, key
        assert torch.equal(back, t), key
        assert back.data_ptr() % 4096 == 0 and host_tensor_info(back) is not None
    assert sorted(store.keys()) == sorted(tensors) and len(store) == len(tensors)
    stats = store.stats()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert stats["bytes_written"] == nbytes and stats["bytes_read"] == nbytes
    assert stats["writes"] == stats["reads"] == len(tensors)
    assert stats["mode"] in ("direct", "buffered") and stats["mode_reason"]
    assert stats["write_failures"] == stats["read_failures"] == stats["checksum_failures"] == 0


def test_get_into_out_and_async(store):
    t = torch.randn(1000, 3)
    store.put("w", t).result()
    out = host_empty(t.shape, t.dtype, pinned=False)
    assert store.get("w", out=out) is out and torch.equal(out, t)
    plain = torch.empty_like(t)  # unaligned torch memory works too
    future = store.get_async("w", out=plain)
    assert future.result(timeout=10) is plain and torch.equal(plain, t)
    assert future.done() and future.finished_at >= future.started_at
    with pytest.raises(ValueError, match="holds 12000 bytes"):
        store.get("w", out=torch.empty(5))


def test_overwrite_delete_and_space_reuse(store):
    store.put("k", torch.zeros(MiB // 4)).result()
    used = store.stats()["used_bytes"]
    store.put("k", torch.ones(10)).result()
    assert torch.equal(store.get("k"), torch.ones(10))
    assert store.stats()["used_bytes"] == 4096 and used == MiB
    assert store.delete("k") and not store.delete("k")
    assert "k" not in store and store.stats()["used_bytes"] == 0
    with pytest.raises(KeyError):
        store.get("k")


def test_concurrent_puts_and_gets_from_threads(store):
    def work(i: int) -> None:
        for j in range(10):
            t = torch.full((1000 + i,), float(i * 100 + j))
            store.put(f"{i}/{j}", t).result()
            assert torch.equal(store.get(f"{i}/{j}"), t)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(store) == 40


def test_keys_are_strings(store):
    with pytest.raises(TypeError, match="strings"):
        store.put(3, torch.zeros(1))
    with pytest.raises(TypeError):
        store.get(b"k")


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_write_failure_surfaces_with_its_errno(store, code):
    store.put("ok", torch.arange(10.0)).result()
    _C._testing_io_fail_next(1, code, "write")
    future = store.put("bad", torch.arange(5000.0))
    with pytest.raises(SpillIOError) as info:
        future.result(timeout=10)
    assert isinstance(info.value, OSError) and info.value.errno == code
    assert "writing key 'bad' failed" in str(info.value)
    assert "bad" not in store and store.stats()["write_failures"] == 1
    with pytest.raises(KeyError):
        store.get("bad")
    assert torch.equal(store.get("ok"), torch.arange(10.0))  # the store is still usable
    store.put("bad", torch.arange(5000.0)).result()
    assert torch.equal(store.get("bad"), torch.arange(5000.0))


def test_read_failure_surfaces_with_its_errno(store):
    store.put("k", torch.arange(100.0)).result()
    _C._testing_io_fail_next(1, errno.EIO, "read")
    with pytest.raises(OSError) as info:
        store.get("k")
    assert info.value.errno == errno.EIO and "reading key 'k' failed" in str(info.value)
    assert store.stats()["read_failures"] == 1
    assert torch.equal(store.get("k"), torch.arange(100.0))


def test_a_full_store_refuses_at_put_with_enospc(tmp_path):
    with SpillStore(tmp_path, 3 * 4096) as s:
        s.put("a", torch.zeros(2048)).result()  # 8 KiB
        with pytest.raises(SpillIOError, match="spill store is full") as info:
            s.put("b", torch.zeros(2048))
        assert info.value.errno == errno.ENOSPC
        assert "b" not in s
        s.delete("a")
        s.put("b", torch.zeros(2048)).result()


def test_a_flipped_byte_is_a_checksum_error_naming_the_key(store):
    t = torch.randn(5000)
    store.put("layer.3/Q", t).result()
    offset, extent = store._store.extent("layer.3/Q")
    assert extent == 20480
    with open(store.path, "r+b") as f:
        f.seek(offset + 12345)
        byte = f.read(1)
        f.seek(offset + 12345)
        f.write(bytes([byte[0] ^ 0x01]))
        f.flush()
        os.fsync(f.fileno())
    with pytest.raises(SpillChecksumError, match="'layer.3/Q'.*corrupt"):
        store.get("layer.3/Q")
    assert store.stats()["checksum_failures"] == 1
    store.put("layer.3/Q", t).result()  # the caller recomputes and spills again
    assert torch.equal(store.get("layer.3/Q"), t)


def test_result_with_a_timeout(tmp_path):
    """result(timeout=0) of a write still queued behind others raises; of a finished one returns.
    Where the single I/O thread got through the whole queue before the check (a fast disk, or a
    main thread held up on a loaded machine), nothing was left to time out: again, with more
    queued ahead."""
    for n in (40, 160, 320):
        with SpillStore(tmp_path, (n + 1) * MiB, io_threads=1) as s:
            futures = [s.put(f"k{i}", torch.zeros(MiB // 4)) for i in range(n)]
            try:
                futures[-1].result(timeout=0)  # n - 1 MiB of writes are queued ahead of it
            except TimeoutError as e:
                assert "did not finish within" in str(e)
                timed_out = True
            else:
                timed_out = False
            assert futures[-1].result(timeout=60) is None
            assert futures[0].result(timeout=0) is None  # done: no wait needed
            with pytest.raises(ValueError, match="timeout_s"):
                futures[0].result(timeout=-1)
        if timed_out:
            break
    assert timed_out, "every queued write had finished before result(timeout=0) was asked"


# ---- modes and bad input ----------------------------------------------------------------------


def test_o_direct_refused_at_open_falls_back_to_buffered(tmp_path):
    _C._testing_io_fail_next(1, errno.EINVAL, "open_direct")  # as tmpfs before Linux 6.6
    with SpillStore(tmp_path, MiB) as s:
        assert s.mode == "buffered" and "refused O_DIRECT" in s.mode_reason
        s.put("k", torch.arange(7.0)).result()
        assert torch.equal(s.get("k"), torch.arange(7.0))
    _C._testing_io_fail_next(1, errno.EINVAL, "open_direct")
    with pytest.raises(ValueError, match="refuses O_DIRECT"):
        SpillStore(tmp_path, MiB, mode="direct")
    assert os.listdir(tmp_path) == []


def test_o_direct_refused_at_first_io_falls_back_to_buffered(tmp_path):
    if not _direct_supported(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT at open; the probe write never runs")
    _C._testing_io_fail_next(1, errno.EINVAL, "write")  # the probe write
    with SpillStore(tmp_path, MiB) as s:
        assert s.mode == "buffered" and "refused direct I/O" in s.mode_reason


def test_buffered_mode_is_what_it_says(tmp_path):
    with SpillStore(tmp_path, MiB, mode="buffered") as s:
        assert s.mode == "buffered"
    with pytest.raises(ValueError, match="mode must be"):
        SpillStore(tmp_path, MiB, mode="fast")


def test_a_missing_directory_says_what_to_change(tmp_path):
    with pytest.raises(ValueError, match="does not exist: create the directory"):
        SpillStore(tmp_path / "nope", MiB)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ValueError, match="is not a directory"):
        SpillStore(tmp_path / "file", MiB)


def test_an_unwritable_directory_says_what_to_change(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root may write anywhere")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="is not writable by this process"):
            SpillStore(locked, MiB)
    finally:
        locked.chmod(0o700)


def test_capacity_beyond_free_space_fails_at_creation(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ValueError, match="exceeds the free space.*lower capacity_bytes"):
        SpillStore(tmp_path, free + (1 << 40))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"capacity_bytes": 0}, "capacity_bytes must be > 0"),
        ({"capacity_bytes": MiB, "io_threads": 0}, r"io_threads must be in \[1, 64\]"),
        ({"capacity_bytes": MiB, "io_threads": 65}, r"io_threads must be in \[1, 64\]"),
    ],
)
def test_bad_arguments_are_value_errors(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpillStore(tmp_path, **kwargs)
    assert os.listdir(tmp_path) == []


# ---- page-in ahead of use ---------------------------------------------------------------------


def test_prefetch_reads_in_the_given_order_and_get_takes_the_buffers(tmp_path):
    with SpillStore(tmp_path, 64 * MiB, io_threads=1) as s:
        tensors = {f"b{i}": torch.full((MiB // 4,), float(i)) for i in range(6)}
        for key, t in tensors.items():
            s.put(key, t)
        order = ["b4", "b1", "b5", "b0"]
        assert s.prefetch(order) == 4
        assert s.prefetch(["b4"]) == 0  # already on its way
        starts = [s._prefetched[key]._future for key in order]
        for future in starts:
            future.result(10)
        started = [f.started_at for f in starts]
        assert started == sorted(started), "reads did not start in the prefetch order"
        stats = s.stats()
        assert stats["prefetch_issued"] == 4 and stats["prefetched"] == 4
        for key in order:
            assert torch.equal(s.get(key), tensors[key])
        assert torch.equal(s.get("b2"), tensors["b2"])  # not prefetched: read on demand
        stats = s.stats()
        assert stats["prefetch_hits"] == 4 and stats["prefetched"] == 0
        with pytest.raises(KeyError):
            s.prefetch(["missing"])


def test_put_or_delete_after_prefetch_drops_the_stale_buffer(store):
    store.put("k", torch.zeros(100)).result()
    store.put("gone", torch.zeros(100)).result()
    store.prefetch(["k", "gone"])
    store.put("k", torch.ones(100)).result()
    assert torch.equal(store.get("k"), torch.ones(100))
    store.delete("gone")
    with pytest.raises(KeyError):
        store.get("gone")
    assert store.stats()["prefetch_hits"] == 0


def test_prefetched_buffer_into_out(store):
    t = torch.randn(64, 8)
    store.put("k", t).result()
    store.prefetch(["k"])
    out = torch.empty(64, 8)
    assert store.get("k", out=out) is out and torch.equal(out, t)


def test_a_read_queued_behind_its_write_waits_for_it(tmp_path):
    with SpillStore(tmp_path, 64 * MiB, io_threads=1) as s:
        t = torch.randn(2 * MiB)
        s.put("k", t)  # not waited for
        assert torch.equal(s.get("k"), t)


# ---- lifetime of the file ---------------------------------------------------------------------


def test_close_deletes_the_file_and_later_calls_fail(tmp_path):
    s = SpillStore(tmp_path, MiB)
    path = s.path
    assert os.path.exists(path) and os.path.getsize(path) == MiB
    s.put("k", torch.zeros(4)).result()
    s.close()
    assert not os.path.exists(path) and s.closed
    with pytest.raises(RuntimeError, match="closed"):
        s.put("k", torch.zeros(4))
    s.close()  # idempotent


def test_the_destructor_deletes_the_file(tmp_path):
    s = SpillStore(tmp_path, MiB)
    path = s.path
    s.put("k", torch.zeros(1000))
    del s
    gc.collect()
    assert not os.path.exists(path)
    assert os.listdir(tmp_path) == []


def test_close_with_queued_writes_resolves_every_future(tmp_path):
    s = SpillStore(tmp_path, 128 * MiB, io_threads=1)
    futures = [s.put(f"k{i}", torch.zeros(MiB // 4)) for i in range(40)]
    s.close()
    outcomes = set()
    for f in futures:
        try:
            f.result(timeout=10)
            outcomes.add("written")
        except RuntimeError as e:
            assert "closed" in str(e)
            outcomes.add("cancelled")
    assert outcomes <= {"written", "cancelled"}
    assert os.listdir(tmp_path) == []
