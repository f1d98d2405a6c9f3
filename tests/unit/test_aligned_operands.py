"""Note [Aligned operands] and Note [One thread per refresh] (csrc/core/aligned.cpp): a block's
product, root or basis is the same bits whatever the batch it travels in, its place in that
batch, the address of its operands and the thread count of the caller, so that the batched step
is the per-block one and ``S = 0`` is native mode bit for bit on any CPU.

MKL on an AMD EPYC gives other bits for a matrix that does not start at a 16-byte boundary, for a
stack through its batched gemm, and on two threads than on one; on the Intel Xeon where the
project was written none of it showed. So besides the results (which catch it where MKL
differs), ``test_no_blas_call_of_a_step_or_refresh_sees_a_misaligned_or_batched_operand`` checks
the rule itself on any CPU: every BLAS or LAPACK call a step or a refresh makes outside
Asteria's own operators gets aligned, dense, unbatched operands, and every LAPACK call of a
refresh runs on one thread.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from asteria import _C
from asteria.memory.tiers import Arch
from asteria.optim import SOAP, KLShampoo, Shampoo, batched
from asteria.optim import matrix_functions as mf
from asteria.runtime import Runtime, RuntimeConfig
from asteria.runtime.testing import pretend_arch

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
OPTIMIZERS = [SOAP, Shampoo, KLShampoo]


@contextlib.contextmanager
def _threads(n: int):
    """torch's intra-op threads at ``n`` (the suite runs on one: conftest.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _at_offset(m: torch.Tensor, offset: int, column_major: bool) -> torch.Tensor:
    """``m``'s values in a row- or column-major matrix starting ``offset`` elements into a fresh
    buffer (the buffer itself starts at the allocator's 64-byte boundary)."""
    rows, cols = m.shape
    buf = torch.zeros(rows * cols + offset, dtype=m.dtype)
    if column_major:
        out = buf[offset:].view(cols, rows).T
    else:
        out = buf[offset:].view(rows, cols)
    out.copy_(m)
    return out


def _fresh(m: torch.Tensor, column_major: bool) -> torch.Tensor:
    return m.T.contiguous().T if column_major else m.contiguous()


@SETTINGS
@given(
    m=st.integers(1, 40),
    k=st.integers(1, 70),
    n=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    a_col=st.booleans(),
    b_col=st.booleans(),
    batch=st.integers(1, 6),
    data=st.data(),
)
def test_a_blocks_product_is_the_same_bits_at_any_place_and_address(
    m, k, n, dtype, a_col, b_col, batch, data
):
    """``block_mm`` of a stack, at each place, is ``aligned_mm`` of that pair alone at any
    offset, which is ``torch.mm`` of fresh copies in the same orientation."""
    gen = torch.Generator().manual_seed(m * 10_000 + k * 100 + n)
    a = [torch.randn(m, k, generator=gen, dtype=dtype) for _ in range(batch)]
    b = [torch.randn(k, n, generator=gen, dtype=dtype) for _ in range(batch)]
    a_stack = torch.stack([x.T for x in a]).mT if a_col else torch.stack(a)
    b_stack = torch.stack([x.T for x in b]).mT if b_col else torch.stack(b)
    got = batched.bmm(a_stack, b_stack)
    for i in range(batch):
        want = torch.mm(_fresh(a[i], a_col), _fresh(b[i], b_col))
        offset_a = data.draw(st.integers(0, 15), label="offset a")
        offset_b = data.draw(st.integers(0, 15), label="offset b")
        alone = batched.mm(_at_offset(a[i], offset_a, a_col), _at_offset(b[i], offset_b, b_col))
        assert torch.equal(alone, want)
        assert torch.equal(got[i], want)


@SETTINGS
@given(
    d=st.integers(1, 48),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    batch=st.integers(1, 6),
    threads=st.integers(1, 2),
)
def test_a_stacks_eigh_and_qr_are_each_matrix_alone_on_one_thread(d, dtype, batch, threads):
    """``eigh_each`` and ``qr_each`` of a stack, at each place and on the caller's threads, are
    ``torch.linalg.eigh`` and geqrf + orgqr of that matrix alone on one LAPACK thread."""
    gen = torch.Generator().manual_seed(d * 10 + batch)
    x = torch.randn(batch, d, d + 3, generator=gen, dtype=dtype)
    sym = batched.bmm(x, x.mT)
    with _threads(threads):
        values, vectors = batched.eigh_each(sym)
        q = batched.qr_each(x[:, :, :d].mT)
    for i in range(batch):
        with _C.OneLapackThread():
            w, v = torch.linalg.eigh(sym[i].clone())
            qi = torch.linalg.householder_product(*torch.geqrf(x[i, :, :d].mT.clone()))
        assert torch.equal(values[i], w) and torch.equal(vectors[i], v)
        assert torch.equal(q[i], qi)
    assert vectors.stride()[1:] == (1, d) and q.stride()[1:] == (1, d)  # column-major


@SETTINGS
@given(d=st.integers(2, 40), n=st.integers(2, 5), threads=st.integers(1, 2))
def test_batched_refreshes_are_the_pools_at_any_thread_count(d, n, threads):
    """``qr_refresh_many`` and ``inverse_root_many`` on the caller's threads are, matrix by
    matrix, the pool's twins (``asteria._C``, what a worker with ``lapack_threads = 1`` runs)."""
    gen = torch.Generator().manual_seed(d * 7 + n)
    x = torch.randn(n, d, 2 * d, generator=gen)
    factors = list(batched.bmm(x, x.mT).unbind(0))
    bases = [mf.eigh_descending(f)[1] for f in factors]
    with _threads(threads):
        qrs = mf.qr_refresh_many(factors, bases, sort=True)
        roots = mf.inverse_root_many(factors, 4.0, [1e-12] * n)
    for f, q, qr, root in zip(factors, bases, qrs, roots):
        want_q, want_perm = _C.qr_refresh(f, q, True, torch.float32)
        assert torch.equal(qr[0], want_q) and torch.equal(qr[1], want_perm)
        assert torch.equal(root, _C.inverse_root(f, 4.0, 1e-12, torch.float32))


