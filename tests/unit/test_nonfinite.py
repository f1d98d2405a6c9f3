"""Non-finite gradients (Note [Non-finite gradients] in asteria/optim/overflow.py).

A parameter whose gradient has a NaN or an Inf is skipped for that step as a whole (step count,
factors, moments, the parameter), counted and warned about once; everything else is bitwise what
it would have been. The objective of ``StochasticQuartic`` is separable per parameter, so a skip
of one parameter must not change any other parameter's trajectory.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.optim.overflow import finite_flags
from asteria.runtime import Runtime, RuntimeConfig
from tests.problems import StochasticQuartic, state_tensors

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}
SHAPES = [(6, 5), (4, 3, 2), (7,)]
STEPS = 24


def _run(opt, params, problem, poison=None, skip=None, steps=STEPS):
    """Train; ``poison[t]`` = indices of params whose grad gets a NaN/Inf at step ``t``;
    ``skip[t]`` = indices of params whose grad is set to None at step ``t`` (the reference for
    a skipped update)."""
    poison, skip = poison or {}, skip or {}
    for t in range(steps):
        opt.zero_grad()
        problem.loss(params, t).backward()
        for i in poison.get(t, ()):
            g = params[i].grad
            g.view(-1)[0] = float("nan") if i % 2 == 0 else float("inf")
        for i in skip.get(t, ()):
            params[i].grad = None
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_poisoned_step_is_skipped_for_that_parameter_only(name):
    cls = OPTIMIZERS[name]
    problem = StochasticQuartic(SHAPES, STEPS, torch.float32)

    clean_params = problem.params()
    clean = _run(cls(clean_params, precondition_frequency=3), clean_params, problem)

    ref_params = problem.params()
    ref_opt = cls(ref_params, precondition_frequency=3)
    ref = _run(ref_opt, ref_params, problem, skip={0: [1], 7: [0], 8: [0, 1, 2]})

    params = problem.params()
    opt = cls(params, precondition_frequency=3)
    with pytest.warns(RuntimeWarning, match=r"'param1' \(index 1, shape \(4, 3, 2\)\).*NaN or Inf"):
        got = _run(opt, params, problem, poison={0: [1], 7: [0], 8: [0, 1, 2]})

    # the skip is exactly "this parameter took no step", the others are untouched by it
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert not torch.equal(got[2], clean[2])  # param 2 was skipped once: it differs...
    assert opt.nonfinite_grads == 1 + 1 + 3
    for p, q in zip(params, ref_params):
        assert torch.isfinite(p).all()
        assert opt.state[p]["step"] == ref_opt.state[q]["step"]
        for v in state_tensors(opt.state[p]):
            assert not v.is_floating_point() or torch.isfinite(v).all()
    # ...and a parameter never poisoned follows the clean trajectory bitwise (separable loss)
    params2 = problem.params()
    opt2 = cls(params2, precondition_frequency=3)
    with pytest.warns(RuntimeWarning):
        got2 = _run(opt2, params2, problem, poison={5: [0]})
    assert torch.equal(got2[1], clean[1]) and torch.equal(got2[2], clean[2])
    assert not torch.equal(got2[0], clean[0])


def test_warns_once_and_counts_every_skip():
    problem = StochasticQuartic([(5, 4)], 10, torch.float32)
    params = problem.params()
    opt = SOAP(params, precondition_frequency=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(opt, params, problem, poison={2: [0], 3: [0], 6: [0]}, steps=10)
    nonfinite = [w for w in caught if "NaN or Inf" in str(w.message)]
    assert len(nonfinite) == 1 and nonfinite[0].category is RuntimeWarning
    assert opt.nonfinite_grads == 3
    assert opt.state[params[0]]["step"] == 10 - 1 - 3  # the first step only initialises


def test_whole_nan_batch_with_a_model_names_the_parameter_and_stays_finite():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = SOAP(model.parameters(), lr=1e-2, precondition_frequency=2)
    with Runtime(model, opt, RuntimeConfig(staleness=2, workers=1)) as rt:
        with pytest.warns(RuntimeWarning, match=r"'0\.weight'"):
            for t in range(20):
                x = torch.randn(16, 6)
                if t == 9:
                    x[3, 2] = float("nan")  # one bad sample poisons every gradient
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
        assert rt.stats()["nonfinite_grads"] == 4
    for p in model.parameters():
        assert torch.isfinite(p).all()
        for v in state_tensors(opt.state[p]):
            assert not v.is_floating_point() or torch.isfinite(v).all()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    "config",
    [RuntimeConfig(staleness=0, workers=1), RuntimeConfig(staleness=3, fixed_delay=2, workers=1)],
    ids=["staleness0", "fixed_delay2"],
)
def test_runtime_modes_skip_like_the_native_step(name, config):
    """staleness 0 equals native mode, fixed_delay equals itself without the poisoned calls."""
    cls = OPTIMIZERS[name]
    problem = StochasticQuartic(SHAPES, STEPS, torch.float32)
    poison = {4: [0, 1, 2], 10: [1], 11: [0]}

    def orchestrated(**run_kw):
        params = problem.params()
        opt = cls(params, precondition_frequency=3)
        with Runtime(None, opt, config) as rt:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                out = _run(opt, params, problem, **run_kw)
            stats = rt.stats()
        return out, stats

    got, stats = orchestrated(poison=poison)
    assert stats["nonfinite_grads"] == 5
    assert all(torch.isfinite(p).all() for p in got)
    reference, _ = orchestrated(skip=poison)
    for a, b in zip(got, reference):
        assert torch.equal(a, b)
    if config.fixed_delay is None:
        native_params = problem.params()
        native = _run(
            cls(native_params, precondition_frequency=3), native_params, problem, skip=poison
        )
        for a, b in zip(got, native):
            assert torch.equal(a, b)
    else:
        assert set(stats["staleness_histogram"]) == {2}


def test_the_check_can_be_turned_off():
    problem = StochasticQuartic([(5, 4)], 4, torch.float32)
    params = problem.params()
    opt = SOAP(params, precondition_frequency=100)  # no refresh: it would raise on the NaN
    opt.skip_nonfinite_grads = False
    _run(opt, params, problem, poison={2: [0]}, steps=4)
    assert opt.nonfinite_grads == 0
    assert not torch.isfinite(params[0]).all(), "without the check the NaN gets in"


def test_finite_flags_cannot_overflow_and_mixes_dtypes():
    big = torch.full((1000,), 3e38)  # a sum would overflow to inf; the inf-norm does not
    grads = [
        big,
        torch.tensor([1.0, math.nan]),
        torch.tensor([-math.inf, 0.0], dtype=torch.bfloat16),
        torch.tensor([6e4, -6e4], dtype=torch.float16),
        torch.tensor(2.0, dtype=torch.float64),
        torch.tensor([math.inf], dtype=torch.float16),
    ]
    assert finite_flags(grads) == [True, False, False, True, True, False]
    assert finite_flags([]) == []


def test_sparse_gradient_is_refused_before_any_parameter_moves():
    a = torch.nn.Parameter(torch.ones(3, 3))
    b = torch.nn.Parameter(torch.ones(4, 3))
    opt = SOAP([a, b])
    a.grad = torch.ones(3, 3)
    b.grad = torch.zeros(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert not opt.state and torch.equal(a, torch.ones(3, 3))
