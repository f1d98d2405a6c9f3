"""The bases window on real CUDA streams (Note [Bases window] in asteria/memory/window.py): copies
on a lowest-priority stream from pinned host memory, a slot refilled only after the event
recorded after its last reader, the main stream reading a slot only after its copy; and the
runtime on a discrete GPU training through the window bitwise like with the bases on the device.
Skipped where torch sees no CUDA device; tests/unit/test_window.py checks the same ordering on the
CPU stand-in.

Build first: ``TORCH_CUDA_ARCH_LIST=9.0 pip install --no-build-isolation --no-deps -e .``.
"""

from __future__ import annotations

import pytest
import torch

from asteria.memory import host_empty, is_host_tensor
from asteria.memory.accounting import detect_arch
from asteria.memory.copies import CudaCopies
from asteria.memory.window import BasesWindow
from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.runtime import Runtime, RuntimeConfig

pytestmark = pytest.mark.gpu  # skipped without CUDA: tests/conftest.py

# About 50-100 ms of GPU time on current parts: work queued behind it is observably pending.
SLEEP_CYCLES = 100_000_000
D = 512


def _pinned(value: float) -> list[torch.Tensor]:
    out = []
    for i in range(2):
        t = host_empty((D, D), torch.float32, pinned=True)
        t.fill_(value + i)
        out.append(t)
    return out


def _window(slots: int = 2) -> tuple[BasesWindow, CudaCopies]:
    copies = CudaCopies("cuda")
    return BasesWindow(copies, slots, BasesWindow.bytes_of(_pinned(0.0))), copies


def test_the_copy_stream_has_the_lowest_priority():
    _, copies = _window()
    assert copies.stream.priority == torch.cuda.Stream.priority_range()[0]


def test_a_slot_is_refilled_only_after_the_kernels_that_read_it():
    window, _ = _window(slots=2)
    a, b, c = _pinned(1.0), _pinned(10.0), _pinned(100.0)
    got_a = window.use("a", a, upcoming=("b", b))
    torch.cuda._sleep(SLEEP_CYCLES)  # the main stream is busy ...
    read = got_a[0].sum()  # ... so this read of a's slot runs late
    window.use("b", b, upcoming=("c", c))  # c's prefetch goes into a's slot
    torch.cuda.synchronize()
    assert read.item() == D * D * 1.0, "the prefetch overwrote a slot a kernel still had to read"
    assert torch.all(got_a[0] == 100.0)  # and then it did land


def test_the_main_stream_reads_a_slot_only_after_its_copy():
    window, copies = _window(slots=1)
    a = _pinned(3.0)
    with torch.cuda.stream(copies.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the copy stream is busy: a's copy lands late
    got = window.use("a", a)
    read = got[1].sum()
    torch.cuda.synchronize()
    assert read.item() == D * D * 4.0, "the main stream read the slot before its copy landed"


def test_copies_to_host_do_not_wait_and_the_window_reads_them_after_they_land():
    """Note [Host writes]: ``to_host`` returns while the main stream is still busy; a fill of
    the window from its destinations waits for it on the device, and ``host_sync`` on the host."""
    window, copies = _window()
    src = [torch.full((D, D), 7.0 + i, device="cuda") for i in range(2)]
    dst = _pinned(0.0)
    torch.cuda._sleep(SLEEP_CYCLES)  # the main stream is busy: the copies to host run late
    written = copies.to_host(dst, src)
    assert not written.query(), "to_host waited for the main stream"
    got = window.use("a", dst)  # the fill waits for the writes on the device
    total = got[0].sum() + got[1].sum()
    copies.host_sync()
    assert written.query() and torch.all(dst[0] == 7.0) and torch.all(dst[1] == 8.0)
    assert total.item() == D * D * 15.0, "the window copied the host bases before they landed"


def test_a_host_tensor_replaced_while_its_copy_is_in_flight_stays_alive():
    window, copies = _window(slots=1)
    a = _pinned(5.0)
    with torch.cuda.stream(copies.stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    got = window.use("a", a)
    del a  # the slot keeps the pinned sources alive for its copy
    _pinned(-1.0)  # host memory churn after the release
    read = got[0].sum()
    torch.cuda.synchronize()
    assert read.item() == D * D * 5.0


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 96), torch.nn.Tanh(),
        torch.nn.Linear(96, 8),
    ).cuda()  # fmt: skip


def _train(cls, config: RuntimeConfig, steps: int = 20):
    model = _mlp()
    opt = cls(model.parameters(), precondition_frequency=5, max_preconditioner_dim=32)
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = torch.randn(steps, 32, 64, device="cuda", generator=gen)
    ys = torch.randn(steps, 32, 8, device="cuda", generator=gen)
    with Runtime(model, opt, config) as rt:
        for t in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xs[t]), ys[t]).backward()
            opt.step()
        report = rt.memory_report()
        hosted = [
            is_host_tensor(q) and q.is_pinned()
            for _, _, block, _ in opt.blocks()
            for q in block[opt.bases_field]
            if q is not None
        ]
    torch.cuda.synchronize()
    return [p.detach().clone() for p in model.parameters()], report, hosted


@pytest.mark.parametrize("fixed_delay", [None, 3])
@pytest.mark.parametrize("cls", [SOAP, Shampoo, KLShampoo], ids=lambda c: c.__name__)
def test_training_through_the_window_equals_bases_on_the_device(cls, fixed_delay):
    if detect_arch("cuda").unified_memory:
        pytest.skip("a unified-memory GPU reads host bases through mapped views, not a window")
    kw = dict(staleness=0 if fixed_delay is None else 3, fixed_delay=fixed_delay, workers=2)
    reference, _, _ = _train(cls, RuntimeConfig(**kw, placement={"bases": "device"}))
    params, report, hosted = _train(cls, RuntimeConfig(**kw))
    assert report["placement"]["bases_access"] == "window"
    assert report["placement"]["window"]["prefetch_hits"] > 20
    assert hosted and all(hosted)
    assert report["device"]["bases"] == report["planned"]["device"]["bases"] > 0
    for a, b in zip(params, reference):
        assert torch.equal(a, b)
