"""Plain, slow, obviously-correct reference implementations of SOAP, KL-Shampoo and Shampoo.

Written from reading the authors' code (SOAP: nikhilvyas/SOAP ``soap.py``; KL-Shampoo:
yorkerlin/KL-Methods ``optim/kl_opt.py``; Shampoo: facebookresearch/optimizers
``distributed_shampoo/``) and the papers, where a summary of the algorithms is silent or wrong
(docs/fidelity.md: one left out KL-Shampoo's damping of the update); re-derived, not transcribed. It
does not import or copy anything from the ``asteria`` package, so that tests can compare the
production optimizers against an independent implementation.

Design rules:

* No ``torch.optim.Optimizer``. Each class takes a list of parameter tensors and has
  ``step(grads)`` which updates the parameters in place (under ``torch.no_grad``). A ``None``
  gradient skips that parameter for this call.
* State lives in plain per-parameter objects (``self.state[i]``), one loop per parameter, clarity
  over speed.
* Everything is computed in the parameter dtype (float64 works), except where the algorithm
  prescribes a precision: eigendecompositions and QR run in ``refresh_dtype`` (the authors: fp32),
  retried in fp64 when LAPACK fails, and their results are cast back to the parameter dtype.

Tensor notation used below: for a tensor ``X`` of order ``k`` and a matrix ``A``,
``mode_product(X, A, i)`` multiplies ``A`` into dimension ``i`` (``Y[.., a, ..] = sum_b A[a, b]
X[.., b, ..]``); ``unfold(X, i)`` is the mode-``i`` unfolding ``X_(i)`` of shape ``d_i x
(numel / d_i)``. For a matrix ``G``: ``mode_product(G, Q_L^T, 0)`` is ``Q_L^T G`` and
``mode_product(G, Q_R^T, 1)`` is ``G Q_R``, so "projecting by all ``Q_i^T``" is ``Q_L^T G Q_R``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "RefKLShampoo",
    "RefSOAP",
    "RefShampoo",
    "authors_merge_dims",
    "meta_merge_dims",
    "mode_product",
    "project",
    "project_back",
    "unfold",
]


# --------------------------------------------------------------------------------------------
# Small tensor helpers
# --------------------------------------------------------------------------------------------


def unfold(x: Tensor, i: int) -> Tensor:
    """Mode-``i`` unfolding: move dim ``i`` to the front and flatten the rest (``d_i x rest``)."""
    return x.movedim(i, 0).reshape(x.shape[i], -1)


def mode_product(x: Tensor, a: Tensor, i: int) -> Tensor:
    """Multiply ``a`` into dim ``i`` of ``x``: ``Y[.., r, ..] = sum_c a[r, c] X[.., c, ..]``."""
    y = torch.tensordot(a, x, dims=([1], [i]))  # the new dim is in front
    return y.movedim(0, i)


def gram(x: Tensor, i: int) -> Tensor:
    """``X_(i) X_(i)^T``: the contraction of ``x`` with itself over every dim except ``i``."""
    u = unfold(x, i)
    return u @ u.T


def project(x: Tensor, bases: Sequence[Tensor | None]) -> Tensor:
    """Into the eigenbasis: mode-``i`` product with ``Q_i^T`` for every dim that has a basis."""
    for i, q in enumerate(bases):
        if q is not None:
            x = mode_product(x, q.T, i)
    return x


def project_back(x: Tensor, bases: Sequence[Tensor | None]) -> Tensor:
    """Back to the original space: mode-``i`` product with ``Q_i`` for every dim with a basis."""
    for i, q in enumerate(bases):
        if q is not None:
            x = mode_product(x, q, i)
    return x


def _nan_inf_to_zero(x: Tensor) -> Tensor:
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def _eigh(mat: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh`` of ``mat`` computed in ``dtype``, retried in fp64 on failure.

    Returns ``(eigenvalues ascending, eigenvectors)`` in ``dtype``.
    """
    try:
        lam, q = torch.linalg.eigh(mat.to(dtype))
    except RuntimeError:  # torch.linalg.LinAlgError is a RuntimeError
        lam, q = torch.linalg.eigh(mat.to(torch.float64))
    return lam.to(dtype), q.to(dtype)


