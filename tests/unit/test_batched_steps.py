"""Batched steps (Note [Batched steps] in asteria/optim/batched.py, Note [Batched refreshes] in
asteria/optim/refresher.py): the same math, another launch pattern.

Invariants, each over a space of settings drawn by hypothesis:
  * on the CPU each optimizer's batched step gives bitwise the parameters and state of its
    per-parameter path (each block's ops one at a time), for any layout, options and
    refreshes (with the batched QR refreshes of one shape);
  * ``qr_refresh_many`` is bitwise ``qr_refresh`` of each factor;
  * the ATen ops of an ordinary step do not grow with the number of blocks of one shape;
  * pieces never exceed the element limit or the refresher's bases room (but for a single
    item over it), and keep the items' order.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from asteria.optim import SOAP, KLShampoo, Shampoo, batched
from asteria.optim import matrix_functions as mf
from asteria.optim.base import KroneckerOptimizer
from asteria.optim.refresher import NativeRefresher
from tests.unit.test_fused_steps import PerBlockSOAP

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class _PerBlockRefresher(NativeRefresher):
    """The synchronous algorithm one block at a time: each due refresh computed and installed
    at its boundary, as before Note [Batched refreshes]."""

    def block_boundary(self, key, block, group, step, due) -> None:
        if not due:
            return
        opt = self._opt()
        try:
            results = [None if j is None else j.run() for j in opt.refresh_jobs(block, group)]
        except mf.MatrixFunctionError as err:
            self._count_failure(opt, key, step, err)
            return
        self.failures.pop(key, None)
        opt.install_refresh(block, results)


def _per_parameter(cls):
    """``cls`` stepping each parameter through ``_update_param`` and refreshing each block
    alone: the per-block ops the batched step replaces."""

    base = PerBlockSOAP if cls is SOAP else cls

    class PerParameter(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._refresher = _PerBlockRefresher(self)

        if cls is not SOAP:  # SOAP's oracle is the authors' per-block ops (test_fused_steps)

            def _update_params(self, group, updates):
                KroneckerOptimizer._update_params(self, group, updates)

    return PerParameter


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
def test_soap_pieces_of_one_block_are_bitwise_the_batched_step(shapes, max_dim, data):
    """With ``normalize_grads`` too: pieces of one block (a refresher's ``bases_room`` of 0, the
    C++ per-block ops) and one piece for all give the same bits."""
    options = dict(
        lr=3e-3,
        max_preconditioner_dim=max_dim,
        precondition_frequency=data.draw(st.sampled_from([1, 2, 3])),
        normalize_grads=data.draw(st.booleans()),
        precondition_1d=data.draw(st.booleans()),
    )
    whole = _run(SOAP, shapes, options, 6)
    limit = batched.BATCH_ELEMENTS
    batched.BATCH_ELEMENTS = 0
    try:
        _same(_run(SOAP, shapes, options, 6), whole)
    finally:
        batched.BATCH_ELEMENTS = limit


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


@SETTINGS
@given(
    sizes=st.lists(st.integers(0, 50), max_size=12),
    limit=st.integers(0, 120),
    room=st.one_of(st.none(), st.integers(0, 120)),
)
def test_pieces_respect_the_limit_and_the_room(sizes, limit, room):
    got = batched.pieces(sizes, lambda n: n, lambda n: 2 * n, room, limit)
    assert [n for piece in got for n in piece] == sizes
    for piece in got:
        assert piece
        if len(piece) > 1:
            assert sum(piece) <= limit
            assert room is None or 2 * sum(piece) <= room
