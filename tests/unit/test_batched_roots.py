"""Shampoo's roots of one shape together (Note [Batched roots] in
asteria/optim/matrix_functions.py, Note [Batched refreshes] in asteria/optim/refresher.py).

Invariants, each over a space of settings drawn by hypothesis:
  * on the CPU ``inverse_root_many`` is bitwise ``inverse_root`` of each factor, for any
    order, count, rank (singular factors: Meta's shift and the round-off floor per matrix),
    root, epsilons (one for all, or one each) and dtypes;
  * a factor that is not finite gets ``None`` (its caller runs it alone and meets the error),
    and the others are still bitwise their own roots;
  * ``run_batched`` gives each job ``job.run()``'s result bit for bit, or ``None`` (run alone),
    over mixed kinds, shapes and relative epsilons, its batches within ``BATCH_ELEMENTS``;
  * SOAP's ``install_refresh_many`` leaves each block as its ``install_refresh`` does;
  * a native refresh step's ATen ops do not grow with the number of blocks of one shape.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.optim import groups as batched
from asteria.optim import matrix_functions as mf
from asteria.optim.refresher import QRRefresh, RootRefresh, run_batched
from tests.unit.test_batched_steps import _Ops

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

dtypes = st.sampled_from([torch.float32, torch.float64])


def _factors(d: int, n: int, rank: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """``n`` PSD ``d x d`` factors of rank ``min(rank, d)`` (a sum of outer products)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        a = torch.randn(d, rank, generator=gen, dtype=torch.float64)
        out.append((a @ a.T).to(dtype))
    return out


@SETTINGS
@given(
    d=st.sampled_from([1, 3, 7, 8, 16, 24, 33, 64, 100]),
    n=st.integers(1, 5),
    rank=st.sampled_from([1, 2, 5, 200]),
    root=st.sampled_from([2, 4, 6, 3.5]),
    epsilons=st.sampled_from(["one", "each"]),
    factor_dtype=dtypes,
    dtype=dtypes,
    seed=st.integers(0, 2**16),
)
def test_inverse_root_many_is_bitwise_each_inverse_root(
    d, n, rank, root, epsilons, factor_dtype, dtype, seed
):
    factors = _factors(d, n, rank, factor_dtype, seed)
    eps = [1e-12] * n if epsilons == "one" else [10.0 ** -(6 + i) for i in range(n)]
    many = mf.inverse_root_many(factors, root, eps, dtype=dtype)
    assert len(many) == n
    for got, f, e in zip(many, factors, eps):
        want = mf.inverse_root(f, root, e, dtype=dtype)
        assert got is not None and got.dtype == want.dtype
        assert torch.equal(got, want)


@SETTINGS
@given(
    d=st.sampled_from([8, 16, 33]),
    n=st.integers(2, 5),
    bad=st.data(),
    value=st.sampled_from([math.nan, math.inf]),
)
def test_a_non_finite_factor_runs_alone_and_the_others_are_bitwise(d, n, bad, value):
    factors = _factors(d, n, d, torch.float32, d + n)
    i = bad.draw(st.integers(0, n - 1))
    factors[i][0, 0] = value
    many = mf.inverse_root_many(factors, 4, [1e-12] * n)
    assert many[i] is None
    with pytest.raises(mf.MatrixFunctionError):
        mf.inverse_root(factors[i], 4, 1e-12)
    for j, (got, f) in enumerate(zip(many, factors)):
        if j != i:
            assert torch.equal(got, mf.inverse_root(f, 4, 1e-12))


def test_inverse_root_many_checks_before_it_computes():
    f = _factors(8, 2, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="epsilons"):
        mf.inverse_root_many(f, 4, [1e-12])
    with pytest.raises(ValueError, match="one shape"):
        mf.inverse_root_many([f[0], _factors(9, 1, 9, torch.float32, 0)[0]], 4, [1e-12] * 2)
    with pytest.raises(ValueError, match="epsilon"):
        mf.inverse_root_many(f, 4, [1e-12, 0.0])
    with pytest.raises(ValueError, match="root"):
        mf.inverse_root_many(f, 0, [1e-12] * 2)
    assert mf.inverse_root_many([], 4, []) == []