def _qr_q(mat: Tensor, dtype: torch.dtype) -> Tensor:
    """The ``Q`` of ``torch.linalg.qr(mat)`` computed in ``dtype``, retried in fp64 on failure."""
    try:
        q, _ = torch.linalg.qr(mat.to(dtype))
    except RuntimeError:
        q, _ = torch.linalg.qr(mat.to(torch.float64))
    return q.to(dtype)


def eigenbasis_descending(factor: Tensor, refresh_dtype: torch.dtype) -> Tensor:
    """SOAP's initial basis: ``Q = eigh(F + 1e-30 I)`` in ``refresh_dtype``, columns flipped so the
    eigenvalues are in descending order, cast back to the factor dtype."""
    f = factor.to(refresh_dtype)
    eye = torch.eye(f.shape[0], dtype=refresh_dtype, device=f.device)
    _, q = _eigh(f + 1e-30 * eye, refresh_dtype)
    return torch.flip(q, dims=[1]).to(factor.dtype)


def authors_merge_dims(shape: Sequence[int], max_dim: int) -> list[int]:
    """The SOAP authors' ``merge_dims`` rule (channels-first).

    Iterate over the dims, multiplying each into the current group while the product stays
    ``<= max_dim``; otherwise close the current group (if it is larger than 1) and start a new one
    with this dim, or, when the current group is still 1, emit this dim on its own. Dims of size
    1 are absorbed. A tensor with no dim larger than 1 becomes ``[1]``.
    """
    new_shape: list[int] = []
    curr = 1
    for sh in shape:
        temp = curr * sh
        if temp > max_dim:
            if curr > 1:
                new_shape.append(curr)
                curr = sh
            else:
                new_shape.append(sh)
                curr = 1
        else:
            curr = temp
    if curr > 1 or len(new_shape) == 0:
        new_shape.append(curr)
    return new_shape


# --------------------------------------------------------------------------------------------
# SOAP
# --------------------------------------------------------------------------------------------


class _SOAPParamState:
    def __init__(self, work_shape: list[int], has_factor: list[bool]):
        self.work_shape = work_shape  # shape the algorithm sees (merged dims, or the param's own)
        self.has_factor = has_factor  # per dim of work_shape
        self.t = 0  # number of parameter updates done (the first gradient only initialises)
        self.m: Tensor | None = None  # first moment, in the eigenbasis
        self.v: Tensor | None = None  # second moment, in the eigenbasis
        self.factors: list[Tensor | None] = []  # F_i (d_i x d_i) or None (dim not rotated)
        self.Q: list[Tensor | None] | None = None  # None until the first gradient arrived


