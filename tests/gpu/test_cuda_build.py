"""The CUDA build of asteria._C on a real GPU: the shadow stream's copies and event ordering, and
the count_nonfinite kernel. Skipped where torch sees no CUDA device.

Build first: ``TORCH_CUDA_ARCH_LIST=9.0 pip install --no-build-isolation --no-deps -e .``.
"""

from __future__ import annotations

import pytest
import torch

from asteria import _C

pytestmark = pytest.mark.gpu  # skipped without CUDA: tests/conftest.py

# About 50-100 ms of GPU time on current parts: long enough that a copy queued behind it is
# observably still pending when the host checks.
SLEEP_CYCLES = 100_000_000


def test_the_extension_was_built_with_cuda():
    info = _C.build_info()
    assert _C.cuda_enabled() and info["cuda"], "CPU build on a CUDA machine: rebuild with CUDA"
    assert info["cuda_version"].split(".")[0] == torch.version.cuda.split(".")[0]


def test_shadow_stream_is_a_lowest_priority_cuda_stream():
    stream = _C.ShadowStream()
    assert stream.is_cuda and stream.device == torch.cuda.current_device()
    least, _greatest = 0, -1  # CUDA: larger numbers are lower priorities, 0 is the lowest
    assert stream.priority == least
    assert stream.priority >= torch.cuda.current_stream().priority


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_copy_to_host_copies(dtype):
    stream = _C.ShadowStream()
    src = torch.randn(513, 257, device="cuda").to(dtype)
    dst = stream.host_buffer_like(src)
    assert dst.is_pinned() and dst.device.type == "cpu" and dst.dtype == dtype
    event = stream.copy_to_host(src, dst)
    event.synchronize()
    assert event.query()
    assert torch.equal(dst, src.cpu())
    assert event.host.data_ptr() == dst.data_ptr()


def test_copy_of_a_non_contiguous_tensor():
    stream = _C.ShadowStream()
    src = torch.randn(64, 32, device="cuda").t()
    dst = torch.empty(src.shape, pin_memory=True)
    stream.copy_to_host(src, dst).synchronize()
    assert torch.equal(dst, src.cpu())


def test_copy_waits_for_the_current_stream_but_not_the_host():
    """The copy sees a write queued on the current stream behind a long kernel, and the host is
    not blocked while that kernel runs."""
    stream = _C.ShadowStream()
    src = torch.zeros(1 << 20, device="cuda")
    dst = stream.host_buffer_like(src)
    torch.cuda.synchronize()
    torch.cuda._sleep(10 * SLEEP_CYCLES)  # on the current stream: ~0.5-1 s
    src.fill_(7.0)  # queued behind the sleep
    event = stream.copy_to_host(src, dst)
    # the host is back while the sleep still runs: the call queued the copy and returned
    assert not torch.cuda.current_stream().query(), "copy_to_host waited for the current stream"
    assert not event.query(), "the copy finished before the current stream's write could run"
    event.synchronize()
    assert torch.all(dst == 7.0), "the copy did not wait for the current stream"


def test_dropping_an_in_flight_event_is_safe():
    stream = _C.ShadowStream()
    src = torch.randn(1 << 22, device="cuda")
    dst = stream.host_buffer_like(src)
    torch.cuda._sleep(SLEEP_CYCLES)
    event = stream.copy_to_host(src, dst)
    del event, src  # waits for the copy before releasing src (no use-after-free)
    stream.synchronize()
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_count_nonfinite_kernel(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = torch.randn(3_000_001, device="cuda", generator=gen).to(dtype)
    idx = torch.randint(0, t.numel(), (1000,), device="cuda", generator=gen)
    t[idx[:500]] = float("nan")
    t[idx[500:]] = float("inf")
    count = _C.count_nonfinite(t)
    assert count.device.type == "cuda" and count.dtype == torch.long and count.dim() == 0
    assert count.item() == int((~torch.isfinite(t)).sum().item())
    assert _C.count_nonfinite(t[::3]).item() == int((~torch.isfinite(t[::3])).sum().item())
    assert _C.count_nonfinite(torch.empty(0, device="cuda", dtype=dtype)).item() == 0


def test_pool_accepts_a_cuda_factor():
    pool = _C.WorkerPool(1)
    a = torch.randn(64, 64, device="cuda")
    a = a @ a.T
    evals, _ = pool.submit_eigh("L", 1, 0, a).result()
    assert evals.device.type == "cpu"
    assert torch.allclose(evals, torch.linalg.eigvalsh(a.cpu()).flip(0), rtol=1e-4, atol=1e-4)
    pool.shutdown()
