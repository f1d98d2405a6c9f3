"""The ``torch.optim`` conventions, for each of the three optimizers (parametrized, not copied).

Param groups, ``state_dict`` round trips, LR schedulers, ``zero_grad``, parameters without
gradients, fp32 state for low-precision parameters, blocking of large dims, bad input.
"""

from __future__ import annotations

import copy

import pytest
import torch

from asteria.optim import SOAP, KLShampoo, Shampoo
from tests.problems import StochasticQuartic, assert_state_equal, max_rel_diff, state_tensors

OPTIMIZERS = {
    "soap": (SOAP, dict(lr=3e-3, precondition_frequency=3)),
    "kl_shampoo": (KLShampoo, dict(lr=3e-3, precondition_frequency=3)),
    "shampoo": (Shampoo, dict(lr=3e-3, precondition_frequency=3)),
}
SHAPES = [(6, 5), (4,), (3, 4, 2), (1, 7)]


@pytest.fixture(params=sorted(OPTIMIZERS))
def optimizer(request):
    cls, kw = OPTIMIZERS[request.param]
    return lambda params, **extra: cls(params, **{**kw, **extra})


def _train(opt, params, problem, steps, start=0):
    for t in range(start, start + steps):
        opt.zero_grad()
        problem.loss(params, t).backward()
        opt.step()


def test_state_dict_round_trip_is_exact(optimizer):
    problem = StochasticQuartic(SHAPES, 20, torch.float32)
    params = problem.params()
    opt = optimizer(params)
    _train(opt, params, problem, 10)

    saved = copy.deepcopy(opt.state_dict())
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = optimizer(params2, lr=1.0)  # hyperparameters come from the state_dict
    opt2.load_state_dict(saved)
    assert_state_equal(opt.state_dict(), opt2.state_dict())

    _train(opt, params, problem, 10, start=10)
    _train(opt2, params2, problem, 10, start=10)
    for a, b in zip(params, params2):
        assert torch.equal(a, b)


class _Net(torch.nn.Module):
    """The quartic problem's parameters as a module (the torch state-dict API takes one)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(params)


def test_torch_distributed_state_dict_api_round_trips(optimizer):
    """``get_optimizer_state_dict`` keys the state by parameter name and probes a fresh optimizer
    with a zero-gradient, ``lr=0`` step first (Note [State-initialisation probe] in
    optim/base.py): the probe changes nothing, and the name-keyed state loads back exactly."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    problem = StochasticQuartic(SHAPES, 20, torch.float32)
    plain = problem.params()
    probed = [torch.nn.Parameter(p.detach().clone()) for p in plain]
    opt_plain, opt_probed = optimizer(plain), optimizer(probed)
    net = _Net(probed)
    assert get_optimizer_state_dict(net, opt_probed)["state"] == {}  # the probe made no state
    assert opt_probed.param_groups[0]["lr"] == opt_plain.param_groups[0]["lr"]
    _train(opt_plain, plain, problem, 8)
    _train(opt_probed, probed, problem, 8)
    assert all(torch.equal(a, b) for a, b in zip(plain, probed))

    saved = copy.deepcopy(get_optimizer_state_dict(net, opt_probed))
    assert set(saved["state"]) == {f"ps.{i}" for i in range(len(SHAPES))}  # keyed by name
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in probed]
    opt2 = optimizer(params2)
    set_optimizer_state_dict(_Net(params2), opt2, saved)
    assert_state_equal(opt_probed.state_dict(), opt2.state_dict())
    _train(opt_probed, probed, problem, 8, start=8)
    _train(opt2, params2, problem, 8, start=8)
    assert all(torch.equal(a, b) for a, b in zip(probed, params2))


def test_low_precision_params_keep_fp32_state(optimizer):
    problem = StochasticQuartic([(6, 5), (5,)], 12, torch.float32)
    params = [torch.nn.Parameter(p.to(torch.bfloat16)) for p in problem.init]
    opt = optimizer(params, lr=1e-2)
    with torch.no_grad():
        first = float(problem.loss([p.float() for p in params], 0))
    for t in range(12):
        opt.zero_grad()
        problem.loss([p.float() for p in params], t).backward()
        opt.step()
    assert all(p.dtype == torch.bfloat16 for p in params)
    floats = [v for s in opt.state.values() for v in state_tensors(s) if v.is_floating_point()]
    assert floats and all(v.dtype == torch.float32 for v in floats)
    # The state_dict keeps fp32 state even though torch would cast it to the parameter dtype.
    opt2 = optimizer([torch.nn.Parameter(p.detach().clone()) for p in params])
    opt2.load_state_dict(opt.state_dict())
    assert all(
        v.dtype == torch.float32
        for s in opt2.state.values()
        for v in state_tensors(s)
        if v.is_floating_point()
    )
    with torch.no_grad():
        assert float(problem.loss([p.float() for p in params], 0)) < first


def test_param_groups_and_frozen_and_gradless_params(optimizer):
    problem = StochasticQuartic([(5, 4), (4, 3), (3,)], 6, torch.float64)
    a, b, c = problem.params()
    opt = optimizer([{"params": [a]}, {"params": [b], "lr": 0.0, "weight_decay": 0.0}])
    before_b = b.detach().clone()
    c_before = c.detach().clone()
    _train(opt, [a, b, c], problem, 6)
    assert torch.equal(b, before_b), "a group with lr=0 must not move"
    assert not torch.equal(a, problem.init[0])
    # ``c`` is not in the optimizer: untouched and stateless.
    assert torch.equal(c, c_before) and c not in opt.state
    # A parameter whose grad is None is skipped, even after it had state.
    a.grad = None
    a_before = a.detach().clone()
    opt.step()
    assert torch.equal(a, a_before)