class RefSOAP:
    """SOAP (Vyas et al., 2024) exactly as the paper and the authors' soap.py define it.

    Per parameter, with work shape ``(d_0, ..., d_{k-1})`` (the parameter's shape, or the merged
    shape with ``merge_dims``): a factor ``F_i`` (``d_i x d_i``) for every dim with ``d_i <=
    max_preconditioner_dim``; larger dims get no factor and are never rotated. 1-D parameters get
    a factor only with ``precondition_1d`` (and ``d <= max_preconditioner_dim``); otherwise they
    run Adam in the identity basis, but still with the skipped first step and the same step
    counter (as in the authors' code).

    First gradient: ``m = v = 0``, factors ``F_i = lerp(0, G_(i) G_(i)^T, 1 - shampoo_beta)``,
    ``Q_i = eigh(F_i + 1e-30 I)`` in ``refresh_dtype``, descending; no parameter update, ``t``
    stays 0. Every later gradient (``t += 1``):

    1. ``G' = G x_i Q_i^T`` (all dims with a basis); ``m = b1 m + (1-b1) G'``;
       ``v = b2 v + (1-b2) G'^2``.
    2. ``N = (m / (sqrt(v) + eps)) x_i Q_i``; optionally ``N /= 1e-30 + sqrt(mean(N^2))``.
    3. ``W -= lr * sqrt(1-b2^t)/(1-b1^t) * N`` (just ``lr`` without ``correct_bias``), then
       ``W -= lr * wd * W``.
    4. ``m`` back to the original space with the old basis; factors updated with ``G``; if
       ``t % precondition_frequency == 0`` each basis is refreshed (sort by ``diag(Q^T F Q)``,
       permute ``v`` along that dim, one power iteration + QR, all in ``refresh_dtype``); ``m``
       projected with the (new) basis.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_preconditioner_dim: int = 10000,
        merge_dims: bool = False,
        precondition_1d: bool = False,
        normalize_grads: bool = False,
        correct_bias: bool = True,
        refresh_dtype: torch.dtype = torch.float32,
    ):
        self.params = list(params)
        self.lr = lr
        self.betas = betas
        # The authors pass shampoo_beta=-1 to mean betas[1]; here None means the same.
        self.shampoo_beta = betas[1] if shampoo_beta is None or shampoo_beta < 0 else shampoo_beta
        self.eps = eps
        self.weight_decay = weight_decay
        self.precondition_frequency = precondition_frequency
        self.max_preconditioner_dim = max_preconditioner_dim
        self.merge_dims = merge_dims
        self.precondition_1d = precondition_1d
        self.normalize_grads = normalize_grads
        self.correct_bias = correct_bias
        self.refresh_dtype = refresh_dtype
        self.state = [self._new_state(p) for p in self.params]

    def _new_state(self, p: Tensor) -> _SOAPParamState:
        max_dim = self.max_preconditioner_dim
        if p.dim() == 1:
            # 1-D: the decision is made on the parameter itself, merging does not apply.
            work_shape = list(p.shape)
            has_factor = [self.precondition_1d and p.shape[0] <= max_dim]
        else:
            work_shape = authors_merge_dims(p.shape, max_dim) if self.merge_dims else list(p.shape)
            if p.dim() == 0:
                work_shape = []  # a scalar: no dims, no factors (Adam)
            has_factor = [d <= max_dim for d in work_shape]
        return _SOAPParamState(work_shape, has_factor)

    @torch.no_grad()
    def step(self, grads: Sequence[Tensor | None]) -> None:
        assert len(grads) == len(self.params)
        for p, g, st in zip(self.params, grads, self.state):
            if g is not None:
                self._step_param(p, g.to(p.dtype), st)

    # -- pieces ---------------------------------------------------------------------------------

    def _update_factors(self, st: _SOAPParamState, G: Tensor) -> None:
        for i, f in enumerate(st.factors):
            if f is not None:
                st.factors[i] = torch.lerp(f, gram(G, i), 1.0 - self.shampoo_beta)

    def _refresh(self, st: _SOAPParamState) -> None:
        """One warm-started power iteration + QR per factor, in ``refresh_dtype``."""
        rd = self.refresh_dtype
        for i, (f, q) in enumerate(zip(st.factors, st.Q)):
            if f is None:
                continue
            f_r, q_r = f.to(rd), q.to(rd)
            est = torch.diag(q_r.T @ f_r @ q_r)
            idx = torch.argsort(est, descending=True)
            st.v = st.v.index_select(i, idx.to(st.v.device))  # permuted, not rotated
            q_r = q_r[:, idx]
            st.Q[i] = _qr_q(f_r @ q_r, rd).to(q.dtype)

    def _step_param(self, p: Tensor, g: Tensor, st: _SOAPParamState) -> None:
        b1, b2 = self.betas
        G = g.reshape(st.work_shape)

        if st.Q is None:  # first gradient: initialise only, no update, t stays 0
            st.m = torch.zeros_like(G)
            st.v = torch.zeros_like(G)
            st.factors = [
                torch.zeros(d, d, dtype=p.dtype, device=p.device) if has else None
                for d, has in zip(st.work_shape, st.has_factor)
            ]
            self._update_factors(st, G)
            st.Q = [
                eigenbasis_descending(f, self.refresh_dtype) if f is not None else None
                for f in st.factors
            ]
            return

        st.t += 1
        t = st.t

        # 1-3: Adam in the eigenbasis.
        G_proj = project(G, st.Q)
        st.m = b1 * st.m + (1.0 - b1) * G_proj
        st.v = b2 * st.v + (1.0 - b2) * G_proj.square()
        N = project_back(st.m / (st.v.sqrt() + self.eps), st.Q)
        if self.normalize_grads:
            N = N / (1e-30 + N.square().mean().sqrt())
        step_size = self.lr
        if self.correct_bias:
            step_size = self.lr * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        p.add_(N.reshape(p.shape), alpha=-step_size)
        if self.weight_decay > 0.0:
            p.add_(p, alpha=-self.lr * self.weight_decay)  # decoupled, on W after the update

        # 4: factors, refresh, and the first moment carried into the (new) basis.
        m_orig = project_back(st.m, st.Q)  # old basis
        self._update_factors(st, G)
        if t % self.precondition_frequency == 0:
            self._refresh(st)
        st.m = project(m_orig, st.Q)  # new basis


# --------------------------------------------------------------------------------------------
# KL-Shampoo
# --------------------------------------------------------------------------------------------


class _AdamWState:
    def __init__(self):
        self.t = 0
        self.m: Tensor | None = None
        self.v: Tensor | None = None


def _adamw_step(
    p: Tensor,
    g: Tensor,
    st: _AdamWState,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One step of ``torch.optim.AdamW`` (single-tensor path, no amsgrad, no maximize)."""
    b1, b2 = betas
    if st.m is None:
        st.m = torch.zeros_like(p)
        st.v = torch.zeros_like(p)
    st.t += 1
    p.mul_(1.0 - lr * weight_decay)  # AdamW decays first
    st.m = b1 * st.m + (1.0 - b1) * g
    st.v = b2 * st.v + (1.0 - b2) * g.square()
    bc1 = 1.0 - b1**st.t
    bc2 = 1.0 - b2**st.t
    denom = st.v.sqrt() / math.sqrt(bc2) + eps
    p.sub_(lr / bc1 * st.m / denom)


