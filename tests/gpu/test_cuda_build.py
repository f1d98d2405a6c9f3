"""The CUDA build of asteria._C on a real GPU, and the copy stream the runtime runs its copies on
(asteria.memory.copies: device-to-host snapshots and their event ordering), and the
count_nonfinite kernel. Skipped where torch sees no CUDA device.

Build first: ``TORCH_CUDA_ARCH_LIST=9.0 pip install --no-build-isolation --no-deps -e .``.
"""

from __future__ import annotations

import pytest
import torch

from asteria import _C
from asteria.memory import host_empty
from asteria.memory.copies import CudaCopies

pytestmark = pytest.mark.gpu  # skipped without CUDA: tests/conftest.py

# About 50-100 ms of GPU time on current parts: long enough that a copy queued behind it is
# observably still pending when the host checks.
SLEEP_CYCLES = 100_000_000


def test_the_extension_was_built_with_cuda():
    info = _C.build_info()
    assert _C.cuda_enabled() and info["cuda"], "CPU build on a CUDA machine: rebuild with CUDA"
    assert info["cuda_version"].split(".")[0] == torch.version.cuda.split(".")[0]


def test_the_copy_stream_is_a_lowest_priority_cuda_stream():
    copies = CudaCopies("cuda")
    least, _greatest = torch.cuda.Stream.priority_range()  # larger numbers are lower priorities
    assert copies.stream.priority == least
    assert copies.stream.priority >= torch.cuda.current_stream().priority


def _to_host(copies: CudaCopies, src: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    """A device-to-host snapshot as the runtime takes one: after the current stream's work."""
    dst = host_empty(src.shape, src.dtype, pinned=True)
    return dst, copies.copy([dst], [src], [copies.record()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_device_to_host_copies(dtype):
    copies = CudaCopies("cuda")
    src = torch.randn(513, 257, device="cuda").to(dtype)
    dst, done = _to_host(copies, src)
    assert dst.is_pinned() and dst.device.type == "cpu" and dst.dtype == dtype
    done.synchronize()
    assert done.query()
    assert torch.equal(dst, src.cpu())


def test_copy_of_a_non_contiguous_tensor():
    copies = CudaCopies("cuda")
    src = torch.randn(64, 32, device="cuda").t()
    dst, done = _to_host(copies, src)
    done.synchronize()
    assert torch.equal(dst, src.cpu())


def test_copy_waits_for_the_current_stream_but_not_the_host():
    """The copy sees a write queued on the current stream behind a long kernel, and the host is
    not blocked while that kernel runs."""
    copies = CudaCopies("cuda")
    src = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(10 * SLEEP_CYCLES)  # on the current stream: ~0.5-1 s
    src.fill_(7.0)  # queued behind the sleep
    dst, done = _to_host(copies, src)
    # the host is back while the sleep still runs: the call queued the copy and returned
    assert not torch.cuda.current_stream().query(), "the copy waited for the current stream"
    assert not done.query(), "the copy finished before the current stream's write could run"
    done.synchronize()
    assert torch.all(dst == 7.0), "the copy did not wait for the current stream"


def test_a_source_freed_during_its_copy_is_not_reused_under_it():
    """The copy stream records its use of device memory: the caching allocator does not hand a
    source freed while its copy is queued to a new tensor before the copy ran."""
    copies = CudaCopies("cuda")
    src = torch.full((1 << 22,), 3.0, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES)
    dst, done = _to_host(copies, src)
    del src
    other = torch.zeros(1 << 22, device="cuda")  # may reuse src's block only after the copy
    other.fill_(9.0)
    done.synchronize()
    assert torch.all(dst == 3.0)
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
