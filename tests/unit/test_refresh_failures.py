"""Failed refreshes in native mode (Note [Refresh failures] in asteria/optim/refresher.py), and
the same failures under ``asteria.Runtime``: the previous bases or roots stay, failures are
counted per block, ``RefreshFailedError`` comes after ``max_consecutive_failures`` in a row, and
the step that raises is applied whole.

A factor entry set to NaN makes every later refresh of its block fail (in its dtype and again in
float64), while the updates, which read the bases or roots and not the factors, go on.
"""

from __future__ import annotations

import pytest
import torch

from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.runtime import RefreshFailedError, Runtime, RuntimeConfig
from tests.problems import StochasticQuartic

OPTIMIZERS = {
    "soap": lambda ps: SOAP(ps, lr=3e-3, precondition_frequency=2),
    "kl_shampoo": lambda ps: KLShampoo(ps, lr=3e-3, precondition_frequency=2),
    "shampoo": lambda ps: Shampoo(ps, lr=3e-3, precondition_frequency=2),
}
SHAPES = [(6, 5), (4, 3, 2), (7, 6)]
POISON_AT = 4  # after this many steps (two refreshes done), block 0 of parameter 0 is poisoned


def _step(opt, params, problem, t):
    opt.zero_grad()
    problem.loss(params, t).backward()
    opt.step()


def _poison(opt, params):
    block = opt.state[params[0]]["blocks"][0]
    block["factors"][0][0, 0] = float("nan")
    return block


def _refreshed(block, field):
    return [None if x is None else x.clone() for x in block[field]]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_native_failures_keep_count_and_raise_after_the_whole_step(name):
    problem = StochasticQuartic(SHAPES, 20, torch.float32)
    params, twin_params = problem.params(), problem.params()
    opt, twin = OPTIMIZERS[name](params), OPTIMIZERS[name](twin_params)
    opt.max_consecutive_failures = 3
    twin.max_consecutive_failures = 10**6  # the same failures, never raised
    for t in range(POISON_AT):
        _step(opt, params, problem, t)
        _step(twin, twin_params, problem, t)
    block, _ = _poison(opt, params), _poison(twin, twin_params)
    field = opt.bases_field
    kept = _refreshed(block, field)
    t = POISON_AT
    raised_at = None
    while t < 20:
        before = [p.detach().clone() for p in params]
        try:
            _step(opt, params, problem, t)
        except RefreshFailedError as err:
            assert "param0[0]" in str(err) and "3 times in a row" in str(err)
            raised_at = t
        _step(twin, twin_params, problem, t)
        # the step (also the one that raised) is applied whole, as without the raise
        assert all(torch.equal(a, b) for a, b in zip(params, twin_params))
        assert all(not torch.equal(a, b) for a, b in zip(params, before)), "every param moved"
        if raised_at is not None:
            break
        t += 1
    assert raised_at is not None, "three failures in a row must raise"
    assert opt.refresher.failures[(0, 0)] == 3 and opt.refresher.failed == 3
    assert all(
        (a is None and b is None) or torch.equal(a, b) for a, b in zip(block[field], kept)
    ), "the failed block keeps its previous bases / roots"
    steps = {opt.state[p]["step"] for p in params}
    assert len(steps) == 1, "every parameter counted the step that raised"
    # the other blocks refreshed as usual
    assert (0, 1) not in opt.refresher.failures and (1, 0) not in opt.refresher.failures


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_success_resets_the_count(name):
    problem = StochasticQuartic(SHAPES, 12, torch.float32)
    params = problem.params()
    opt = OPTIMIZERS[name](params)
    for t in range(POISON_AT):
        _step(opt, params, problem, t)
    block = _poison(opt, params)
    clean = block["factors"][0].clone()
    clean[0, 0] = 1.0
    t = POISON_AT
    while opt.refresher.failed < 2:
        _step(opt, params, problem, t)
        t += 1
    assert opt.refresher.failures[(0, 0)] == 2
    block["factors"][0].copy_(clean @ clean.T / clean.shape[1])  # finite again: PSD
    while (0, 0) in opt.refresher.failures:
        _step(opt, params, problem, t)
        t += 1
    assert opt.refresher.failed == 2 and all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_native_and_runtime_fail_alike(name):
    """With S = 0 the runtime keeps the same previous versions (bitwise the same parameters up
    to the raise) and raises at the same step (the runtime raises inside the step)."""
    problem = StochasticQuartic(SHAPES, 20, torch.float32)

    def run(orchestrate: bool):
        params = problem.params()
        opt = OPTIMIZERS[name](params)
        opt.max_consecutive_failures = 2
        rt = None
        if orchestrate:
            config = RuntimeConfig(staleness=0, workers=1, max_consecutive_failures=2)
            rt = Runtime(None, opt, config)
        history = []
        try:
            for t in range(20):
                if t == POISON_AT:
                    if rt is not None:
                        rt.sync()
                    _poison(opt, params)
                try:
                    _step(opt, params, problem, t)
                except RefreshFailedError:
                    return history, t
                history.append([p.detach().clone() for p in params])
        finally:
            if rt is not None:
                rt.close()
        return history, None

    native, native_raised = run(False)
    orchestrated, orchestrated_raised = run(True)
    assert native_raised is not None and native_raised == orchestrated_raised
    for a, b in zip(native, orchestrated):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


