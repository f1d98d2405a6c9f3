"""Matrix functions of the preconditioner refreshes, in pure torch.

Owns: the three refreshes the optimizers need (eigendecomposition, one warm-started power iteration
followed by QR, inverse p-th root), the last two also for many factors of one shape at once
(``qr_refresh_many``, ``inverse_root_many``: bitwise the single ones on the CPU), their precision
policy (compute in ``dtype``, retry in float64 when LAPACK fails or the result is not finite) and
the error raised when even the retry fails.

Must not: know about optimizers, blocks or state. The C++ twins in
``csrc/core/matrix_functions.cpp`` (``asteria._C``) compute the same functions on the worker
pool; tests/unit/test_cpp_matrix_functions.py checks that both agree.
"""

from __future__ import annotations

import contextlib

import torch

from asteria._C import OneLapackThread
from asteria.optim.batched import (
    SMALL_BMM,
    bmm,
    eigh_each,
    index_select_each,
    mm,
    qr_each,
    qr_refresh_each,
)

__all__ = [
    "MatrixFunctionError",
    "check_matrix",
    "check_real",
    "eigh_descending",
    "qr_refresh",
    "qr_refresh_many",
    "inverse_root",
    "inverse_root_many",
    "solver_failed",
]

# The shift the authors of SOAP add before eigh ("L + 1e-30 I"); kept so results match theirs.
EIGH_SHIFT = 1e-30


try:  # One class for both twins: a pool future raises the same error this module raises.
    from asteria._C import MatrixFunctionError
except ImportError:  # pragma: no cover - only while the extension is not built

    class MatrixFunctionError(RuntimeError):  # type: ignore[no-redef]
        """A refresh failed in ``dtype`` and again in float64, or produced a non-finite result."""


def check_real(name: str, a: object) -> None:
    """A real (floating-point), dense tensor: a complex one is refused rather than silently
    cast (its imaginary part dropped: wrong eigenvalues), here and where the pool is submitted
    to (asteria.lowlevel's WorkerPool, the runtime's ``pool_submit``)."""
    if not isinstance(a, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(a).__name__}")
    if a.is_complex() or not a.is_floating_point() or a.layout != torch.strided:
        raise ValueError(
            f"{name} must be a dense real floating-point matrix, got a {a.dtype} tensor "
            f"(layout {a.layout}): complex Hermitian matrices are not supported"
        )


def _check_square(name: str, a: torch.Tensor) -> None:
    """A real, dense, square matrix (``check_real``)."""
    check_real(name, a)
    if a.dim() != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"{name} must be a square matrix, got shape {tuple(a.shape)}")


#: The check of a matrix function's input (pool submissions use it too).
check_matrix = _check_square


def _finite_one(t: torch.Tensor) -> bool:
    """Exact, usually in one pass: a finite sum means every entry is finite (a NaN or Inf makes
    the sum non-finite); only a non-finite sum, which may be an overflow, needs the full test."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _finite(*tensors: torch.Tensor) -> bool:
    return all(_finite_one(t) for t in tensors if t.is_floating_point())


def _finite_orthonormal(q: torch.Tensor, *rest: torch.Tensor) -> bool:
    """Validity gate for an orthonormal ``q`` (plus integer outputs): its entries are bounded by 1,
    so its sum cannot overflow, and a NaN or Inf anywhere makes the sum non-finite. One reduction
    instead of ``isfinite`` + ``all`` (four passes), on the refresh's hot path."""
    return bool(torch.isfinite(q.sum())) and _finite(*rest)


