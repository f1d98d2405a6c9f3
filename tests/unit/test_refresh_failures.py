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