@SETTINGS
@given(
    dims=st.lists(st.sampled_from([8, 16, 24]), min_size=1, max_size=8),
    kinds=st.lists(st.sampled_from(["root", "qr", "qr_sorted"]), min_size=8, max_size=8),
    rel=st.lists(st.sampled_from([0.0, 1e-6, 1e-2]), min_size=8, max_size=8),
    dtype=dtypes,
    seed=st.integers(0, 2**16),
    limit=st.sampled_from([None, 0, 600, 2000]),
)
def test_run_batched_is_bitwise_each_job_run(dims, kinds, rel, dtype, seed, limit):
    """With any ``BATCH_ELEMENTS``: every batch holds at most that many factor elements (or
    one factor), and each result is the job's own."""
    jobs = []
    for i, d in enumerate(dims):
        f = _factors(d, 1, d // 2 + 1, torch.float32, seed + i)[0]
        if kinds[i] == "root":
            jobs.append(RootRefresh(f, root=4, epsilon=1e-12, dtype=dtype, rel_epsilon=rel[i]))
        else:
            basis = mf.eigh_descending(f + torch.eye(d), torch.float32)[1]
            jobs.append(QRRefresh(f, basis, sort=kinds[i] == "qr_sorted", dtype=dtype))
    seen: list[int] = []
    many = (mf.inverse_root_many, mf.qr_refresh_many)

    def spy(fn):
        def wrapped(factors, *args, **kwargs):
            seen.append(sum(f.numel() for f in factors))
            return fn(factors, *args, **kwargs)

        return wrapped

    saved = batched.BATCH_ELEMENTS
    mf.inverse_root_many, mf.qr_refresh_many = map(spy, many)
    batched.BATCH_ELEMENTS = saved if limit is None else limit
    try:
        results = run_batched(jobs)
    finally:
        batched.BATCH_ELEMENTS = saved
        mf.inverse_root_many, mf.qr_refresh_many = many
    assert all(n <= (saved if limit is None else limit) for n in seen), seen
    assert len(results) == len(jobs)
    for job, got in zip(jobs, results):
        if got is None:
            continue
        want = job.run()
        if isinstance(job, RootRefresh):
            assert torch.equal(got, want)
        else:
            assert torch.equal(got[0], want[0])
            assert (got[1] is None) == (want[1] is None)
            assert want[1] is None or torch.equal(got[1], want[1])


def _refresh_step_ops(cls, layers: int) -> int:
    """Ops of a native refresh step of ``cls`` on ``layers`` copies of one layer's shapes."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(24, 24), (48, 24), (24, 48), (24,)] * layers
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = cls(params, lr=1e-3, precondition_frequency=2)
    for step in range(10):  # past the first refresh, to the next refresh step
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        if step >= 2 and opt.is_refresh_step():
            break
    assert opt.is_refresh_step()
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    with _Ops() as counter:
        opt.step()
    return counter.ops


@pytest.mark.parametrize("cls", [Shampoo, KLShampoo, SOAP])
def test_refresh_step_ops_do_not_grow_with_the_blocks_of_one_shape(cls):
    """Note [Batched refreshes]: 2, 4 and 8 layers of the same shapes dispatch the same ops at
    a refresh step."""
    counts = {layers: _refresh_step_ops(cls, layers) for layers in (2, 4, 8)}
    assert len(set(counts.values())) == 1, counts


def _soap_blocks(shapes, max_dim: int, seed: int) -> tuple[SOAP, list[dict]]:
    """The blocks of a SOAP over ``shapes`` after two steps (bases from its first refresh)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = SOAP(params, lr=1e-3, max_preconditioner_dim=max_dim, precondition_frequency=100)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt, [block for _, _, block, _ in opt.blocks()]


@SETTINGS
@given(
    shapes=st.lists(
        st.one_of(st.tuples(st.sampled_from([8, 20, 33]), st.sampled_from([3, 8, 20, 33])),
                  st.tuples(st.sampled_from([8, 20, 33]))),
        min_size=1, max_size=4,
    ).map(lambda s: s + s),
    max_dim=st.sampled_from([16, 64]),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_soap_batched_install_is_bitwise_each_install(shapes, max_dim, seed):
    """Note [Batched installs]: SOAP's ``install_refresh_many`` leaves every block's moments
    and bases bitwise as ``install_refresh`` of each block does."""
    import copy

    opt, blocks = _soap_blocks(shapes, max_dim, seed)
    group = opt.param_groups[0]
    results = [[None if j is None else j.run() for j in opt.refresh_jobs(b, group)] for b in blocks]
    alone = copy.deepcopy(blocks)
    for b, r in zip(alone, results):
        opt.install_refresh(b, r)
    opt.install_refresh_many(blocks, results)
    for a, b in zip(alone, blocks):
        for field in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a[field], b[field])
        for qa, qb in zip(a["bases"], b["bases"]):
            assert (qa is None) == (qb is None)
            assert qa is None or torch.equal(qa, qb)