class _KLParamState:
    def __init__(self):
        self.t = 0  # updates done; the first gradient only initialises
        self.M: Tensor | None = None  # first moment, original space
        self.S: list[Tensor] = []  # Kronecker factors S_i (d_i x d_i)
        self.Q: list[Tensor] | None = None  # their (possibly stale) eigenbases
        self.s: list[Tensor] = []  # s_i = lambda_i^{-1/2} (clamped), one vector per factor
        self.adamw: _AdamWState | None = None  # 1-D (and 0-D) parameters


class RefKLShampoo:
    """KL-Shampoo (Lin et al., arXiv 2509.03378), as the authors' ``KLOpt`` computes it.

    Re-derived from reading yorkerlin/KL-Methods ``optim/kl_opt.py`` (``using_klsoap=False``,
    default ``using_damping=False``, ``using_clamping=True``, ``normalize_grads=False``), not
    transcribed: the same quantities, each computed the plain way.

    For a parameter of order ``k >= 2`` every dim ``i`` has a factor ``S_i`` (``d_i x d_i``), a
    basis ``Q_i`` and an eigenvalue state ``s_i = lambda_i^{-1/2}``; ``d_other_i = numel / d_i``.

    First gradient (no update, ``M = 0`` stays untouched, ``t`` stays 0):
    ``S_i = (1-beta) G_(i) G_(i)^T / d_other_i``; ``Q_i`` = eigh of ``S_i`` (``+1e-30 I``, in
    ``refresh_dtype``, descending, as SOAP); ``lambda_i = init_factor`` so
    ``s_i = init_factor^{-1/2}``.

    Every later gradient (``t += 1``), with the bases and estimates from before the step:

    1. ``M = lerp(M, G, 1-b1)``.
    2. ``E = s_0 o s_1 o ...`` (outer product), damped: ``E = E / (1 + eps E)``;
       ``Delta = ((M x_j Q_j^T for all j) * E) x_j Q_j for all j``.
    3. Factor ``i``: ``H = G x_j (Q_j diag(s_j))^T for all j != i``;
       ``S_i = beta S_i + (1-beta)/d_other_i H_(i) H_(i)^T``.
    4. Estimate ``i``: ``P = G x_j Q_j^T for all j``; ``diag_i = mean over dims != i of
       (P * prod_{j != i} s_j)^2``; ``D_i = nan/inf->0(1/s_i^2)``; ``D_i = lerp(D_i, diag_i,
       1-beta)``; ``s_i = nan/inf->0(1/sqrt(D_i))`` clamped to ``<= max(10, min(d_i,
       max_clamp_value))``.
       Which ``s_j`` steps 3 and 4 read: order 2 (and, beyond the authors, order >= 4) all
       from before the step. Order 3, the authors' sequence: ``S_2`` (old ``s_0, s_1``),
       ``S_1`` (old ``s_0, s_2``), ``s_2`` (old ``s_0, s_1``), ``s_1`` (old ``s_0``, new
       ``s_2``), ``S_0`` (new ``s_1``, old ``s_2``), ``s_0`` (new ``s_1``, old ``s_2``).
    5. If ``t % precondition_frequency == 0``: ``Q_i = QR(S_i Q_i).Q`` in ``refresh_dtype`` (no
       sort), with the ``S_i`` of step 3.
    6. ``W -= lr * Delta``; ``W -= lr * wd * W``.

    1-D (and 0-D) parameters: the authors' ``KLOpt`` cannot take them (their scripts give them to
    a separate AdamW); this reference runs plain AdamW on them (``torch.optim.AdamW`` semantics:
    same ``lr``, ``betas``, ``eps``, ``weight_decay``, bias correction, decay applied before the
    update, steps counted from the first gradient, no skipped first step).
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.98),
        shampoo_beta: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        init_factor: float = 0.1,
        max_clamp_value: float = 4000,
        refresh_dtype: torch.dtype = torch.float32,
    ):
        self.params = list(params)
        self.lr = lr
        self.betas = betas
        self.shampoo_beta = betas[1] if shampoo_beta is None or shampoo_beta < 0 else shampoo_beta
        self.eps = eps
        self.weight_decay = weight_decay
        self.precondition_frequency = precondition_frequency
        self.init_factor = init_factor
        self.max_clamp_value = max_clamp_value
        self.refresh_dtype = refresh_dtype
        self.state = [_KLParamState() for _ in self.params]

    @torch.no_grad()
    def step(self, grads: Sequence[Tensor | None]) -> None:
        assert len(grads) == len(self.params)
        for p, g, st in zip(self.params, grads, self.state):
            if g is None:
                continue
            g = g.to(p.dtype)
            if p.dim() < 2:
                if st.adamw is None:
                    st.adamw = _AdamWState()
                _adamw_step(p, g, st.adamw, self.lr, self.betas, self.eps, self.weight_decay)
            else:
                self._step_param(p, g, st)

    def _clamp_max(self, d: int) -> float:
        return max(10.0, min(float(d), float(self.max_clamp_value)))

    def _factor_update(self, st: _KLParamState, G: Tensor, i: int, s: Sequence[Tensor]) -> None:
        """Step 3 for factor ``i``, whitening the other dims with ``Q_j`` and ``s[j]``."""
        H = G
        for j in range(G.dim()):
            if j != i:
                H = mode_product(H, (st.Q[j] * s[j][None, :]).T, j)
        d_other = G.numel() // G.shape[i]
        st.S[i] = self.shampoo_beta * st.S[i] + (1.0 - self.shampoo_beta) / d_other * gram(H, i)

    def _estimate(self, st: _KLParamState, P: Tensor, i: int, s: Sequence[Tensor]) -> Tensor:
        """Step 4 for dim ``i``: the new ``s_i`` from ``P`` scaled by ``s[j]``, ``j != i``."""
        k = P.dim()
        scale = _outer([s[j] if j != i else torch.ones_like(s[j]) for j in range(k)])
        diag_i = (P * scale).square().mean(dim=[j for j in range(k) if j != i])
        D_i = _nan_inf_to_zero(1.0 / st.s[i].square())
        D_i = torch.lerp(D_i, diag_i, 1.0 - self.shampoo_beta)
        s_i = _nan_inf_to_zero(1.0 / D_i.sqrt())
        return s_i.clamp(max=self._clamp_max(P.shape[i]))

    def _step_param(self, p: Tensor, G: Tensor, st: _KLParamState) -> None:
        b1 = self.betas[0]
        beta = self.shampoo_beta
        k = G.dim()
        dims = list(G.shape)
        numel = G.numel()

        if st.Q is None:  # first gradient: initialise only
            st.M = torch.zeros_like(G)
            st.S = [(1.0 - beta) * gram(G, i) / (numel // dims[i]) for i in range(k)]
            st.Q = [eigenbasis_descending(S_i, self.refresh_dtype) for S_i in st.S]
            s0 = self.init_factor**-0.5
            st.s = [torch.full((d,), s0, dtype=G.dtype, device=G.device) for d in dims]
            return

        st.t += 1
        old = list(st.s)

        # 1. first moment (original space)
        st.M = torch.lerp(st.M, G, 1.0 - b1)

        # 2. damped preconditioned direction, old basis and estimates
        E = _outer(old)
        E = E / (1.0 + self.eps * E)
        delta = project_back(project(st.M, st.Q) * E, st.Q)

        # 3-4. factors and estimates
        P = project(G, st.Q)
        if k == 3:
            new = list(old)
            self._factor_update(st, G, 2, old)
            self._factor_update(st, G, 1, old)
            new[2] = self._estimate(st, P, 2, old)
            new[1] = self._estimate(st, P, 1, [old[0], old[1], new[2]])
            self._factor_update(st, G, 0, [old[0], new[1], old[2]])
            new[0] = self._estimate(st, P, 0, [old[0], new[1], old[2]])
        else:
            for i in range(k):
                self._factor_update(st, G, i, old)
            new = [self._estimate(st, P, i, old) for i in range(k)]
        st.s = new

        # 5. refresh: one power iteration + QR, no sorting
        if st.t % self.precondition_frequency == 0:
            rd = self.refresh_dtype
            st.Q = [
                _qr_q(S_i.to(rd) @ Q_i.to(rd), rd).to(Q_i.dtype) for S_i, Q_i in zip(st.S, st.Q)
            ]

        # 6. update, then decoupled weight decay
        p.sub_(self.lr * delta)
        if self.weight_decay > 0.0:
            p.sub_(self.lr * self.weight_decay * p)


def _outer(vectors: Sequence[Tensor]) -> Tensor:
    """Outer product ``v_0 o v_1 o ... o v_{k-1}`` as a tensor of shape ``(len(v_0), ...)``."""
    k = len(vectors)
    out = None
    for j, v in enumerate(vectors):
        shape = [1] * k
        shape[j] = v.shape[0]
        term = v.reshape(shape)
        out = term if out is None else out * term
    return out


# --------------------------------------------------------------------------------------------
# Shampoo
# --------------------------------------------------------------------------------------------


class _ShampooBlock:
    def __init__(self, index: tuple[slice, ...], shape: list[int], dtype, device):
        self.index = index  # where the block sits in the parameter's (merged) view
        self.factors = [torch.zeros(d, d, dtype=dtype, device=device) for d in shape]
        self.roots: list[Tensor | None] = [None] * len(shape)  # none until first computed
        self.failures = 0  # consecutive refreshes of this block that failed even in fp64


class _ShampooParamState:
    def __init__(self):
        self.t = 0  # counts every gradient (Shampoo skips no step)
        self.view: tuple[int, ...] = ()
        self.M: Tensor | None = None
        self.graft_v: Tensor | None = None
        self.buf: Tensor | None = None
        self.blocks: list[_ShampooBlock] = []


def meta_merge_dims(shape: Sequence[int], max_dim: int) -> tuple[int, ...]:
    """The view Meta's Distributed Shampoo preconditions (``merge_small_dims`` with
    ``target_parameter_dimensionality=1``): drop every size-1 dim (none left: ``(1,)``); walk the
    dims from the last to the first, multiplying each into the group of the dims after it while the
    product stays ``<= max_dim``, else starting a new group."""
    groups: list[int] = []
    for d in reversed([d for d in shape if d != 1] or [1]):
        if groups and groups[0] * d <= max_dim:
            groups[0] *= d
        else:
            groups.insert(0, d)
    return tuple(groups)


class RefShampoo:
    """Shampoo with grafting, momentum and weight decay, as Meta's Distributed Shampoo computes it.

    Re-derived from reading facebookresearch/optimizers ``distributed_shampoo`` (the
    ``DistributedShampoo`` step, ``RootInvShampooPreconditionerList``, ``AdagradPreconditionerList``
    and the distributor's merge-and-block), not transcribed.

    Per parameter: the view ``meta_merge_dims(shape, max_preconditioner_dim)`` (with
    ``merge_dims=False``: size-1 dims dropped only), every dim of the view split into chunks of at
    most ``max_preconditioner_dim`` (``torch.split``), and the cartesian product of the chunks are
    the blocks; each has one factor per dim (a 1-D view too: a full matrix) and an inverse root per
    factor. Step ``t`` (``t = 1`` on the first gradient):

    * ``L_i = b2 L_i + (1-b2) G_(i) G_(i)^T`` per block (``b2 == 1``: ``L_i += G_(i) G_(i)^T``).
    * At ``t == start`` and at every ``t > start`` with ``t % precondition_frequency == 0``:
      ``R_i = Q diag((max(lam, 0) + epsilon)^(-1/(2k))) Q^T`` from ``eigh(L_i / c)``, ``c = 1 -
      b2^t`` when ``use_bias_correction`` and ``b2 < 1`` (else 1), in ``refresh_dtype`` (fp64
      retry; if that fails too the block keeps its previous roots, and
      ``max_consecutive_failures`` failures in a row raise). (Meta shifts the eigenvalues by the
      smallest one when it is negative instead of clamping them; the clamp is Asteria's.)
    * ``M = b1 M + (1-b1) G``; ``M_hat = M / (1 - b1^t)`` (just ``M`` without bias correction).
    * Grafting state: ``adam``: ``v = g2 v + (1-g2) G^2``,
      ``graft = M_hat / (sqrt(v) / sqrt(1-g2^t) + grafting_epsilon)``; ``rmsprop``: the same ``v``
      without its bias correction; ``adagrad``: ``v += G^2``, ``graft = M_hat / (sqrt(v) +
      grafting_epsilon)``; ``sgd`` and ``none``: ``graft = M_hat``.
    * ``t < start``: ``P = graft``. Otherwise per block: ``graft_block`` while the block has no
      roots (Asteria's rule; Meta starts from identity roots), else ``P = M_hat_block x_i R_i``,
      with grafting rescaled by ``||graft_block|| / (||P|| + 1e-16)`` (Frobenius).
    * Weight decay and momentum (``> 0``): ``P += wd W``; ``buf = momentum * buf + P`` (``buf``
      starts at 0); ``W -= lr buf``. Without momentum: ``W *= 1 - lr wd``, then ``W -= lr P``.

    ``start = precondition_frequency`` for ``start_preconditioning_step = -1`` (or ``None``).
    """

    GRAFTINGS = ("adam", "rmsprop", "adagrad", "sgd", "none")

    def __init__(
        self,
        params: Sequence[Tensor],
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 1.0),
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int | None = -1,
        use_bias_correction: bool = True,
        grafting: str = "adam",
        grafting_beta2: float = 0.999,
        grafting_epsilon: float = 1e-10,
        momentum: float = 0.0,
        merge_dims: bool = True,
        refresh_dtype: torch.dtype = torch.float32,
        max_consecutive_failures: int = 3,
        rel_epsilon: float = 0.0,
    ):
        if grafting not in self.GRAFTINGS:
            raise ValueError(f"grafting must be one of {self.GRAFTINGS}, got {grafting!r}")
        self.params = list(params)
        self.lr = lr
        self.betas = betas
        self.epsilon = epsilon
        self.weight_decay = weight_decay
        self.max_preconditioner_dim = max_preconditioner_dim
        self.precondition_frequency = precondition_frequency
        start = start_preconditioning_step
        self.start = precondition_frequency if start is None or start == -1 else start
        self.use_bias_correction = use_bias_correction
        self.grafting = grafting
        self.grafting_beta2 = grafting_beta2
        self.grafting_epsilon = grafting_epsilon
        self.momentum = momentum
        self.merge_dims = merge_dims
        self.refresh_dtype = refresh_dtype
        self.max_consecutive_failures = max_consecutive_failures
        self.rel_epsilon = rel_epsilon
        self.state = [self._new_state(p) for p in self.params]

    def _new_state(self, p: Tensor) -> _ShampooParamState:
        st = _ShampooParamState()
        if self.merge_dims:
            st.view = meta_merge_dims(p.shape, self.max_preconditioner_dim)
        else:
            st.view = tuple(d for d in p.shape if d != 1) or (1,)
        per_dim_chunks = []
        for d in st.view:
            sizes = [len(c) for c in torch.split(torch.arange(d), self.max_preconditioner_dim)]
            starts = [sum(sizes[:n]) for n in range(len(sizes))]
            per_dim_chunks.append(list(zip(starts, sizes)))
        for combo in itertools.product(*per_dim_chunks):
            index = tuple(slice(a, a + s) for a, s in combo)
            shape = [s for _, s in combo]
            st.blocks.append(_ShampooBlock(index, shape, p.dtype, p.device))
        return st

    @torch.no_grad()
    def step(self, grads: Sequence[Tensor | None]) -> None:
        assert len(grads) == len(self.params)
        for p, g, st in zip(self.params, grads, self.state):
            if g is not None:
                self._step_param(p, g.to(p.dtype), st)

    def _roots(self, block: _ShampooBlock, bias_correction: float) -> None:
        """``R_i = (L_i / c)^{-1/(2k)}`` (with ``epsilon``) via eigh in ``refresh_dtype``; the
        block keeps all its previous roots when one fails even in fp64."""
        rd = self.refresh_dtype
        order = len(block.factors)
        new = []
        try:
            for L in block.factors:
                A = L / bias_correction
                # Meta's rel_epsilon: relative to the largest absolute row sum of the factor
                eps = max(self.epsilon, self.rel_epsilon * float(A.abs().sum(1).max()))
                try:
                    lam, q = torch.linalg.eigh(A.to(rd))
                except RuntimeError:
                    lam, q = torch.linalg.eigh(A.to(torch.float64))
                powered = (lam.clamp(min=0.0) + eps) ** (-1.0 / (2 * order))
                new.append((q @ torch.diag(powered) @ q.T).to(L.dtype))
        except RuntimeError:
            block.failures += 1
            if block.failures >= self.max_consecutive_failures:
                raise
            return  # keep the previous roots
        block.failures = 0
        block.roots = new

    def _step_param(self, p: Tensor, g: Tensor, st: _ShampooParamState) -> None:
        b1, b2 = self.betas
        g2 = self.grafting_beta2
        st.t += 1
        t = st.t
        G = g.reshape(st.view)
        W = p.view(st.view)

        # factors (every step, every block)
        for block in st.blocks:
            Gb = G[block.index]
            for i, L in enumerate(block.factors):
                if b2 == 1.0:
                    block.factors[i] = L + gram(Gb, i)
                else:
                    block.factors[i] = b2 * L + (1.0 - b2) * gram(Gb, i)

        # inverse roots: at the start, and at every multiple of the frequency after it
        f = self.precondition_frequency
        if t == self.start or (t > self.start and t % f == 0):
            c = 1.0 - b2**t if self.use_bias_correction and b2 < 1.0 else 1.0
            for block in st.blocks:
                self._roots(block, c)

        # first moment
        if st.M is None:
            st.M = torch.zeros_like(G)
        st.M = b1 * st.M + (1.0 - b1) * G
        M_hat = st.M / (1.0 - b1**t) if self.use_bias_correction else st.M

        # grafting direction
        if st.graft_v is None:
            st.graft_v = torch.zeros_like(G)
        eps = self.grafting_epsilon
        if self.grafting == "adam":
            st.graft_v = g2 * st.graft_v + (1.0 - g2) * G.square()
            graft = M_hat / (st.graft_v.sqrt() / math.sqrt(1.0 - g2**t) + eps)
        elif self.grafting == "rmsprop":
            st.graft_v = g2 * st.graft_v + (1.0 - g2) * G.square()
            graft = M_hat / (st.graft_v.sqrt() + eps)
        elif self.grafting == "adagrad":
            st.graft_v = st.graft_v + G.square()
            graft = M_hat / (st.graft_v.sqrt() + eps)
        else:  # "sgd", and "none" (whose graft is only used as the un-preconditioned direction)
            graft = M_hat

        # direction
        if t < self.start:
            direction = graft
        else:
            direction = torch.empty_like(G)
            for block in st.blocks:
                if all(R is None for R in block.roots):
                    direction[block.index] = graft[block.index]
                    continue
                P = M_hat[block.index]
                for i, R in enumerate(block.roots):
                    P = mode_product(P, R, i)
                if self.grafting != "none":
                    scale = torch.linalg.vector_norm(graft[block.index]) / (
                        torch.linalg.vector_norm(P) + 1e-16
                    )
                    P = P * scale
                direction[block.index] = P

        # weight decay, momentum, the step
        if self.momentum > 0.0:
            if st.buf is None:
                st.buf = torch.zeros_like(G)
            st.buf = self.momentum * st.buf + (direction + self.weight_decay * W)
            W.sub_(self.lr * st.buf)
        else:
            W.mul_(1.0 - self.lr * self.weight_decay)
            W.sub_(self.lr * direction)
