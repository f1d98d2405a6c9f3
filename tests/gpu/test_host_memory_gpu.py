"""Host memory on a real GPU: pinned (cudaHostRegister'ed) blocks and their accounting, chunked
registration of large blocks, mapped device views and their lifetimes, the staging ring fenced by
real CUDA events (current stream, side stream, shadow stream), and the spill store with CUDA
tensors. Skipped where torch sees no CUDA device.

Build first: ``TORCH_CUDA_ARCH_LIST=9.0 pip install --no-build-isolation --no-deps -e .``.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from asteria import _C
from asteria.memory import (
    SpillStore,
    StagingRing,
    device_view,
    host_empty,
    host_memory_stats,
    host_tensor_info,
)
from asteria.memory.copies import CudaCopies

pytestmark = pytest.mark.gpu  # skipped without CUDA: tests/conftest.py

MiB = 1 << 20
# About 50-100 ms of GPU time on current parts: a copy queued behind it is observably pending.
SLEEP_CYCLES = 100_000_000


def _stats() -> dict[str, int]:
    gc.collect()
    torch.cuda.synchronize()
    return host_memory_stats()


def test_the_extension_was_built_with_cuda():
    assert _C.cuda_enabled(), "CPU build on a CUDA machine: rebuild with CUDA"


def test_host_empty_pins_by_default_and_accounts_registered_bytes():
    before = _stats()
    t = host_empty((1024, 1024), torch.float32)  # 4 MiB
    assert t.is_pinned() and host_tensor_info(t)["pinned"]
    during = _stats()
    assert during["registered_blocks"] == before["registered_blocks"] + 1
    assert during["registered_bytes"] == before["registered_bytes"] + 4 * MiB
    pageable = host_empty((1024,), torch.float32, pinned=False)
    assert not pageable.is_pinned() and not host_tensor_info(pageable)["pinned"]
    assert host_empty((8,), torch.float32, pinned=True).is_pinned()
    del t, pageable
    after = _stats()
    assert after["registered_bytes"] == before["registered_bytes"]
    assert after["live_blocks"] == before["live_blocks"]


def test_copies_from_pinned_blocks_do_not_block_the_host():
    host = host_empty((16 * MiB,), torch.float32)
    dev = torch.empty(16 * MiB, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(10 * SLEEP_CYCLES)  # ~0.5-1 s
    dev.copy_(host, non_blocking=True)  # queued behind the sleep
    # the host is back while the sleep still runs: the copy did not block it
    assert not torch.cuda.current_stream().query(), "the H2D copy blocked the host"
    torch.cuda.synchronize()


def test_a_block_larger_than_one_registration_chunk():
    n = 600 * MiB // 4  # 600 MiB: registered as 256 + 256 + 88 MiB
    before = _stats()
    t = host_empty((n,), torch.float32)
    assert _stats()["registered_bytes"] == before["registered_bytes"] + 600 * MiB
    assert t.is_pinned() and t[-1:].is_pinned() and t[n // 2 :].is_pinned()
    t.copy_(torch.arange(n, dtype=torch.float32).remainder_(4099.0))
    boundary = 256 * MiB // 4
    # Note [Device views across registrations]: the driver refuses a copy across two
    # registrations (seen on the H200), so a view may not span a chunk boundary ...
    with pytest.raises(ValueError, match="spans 3 host registration chunks"):
        device_view(t)
    with pytest.raises(ValueError, match="spans 2 host registration chunks"):
        device_view(t[boundary - 3 : boundary + 3])
    # ... and every view inside one chunk works, in each chunk
    for lo, hi in ((0, boundary), (boundary, 2 * boundary), (2 * boundary, n)):
        dv = device_view(t[lo:hi])
        assert torch.equal(dv.cpu(), t[lo:hi])
        assert torch.equal(dv, t[lo:hi].cuda()), "a kernel reading the mapped chunk saw others"
    del t, dv
    assert _stats()["registered_bytes"] == before["registered_bytes"]


def test_device_view_aliases_the_host_memory_both_ways():
    ref = torch.arange(1000, dtype=torch.float32)
    t = host_empty((1000,), torch.float32)
    t.copy_(ref)
    dv = device_view(t)
    assert dv.device == torch.device("cuda", torch.cuda.current_device())
    assert dv.shape == t.shape and dv.dtype == t.dtype
    assert host_tensor_info(dv)["device_view"]
    assert torch.equal(dv.cpu(), ref)
    dv.mul_(2)  # a kernel writes host memory
    torch.cuda.synchronize()
    assert torch.equal(t, ref * 2)
    t.add_(1)  # the host writes, the GPU reads
    assert torch.equal(dv.cpu(), ref * 2 + 1)
    # Views keep their strides and offsets.
    strided = t.view(10, 100).t()[5:]
    dstrided = device_view(strided)
    assert dstrided.stride() == strided.stride()
    assert dstrided.storage_offset() == strided.storage_offset()
    assert torch.equal(dstrided.cpu(), strided)
    assert device_view(t, device=f"cuda:{torch.cuda.current_device()}").device == dv.device


def test_device_view_keeps_the_block_alive_after_the_host_tensor_is_gone():
    blocks = _stats()["live_blocks"]
    t = host_empty((4096,), torch.float32)
    t.fill_(5.0)
    dv = device_view(t)
    del t
    assert _stats()["live_blocks"] == blocks + 1
    assert bool(torch.all(dv == 5.0))
    del dv
    assert _stats()["live_blocks"] == blocks


def test_device_view_refuses_pageable_and_foreign_memory():
    with pytest.raises(ValueError, match="not pinned"):
        device_view(host_empty((4,), torch.float32, pinned=False))
    with pytest.raises(ValueError, match="does not come from asteria.memory"):
        device_view(torch.empty(4, pin_memory=True))
    with pytest.raises(ValueError, match="device view already"):
        device_view(device_view(host_empty((4,), torch.float32)))


def test_a_device_view_of_a_slot_pins_the_slot():
    ring = StagingRing(1, 4096)
    assert ring.stats()["pinned"]
    with ring.acquire(0) as slot:
        view = slot.view((16,), torch.float32)
        view.fill_(3.0)
        dv = device_view(view)
    del view
    with pytest.raises(TimeoutError, match="held by live tensor views"):
        ring.acquire(0.01)
    assert bool(torch.all(dv == 3.0))
    del dv
    torch.cuda.synchronize()
    assert ring.acquire(1).index == 0


def test_a_slot_is_not_reused_before_its_cuda_copy_completed():
    ring = StagingRing(1, 4 * MiB)
    src = torch.full((MiB,), 7.0, device="cuda")
    torch.cuda.synchronize()
    with ring.acquire(0) as slot:
        torch.cuda._sleep(SLEEP_CYCLES)
        dst = slot.view(src.shape, src.dtype)
        dst.copy_(src, non_blocking=True)  # D2H on the current stream, behind the sleep
        slot.record()
        assert not slot.query()
        del dst  # no view left: only the event keeps the slot busy
    with pytest.raises(TimeoutError, match="1 wait for copies"):
        ring.acquire(0.001)
    again = ring.acquire(timeout=10)  # waits for the event
    assert again.query()
    assert bool(torch.all(again.view(src.shape, src.dtype) == 7.0))


def test_record_on_a_side_stream():
    ring = StagingRing(1, 4 * MiB)
    side = torch.cuda.Stream()
    src = torch.full((MiB,), 2.0, device="cuda")
    torch.cuda.synchronize()
    with ring.acquire(0) as slot:
        dst = slot.view(src.shape, src.dtype)
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            dst.copy_(src, non_blocking=True)
        slot.record(side)
        assert not slot.query()
        assert slot.wait(timeout=10)
        assert bool(torch.all(dst == 2.0))


def test_a_copy_on_the_copy_stream_fences_the_slot():
    """As the runtime's staged snapshots fill a slot (Note [Staged snapshots])."""
    copies = CudaCopies("cuda")
    ring = StagingRing(1, 4 * MiB)
    src = torch.zeros(MiB, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    src.fill_(5.0)  # queued behind the sleep on the current stream
    with ring.acquire(0) as slot:
        dst = slot.view(src.shape, src.dtype)
        copies.copy([dst], [src], [copies.record()])
        slot.record(copies.stream)
        assert not slot.query()
        with pytest.raises(TimeoutError):
            ring.acquire(0.001)
        assert slot.wait(timeout=10)
    assert bool(torch.all(dst == 5.0))
    del dst
    assert ring.acquire(timeout=10).index == 0


def test_pinned_memory_freed_from_another_thread():
    before = _stats()
    holder = [host_empty((MiB,), torch.float32)]
    assert _stats()["registered_bytes"] == before["registered_bytes"] + 4 * MiB
    worker = threading.Thread(target=holder.clear)
    worker.start()
    worker.join()
    assert _stats()["registered_bytes"] == before["registered_bytes"]


def test_spill_store_with_cuda_tensors(tmp_path):
    with SpillStore(tmp_path, 64 * MiB) as store:
        t = torch.randn(1000, 100, device="cuda")
        store.put("k", t).result()
        back = store.get("k")
        assert back.device.type == "cpu" and torch.equal(back, t.cpu())
        out = host_empty(t.shape, t.dtype)  # pinned: the H2D copy after it is asynchronous
        store.get("k", out=out)
        assert out.is_pinned() and torch.equal(out.to("cuda", non_blocking=True), t)
