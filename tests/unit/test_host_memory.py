"""Host memory from Python (asteria.memory.host): tensors over Asteria's host blocks and their
lifetimes, the staging ring's reuse rules, and device views' errors on a build or machine without
CUDA. The CUDA side (pinning, mapped views, real events) is tests/gpu/test_host_memory_gpu.py.

Counters are process-wide, so each test compares them before and after its own allocations.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asteria import _C
from asteria.memory import (
    StagingRing,
    device_view,
    host_copy,
    host_empty,
    host_empty_like,
    host_memory_stats,
    host_tensor_info,
    is_host_tensor,
    release_host_cache,
)
from asteria.memory.copies import HostCopies


def _live() -> tuple[int, int]:
    gc.collect()
    stats = host_memory_stats()
    return stats["live_blocks"], stats["live_bytes"]


@pytest.fixture
def held_fences():
    """Stand-in fences recorded inside the test stay pending until the test releases them."""
    _C._testing_hold_fences()
    yield _C._testing_release_fences
    _C._testing_release_fences()


# ---- host_empty and lifetimes -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8])
@pytest.mark.parametrize("shape", [(0,), (1,), (3, 5), (1023, 7), ()])
def test_host_empty_is_an_aligned_contiguous_cpu_tensor(shape, dtype):
    t = host_empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu"
    assert t.is_contiguous()
    assert t.data_ptr() % 4096 == 0
    info = host_tensor_info(t)
    assert info is not None and info["offset"] == 0 and not info["staging_slot"]
    expected = max(4096, -(-t.numel() * t.element_size() // 4096) * 4096)
    assert info["block_bytes"] == expected
    t.fill_(3)
    assert torch.all(t == 3)


def test_host_empty_like_and_copy():
    src = torch.randn(17, 9, dtype=torch.float64)
    like = host_empty_like(src)
    assert like.shape == src.shape and like.dtype == src.dtype and is_host_tensor(like)
    copy = host_copy(src.t())
    assert torch.equal(copy, src.t()) and copy.is_contiguous() and is_host_tensor(copy)
    assert not is_host_tensor(src) and host_tensor_info(src) is None


def test_counters_follow_allocation_and_free():
    blocks, nbytes = _live()
    a = host_empty((1000,), torch.float32)  # 4000 bytes -> one 4 KiB block
    b = host_empty((4097,), torch.uint8)  # two blocks' worth
    assert _live() == (blocks + 2, nbytes + 4096 + 8192)
    stats = host_memory_stats()
    assert stats["peak_bytes"] >= stats["live_bytes"]
    del a
    assert _live() == (blocks + 1, nbytes + 8192)
    del b
    assert _live() == (blocks, nbytes)


@given(
    sizes=st.lists(st.integers(1, 3 * 4096), min_size=1, max_size=12),
    order=st.randoms(use_true_random=False),
)
@settings(max_examples=40, deadline=None)
def test_reused_blocks_are_handed_back_only_to_the_same_size_and_only_once_free(sizes, order):
    """Note [Reused host blocks]: a reuse=True block returns to the cache when its last tensor
    goes; a later reuse=True tensor of the same rounded size gets it (never a block still
    referenced); plain host_empty never touches the cache; release_host_cache frees it all."""
    release_host_cache()
    blocks, nbytes = _live()
    live = [host_empty((n,), torch.uint8, reuse=True) for n in sizes]
    for x in live:
        x.fill_(7)
    del x
    addresses = {t.data_ptr() for t in live}
    freed = order.sample(live, len(live) // 2)
    kept = [t for t in live if all(t is not f for f in freed)]
    freed_sizes = [-(-t.numel() // 4096) * 4096 for t in freed]
    del live
    freed_ptrs = {t.data_ptr() for t in freed}
    del freed
    gc.collect()
    stats = host_memory_stats()
    assert stats["cached_blocks"] == len(freed_sizes)
    assert stats["cached_bytes"] == sum(freed_sizes)
    reused_before = stats["reused_blocks"]
    plain = host_empty((4096,), torch.uint8)  # never from the cache
    assert host_memory_stats()["cached_blocks"] == len(freed_sizes)
    again = [host_empty((n,), torch.uint8, reuse=True) for n in freed_sizes]
    assert host_memory_stats()["reused_blocks"] == reused_before + len(freed_sizes)
    assert {t.data_ptr() for t in again} == freed_ptrs  # the same blocks, none still in use
    assert not {t.data_ptr() for t in again} & {t.data_ptr() for t in kept}
    assert all(bool((t == 7).all()) for t in kept)
    assert {t.data_ptr() for t in kept} <= addresses
    del again, kept, plain
    assert release_host_cache() == sum(-(-n // 4096) * 4096 for n in sizes)
    assert _live() == (blocks, nbytes)
    assert host_memory_stats()["cached_blocks"] == 0


def test_a_view_outlives_its_base_and_the_last_view_frees_the_block():
    blocks, nbytes = _live()
    base = host_empty((64, 64), torch.float32)
    base.copy_(torch.arange(64 * 64, dtype=torch.float32).view(64, 64))
    row = base[10]
    col = base[:, 3]
    del base
    assert _live() == (blocks + 1, nbytes + 16384)  # the views keep the block
    assert torch.equal(row, torch.arange(640, 704, dtype=torch.float32))
    assert torch.equal(col, torch.arange(3, 64 * 64, 64, dtype=torch.float32))
    row.add_(1)  # still writable memory, not freed
    del row
    assert _live()[0] == blocks + 1
    del col
    assert _live() == (blocks, nbytes)


def test_the_block_is_freed_when_a_view_dies_on_another_thread():
    blocks, _ = _live()
    holder = [host_empty((256,), torch.float64)[100:]]
    worker = threading.Thread(target=holder.clear)
    worker.start()
    worker.join()
    assert _live()[0] == blocks


def test_storage_is_not_resizable():
    t = host_empty((8,), torch.float32)
    with pytest.raises(RuntimeError):
        t.resize_(1 << 20)  # would move the tensor off the block


def test_bad_sizes_are_value_errors():
    with pytest.raises(ValueError, match="negative"):
        host_empty((3, -1), torch.float32)


@pytest.mark.no_gpu
def test_pinning_without_a_gpu():
    blocks, _ = _live()
    t = host_empty((16,), torch.float32)  # pinned=None: pageable here
    assert not host_tensor_info(t)["pinned"]
    with pytest.raises(RuntimeError, match="pinned=None"):
        host_empty((16,), torch.float32, pinned=True)
    assert host_memory_stats()["registered_bytes"] == 0
    del t
    assert _live()[0] == blocks


@pytest.mark.no_gpu
def test_device_view_without_cuda_is_a_clear_error():
    t = host_empty((4,), torch.float32)
    with pytest.raises(RuntimeError, match="no CUDA|no GPU"):
        device_view(t)


@pytest.mark.gpu  # the memory checks run before the CUDA check only on a GPU
def test_device_view_refuses_foreign_or_pageable_memory():
    with pytest.raises(ValueError, match="does not come from asteria.memory"):
        device_view(torch.empty(4))
    with pytest.raises(ValueError, match="not pinned"):
        device_view(host_empty((4,), torch.float32, pinned=False))


# ---- the staging ring -------------------------------------------------------------------------


def test_slots_are_aligned_and_handed_out_in_ring_order():
    ring = StagingRing(3, 1000)
    assert ring.slots == 3 and ring.slot_bytes == 4096
    a, b, c = ring.acquire(0), ring.acquire(0), ring.acquire(0)
    assert [a.index, b.index, c.index] == [0, 1, 2]
    va, vb = a.view((10,), torch.float32), b.view((4096,), torch.uint8)
    assert vb.data_ptr() - va.data_ptr() == 4096 and va.data_ptr() % 4096 == 0
    info = host_tensor_info(va)
    assert info["staging_slot"] and info["block_bytes"] == 3 * 4096
    del va, vb
    b.release()
    with ring.acquire(0) as d:
        assert d.index == 1
    assert d.released
    stats = ring.stats()
    assert stats["leased"] == 2 and stats["acquires"] == 4
    a.release()
    c.release()


def test_a_full_ring_times_out_and_says_why():
    ring = StagingRing(2, 4096)
    leased = ring.acquire(0)
    viewed = ring.acquire(0)
    view = viewed.view((8,), torch.float32)
    viewed.release()
    with pytest.raises(TimeoutError, match="1 are leased.*1 are held by live tensor views"):
        ring.acquire(timeout=0.01)
    assert ring.stats()["held_by_views"] == 1
    del view
    assert ring.acquire(0).index == 1
    leased.release()


def test_a_slot_is_reused_only_after_its_views_are_gone():
    ring = StagingRing(1, 4096)
    with ring.acquire(0) as slot:
        view = slot.view((4,), torch.float32)
        view.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        alias = view[1:]  # a view of the view pins the slot too
    del view
    with pytest.raises(TimeoutError):
        ring.acquire(0.01)
    assert torch.equal(alias, torch.tensor([2.0, 3.0, 4.0]))  # nobody overwrote it
    del alias
    assert ring.acquire(0).index == 0


@pytest.mark.no_gpu  # with a GPU, record() takes a real CUDA event: tests/gpu checks that ordering
def test_a_slot_is_reused_only_after_its_copy_completed(held_fences):
    ring = StagingRing(1, 4096)
    with ring.acquire(0) as slot:
        slot.view((4,), torch.float32).fill_(1.0)
        slot.record()  # a copy that has not completed
        assert not slot.query() and not slot.wait(0.001)
    with pytest.raises(TimeoutError, match="1 wait for copies"):
        ring.acquire(0.01)
    assert ring.stats()["pending_copies"] == 1
    held_fences()
    slot = ring.acquire(0)
    assert slot.query() and slot.wait(0)


def test_a_waiting_acquire_is_woken_by_a_view_dying_and_releases_the_gil():
    """The waiter blocks in acquire() while the main thread runs Python (the GIL is free) and
    drops the view that pins the only slot; that wakes the waiter. ``waited`` counts an acquire
    that had to wait: where the waiter was scheduled only after the view died (a loaded machine),
    it did not wait, and the case is run again with the waiter given longer to get there."""
    for settle_s in (0.05, 0.2, 1.0, 5.0):
        ring = StagingRing(1, 4096)
        slot = ring.acquire(0)
        view = slot.view((16,), torch.float32)
        slot.release()
        got = []
        waiter = threading.Thread(target=lambda r=ring, g=got: g.append(r.acquire(60).index))
        waiter.start()
        time.sleep(settle_s)  # the main thread runs Python while the waiter blocks
        assert not got, "acquire() returned a slot that a live view still pins"
        del view
        waiter.join(timeout=60)
        assert got == [0], "the waiter was not woken when the view died"
        if ring.stats()["waited"] == 1:
            break
    assert ring.stats()["waited"] == 1, "the waiter never got to wait before the view died"


def test_copies_into_a_slot_through_the_copy_stream():
    """As the runtime's staged snapshots fill a slot (Note [Staged snapshots]), on the stand-in."""
    ring = StagingRing(2, 1 << 16)
    copies = HostCopies()
    src = torch.randn(64, 32)
    with ring.acquire(0) as slot:
        dst = slot.view(src.shape, src.dtype)
        done = copies.copy([dst], [src], [copies.record()])
        slot.record(copies.stream)
        assert slot.wait(5) and done.query()
        assert torch.equal(dst, src) and host_tensor_info(dst)["staging_slot"]
    # once the copy completed, only `dst` pins slot 0
    held = ring.acquire(0)
    assert held.index == 1
    with pytest.raises(TimeoutError):
        ring.acquire(0.01)
    del dst
    assert ring.acquire(1).index == 0


