"""Overflow is caught where it happens (issue 22, item 3; Note [Overflowing gradients] in
asteria/optim/base.py), and the smaller holes of item 4 are closed.

Finite gradients that would make a factor or a moment inf are skipped like non-finite ones (the
parameter's state and value untouched, counted, warned once with its name) and never reach a
matrix function; a refresh that still fails names its block. Attaching a refresher that is not
the optimizer's own, or a second runtime, is refused before any thread starts; the matrix
functions refuse complex and non-square matrices; closed objects raise their own closed error."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from asteria.memory.nvme import SpillClosedError, SpillStore
from asteria.optim import SOAP, Shampoo
from asteria.optim import matrix_functions as mf
from asteria.runtime import RefreshFailedError, Runtime, RuntimeConfig
from tests.faults import (
    OPTIMIZERS,
    model,
    picture,
    same,
    threads,
    threads_back_to,
    train,
    two_groups,
)


def _orchestrated(net, opt, runtime):
    # no module hooks: they may install a finished refresh between steps, skipped or not
    config = RuntimeConfig(staleness=2, workers=1, hooks=False)
    return Runtime(net, opt, config) if runtime else None


@pytest.mark.parametrize("runtime", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_gradients_of_1e30_are_skipped_with_a_warning_naming_the_parameter(name, runtime):
    """Gradients of 1e30 are finite: they made the factors and second moments inf (native mode:
    a MatrixFunctionError naming nothing; with a runtime: RefreshFailedError ~8 steps later;
    KL-Shampoo's parameters jumped to ~3e25)."""
    net = model()
    opt = two_groups(net, name)
    rt = _orchestrated(net, opt, runtime)
    train(net, opt, 3)
    opt.refresher.sync()  # the statistics lane's last updates are in
    before = picture(opt, rt)
    with pytest.warns(
        RuntimeWarning, match=r"parameter '(0.weight|param0)'.*so large.*overflow"
    ) as seen:
        train(net, opt, 4, scale=1e30)
    assert len([w for w in seen if "so large" in str(w.message)]) == 1  # warned once
    assert opt.nonfinite_grads == 4 * 4  # every parameter, every step: skipped and counted
    opt.refresher.sync()
    after = picture(opt, rt)
    assert same(before["params"], after["params"]) and same(before["state"], after["state"])
    train(net, opt, 4)  # ordinary gradients again: the run goes on
    assert all(torch.isfinite(p).all() for p in net.parameters())
    if rt is not None:
        rt.close()
        assert rt.stats()["nonfinite_grads"] == opt.nonfinite_grads
        assert rt.stats()["jobs"]["failed"] == 0


def test_gradients_below_the_limit_are_used():
    """The limit is the overflow's, not a clip: large gradients that fit are applied."""
    net = model()
    opt = two_groups(net, "soap")
    train(net, opt, 3, scale=1e15)
    assert opt.nonfinite_grads == 0
    assert all(torch.isfinite(s).all() for st in opt.state.values() for s in _tensors(st))


def _tensors(state):
    for v in state.values() if isinstance(state, dict) else state:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (dict, list)):
            yield from _tensors(v)


@pytest.mark.parametrize("grafting", ["adam", "adagrad"])
def test_shampoo_sums_are_stopped_before_they_reach_inf(grafting):
    """At ``betas[1] == 1`` Shampoo's factors are sums (Adagrad grafting too): gradients each
    far below the limit of one step creep the sums up to float32's largest value."""
    p = torch.nn.Parameter(torch.ones(4, 3))
    opt = Shampoo([p], lr=1e-3, betas=(0.9, 1.0), grafting=grafting, precondition_frequency=100)
    big = 6e18  # ||g||^2 ~ 4e38 / 12 ... a handful of steps fill float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(12):
            p.grad = torch.full_like(p, big / 4)
            opt.step()
    assert opt.nonfinite_grads > 0
    state = opt.state[p]
    assert all(torch.isfinite(t).all() for t in _tensors(state))


