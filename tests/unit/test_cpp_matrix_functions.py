"""The C++ matrix functions (asteria._C) agree with the pure-torch ones they mirror
(asteria/optim/matrix_functions.py): same outputs within tolerance, same permutation, same
precision policy (float64 retry, errors when both attempts fail, non-finite input rejected)."""

from __future__ import annotations

import pytest
import torch

from asteria import _C
from asteria.optim import matrix_functions as mf

SIZES = [1, 7, 64, 256]
DTYPES = [torch.float32, torch.float64]
# Agreement tolerances relative to the largest entry: a few hundred ulps of the dtype, far above
# the two implementations' difference (the same ATen calls) and far below any real disagreement.
REL_TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _separated_spd(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Q diag(1..2) Q^T with evenly spaced eigenvalues, so eigenvectors are well determined."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0]
    evals = torch.linspace(2.0, 1.0, n, dtype=torch.float64)
    return ((q * evals) @ q.T).to(dtype)


def _random_spd(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n + 3, generator=gen, dtype=torch.float64)
    return (a @ a.T / n + 1e-3 * torch.eye(n, dtype=torch.float64)).to(dtype)


def _orthogonal(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0].to(dtype)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> bool:
    return bool((a - b).abs().max() <= REL_TOL[dtype] * max(scale, 1e-30))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_eigh_descending_agrees(n, dtype):
    a = _separated_spd(n, dtype, seed=n)
    evals_cpp, evecs_cpp = _C.eigh_descending(a, dtype)
    evals_py, evecs_py = mf.eigh_descending(a, dtype)
    assert evals_cpp.dtype == dtype and evecs_cpp.dtype == dtype
    assert _close(evals_cpp, evals_py, dtype, float(evals_py.abs().max()))
    # Eigenvectors are defined up to sign: on a separated spectrum |V1^T V2| is the identity.
    overlap = (evecs_cpp.T @ evecs_py).abs()
    tol = 1e-3 if dtype == torch.float32 else 1e-9
    assert torch.allclose(overlap, torch.eye(n, dtype=dtype), atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [7, 64])
def test_eigh_descending_reconstructs_random_factor(n, dtype):
    a = _random_spd(n, dtype, seed=n)
    evals, evecs = _C.eigh_descending(a, dtype)
    assert torch.all(evals[:-1] >= evals[1:])
    scale = float(a.abs().max())
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert torch.allclose((evecs * evals) @ evecs.T, a, atol=tol * scale)


@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_qr_refresh_agrees(n, dtype, sort):
    a = _separated_spd(n, dtype, seed=n + 1)
    basis = _orthogonal(n, dtype, seed=n + 2)
    q_cpp, perm_cpp = _C.qr_refresh(a, basis, sort, dtype)
    q_py, perm_py = mf.qr_refresh(a, basis, sort=sort, dtype=dtype)
    if sort:
        assert perm_cpp is not None and perm_cpp.dtype == torch.long
        assert torch.equal(perm_cpp, perm_py)
    else:
        assert perm_cpp is None and perm_py is None
    assert q_cpp.dtype == dtype
    assert _close(q_cpp, q_py, dtype)


@pytest.mark.parametrize("root", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_inverse_root_agrees(n, dtype, root):
    a = _random_spd(n, dtype, seed=n + 3)
    r_cpp = _C.inverse_root(a, root, 1e-6, dtype)
    r_py = mf.inverse_root(a, root, epsilon=1e-6, dtype=dtype)
    assert r_cpp.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert torch.allclose(r_cpp, r_py, atol=tol * float(r_py.abs().max()))


def test_defaults_match_the_python_signatures():
    a = _random_spd(5, torch.float32)
    assert _C.eigh_descending(a)[0].dtype == torch.float32
    assert _C.qr_refresh(a, torch.eye(5))[1] is not None  # sort=True by default
    assert torch.allclose(_C.inverse_root(a, 2), mf.inverse_root(a, 2), rtol=1e-5, atol=1e-6)


# ---- the precision policy -------------------------------------------------------------------

CALLS = {
    "eigh_descending": (
        lambda impl, a: impl.eigh_descending(a, torch.float32),
        lambda a: mf.eigh_descending(a, torch.float64),
    ),
    "qr_refresh": (
        lambda impl, a: impl.qr_refresh(a, torch.eye(a.shape[0]), True, torch.float32),
        lambda a: mf.qr_refresh(a, torch.eye(a.shape[0]), True, torch.float64),
    ),
    "inverse_root": (
        lambda impl, a: impl.inverse_root(a, 2, 1e-12, torch.float32),
        lambda a: mf.inverse_root(a, 2, 1e-12, torch.float64),
    ),
}


@pytest.fixture
def disarm_hook():
    yield
    _C._testing_fail_next(0)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_lapack_failure_retries_in_float64(name, disarm_hook):
    """The test hook makes the float32 LAPACK call fail; the float64 retry answers, in float32."""
    call, fp64_reference = CALLS[name]
    a = _separated_spd(16, torch.float32, seed=5)
    _C._testing_fail_next(1)
    got = call(_C, a)
    expected = fp64_reference(a)
    got = got if isinstance(got, tuple) else (got,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for g, e in zip(got, expected):
        if e is None:
            assert g is None
            continue
        if g.is_floating_point():
            assert g.dtype == torch.float32
            assert torch.allclose(g, e.to(torch.float32), atol=1e-6)
        else:
            assert torch.equal(g, e)
    call(_C, a)  # the hook is used up: no failure left


@pytest.mark.parametrize("name", sorted(CALLS))
def test_failure_in_both_precisions_raises(name, disarm_hook):
    call, _ = CALLS[name]
    _C._testing_fail_next(2, include_float64=True)
    with pytest.raises(_C.MatrixFunctionError, match=rf"^{name} failed in torch.float32 \(") as e:
        call(_C, _separated_spd(8, torch.float32))
    assert "and in float64 (" in str(e.value)
    assert isinstance(e.value, RuntimeError)


def test_float64_gets_no_second_try(disarm_hook):
    _C._testing_fail_next(1, include_float64=True)
    with pytest.raises(_C.MatrixFunctionError, match=r"in torch.float64 .* and in float64"):
        _C.eigh_descending(_separated_spd(8, torch.float64), torch.float64)


def test_non_finite_float32_result_retries_in_float64():
    """Overflow in float32 (factor @ basis) gives a non-finite Q; float64 is finite. Both
    implementations take the retry and return the same finite float32 answer."""
    n = 7
    factor = torch.full((n, n), 3e38)
    basis = _orthogonal(n, torch.float32, seed=11)
    assert not torch.isfinite(factor @ basis).all()
    q_cpp, perm_cpp = _C.qr_refresh(factor, basis, True, torch.float32)
    q_py, perm_py = mf.qr_refresh(factor, basis, sort=True, dtype=torch.float32)
    assert torch.isfinite(q_cpp).all() and q_cpp.dtype == torch.float32
    assert torch.equal(perm_cpp, perm_py)
    assert torch.allclose(q_cpp, q_py, atol=1e-6)


@pytest.mark.parametrize(
    "call",
    [
        lambda a: _C.eigh_descending(a),
        lambda a: _C.qr_refresh(a, torch.eye(a.shape[0])),
        lambda a: _C.qr_refresh(torch.eye(a.shape[0]), a),
        lambda a: _C.inverse_root(a, 2),
    ],
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_is_rejected(call, bad):
    a = _random_spd(4, torch.float32)
    a[1, 2] = bad
    with pytest.raises(_C.MatrixFunctionError, match=r"^(eigh_descending|qr_refresh|inverse_root)"):
        call(a)


def test_caller_mistakes_raise_value_error():
    with pytest.raises(ValueError, match="must be a square matrix"):
        _C.eigh_descending(torch.ones(3, 4))
    with pytest.raises(ValueError, match="basis shape"):
        _C.qr_refresh(torch.eye(3), torch.eye(4))
    with pytest.raises(ValueError, match="root must be > 0"):
        _C.inverse_root(torch.eye(3), 0)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        _C.inverse_root(torch.eye(3), 2, 0.0)
    with pytest.raises(ValueError, match="dtype must be"):
        _C.eigh_descending(torch.eye(3), torch.float16)


def test_inputs_are_not_modified():
    a = _random_spd(9, torch.float32)
    basis = _orthogonal(9, torch.float32, seed=1)
    a0, basis0 = a.clone(), basis.clone()
    _C.eigh_descending(a)
    _C.qr_refresh(a, basis)
    _C.inverse_root(a, 4)
    assert torch.equal(a, a0) and torch.equal(basis, basis0)


# ---- the optional direct-MKL eigh path (csrc/core/lapack_backend.cpp, Note [Direct MKL eigh]) ----


@pytest.fixture
def mkl_direct():
    if not _C.build_info()["thread_local_mkl"]:
        pytest.skip("this torch exports no MKL symbols")
    _C.set_eigh_path("mkl_direct")
    yield
    _C.set_eigh_path("aten")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_mkl_direct_eigh_agrees(n, dtype, mkl_direct):
    assert _C.eigh_path() == "mkl_direct"
    a = _separated_spd(n, dtype, seed=n + 7)
    evals, evecs = _C.eigh_descending(a, dtype)
    ref_evals, ref_evecs = mf.eigh_descending(a, dtype)
    assert _close(evals, ref_evals, dtype, float(ref_evals.abs().max()))
    tol = 1e-3 if dtype == torch.float32 else 1e-9
    assert torch.allclose((evecs.T @ ref_evecs).abs(), torch.eye(n, dtype=dtype), atol=tol)
    root = _C.inverse_root(a, 2, 1e-6, dtype)
    assert torch.allclose(root, mf.inverse_root(a, 2, 1e-6, dtype), atol=1e-4 if n > 1 else 1e-6)


def test_eigh_path_switch_rejects_unknown_paths():
    with pytest.raises(ValueError, match="'aten' or 'mkl_direct'"):
        _C.set_eigh_path("openblas")
    assert _C.eigh_path() == "aten"