def test_views_must_fit_and_released_slots_refuse_new_views():
    ring = StagingRing(1, 4096)
    slot = ring.acquire(0)
    with pytest.raises(ValueError, match="needs 4100 bytes; the slot has 4096"):
        slot.view((1025,), torch.float32)
    slot.release()
    with pytest.raises(RuntimeError, match="released"):
        slot.view((1,), torch.float32)
    with pytest.raises(ValueError):
        StagingRing(0, 4096)
    with pytest.raises(ValueError):
        StagingRing(1, 0)


def test_ring_memory_outlives_the_ring():
    blocks, _ = _live()
    ring = StagingRing(2, 8192)
    slot = ring.acquire(0)
    view = slot.view((2048,), torch.float32)
    view.fill_(7.0)
    del ring, slot
    assert _live()[0] == blocks + 1
    assert torch.all(view == 7.0)
    del view
    assert _live()[0] == blocks


def test_a_dropped_ring_with_a_live_view_and_a_fence_is_freed():
    """A released slot with a fence and a live view; dropping everything without another
    acquire must still free the block (a fence that owns a view of its slot: C++,
    dropped_ring_with_a_fence_owning_a_view_is_freed)."""
    blocks, nbytes = _live()
    ring = StagingRing(1, 1 << 16)
    slot = ring.acquire(0)
    dst = slot.view((100,), torch.float32)
    dst.copy_(torch.randn(100))
    slot.record()
    slot.release()
    del ring, slot, dst
    assert _live() == (blocks, nbytes)
