"""Batched steps (Note [Batched steps] in asteria/optim/groups.py, Note [Batched refreshes] in
asteria/optim/refresher.py): the same math, another launch pattern.

Invariants, each over a space of settings drawn by hypothesis:
  * on the CPU each optimizer's batched step gives bitwise the parameters and state of its
    per-parameter path (each block's ops one at a time), for any layout, options and
    refreshes (with the batched QR refreshes of one shape);
  * ``qr_refresh_many`` is bitwise ``qr_refresh`` of each factor;
  * the ATen ops of an ordinary step do not grow with the number of blocks of one shape;
  * batches of one block are bitwise one batch for the step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.optim import groups as grouping
from asteria.optim import matrix_functions as mf
from asteria.optim.kernels import kl_shampoo as kl_kernel
from asteria.optim.kernels import shampoo as shampoo_kernel
from asteria.optim.kernels import shampoo_beta
from asteria.optim.kron import gram, mode_products
from asteria.optim.tensors import block_views
from tests.unit.test_fused_steps import PerBlockSOAP, refresh_alone

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class _ShampooPerParameter(Shampoo):
    """Shampoo one parameter and block at a time (the oracle the batched step replaced)."""

    def _run_group(self, group, updates):
        for u in updates:
            self._update_param(u.pid, u.p, u.grad, group, u.state, u.layout)

    def _update_param(self, pid, p, grad, group, state, layout) -> None:
        beta1 = group["betas"][0]
        lr, wd, grafting = group["lr"], group["weight_decay"], group["grafting"]
        state["step"] += 1
        t = state["step"]
        exp_avg = state["exp_avg"]
        exp_avg.lerp_(grad, 1 - beta1)
        bias_correction1 = 1 - beta1**t if group["use_bias_correction"] else 1.0
        denom = _grafting_denominator(state, grad, group, t)
        blocks = state.get("blocks")
        if blocks is not None:
            scale, weight = shampoo_kernel.factor_scales(group, t)
            for bi, (b, g) in enumerate(zip(blocks, block_views(grad, layout))):
                for i, f in enumerate(b["factors"]):
                    if scale != 1.0:
                        f.mul_(scale)
                    f.add_(gram(g, i), alpha=weight)
                refresh_alone(self, (pid, bi), b, group, t, self.refresh_due(t, group))
        preconditioning = blocks is not None and t >= shampoo_kernel.start_step(group)
        if not preconditioning and group["momentum"] == 0:
            p.mul_(1 - lr * wd)
            if denom is None:
                p.add_(exp_avg, alpha=-lr / bias_correction1)
            else:
                p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
            return
        m_hat = exp_avg / bias_correction1
        graft = m_hat if denom is None else m_hat / denom
        if preconditioning:
            direction = torch.empty_like(m_hat)
            views = zip(blocks, block_views(m_hat, layout), block_views(graft, layout),
                        block_views(direction, layout))  # fmt: skip
            for b, m_b, g_b, out in views:
                roots = b["roots"]
                if all(r is None for r in roots):
                    out.copy_(g_b)
                    continue
                pre = mode_products(m_b, roots, transpose=False)
                if grafting != "none":
                    norm = torch.linalg.vector_norm(pre) + shampoo_kernel.GRAFTING_NORM_EPSILON
                    pre = pre * (torch.linalg.vector_norm(g_b) / norm)
                out.copy_(pre)
        else:
            direction = graft
        if group["momentum"] > 0:
            if wd > 0:
                direction = direction + wd * p
            buf = state["momentum_buffer"]
            buf.mul_(group["momentum"]).add_(direction)
            p.add_(buf, alpha=-lr)
            return
        p.mul_(1 - lr * wd)
        p.add_(direction, alpha=-lr)


def _grafting_denominator(state, grad, group, t: int):
    grafting = group["grafting"]
    if grafting in ("sgd", "none"):
        return None
    v = state["exp_avg_sq"]
    eps = group["grafting_epsilon"]
    if grafting == "adagrad":
        v.addcmul_(grad, grad, value=1.0)
        return v.sqrt().add_(eps)
    b2 = group["grafting_beta2"]
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    if grafting == "rmsprop":
        return v.sqrt().add_(eps)
    return (v.sqrt() / (1 - b2**t) ** 0.5).add_(eps)


class _KLPerParameter(KLShampoo):
    """KL-Shampoo one parameter and block at a time (the oracle the batched step replaced):
    each block updated, its statistics run and its refresh decided before the next one."""

    def _run_group(self, group, updates):
        for u in updates:
            self._update_param(u.pid, u.p, u.grad, group, u.state, u.layout)

    def _update_param(self, pid, p, grad, group, state, layout) -> None:
        if "blocks" not in state:
            kl_kernel.adamw_update(p, grad, state, group["lr"], group["betas"], group["eps"],
                                   group["weight_decay"])  # fmt: skip
            return
        beta1, beta = group["betas"][0], shampoo_beta(group)
        state["step"] += 1
        refresh = state["step"] % group["precondition_frequency"] == 0
        views = zip(layout.blocks, state["blocks"], block_views(grad, layout),
                    block_views(p, layout))  # fmt: skip
        for bi, (spec, b, g, w) in enumerate(views):
            bases = list(b["bases"])
            b["exp_avg"].lerp_(g, 1 - beta1)
            kl_kernel.project_update(b, w, bases, group["lr"], group["eps"])
            kl_kernel.update_statistics(b, bases, g, spec.numel, beta, group["max_clamp_value"])
            refresh_alone(self, (pid, bi), b, group, state["step"], refresh)
        if group["weight_decay"] > 0.0:
            p.add_(p, alpha=-group["lr"] * group["weight_decay"])


def _per_parameter(cls):
    """``cls`` stepping each parameter and block alone: the per-block ops the batched step
    replaces (SOAP's: the authors' formulation, test_fused_steps.py)."""
    return {SOAP: PerBlockSOAP, KLShampoo: _KLPerParameter, Shampoo: _ShampooPerParameter}[cls]


def _run(cls, shapes, options, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = cls(params, **options)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    tensors = [p.detach() for p in params]
    for p in params:
        tensors += _tensors(opt.state[p])
    return tensors


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in sorted(value) for t in _tensors(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)


dims = st.sampled_from([3, 8, 20, 24, 33])
shape = st.one_of(
    st.tuples(dims, dims), st.tuples(dims), st.tuples(st.sampled_from([2, 3]), dims, dims)
)
# repeated shapes: groups of several blocks; others alone
shapes = st.lists(shape, min_size=1, max_size=4).map(lambda s: s + s[:2])
max_dim = st.sampled_from([16, 24, 64])


@SETTINGS
@given(shapes=shapes, max_dim=max_dim, data=st.data())
def test_soap_batched_step_is_bitwise_the_per_block_path(shapes, max_dim, data):
    options = dict(
        lr=3e-3,
        max_preconditioner_dim=max_dim,
        precondition_frequency=data.draw(st.sampled_from([1, 2, 3])),
        precondition_1d=data.draw(st.booleans()),
        weight_decay=data.draw(st.sampled_from([0.0, 0.01])),
    )
    _same(_run(_per_parameter(SOAP), shapes, options, 6), _run(SOAP, shapes, options, 6))


@SETTINGS
@given(shapes=shapes, max_dim=max_dim, data=st.data())
def test_soap_batches_of_one_block_are_bitwise_the_batched_step(shapes, max_dim, data):
    """With ``normalize_grads`` too: batches of one block (``BATCH_ELEMENTS`` 0) and one batch
    for all give the same bits."""
    options = dict(
        lr=3e-3,
        max_preconditioner_dim=max_dim,
        precondition_frequency=data.draw(st.sampled_from([1, 2, 3])),
        normalize_grads=data.draw(st.booleans()),
        precondition_1d=data.draw(st.booleans()),
    )
    whole = _run(SOAP, shapes, options, 6)
    limit = grouping.BATCH_ELEMENTS
    grouping.BATCH_ELEMENTS = 0
    try:
        _same(_run(SOAP, shapes, options, 6), whole)
    finally:
        grouping.BATCH_ELEMENTS = limit


@SETTINGS
@given(shapes=shapes, max_dim=max_dim, data=st.data())
def test_kl_shampoo_batched_step_is_bitwise_the_per_block_path(shapes, max_dim, data):
    options = dict(
        lr=1e-3,
        max_preconditioner_dim=max_dim,
        precondition_frequency=data.draw(st.sampled_from([1, 2, 3])),
        eps=data.draw(st.sampled_from([0.0, 1e-8, 0.1])),
        weight_decay=data.draw(st.sampled_from([0.0, 0.01])),
    )
    _same(_run(_per_parameter(KLShampoo), shapes, options, 6), _run(KLShampoo, shapes, options, 6))


@SETTINGS
@given(shapes=shapes, max_dim=max_dim, data=st.data())
def test_shampoo_batched_step_is_bitwise_the_per_block_path(shapes, max_dim, data):
    options = dict(
        lr=1e-2,
        max_preconditioner_dim=max_dim,
        precondition_frequency=data.draw(st.sampled_from([1, 2, 3])),
        start_preconditioning_step=data.draw(st.sampled_from([-1, 1, 2])),
        grafting=data.draw(st.sampled_from(["adam", "rmsprop", "adagrad", "sgd", "none"])),
        betas=(0.9, data.draw(st.sampled_from([1.0, 0.99]))),
        use_bias_correction=data.draw(st.booleans()),
        weight_decay=data.draw(st.sampled_from([0.0, 0.01])),
        momentum=data.draw(st.sampled_from([0.0, 0.5])),
        epsilon=data.draw(st.sampled_from([1e-12, 1e-6])),
        rel_epsilon=data.draw(st.sampled_from([0.0, 1e-5])),
    )
    _same(_run(_per_parameter(Shampoo), shapes, options, 6), _run(Shampoo, shapes, options, 6))


@SETTINGS
@given(
    d=st.sampled_from([2, 5, 8, 17, 40]),
    n=st.integers(1, 4),
    sort=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_batched_qr_refresh_is_bitwise_each_qr_refresh(d, n, sort, dtype):
    gen = torch.Generator().manual_seed(d * 10 + n)
    factors, bases = [], []
    for _ in range(n):
        a = torch.randn(d, 2 * d, generator=gen, dtype=dtype)
        factors.append(a @ a.T)
        bases.append(mf.eigh_descending(factors[-1] + torch.eye(d, dtype=dtype), dtype)[1])
    many = mf.qr_refresh_many(factors, bases, sort=sort, dtype=dtype)
    for (q, perm), f, b in zip(many, factors, bases):
        want_q, want_perm = mf.qr_refresh(f, b, sort=sort, dtype=dtype)
        assert torch.equal(q, want_q)
        assert (perm is None) == (want_perm is None)
        assert want_perm is None or torch.equal(perm, want_perm)


class _Ops(TorchDispatchMode):
    """ATen ops dispatched (views and metadata apart), as bench/optim_step.py --count."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in {"detach", "alias", "view"}:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _ordinary_step_ops(cls, layers: int) -> int:
    """Ops of an ordinary step of ``cls`` on ``layers`` copies of one layer's shapes."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(24, 24), (48, 24), (24, 48), (24,)] * layers
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = cls(params, lr=1e-3, precondition_frequency=100)
    for step in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if step < 2:
            opt.step()
    with _Ops() as counter:
        opt.step()
    return counter.ops


@pytest.mark.parametrize("cls", [SOAP, KLShampoo, Shampoo])
def test_ordinary_step_ops_do_not_grow_with_the_blocks_of_one_shape(cls):
    """Note [Batched steps]: 2, 4 and 8 layers of the same shapes dispatch the same ops."""
    counts = {layers: _ordinary_step_ops(cls, layers) for layers in (2, 4, 8)}
    assert len(set(counts.values())) == 1, counts
