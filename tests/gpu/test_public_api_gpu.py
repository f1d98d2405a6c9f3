"""The CUDA-only parts of ``asteria.lowlevel`` on a real GPU (docs/api.md): capabilities,
pinned memory and mapped device views, a snapshot on the CUDA copy stream with its fences, and
the pool fed a CUDA factor. Skipped where torch sees no CUDA device; the CPU-build errors are
tests/unit/test_public_api.py.
"""

from __future__ import annotations

import pytest
import torch

from asteria import lowlevel as ll

pytestmark = pytest.mark.gpu  # skipped without CUDA: tests/conftest.py

# About 50-100 ms of GPU time on current parts (as tests/gpu/test_cuda_build.py).
SLEEP_CYCLES = 100_000_000


def test_capabilities_on_a_gpu():
    caps = ll.capabilities(probe_o_direct=False)
    assert caps.cuda_build and caps.cuda_device
    assert caps.pinned_memory and caps.mapped_memory and caps.cuda_copy_stream


def test_pinned_memory_and_a_device_view_alias():
    host = ll.host_empty((4, 8), torch.float32, pinned=True)
    assert ll.host_tensor_info(host)["pinned"]
    host.zero_()
    view = ll.device_view(host)
    assert view.is_cuda and view.shape == host.shape
    view.fill_(5.0)  # written on the device, into the host memory
    torch.cuda.synchronize()
    assert torch.all(host == 5.0)
    del host
    torch.cuda.synchronize()
    assert ll.is_host_tensor(view) and float(view.sum()) == 5.0 * 32  # the view keeps it alive


def test_a_snapshot_sees_earlier_writes_and_fences_later_ones():
    copies = ll.copy_stream("cuda")
    src = torch.full((1 << 20,), 1.0, device="cuda")
    ring = ll.StagingRing(slots=2, slot_bytes=src.nbytes)
    torch.cuda._sleep(SLEEP_CYCLES)  # the main stream is busy
    src.fill_(2.0)  # queued behind it: the snapshot must see this value
    snap = ll.snapshot([src], ring, copies, timeout=5)
    snap.fence()
    src.fill_(3.0)  # after the fence: waits (on the device) for the copy
    (host,) = snap.wait(timeout=30)
    assert torch.all(host == 2.0)
    snap.release()
    del host, snap
    torch.cuda.synchronize()
    assert ring.stats()["leased"] == 0
    with ll.snapshot([src, src], ring, copies, timeout=5) as again:  # both slots reusable
        assert all(torch.all(t == 3.0) for t in again.wait(timeout=30))


def test_the_pool_takes_a_cuda_factor():
    g = torch.randn(64, 80, dtype=torch.float64)
    factor = g @ g.T
    with ll.WorkerPool(workers=1) as pool:
        future = pool.submit_eigh("b", factor.cuda(), dtype=torch.float64)
        evals, evecs = future.result(timeout=60)
    want = ll.eigh_descending(factor, torch.float64)
    assert torch.equal(evals.cpu(), want[0]) and torch.equal(evecs.cpu(), want[1])


def test_the_custom_ops_run_on_the_gpu():
    g = torch.randn(32, 40, dtype=torch.float64, device="cuda")
    factor = g @ g.T
    evals, evecs = ll.eigh_descending(factor, torch.float64)
    assert evals.is_cuda and evecs.stride() == (1, 32)  # what the fake kernel declares
    ref = torch.linalg.eigvalsh(factor.cpu()).flip(0)
    assert torch.allclose(evals.cpu(), ref, atol=1e-9 * float(ref.abs().max()))