def test_a_non_finite_factor_from_a_checkpoint_is_a_failure_that_names_its_block():
    net = model()
    opt = two_groups(net, "shampoo")
    opt.max_consecutive_failures = 1
    train(net, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    key = next(k for k in saved["state"][2] if "factors.0" in k)
    saved["state"][2][key][0, 0] = float("inf")
    opt.load_state_dict(saved)
    with pytest.raises(RefreshFailedError, match=r"block '2.weight\[0\]'|block 'param2\[0\]'"):
        train(net, opt, 2)


# -- item 4: the smaller holes --------------------------------------------------------------------


def test_a_runtime_of_another_optimizer_is_refused_and_nothing_changes():
    """``o2.attach_refresher(runtime_of_o1)`` was accepted, failed later with shape errors, and
    ``o2`` kept pointing at the closed runtime."""
    net1, net2 = model(), model()
    o1, o2 = two_groups(net1, "soap"), two_groups(net2, "soap")
    rt = Runtime(net1, o1, RuntimeConfig(staleness=1, workers=1))
    with pytest.raises(ValueError, match="bound to another optimizer"):
        o2.attach_refresher(rt)
    assert type(o2.refresher).__name__ == "NativeRefresher"
    rt.close()
    with pytest.raises(ValueError, match="is closed|bound to another"):
        o2.attach_refresher(rt)
    train(net2, o2, 2)


def test_a_second_runtime_is_refused_before_any_thread_starts():
    net = model()
    opt = two_groups(net, "kl_shampoo")
    with Runtime(net, opt, RuntimeConfig(staleness=1, workers=1)):
        baseline = threads()
        for _ in range(3):
            with pytest.raises(ValueError, match="already orchestrated"):
                Runtime(net, opt, RuntimeConfig(staleness=1, workers=2, statistics_lane=True))
            assert threads() == baseline  # the refused runtime started none
        train(net, opt, 2)


def test_a_refused_resumed_state_starts_no_thread():
    """A checkpoint's refreshes in flight that do not fit are refused by the runtime that
    attaches, before its pool starts."""
    net = model()
    opt = two_groups(net, "soap")
    with Runtime(net, opt, RuntimeConfig(staleness=3, fixed_delay=3, workers=1)):
        train(net, opt, 5)
        saved = opt.state_dict()
    assert saved["asteria_runtime"]["pending"]
    fresh_net = model()
    fresh = two_groups(fresh_net, "soap")
    fresh.load_state_dict(saved)
    baseline = threads()
    with pytest.raises(ValueError, match="within the budget 1"):
        Runtime(fresh_net, fresh, RuntimeConfig(staleness=1, workers=2))  # a smaller budget
    assert threads_back_to(baseline, timeout_s=0.5)
    with Runtime(fresh_net, fresh, RuntimeConfig(staleness=3, fixed_delay=3, workers=1)) as rt:
        train(fresh_net, fresh, 3)
    assert rt.stats()["basis_age"]["within_bound"]


@pytest.mark.parametrize(
    "fn",
    [
        lambda a: mf.eigh_descending(a, torch.float32),
        lambda a: mf.qr_refresh(a, torch.eye(a.shape[0]), sort=True),
        lambda a: mf.inverse_root(a, 2, 1e-6),
    ],
    ids=["eigh", "qr", "inverse_root"],
)
def test_matrix_functions_refuse_complex_and_non_square_matrices(fn):
    hermitian = torch.tensor([[2.0, 1j], [-1j, 2.0]], dtype=torch.complex64)
    with pytest.raises(ValueError, match="complex"):
        fn(hermitian)
    with pytest.raises(ValueError, match="square"):
        fn(torch.ones(2, 3))


def test_the_pool_path_refuses_complex_factors():
    """``submit_eigh`` took a complex Hermitian matrix, dropped its imaginary part (only torch's
    warning) and returned the wrong eigenvalues: the runtime's submissions refuse it."""
    from asteria._C import WorkerPool
    from asteria.optim.refresher import QRRefresh
    from asteria.runtime.placement import Executors, Submission

    pool = WorkerPool(workers=1, lapack_threads=1)
    try:
        hermitian = torch.tensor([[2.0, 1j], [-1j, 2.0]], dtype=torch.complex64)
        job = QRRefresh(hermitian, torch.eye(2), sort=True)
        executors = Executors(pool, None, 1, 1, TimeoutError)
        (future,) = executors.submit_many([Submission(job, "b.dim0", 0, 1)])
        with pytest.raises(ValueError, match="complex"):
            future.result(timeout_s=5)
        assert pool.stats()["submitted"] == 0
    finally:
        pool.shutdown()


def test_the_public_pool_refuses_complex_factors():
    """The same through asteria.lowlevel's WorkerPool (a non-square one fails its job, with a
    ValueError naming block and version, as before)."""
    from asteria.lowlevel import WorkerPool

    pool = WorkerPool(workers=1)
    try:
        hermitian = torch.tensor([[2.0, 1j], [-1j, 2.0]], dtype=torch.complex64)
        with pytest.raises(ValueError, match="block 'h' \\(version 4\\).*complex"):
            pool.submit_eigh("h", hermitian, version=4)
        with pytest.raises(ValueError, match="complex"):
            pool.submit_inverse_root("h", hermitian, 2)
        with pytest.raises(ValueError, match="complex"):
            pool.submit_qr_refresh("h", torch.eye(2), hermitian)
    finally:
        pool.shutdown()


def test_closed_objects_raise_their_own_closed_error(tmp_path):
    store = SpillStore(str(tmp_path), capacity_bytes=1 << 20)
    store.put("a", torch.ones(3)).result()
    store.close()
    for use in (lambda: store.get("a"), lambda: store.prefetch(["a"]), lambda: store.nbytes("a")):
        with pytest.raises(SpillClosedError, match="is closed"):
            use()  # was KeyError "not in the spill store"
    from asteria._C import WorkerPool

    pool = WorkerPool(workers=1, lapack_threads=1)
    pool.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit_eigh("b", 0, 1, torch.eye(2), torch.float32)
    net = model()
    opt = SOAP(net.parameters())
    rt = Runtime(net, opt, RuntimeConfig(staleness=1, workers=1))
    rt.close()
    with pytest.raises(RuntimeError, match="closed"):
        rt.begin()
    with pytest.raises(ValueError, match="closed|bound"):
        opt.attach_refresher(rt)
    with pytest.raises(RuntimeError, match="is closed"):
        rt.load_state_dict({"format": 1, "pending": []})


@pytest.mark.parametrize("name", ["soap", "kl_shampoo"])
def test_a_failed_first_eigenbasis_names_the_parameter(name, monkeypatch):
    import asteria.optim.kl_shampoo as kl_module
    import asteria.optim.soap as soap_module

    def failing(factor, dtype):
        raise mf.MatrixFunctionError("eigh: injected")

    module = soap_module if name == "soap" else kl_module
    monkeypatch.setattr(module.mf, "eigh_descending", failing)
    net = model()
    opt = two_groups(net, name)
    with pytest.raises(mf.MatrixFunctionError, match=r"parameter 'param0' .*injected"):
        train(net, opt, 1)
    monkeypatch.undo()
    train(net, opt, 2)  # the parameter starts again at its next step
    assert opt.state[net[0].weight]["step"] >= 1
