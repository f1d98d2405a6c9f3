"""The matrix functions as ``torch.library`` custom ops (issue 18, item 2; asteria/ops.py).

``torch.ops.asteria.*`` compute what ``asteria.optim.matrix_functions`` computes, bit for bit,
and what ``torch.linalg`` computes in float64; their fake kernels pass torch's own ``opcheck``
(schema, fake tensors, AOT dispatch) over sizes, dtypes and ``sort``; a function that calls all
three compiles with ``torch.compile(fullgraph=True)`` on the CPU, with the ops in its graph, and
returns what the eager function returns; bad arguments fail while tracing with the eager errors.

Inductor's on-disk graph cache is off in the compiled tests: a cached graph keeps the strides
an older fake kernel declared.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._inductor.config
from hypothesis import given, settings
from hypothesis import strategies as st

from asteria import ops
from asteria.optim import matrix_functions as mf
from asteria.optim.matrix_functions import MatrixFunctionError

DTYPES = [torch.float32, torch.float64]
EXAMPLES = settings(max_examples=12, deadline=None, derandomize=True)


def _psd(n: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.randn(n, n + 3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return (g @ g.T / (n + 3)).to(dtype)


def _basis(n: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return mf.eigh_descending(_psd(n, seed + 1), torch.float64)[1].to(dtype)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False, autotune_local_cache=False):
        yield
    torch._dynamo.reset()


def test_the_ops_are_registered():
    for qualname in ops.OPS:
        namespace, name = qualname.split("::")
        assert namespace == "asteria"
        assert isinstance(getattr(torch.ops.asteria, name), torch._ops.OpOverloadPacket)


# ---- eager: the same as the pure-torch functions, and as torch.linalg in float64 -------------


@EXAMPLES
@given(n=st.integers(1, 24), seed=st.integers(0, 2**16), dtype=st.sampled_from(DTYPES))
def test_eigh_op_is_the_matrix_function(n, seed, dtype):
    a = _psd(n, seed, dtype)
    evals, evecs = ops.eigh_descending(a, dtype)
    ref_w, ref_v = mf.eigh_descending(a, dtype)
    assert torch.equal(evals, ref_w) and torch.equal(evecs, ref_v)
    assert evals.dtype == dtype and evecs.dtype == dtype


@EXAMPLES
@given(n=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_eigh_op_agrees_with_torch_linalg_in_float64(n, seed):
    a = _psd(n, seed)
    evals, evecs = ops.eigh_descending(a, torch.float64)
    ref = torch.linalg.eigvalsh(a).flip(0)
    scale = float(ref.abs().max()) + 1.0
    tol = 100 * n * torch.finfo(torch.float64).eps * scale
    assert torch.allclose(evals, ref, rtol=0, atol=tol)
    assert torch.allclose(evecs @ torch.diag(evals) @ evecs.T, a, rtol=0, atol=tol)
    assert torch.allclose(evecs.T @ evecs, torch.eye(n, dtype=torch.float64), atol=100 * n * 1e-16)


@EXAMPLES
@given(
    n=st.integers(1, 24),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(DTYPES),
    sort=st.booleans(),
)
def test_qr_op_is_the_matrix_function(n, seed, dtype, sort):
    a, basis = _psd(n, seed, dtype), _basis(n, seed, dtype)
    q, perm = ops.qr_refresh(a, basis, sort=sort, dtype=dtype)
    ref_q, ref_perm = mf.qr_refresh(a, basis, sort=sort, dtype=dtype)
    assert torch.equal(q, ref_q)
    if sort:
        assert torch.equal(perm, ref_perm) and perm.dtype == torch.long
    else:
        assert perm is None and ref_perm is None
        raw = torch.ops.asteria.qr_refresh(a, basis, False, dtype)[1]  # Note [Custom op schemas]
        assert raw.shape == (0,) and raw.dtype == torch.long


@EXAMPLES
@given(n=st.integers(1, 24), seed=st.integers(0, 2**16), sort=st.booleans())
def test_qr_op_agrees_with_torch_linalg_in_float64(n, seed, sort):
    a, basis = _psd(n, seed), _basis(n, seed)
    q, perm = ops.qr_refresh(a, basis, sort=sort, dtype=torch.float64)
    cols = basis if perm is None else basis[:, perm]
    ref_q, ref_r = torch.linalg.qr(a @ cols)
    signs = torch.sign(torch.diagonal(ref_r))  # the same Q up to the signs of its columns
    signs[signs == 0] = 1
    assert torch.allclose(q.abs(), (ref_q * signs).abs(), atol=1e-8)
    assert torch.allclose(q.T @ q, torch.eye(n, dtype=torch.float64), atol=100 * n * 1e-16)
    if sort:  # ordered by the estimates diag(B^T A B), descending
        est = torch.diagonal(basis.T @ a @ basis)[perm]
        assert bool((est[:-1] >= est[1:] - 1e-12).all())


@EXAMPLES
@given(
    n=st.integers(1, 24),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(DTYPES),
    root=st.sampled_from([1.0, 2.0, 4.0, 3.5]),
)
def test_inverse_root_op_is_the_matrix_function(n, seed, dtype, root):
    a = _psd(n, seed, dtype)
    out = ops.inverse_root(a, root, 1e-6, dtype=dtype)
    assert torch.equal(out, mf.inverse_root(a, root, 1e-6, dtype=dtype))


@EXAMPLES
@given(n=st.integers(1, 24), seed=st.integers(0, 2**16), root=st.sampled_from([1, 2, 4]))
def test_inverse_root_op_agrees_with_torch_linalg_in_float64(n, seed, root):
    a = _psd(n, seed) + 0.1 * torch.eye(n, dtype=torch.float64)  # well conditioned
    out = ops.inverse_root(a, float(root), 1e-12, dtype=torch.float64)
    # (a^(-1/root))^root == a^-1
    got = torch.linalg.matrix_power(out, root)
    assert torch.allclose(got, torch.linalg.inv(a), rtol=1e-8, atol=1e-8)


def test_errors_are_the_matrix_functions():
    a = _psd(4, 0)
    with pytest.raises(ValueError, match="square"):
        ops.eigh_descending(torch.ones(3, 4))
    with pytest.raises(ValueError, match="basis shape"):
        ops.qr_refresh(a, torch.ones(4, 3))
    with pytest.raises(ValueError, match="root must be > 0"):
        ops.inverse_root(a, 0.0)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        ops.inverse_root(a, 2.0, epsilon=0.0)
    bad = a.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(MatrixFunctionError, match="non-finite"):
        ops.eigh_descending(bad)
    with pytest.raises(MatrixFunctionError, match="non-finite"):
        ops.inverse_root(bad, 2.0)


# ---- fake kernels ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(n, dtype):
    a, basis = _psd(n, n, torch.float64), _basis(n, n, torch.float64)
    torch.library.opcheck(torch.ops.asteria.eigh_descending.default, (a, dtype))
    for sort in (True, False):
        torch.library.opcheck(torch.ops.asteria.qr_refresh.default, (a, basis, sort, dtype))
    torch.library.opcheck(torch.ops.asteria.inverse_root.default, (a, 4.0, 1e-12, dtype))
    each = torch.ops.asteria.qr_refresh_each.default  # a shape group's refreshes, on the CPU
    for sort in (True, False):
        torch.library.opcheck(each, ([a, a.T.contiguous()], [basis, basis], sort, dtype))
    # SOAP's installs of 2-D blocks on the CPU: one refreshed dim, then both
    m, v = torch.randn(n, n + 1, dtype=dtype), torch.rand(n, n + 1, dtype=dtype)
    q_l, q_r = _basis(n, n, dtype), _basis(n + 1, n + 1, dtype)
    perm_l, perm_r = torch.randperm(n), torch.randperm(n + 1)
    install = torch.ops.asteria.soap_install_each.default
    torch.library.opcheck(install, ([m], [v], [q_l], [None], [q_l.T], [None], [perm_l], [None]))
    both = ([m], [v], [q_l], [q_r], [q_l.T], [q_r.T], [perm_l], [perm_r])
    torch.library.opcheck(install, both)


@pytest.mark.parametrize("sort", [True, False])
def test_fake_kernels_on_meta_tensors(sort):
    a = torch.empty(6, 6, device="meta")
    evals, evecs = ops.eigh_descending(a, torch.float64)
    assert (evals.shape, evecs.shape, evecs.dtype) == ((6,), (6, 6), torch.float64)
    assert evecs.stride() == (1, 6)  # column-major, as LAPACK returns it
    q, perm = ops.qr_refresh(a, a, sort=sort)
    assert q.shape == (6, 6) and q.stride() == (1, 6)
    assert (perm.shape == (6,) and perm.dtype == torch.long) if sort else perm is None
    assert ops.inverse_root(a, 2.0).shape == (6, 6)
    with pytest.raises(ValueError, match="square"):
        ops.eigh_descending(torch.empty(2, 3, device="meta"))


# ---- torch.compile --------------------------------------------------------------------------


def _refresh_all(factor: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    evals, evecs = ops.eigh_descending(factor, torch.float64)
    q, perm = ops.qr_refresh(factor, evecs, sort=True, dtype=torch.float64)
    root = ops.inverse_root(factor, 4.0, 1e-12, dtype=torch.float64)
    return evals * 2, root @ (q.T @ grad), perm + 1


def _graph_recorder(graphs: list[torch.fx.GraphModule]):
    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def test_compiled_fullgraph_records_the_ops_and_matches_eager(fresh_dynamo):
    factor, grad = _psd(12, 3), torch.randn(12, 5, dtype=torch.float64)
    graphs: list[torch.fx.GraphModule] = []
    compiled = torch.compile(_refresh_all, fullgraph=True, backend=_graph_recorder(graphs))
    for got, want in zip(compiled(factor, grad), _refresh_all(factor, grad)):
        assert torch.equal(got, want)
    assert len(graphs) == 1
    called = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    for name in ("eigh_descending", "qr_refresh", "inverse_root"):
        assert any(f"asteria.{name}" in target for target in called), called


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fullgraph_matches_eager(backend, fresh_dynamo):
    factor, grad = _psd(12, 4), torch.randn(12, 5, dtype=torch.float64)
    compiled = torch.compile(_refresh_all, fullgraph=True, backend=backend)
    got, want = compiled(factor, grad), _refresh_all(factor, grad)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    # inductor may order the small products' sums differently: a few ulps of the result
    tol = 0 if backend == "aot_eager" else 64 * torch.finfo(torch.float64).eps
    assert torch.allclose(got[1], want[1], rtol=tol, atol=tol * float(want[1].abs().max()))


def test_compiled_with_dynamic_shapes_takes_every_size(fresh_dynamo):
    compiled = torch.compile(_refresh_all, fullgraph=True, backend="aot_eager", dynamic=True)
    for n in (5, 9, 16):
        factor, grad = _psd(n, n), torch.randn(n, 3, dtype=torch.float64)
        for got, want in zip(compiled(factor, grad), _refresh_all(factor, grad)):
            assert torch.equal(got, want)


def test_bad_arguments_fail_while_tracing(fresh_dynamo):
    """The fake kernel refuses what the real one refuses; dynamo reports it as the trace's
    error (a TorchRuntimeError, a RuntimeError) quoting the ValueError's message."""
    compiled = torch.compile(lambda f, b: ops.qr_refresh(f, b)[0], fullgraph=True)
    with pytest.raises(RuntimeError, match=r"ValueError\('basis shape \(4, 3\) != factor shape"):
        compiled(_psd(4, 0), torch.ones(4, 3))