def _canonical(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a`` in ``dtype`` and row-major: BLAS results depend on the operands' memory layout, and
    the C++ twins receive contiguous copies, so both compute on the same layout, bit for bit."""
    return a.to(dtype).contiguous()


def _shifted(a: torch.Tensor, dtype: torch.dtype, shift: float = EIGH_SHIFT) -> torch.Tensor:
    """A copy of ``a`` in ``dtype`` with ``shift`` added to its diagonal (in place: the same
    values as ``a + shift * I`` without building the identity)."""
    # Column-major, the layout LAPACK works in: eigh's own working copy is then a plain memcpy
    # (it copies any layout to the same column-major values, so the result does not change).
    out = torch.empty(a.shape[::-1], dtype=dtype, device=a.device).T
    out.copy_(a)
    out.diagonal().add_(shift)
    return out


def _shift_is_exact_noop(a: torch.Tensor) -> bool:
    """Whether ``a + EIGH_SHIFT * I`` equals ``a`` bit for bit: adding ``s`` to a float ``x``
    returns ``x`` when ``|s| < ulp(x) / 2``, and ``ulp(x) >= |x| * eps / 2``; so every diagonal
    entry above ``4 * s / eps`` in magnitude (with a margin of 2) absorbs the shift."""
    eps = torch.finfo(a.dtype).eps
    return a.shape[0] > 0 and bool(a.diagonal().abs().min() * eps > 8 * EIGH_SHIFT)


def _eigh(a: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # The shifted copy only where the shift changes a bit (a zero or tiny diagonal entry):
    # eigh's own working copy is then the only one.
    if a.dtype == dtype and _shift_is_exact_noop(a):
        return torch.linalg.eigh(a)
    return torch.linalg.eigh(_shifted(a, dtype))


def _qr_q(a: torch.Tensor) -> torch.Tensor:
    """The Q factor of a reduced QR, by ``geqrf`` + ``orgqr`` (the same LAPACK calls, bit for
    bit, as ``torch.linalg.qr``, without forming and copying out R)."""
    return torch.linalg.householder_product(*torch.geqrf(a))


#: What a solver's failure on a device says: cuSOLVER, cuBLAS and MAGMA report theirs as a
#: ``RuntimeError`` that is not a ``LinAlgError`` (an out-of-memory error is its own type).
_SOLVER_ERRORS = ("cusolver", "cublas", "magma")


def solver_failed(e: BaseException) -> bool:
    """Whether ``e`` is a refresh's numerical or device failure, handled like LAPACK's (a
    float64 retry, then ``MatrixFunctionError``: counted, the previous bases kept; Note
    [Refresh failures]): a ``LinAlgError``, an out-of-memory error, or a device solver's
    ``RuntimeError``. Anything else (a bug, a bad argument) is not, and propagates."""
    if isinstance(e, (torch.linalg.LinAlgError, torch.OutOfMemoryError)):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e).lower() for s in _SOLVER_ERRORS)


def _one_thread(t: torch.Tensor):
    """On the CPU, the calling thread's LAPACK/BLAS threads at 1 for a refresh's computation, as
    on a pool worker (Note [One thread per refresh] in csrc/core/aligned.cpp)."""
    return OneLapackThread() if t.device.type == "cpu" else contextlib.nullcontext()


def _with_fp64_retry(fn, dtype: torch.dtype, what: str, valid=_finite, on=None):
    """Run ``fn(dtype)``; on a LAPACK error or a non-finite result (``valid``) run ``fn(float64)``
    once, each on one LAPACK thread where ``on`` is on the CPU."""
    if on is not None:
        with _one_thread(on):
            return _with_fp64_retry(fn, dtype, what, valid)
    first_error: str
    try:
        out = fn(dtype)
        if valid(*out):
            return out
        first_error = "non-finite result"
    except RuntimeError as e:  # LAPACK did not converge, or a device solver failed
        if not solver_failed(e):
            raise
        first_error = str(e)
    if dtype != torch.float64:
        try:
            out = fn(torch.float64)
            if valid(*out):
                return tuple(t.to(dtype) if t.is_floating_point() else t for t in out)
            retry_error = "non-finite result"
        except RuntimeError as e:
            if not solver_failed(e):
                raise
            retry_error = str(e)
    else:
        retry_error = first_error
    raise MatrixFunctionError(
        f"{what} failed in {dtype} ({first_error}) and in float64 ({retry_error})"
    )


def eigh_descending(
    factor: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues and eigenvectors of a symmetric ``factor``, eigenvalues descending (LAPACK's
    columns flipped, as SOAP's authors do), in ``dtype`` (float64 retry on failure)."""
    _check_square("factor", factor)
    if not _finite(factor):
        raise MatrixFunctionError("eigh: factor has non-finite entries")
    evals, evecs = _with_fp64_retry(
        lambda dt: _eigh(factor, dt),
        dtype,
        "eigh",
        valid=lambda w, v: _finite_orthonormal(v, w),
        on=factor,
    )
    return evals.flip(0), evecs.flip(1)


def qr_refresh(
    factor: torch.Tensor,
    basis: torch.Tensor,
    sort: bool = True,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One warm-started power iteration plus QR: ``Q = qr(factor @ basis[:, perm]).Q``. With
    ``sort`` (SOAP) the columns of ``basis`` are first ordered by ``diag(basis^T factor basis)``,
    descending, and the permutation returned (for state kept in the old basis); else it is None."""
    _check_square("factor", factor)
    if basis.shape != factor.shape:
        raise ValueError(f"basis shape {tuple(basis.shape)} != factor shape {tuple(factor.shape)}")
    # Non-finite input needs no check of its own: it makes the result non-finite, which the
    # validity gate of _with_fp64_retry catches (the refresh is on the hot path of native mode).

    def run(dt: torch.dtype):
        # Note [QR layout]: everything is computed transposed, P^T = Q^T F^T, so that the basis
        # LAPACK returned (column-major) is read without a copy, the estimates reduce along
        # contiguous rows, the sort gathers whole rows, and the sorted power iteration reaches
        # geqrf already column-major (its working copy is then a plain memcpy).
        f = _canonical(factor, dt)
        qt = _canonical(basis.T, dt)
        power_t = mm(qt, f.T)  # (F Q)^T: one n^3 product for estimates and iteration
        if not sort:
            return (_qr_q(power_t.T),)
        est = (qt * power_t).sum(dim=1)  # diag(Q^T F Q)
        perm = torch.argsort(est, descending=True)
        return _qr_q(power_t.index_select(0, perm).T), perm

    out = _with_fp64_retry(run, dtype, "qr_refresh", valid=_finite_orthonormal, on=factor)
    return (out[0], None) if len(out) == 1 else (out[0], out[1].to(torch.long))


def qr_refresh_many(
    factors: list[torch.Tensor],
    bases: list[torch.Tensor],
    sort: bool = True,
    dtype: torch.dtype = torch.float32,
) -> list[tuple[torch.Tensor, torch.Tensor | None] | None]:
    """``qr_refresh`` of factors of one shape at once: on the CPU one operator running the pool's
    ``qr_refresh`` on each (Note [Refreshes one by one on the CPU] in csrc/core/aligned.cpp),
    elsewhere batched ops. A factor whose result is not finite (or failed) gets ``None``: its caller
    runs ``qr_refresh``, with its retry and error, for it alone."""
    for f, q in zip(factors, bases):  # (the checks inline: no call per factor)
        if not (f.is_floating_point() and f.layout == torch.strided and f.dim() == 2):
            _check_square("factor", f)
        if f.shape[0] != f.shape[1]:
            _check_square("factor", f)
        if q.shape != f.shape:
            raise ValueError(f"basis shape {tuple(q.shape)} != factor shape {tuple(f.shape)}")
    on_cpu = bool(factors) and factors[0].device.type == "cpu"
    if len(factors) < 2 and not on_cpu:
        return [_qr_refresh_or_none(f, q, sort, dtype) for f, q in zip(factors, bases)]
    try:
        if on_cpu:  # one op, each factor on its own (Note [Refreshes one by one on the CPU])
            qs, perms, ok = qr_refresh_each(list(factors), list(bases), sort, dtype)
            return [
                (q, perm if sort else None) if good else None
                for q, perm, good in zip(qs, perms, ok.tolist())
            ]
        return _qr_many(factors, bases, sort, dtype)
    except RuntimeError as e:
        if not solver_failed(e):
            raise
        return [None] * len(factors)  # each alone, with its float64 retry


def _qr_many(factors, bases, sort: bool, dtype: torch.dtype) -> list:
    f = torch.stack([_canonical(x, dtype) for x in factors])
    qt = torch.stack([q.T for q in bases]).to(dtype)  # row-major Q^T, as _canonical(basis.T)
    with _one_thread(f):  # Note [One thread per refresh]
        power_t = bmm(qt, f.mT)  # Note [QR layout], per matrix
    perm = None
    if sort:
        est = (qt * power_t).sum(dim=2)
        perm = torch.argsort(est, dim=1, descending=True)
        power_t = index_select_each(power_t, 0, perm)  # qr_refresh's gather of rows
    q = qr_each(power_t.mT)  # one matrix at a time on the CPU (Note [Aligned operands])
    ok = torch.isfinite(q.sum(dim=(1, 2))).tolist()
    return [
        (q[i], None if perm is None else perm[i]) if ok[i] else None for i in range(len(factors))
    ]


def _qr_refresh_or_none(f, q, sort, dtype):
    try:
        return qr_refresh(f, q, sort=sort, dtype=dtype)
    except MatrixFunctionError:
        return None  # the caller runs it alone, and meets the error there


def inverse_root(
    factor: torch.Tensor,
    root: float,
    epsilon: float = 1e-12,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``factor^{-1/root}`` of a symmetric positive semi-definite ``factor``, by eigendecomposition.

    As Meta's Distributed Shampoo computes it (``matrix_inverse_root`` with its default
    ``PerturbationConfig``): ``lam, Q = eigh(factor + epsilon I)``; where the smallest ``lam`` is
    below ``epsilon`` (round-off of a singular PSD factor makes it negative) every eigenvalue is
    shifted by it, ``lam - min(lam) + epsilon``; then ``Q diag(lam^{-1/root}) Q^T``. One step
    comes first that Meta does not take: eigenvalues below the eigensolver's accuracy,
    ``n * eps(dtype) * max|lam|``, are raised to it (Note [Round-off floor]); above it every
    bit is Meta's.
    """
    _check_square("factor", factor)
    if root <= 0:
        raise ValueError(f"root must be > 0, got {root}")
    if epsilon <= 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    if not _finite(factor):
        raise MatrixFunctionError("inverse_root: factor has non-finite entries")

    def run(dt: torch.dtype):
        evals, evecs = torch.linalg.eigh(_shifted(factor, dt, epsilon))  # factor + epsilon I
        scale = _perturbed(evals, epsilon).pow(-1.0 / root)
        return (mm(evecs * scale, evecs.T),)

    return _with_fp64_retry(run, dtype, "inverse_root", on=factor)[0]


def inverse_root_many(
    factors: list[torch.Tensor],
    root: float,
    epsilons: list[float],
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor | None]:
    """``inverse_root`` of factors of one shape at once (Note [Batched roots]). A factor that is not
    finite, or whose root is not, gets ``None`` (its caller runs ``inverse_root`` for it alone), as
    every factor does when the batch's ``eigh`` fails, and factors with ``d^3 < SMALL_BMM`` on the
    CPU."""
    if len(epsilons) != len(factors):
        raise ValueError(f"{len(factors)} factors but {len(epsilons)} epsilons")
    for f in factors:  # (the checks inline: no call per factor)
        if not (f.is_floating_point() and f.layout == torch.strided and f.dim() == 2):
            _check_square("factor", f)
        if f.shape[0] != f.shape[1]:
            _check_square("factor", f)
    if root <= 0:
        raise ValueError(f"root must be > 0, got {root}")
    for e in epsilons:
        if e <= 0:
            raise ValueError(f"every epsilon must be > 0, got {epsilons}")
    if len({(tuple(f.shape), f.dtype, f.device) for f in factors}) > 1:
        raise ValueError("inverse_root_many: factors of one shape, dtype and device")
    d = factors[0].shape[0] if factors else 0
    if len(factors) < 2 or (factors[0].device.type == "cpu" and d**3 < SMALL_BMM):
        # ATen's bmm rounds products this small otherwise than mm: one at a time
        return [_inverse_root_or_none(f, root, e, dtype) for f, e in zip(factors, epsilons)]
    stacked = torch.stack(factors)
    finite = torch.isfinite(stacked.sum(dim=(1, 2))).tolist()
    rows = [i for i, ok in enumerate(finite) if ok]
    if len(rows) < len(factors):  # a non-finite factor raises alone (inverse_root's check)
        if len(rows) < 2:
            return [_inverse_root_or_none(f, root, e, dtype) for f, e in zip(factors, epsilons)]
        stacked = stacked[rows]
    try:
        roots = _roots_many(stacked, root, [epsilons[i] for i in rows], dtype)
    except RuntimeError as e:  # a LAPACK or device solver failure (Note [Refresh failures])
        if not solver_failed(e):
            raise
        return [None] * len(factors)  # each alone, with its float64 retry
    ok = torch.isfinite(roots.sum(dim=(1, 2))).tolist()
    out: list[torch.Tensor | None] = [None] * len(factors)
    for j, i in enumerate(rows):
        out[i] = roots[j] if ok[j] else None
    return out


def _roots_many(stacked: torch.Tensor, root: float, epsilons: list[float], dtype: torch.dtype):
    """``inverse_root``'s ``run`` in ``dtype`` along a stack's leading dim (Note [Batched
    roots])."""
    n, d = stacked.shape[0], stacked.shape[1]
    same = epsilons.count(epsilons[0]) == len(epsilons)
    # each epsilon rounded to dtype as a Python scalar is in the per-matrix ops
    eps = (
        epsilons[0] if same else torch.tensor(epsilons, dtype=dtype, device=stacked.device)[:, None]
    )
    shifted = torch.empty((n, d, d), dtype=dtype, device=stacked.device).mT  # _shifted's layout
    shifted.copy_(stacked)
    shifted.diagonal(dim1=1, dim2=2).add_(eps)
    evals, evecs = eigh_each(shifted)  # one matrix at a time on the CPU (Note [Aligned operands])
    # pow per row: a vectorised pow rounds otherwise than its scalar tail, and one pow over
    # the stack would cut the rows into other runs of vector lanes
    rows = torch._foreach_pow(list(_perturbed_many(evals, eps).unbind(0)), -1.0 / root)
    with _one_thread(evecs):  # Note [One thread per refresh]
        return bmm(evecs * torch.stack(rows).unsqueeze(1), evecs.mT)


def _perturbed_many(lam: torch.Tensor, epsilon: float | torch.Tensor) -> torch.Tensor:
    """``_perturbed`` of each row of ``lam`` (``(n, d)``), ``epsilon`` a scalar or ``(n, 1)``."""
    floor = lam.abs().amax(dim=1, keepdim=True) * (lam.shape[1] * torch.finfo(lam.dtype).eps)
    lam = torch.maximum(lam, floor)  # roundoff_floor per matrix (Note [Round-off floor])
    low = lam.amin(dim=1, keepdim=True)
    return torch.where(low < epsilon, (lam - low) + epsilon, lam)


def _inverse_root_or_none(f, root, epsilon, dtype):
    try:
        return inverse_root(f, root, epsilon, dtype=dtype)
    except MatrixFunctionError:
        return None  # the caller runs it alone, and meets the error there


# Note [Batched roots]
# ~~~~~~~~~~~~~~~~~~~~
# The due factors of one shape run as one stack through ``inverse_root``'s ops in its order, each
# matrix with its own round-off floor and Meta's shift. On the CPU bitwise ``inverse_root`` of
# each: the batched ``eigh`` calls LAPACK per column-major matrix; per-matrix max/min are exact;
# ``pow``, whose vector kernel rounds otherwise than its scalar tail, runs per matrix
# (``_foreach_pow``); an epsilon tensor of ``dtype`` rounds as the scalar; the ``bmm`` reads the
# operands in ``mm``'s layouts, one ``gemm`` per matrix above ``SMALL_BMM``
# (tests/unit/test_batched_roots.py). On a GPU: equal to rounding.


def _perturbed(lam: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Meta's second perturbation: ``lam - min(lam) + epsilon`` where ``min(lam) < epsilon``
    (without a host sync: both branches are computed).

    Note [Singular factors]: a Shampoo factor is singular while it has seen fewer gradients than
    its dim, its null space's eigenvalues round-off of either sign. Clamping them at zero and
    adding ``epsilon`` gave each negative one the root's largest scale, ``epsilon^{-1/root}``,
    and grafting put the block's step there; Meta's shift gives that scale to one direction only
    (docs/fidelity.md, "Singular factors", has the measurements).
    """
    lam = torch.maximum(lam, roundoff_floor(lam))
    low = lam.min()
    return torch.where(low < epsilon, (lam - low) + epsilon, lam)


def roundoff_floor(lam: torch.Tensor) -> torch.Tensor:
    """``n * eps * max|lam|`` (a 0-d tensor, no host sync): how far the eigenvalues of an
    ``n x n`` symmetric matrix that eigh returns in ``lam``'s dtype can be from its own.

    Note [Round-off floor]: eigh returns the exact eigenvalues of ``L + E`` with ``||E|| <= c n
    eps ||L||``, so an eigenvalue below ``n eps max|lam|`` is round-off (a rank-deficient
    factor's null space, of either sign), which Meta's shift (Note [Singular factors]) would give
    scales up to ``epsilon^{-1/root}``: Shampoo's direction, rescaled by grafting, was then mostly
    noise. Raised to the floor, torch's generic test problem no longer diverges on any seed
    (docs/fidelity.md, "Singular factors"). Above the floor (a full-rank factor) the root is
    Meta's bit for bit. csrc/core/matrix_functions.cpp computes the same.
    """
    return lam.abs().max() * (lam.shape[0] * torch.finfo(lam.dtype).eps)
