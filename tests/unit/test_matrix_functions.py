"""The pure-torch matrix functions (asteria/optim/matrix_functions.py) against their definitions."""

from __future__ import annotations

import pytest
import torch

from asteria.optim import matrix_functions as mf


def _spd(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n + 3, generator=gen, dtype=torch.float64)
    return (a @ a.T / n + 1e-3 * torch.eye(n, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 7, 64])
def test_eigh_descending_reconstructs(n, dtype):
    a = _spd(n, dtype)
    evals, evecs = mf.eigh_descending(a, dtype)
    assert evals.dtype == dtype and evecs.dtype == dtype
    assert torch.all(evals[:-1] >= evals[1:])
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert torch.allclose(evecs @ torch.diag(evals) @ evecs.T, a, atol=tol * float(a.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_qr_refresh_is_sorted_power_iteration(dtype):
    a = _spd(16, dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    basis = torch.linalg.qr(torch.randn(16, 16, generator=gen, dtype=torch.float64))[0].to(dtype)
    new, perm = mf.qr_refresh(a, basis, sort=True, dtype=dtype)
    est = torch.diag(basis.T @ a @ basis)
    assert torch.equal(perm, torch.argsort(est, descending=True))
    expected = torch.linalg.qr(a @ basis[:, perm])[0]
    assert torch.allclose(new, expected, atol=1e-6 if dtype == torch.float32 else 1e-12)
    new_unsorted, none = mf.qr_refresh(a, basis, sort=False, dtype=dtype)
    assert none is None
    assert torch.allclose(new_unsorted, torch.linalg.qr(a @ basis)[0], atol=1e-5)


def test_qr_refresh_converges_to_the_eigenbasis():
    a = _spd(12, torch.float64, seed=3)
    q = torch.eye(12, dtype=torch.float64)
    for _ in range(400):
        q, _ = mf.qr_refresh(a, q, sort=True, dtype=torch.float64)
    _, exact = mf.eigh_descending(a, torch.float64)
    assert torch.allclose((q.T @ exact).abs(), torch.eye(12, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("root", [2, 4, 6])
def test_inverse_root(root):
    a = _spd(10, torch.float64, seed=4)
    r = mf.inverse_root(a, root, epsilon=1e-12, dtype=torch.float64)
    assert torch.allclose(
        torch.linalg.matrix_power(r, root) @ a, torch.eye(10, dtype=torch.float64), atol=1e-8
    )


def test_inverse_root_of_a_singular_factor_is_finite():
    v = torch.randn(6, 1, dtype=torch.float64)
    r = mf.inverse_root(v @ v.T, 4, epsilon=1e-6, dtype=torch.float64)
    assert torch.isfinite(r).all()


def test_float64_retry_when_float32_fails(monkeypatch):
    calls = []
    real = torch.linalg.eigh

    def flaky(a, *args, **kwargs):
        calls.append(a.dtype)
        if a.dtype == torch.float32:
            raise torch.linalg.LinAlgError("injected: failed to converge")
        return real(a, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    evals, evecs = mf.eigh_descending(_spd(5, torch.float32), torch.float32)
    assert calls == [torch.float32, torch.float64]
    assert evecs.dtype == torch.float32 and torch.isfinite(evecs).all()


def test_failure_in_both_precisions_raises(monkeypatch):
    def broken(a, *args, **kwargs):
        raise torch.linalg.LinAlgError("injected")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    with pytest.raises(mf.MatrixFunctionError, match="float64"):
        mf.eigh_descending(_spd(4, torch.float32), torch.float32)


def test_non_finite_and_non_square_input_is_refused():
    bad = _spd(4, torch.float32)
    bad[0, 0] = float("nan")
    with pytest.raises(mf.MatrixFunctionError, match="non-finite"):
        mf.eigh_descending(bad)
    with pytest.raises(ValueError, match="square"):
        mf.inverse_root(torch.zeros(3, 4), 2)
    with pytest.raises(ValueError, match="root"):
        mf.inverse_root(torch.eye(3), 0)
