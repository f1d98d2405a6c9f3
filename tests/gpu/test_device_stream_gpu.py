"""The device-stream executor on real CUDA streams (Note [Refresh placement] in
asteria/runtime/placement.py): a submission copies its inputs on a stream of its own without a
host wait, so the training stream's later in-place writes to a factor must wait for the copy on
the device, and the refresh stream for the copy before the job runs. Skipped without CUDA; the
CPU stand-in of tests/unit/test_placement.py covers the scheduling.
"""

from __future__ import annotations

import pytest
import torch

from asteria._ext import load_extension
from asteria.optim import matrix_functions as mf
from asteria.optim.refresher import QRRefresh, RootRefresh
from asteria.runtime.placement import StreamExecutor

pytestmark = pytest.mark.gpu  # skipped without CUDA: tests/conftest.py

# About 50-100 ms of GPU time on current parts: work queued behind it is observably pending.
SLEEP_CYCLES = 100_000_000


def _spd(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(d, d, device="cuda", generator=g)
    return a @ a.T + d * torch.eye(d, device="cuda")


@pytest.mark.parametrize("kind", ["qr", "root"])
def test_a_submission_sees_the_factor_as_it_was_and_not_later_writes(kind):
    executor = StreamExecutor(torch.device("cuda"), load_extension().FutureTimeoutError)
    try:
        d = 256
        factor = _spd(d, 0)
        basis = torch.linalg.qr(_spd(d, 1))[0]
        expected_input = factor.clone()
        torch.cuda._sleep(SLEEP_CYCLES)  # the training stream is busy: the copy waits behind it
        factor.mul_(2.0)  # this step's write, queued before the submission: the copy sees it
        expected_input.mul_(2.0)
        if kind == "qr":
            job = QRRefresh(factor, basis, sort=True)
        else:
            job = RootRefresh(factor, root=4.0, epsilon=1e-12)
        future = executor.submit(job, deadline=0)
        factor.add_(1000.0)  # the next step's write, queued after it: the copy must not see it
        got = future.result(timeout_s=60)
        if kind == "qr":
            want = mf.qr_refresh(expected_input, basis, sort=True)
            assert torch.allclose(got[0], want[0], atol=1e-4)
        else:
            want = mf.inverse_root(expected_input, 4.0, epsilon=1e-12)
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)
        torch.cuda.synchronize()
        assert torch.equal(factor, expected_input + 1000.0)
    finally:
        executor.shutdown()