_BLAS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "dot", "mv", "addmv"}
_LAPACK = {"_linalg_eigh", "linalg_eigh", "geqrf", "linalg_householder_product", "linalg_qr"}


class _OperandCheck(TorchDispatchMode):
    """Records every BLAS or LAPACK call on CPU tensors that breaks Note [Aligned operands] or
    Note [One thread per refresh]."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[str] = []
        self.seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == "cpu"]
        if name in _BLAS and tensors:
            self.seen += 1
            if name in ("bmm", "baddbmm", "addbmm") and tensors[-1].shape[-2] != 1:
                self.bad.append(f"{name} of a stack {tuple(tensors[-1].shape)}")  # batched gemm
            for t in tensors[-2:]:
                if t.dim() == 2 and t.numel() > 1 and not _aligned_dense(t):
                    self.bad.append(
                        f"{name} operand {tuple(t.shape)} {t.stride()} at {t.data_ptr() % 64}"
                    )
        if name in _LAPACK and tensors:
            self.seen += 1
            if tensors[0].dim() > 2 and tensors[0].shape[0] > 1:
                self.bad.append(f"{name} of a stack {tuple(tensors[0].shape)}")
            if torch.get_num_threads() != 1:
                self.bad.append(f"{name} on {torch.get_num_threads()} threads")
        return func(*args, **(kwargs or {}))


def _aligned_dense(t: torch.Tensor) -> bool:
    if t.data_ptr() % 64:
        return False
    rows, cols = t.shape
    row_major = (cols == 1 or t.stride(1) == 1) and (rows == 1 or t.stride(0) == cols)
    col_major = (rows == 1 or t.stride(0) == 1) and (cols == 1 or t.stride(1) == rows)
    return row_major or col_major


def _odd_params(seed: int) -> list[torch.nn.Parameter]:
    """Blocks of odd widths, one a row slice of a larger parameter at an odd offset (a view that
    does not start at a 16-byte boundary) and one transposed."""
    gen = torch.Generator().manual_seed(seed)
    big = torch.randn(40, 33, generator=gen)
    return [
        torch.nn.Parameter(big[3:20]),  # (17, 33) from element 99
        torch.nn.Parameter(torch.randn(33, 17, generator=gen).T),  # (17, 33), column-major
        torch.nn.Parameter(torch.randn(3, 33, generator=gen)),
        torch.nn.Parameter(torch.randn(3, 33, generator=gen)),
        torch.nn.Parameter(torch.randn(45, generator=gen)),
    ]


def _train(params, opt, steps: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.filterwarnings("ignore::asteria.runtime.NoSpareCoreWarning")
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("runtime", [False, True], ids=["native", "runtime"])
def test_no_blas_call_of_a_step_or_refresh_sees_a_misaligned_or_batched_operand(cls, runtime):
    """On any CPU: the steps and refreshes (native and at ``S = 0``, two threads) hand BLAS and
    LAPACK only aligned dense unbatched operands (outside ``torch.ops.asteria``'s operators,
    which keep the rule inside), and every LAPACK call a refresh makes runs on one thread."""
    params = _odd_params(0)
    opt = cls(params, lr=1e-2, precondition_frequency=2)
    check = _OperandCheck()
    rt = Runtime(None, opt, RuntimeConfig(staleness=0, statistics_lane=False)) if runtime else None
    try:
        with _threads(2), check:
            _train(params, opt, 6, 0)
    finally:
        if rt is not None:
            rt.close()
    assert check.seen > 0
    assert check.bad == []


TIERS = [None, "device", "host"]


@pytest.mark.filterwarnings("ignore::asteria.runtime.NoSpareCoreWarning")
@settings(max_examples=24, deadline=None, derandomize=True, database=None)
@given(
    cls=st.sampled_from(OPTIMIZERS),
    tier=st.sampled_from(TIERS),
    lane=st.booleans(),
    frequency=st.integers(1, 3),
    threads=st.integers(1, 2),
    seed=st.integers(0, 3),
)
def test_staleness_zero_is_native_bit_for_bit_with_odd_blocks(
    cls, tier, lane, frequency, threads, seed
):
    """``S = 0`` trains native's parameters bit for bit on blocks of odd sizes (views at odd
    offsets, a transposed one, two of one shape), for each optimizer, with the bases where the
    CPU keeps them (with and without the statistics lane) and on the CPU stand-in of a discrete
    GPU (on the device, behind the window), on one or two threads."""
    if tier is not None:
        lane = False  # the lane runs for CPU training only
    with _threads(threads):
        params = _odd_params(seed)
        native = _train(params, cls(params, precondition_frequency=frequency), 8, seed)
        params = _odd_params(seed)
        opt = cls(params, precondition_frequency=frequency)
        placement = {} if tier is None else dict(placement={"bases": tier})
        config = RuntimeConfig(staleness=0, statistics_lane=lane, **placement)
        arch = (
            contextlib.nullcontext()
            if tier is None
            else pretend_arch(Arch(cuda=True), device_free_bytes=1 << 40)
        )
        with arch, Runtime(None, opt, config) as rt:
            got = _train(params, opt, 8, seed)
            access = rt.memory_report()["placement"]["bases_access"]
    assert access == {None: "direct", "device": None, "host": "window"}[tier]
    for a, b in zip(got, native):
        assert torch.equal(a, b), (a - b).abs().max().item()