def test_lr_scheduler_drives_the_step(optimizer):
    problem = StochasticQuartic([(5, 4)], 8, torch.float64)
    (p,) = params = problem.params()
    opt = optimizer(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch < 4 else 0.0)
    for t in range(8):
        opt.zero_grad()
        problem.loss(params, t).backward()
        if t == 4:
            frozen = p.detach().clone()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.0
    assert torch.equal(p, frozen), "lr 0 from the scheduler must stop the updates"


def test_zero_grad_and_closure(optimizer):
    problem = StochasticQuartic([(4, 3)], 2, torch.float64)
    params = problem.params()
    opt = optimizer(params)

    def closure():
        opt.zero_grad()
        loss = problem.loss(params, 0)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.ndim == 0
    opt.zero_grad(set_to_none=True)
    assert params[0].grad is None


def test_blocked_preconditioner_equals_per_block_optimizers(optimizer):
    """A (10, 7) matrix with max_preconditioner_dim=4 is the 3x2 grid of its blocks."""
    problem = StochasticQuartic([(10, 7)], 25, torch.float64)
    blocked = problem.run(lambda ps: optimizer(ps, max_preconditioner_dim=4))[0]

    rows, cols = [slice(0, 4), slice(4, 8), slice(8, 10)], [slice(0, 4), slice(4, 7)]
    pieces = [problem.init[0][r, c].clone() for r in rows for c in cols]
    params = [torch.nn.Parameter(x) for x in pieces]
    opt = optimizer(params, max_preconditioner_dim=4)
    for t in range(25):
        full = torch.cat([torch.cat(params[i * 2 : (i + 1) * 2], dim=1) for i in range(3)], dim=0)
        grad = problem.grads([full], t)[0]
        for p, (r, c) in zip(params, [(r, c) for r in rows for c in cols]):
            p.grad = grad[r, c].clone()
        opt.step()
    assembled = torch.cat([torch.cat(params[i * 2 : (i + 1) * 2], dim=1) for i in range(3)], dim=0)
    assert max_rel_diff([blocked], [assembled.detach()]) < 1e-12
    assert max_rel_diff([blocked], [problem.init[0]]) > 1e-3


def test_is_refresh_step_follows_the_schedule():
    problem = StochasticQuartic([(5, 4)], 12, torch.float64)
    params = problem.params()
    opt = SOAP(params, precondition_frequency=4)
    flags = []
    for t in range(12):
        flags.append(opt.is_refresh_step())
        opt.zero_grad()
        problem.loss(params, t).backward()
        opt.step()
    # Step 0 initialises (eigh); then steps t=1.. refresh when t % 4 == 0 (calls 4 and 8).
    assert flags == [
        True,
        False,
        False,
        False,
        True,
        False,
        False,
        False,
        True,
        False,
        False,
        False,
    ]


BAD_ARGUMENTS = [
    ("lr", -1.0),
    ("lr", float("nan")),
    ("betas", (1.0, 0.9)),
    ("betas", (0.9, -0.1)),
    ("betas", 0.9),
    ("eps", -1e-8),
    ("weight_decay", -0.1),
    ("precondition_frequency", 0),
    ("precondition_frequency", 2.5),
    ("max_preconditioner_dim", 0),
]


@pytest.mark.parametrize("name,value", BAD_ARGUMENTS, ids=[f"{n}={v}" for n, v in BAD_ARGUMENTS])
def test_bad_arguments_name_the_argument(optimizer, name, value):
    with pytest.raises(ValueError, match=name.split("[")[0]):
        optimizer([torch.nn.Parameter(torch.zeros(3, 3))], **{name: value})


@pytest.mark.parametrize(
    "cls,name,value",
    [
        (Shampoo, "grafting", "adamw"),
        (Shampoo, "epsilon", 0.0),
        (Shampoo, "momentum", 1.0),
        (Shampoo, "start_preconditioning_step", 0),
        (SOAP, "shampoo_beta", 1.5),
        (SOAP, "merge_dims", "yes"),
        (SOAP, "refresh_dtype", torch.float16),
        (KLShampoo, "init_factor", 0.0),
        (KLShampoo, "max_clamp_value", -1.0),
    ],
)
def test_algorithm_specific_bad_arguments(cls, name, value):
    with pytest.raises(ValueError, match=name):
        cls([torch.nn.Parameter(torch.zeros(3, 3))], **{name: value})


def test_bad_groups_are_checked_too(optimizer):
    with pytest.raises(ValueError, match="lr"):
        optimizer([{"params": [torch.nn.Parameter(torch.zeros(2, 2))], "lr": -1.0}])


def test_sparse_complex_and_integer_are_refused(optimizer):
    with pytest.raises(RuntimeError, match="complex"):
        optimizer([torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64))])
    with pytest.raises(RuntimeError, match="floating-point"):
        optimizer([torch.zeros(2, 2, dtype=torch.int64)])
    p = torch.nn.Parameter(torch.zeros(4, 3))
    opt = optimizer([p])
    p.grad = torch.zeros(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_zero_size_and_scalar_parameters(optimizer):
    empty = torch.nn.Parameter(torch.zeros(0, 3))
    scalar = torch.nn.Parameter(torch.tensor(2.0))
    opt = optimizer([empty, scalar], lr=1e-1)
    for _ in range(4):
        opt.zero_grad()
        ((scalar - 1) ** 2 + empty.sum()).backward()
        opt.step()
    assert float(scalar) < 2.0 and empty.shape == (0, 3)