class _DeviceSolverFault:
    """Stands in for a device solver's failure (cuSOLVER reports a ``RuntimeError`` that is not
    a ``LinAlgError``; an out-of-memory error is a ``torch.OutOfMemoryError``) on every batched
    factorization and on the single ones of matrices of order ``order``."""

    def __init__(self, monkeypatch, order: int, error: Exception) -> None:
        from asteria.optim import matrix_functions as mf

        self.calls = 0
        real_eigh, real_q = torch.linalg.eigh, mf._qr_q

        def fail(*args, **kwargs):
            self.calls += 1
            raise error

        def eigh(a, *args, **kwargs):
            if a.shape[-1] == order:
                return fail()
            return real_eigh(a, *args, **kwargs)

        def qr_q(a):
            if a.shape[-1] == order:
                return fail()
            return real_q(a)

        monkeypatch.setattr(mf, "eigh_each", fail)
        monkeypatch.setattr(mf, "qr_each", fail)
        monkeypatch.setattr(mf, "qr_refresh_each", fail)  # the CPU's one op for a group
        monkeypatch.setattr(torch.linalg, "eigh", eigh)
        monkeypatch.setattr(mf, "_qr_q", qr_q)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    "error",
    [RuntimeError("cusolver error: CUSOLVER_STATUS_EXECUTION_FAILED"), torch.OutOfMemoryError()],
    ids=["cusolver", "oom"],
)
def test_a_device_solver_failure_is_a_counted_failure_and_drops_no_other_refresh(
    name, error, monkeypatch
):
    """Issue 50 item 6: a device solver's error or an out-of-memory error inside a batched
    native refresh is handled like LAPACK's (Note [Refresh failures]): the blocks it hit keep
    their previous bases or roots and are counted, the step's other due refreshes run alone and
    are installed as without the fault, and nothing escapes ``step()``."""
    shapes = [(6, 5), (6, 5), (7, 9)]  # two of one shape: a batched group
    problem = StochasticQuartic(shapes, 8, torch.float32)
    params, twin_params = problem.params(), problem.params()
    opt, twin = OPTIMIZERS[name](params), OPTIMIZERS[name](twin_params)
    for t in range(POISON_AT):
        _step(opt, params, problem, t)
        _step(twin, twin_params, problem, t)
    field = opt.bases_field
    before = [_refreshed(opt.state[p]["blocks"][0], field) for p in params]
    order = opt.state[params[2]]["blocks"][0]["factors"][0].shape[0]  # 7 (Shampoo merges: 63)
    fault = _DeviceSolverFault(monkeypatch, order=order, error=error)
    for t in (POISON_AT, POISON_AT + 1):  # one of them a refresh step (frequency 2)
        _step(opt, params, problem, t)
    monkeypatch.undo()
    for t in (POISON_AT, POISON_AT + 1):
        _step(twin, twin_params, problem, t)
    assert fault.calls > 0
    after = [opt.state[p]["blocks"][0][field] for p in params]
    twin_after = [twin.state[p]["blocks"][0][field] for p in twin_params]
    # the (7, 9) block's first factor failed: kept, and counted
    assert opt.refresher.failures.get((2, 0), 0) >= 1
    assert before[2][0] is None or torch.equal(after[2][0], before[2][0])
    # its other dim and the other blocks refreshed as without the fault
    for i in (0, 1):
        for got, want in zip(after[i], twin_after[i]):
            assert (got is None and want is None) or torch.equal(got, want)
    assert (0, 0) not in opt.refresher.failures and (1, 0) not in opt.refresher.failures


def test_a_bug_inside_a_refresh_is_not_taken_for_a_solver_failure(monkeypatch):
    """Only solver failures are counted: any other error (a bug, a bad argument) propagates."""
    from asteria.optim import matrix_functions as mf

    assert mf.solver_failed(torch.linalg.LinAlgError("syevd failed"))
    assert mf.solver_failed(torch.OutOfMemoryError("CUDA out of memory"))
    assert mf.solver_failed(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublas"))
    assert not mf.solver_failed(RuntimeError("shape mismatch"))
    assert not mf.solver_failed(ValueError("cusolver"))

    def broken(*args, **kwargs):
        raise RuntimeError("an index out of range")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    with pytest.raises(RuntimeError, match="index out of range"):
        mf.inverse_root(torch.eye(3), 4.0)
