"""The matrix functions as ``torch.library`` custom ops: ``torch.ops.asteria.*``.

Owns: the ops ``asteria::eigh_descending``, ``asteria::qr_refresh`` and ``asteria::inverse_root``,
their fake kernels, and the Python functions of the same names (what ``asteria.lowlevel``
exports). They run ``asteria.optim.matrix_functions`` on any device (bit for bit) and are opaque
to ``torch.compile``: one call per op in the graph, no break on a pybind function, no tracing into
LAPACK and its float64 retry.

Note [Custom op schemas]: an op returns tensors only, so ``qr_refresh``'s "no permutation" is an
empty int64 vector in the op and ``None`` in the Python function. The fake kernels return the real
ones' shapes, dtypes, strides (eigenvectors and Q column-major) and device, and refuse what they
can tell at trace time with the same errors; non-finite entries only the real kernel finds. No
autograd formula: they refresh optimizer state, under ``torch.no_grad``.

Must not: hold math of its own (matrix_functions.py does) or know about optimizers.
"""

from __future__ import annotations

import torch

from asteria.optim import matrix_functions as mf

__all__ = ["OPS", "eigh_descending", "inverse_root", "qr_refresh"]

#: The ops' qualified names, as ``torch.ops.asteria.<name>`` finds them.
OPS = ("asteria::eigh_descending", "asteria::qr_refresh", "asteria::inverse_root")


def _column_major(like: torch.Tensor, n, dtype: torch.dtype) -> torch.Tensor:
    """An ``n x n`` matrix laid out as LAPACK returns eigenvectors and Q factors (column-major):
    a fake output must have the real one's strides, which compiled code asserts."""
    return like.new_empty((n, n), dtype=dtype).mT


def _check_qr_args(factor: torch.Tensor, basis: torch.Tensor) -> None:
    mf.check_matrix("factor", factor)
    if basis.shape != factor.shape:
        raise ValueError(f"basis shape {tuple(basis.shape)} != factor shape {tuple(factor.shape)}")


def _check_root_args(factor: torch.Tensor, root: float, epsilon: float) -> None:
    mf.check_matrix("factor", factor)
    if root <= 0:
        raise ValueError(f"root must be > 0, got {root}")
    if epsilon <= 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")


@torch.library.custom_op("asteria::eigh_descending", mutates_args=())
def _eigh_descending_op(
    factor: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    evals, evecs = mf.eigh_descending(factor, dtype)
    return evals, evecs


@_eigh_descending_op.register_fake
def _eigh_descending_fake(factor: torch.Tensor, dtype: torch.dtype):
    mf.check_matrix("factor", factor)
    n = factor.shape[0]
    return factor.new_empty((n,), dtype=dtype), _column_major(factor, n, dtype)


@torch.library.custom_op("asteria::qr_refresh", mutates_args=())
def _qr_refresh_op(
    factor: torch.Tensor, basis: torch.Tensor, sort: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    q, perm = mf.qr_refresh(factor, basis, sort=sort, dtype=dtype)
    if perm is None:  # Note [Custom op schemas]
        perm = torch.empty(0, dtype=torch.long, device=q.device)
    return q, perm


@_qr_refresh_op.register_fake
def _qr_refresh_fake(factor: torch.Tensor, basis: torch.Tensor, sort: bool, dtype: torch.dtype):
    _check_qr_args(factor, basis)
    n = factor.shape[0]
    perm = factor.new_empty((n if sort else 0,), dtype=torch.long)
    return _column_major(factor, n, dtype), perm


@torch.library.custom_op("asteria::inverse_root", mutates_args=())
def _inverse_root_op(
    factor: torch.Tensor, root: float, epsilon: float, dtype: torch.dtype
) -> torch.Tensor:
    return mf.inverse_root(factor, root, epsilon, dtype=dtype)


@_inverse_root_op.register_fake
def _inverse_root_fake(factor: torch.Tensor, root: float, epsilon: float, dtype: torch.dtype):
    _check_root_args(factor, root, epsilon)
    n = factor.shape[0]
    return factor.new_empty((n, n), dtype=dtype)  # row-major: the product Q diag Q^T


def eigh_descending(
    factor: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues and eigenvectors of a symmetric ``factor``, eigenvalues descending, computed
    and returned in ``dtype`` (one float64 retry when LAPACK fails or the result is not finite).

    Raises ValueError for a non-square ``factor``, ``MatrixFunctionError`` when the retry fails
    too or ``factor`` has non-finite entries. ``torch.ops.asteria.eigh_descending``."""
    evals, evecs = torch.ops.asteria.eigh_descending(factor, dtype)
    return evals, evecs


def qr_refresh(
    factor: torch.Tensor,
    basis: torch.Tensor,
    sort: bool = True,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One warm-started power iteration plus QR, ``Q = qr(factor @ basis[:, perm]).Q``; with
    ``sort`` the columns of ``basis`` are ordered by ``diag(basis^T factor basis)``, descending,
    and ``perm`` (int64) is returned, else None.

    Raises ValueError for a non-square ``factor`` or a ``basis`` of another shape,
    ``MatrixFunctionError`` when the float64 retry fails too. ``torch.ops.asteria.qr_refresh``
    (whose permutation is empty without ``sort``: Note [Custom op schemas])."""
    q, perm = torch.ops.asteria.qr_refresh(factor, basis, sort, dtype)
    return q, (perm if sort else None)


def inverse_root(
    factor: torch.Tensor,
    root: float,
    epsilon: float = 1e-12,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``Q diag(lam^(-1/root)) Q^T`` of a symmetric PSD ``factor``, ``lam`` the eigenvalues of
    ``factor + epsilon I``, shifted to a smallest of ``epsilon`` where below it (Meta's).

    Raises ValueError for a non-square ``factor`` or ``root`` / ``epsilon`` not > 0,
    ``MatrixFunctionError`` when the float64 retry fails too or ``factor`` has non-finite
    entries. ``torch.ops.asteria.inverse_root``."""
    return torch.ops.asteria.inverse_root(factor, float(root), float(epsilon), dtype)
