"""torch.optim's generic conventions, tested as torch tests its own optimizers (issue 23).

Each optimizer has an ``OptimizerInfo`` (``torch.testing._internal.common_optimizers``, which ships
with torch): the configurations to run (``optim_inputs_func``), the inputs that must fail
(torch's own ``get_error_inputs_for_all_optims``, unchanged, and Asteria's), and what it does not
offer (``supported_impls=()``: no foreach / fused / differentiable, no capturable; no complex, no
sparse). The tests are the generic checks of torch's test/test_optim.py (``TestOptimRenewed``),
written again for pytest, and run natively and with a runtime attached (``mode="runtime"``:
``fixed_delay``, so that two runs compare bit for bit) wherever the convention applies; Note
[torch.optim conventions] in asteria/optim/base.py lists them.

Left out, as torch leaves them out for optimizers without them: foreach / fused parity,
capturable, differentiable, complex parity, sparse Rosenbrock, LBFGS' closure types. Loading
across devices needs CUDA (``gpu``). Importing torch's testing internals calls
``torch.backends.disable_global_flags()`` for the whole session; no test here sets those flags.
"""

from __future__ import annotations

import copy
import functools
import io
import pickle

import pytest
import torch
from torch.nn import Parameter
from torch.optim import SGD
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.testing._internal.common_optimizers import (
    ErrorOptimizerInput,
    OptimizerErrorEnum,
    OptimizerInfo,
    OptimizerInput,
    get_error_inputs_for_all_optims,
)

from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.optim.state_io import RUNTIME_STATE_KEY
from asteria.runtime import Runtime, RuntimeConfig
from tests.problems import assert_state_equal

#: The runtime of ``mode="runtime"``: installs at a fixed delay, so runs are reproducible.
RUNTIME_CONFIG = RuntimeConfig(staleness=2, fixed_delay=1, workers=1)

#: torch's implementation flags, and ``maximize``: not offered (LBFGS and Muon do not either).
NOT_OFFERED = ("foreach", "fused", "capturable", "differentiable", "maximize")


def _inputs(specific: list[OptimizerInput]):
    """The configurations of one optimizer: the common ones, then its own (frequent refreshes,
    so that every test crosses a refresh)."""

    def optim_inputs_func(device, dtype=None):
        return [
            OptimizerInput(None, {"lr": 1e-2, "weight_decay": 0.0, "precondition_frequency": 2}),
            OptimizerInput(None, {"lr": 1e-2, "weight_decay": 0.1, "precondition_frequency": 3}),
            OptimizerInput(
                None,
                {"lr": torch.tensor(1e-2), "weight_decay": 0.0, "precondition_frequency": 2},
                desc="Tensor lr",
            ),
            OptimizerInput(
                None,
                {"lr": 1e-2, "weight_decay": 0.0, "max_preconditioner_dim": 4},
                desc="blocked dims",
            ),
            *copy.deepcopy(specific),
        ]

    return optim_inputs_func


def _error_inputs(device, dtype):
    """torch's error inputs for every optimizer, and Asteria's refusals."""
    inputs = get_error_inputs_for_all_optims(device, dtype)
    p = Parameter(torch.randn(3, 2, device=device, dtype=dtype))
    sparse_grad = Parameter(torch.randn(3, 2, device=device, dtype=dtype))
    sparse_grad.grad = torch.randn(3, 2, device=device, dtype=dtype).to_sparse()
    complex_param = Parameter(torch.randn(3, 2, device=device, dtype=torch.complex64))
    sparse_param = Parameter(torch.randn(3, 2, device=device, dtype=dtype).to_sparse())
    construction = OptimizerErrorEnum.CONSTRUCTION_ERROR
    inputs += [
        ErrorOptimizerInput(
            OptimizerInput([complex_param], {}, "complex parameters"),
            error_on=construction,
            error_type=RuntimeError,
            error_regex="does not support complex parameters",
        ),
        ErrorOptimizerInput(
            OptimizerInput([sparse_param], {}, "sparse parameters"),
            error_on=construction,
            error_type=RuntimeError,
            error_regex="does not support sparse parameters",
        ),
        ErrorOptimizerInput(
            OptimizerInput([sparse_grad], {}, "sparse gradients"),
            error_on=OptimizerErrorEnum.STEP_ERROR,
            error_type=RuntimeError,
            error_regex="does not support sparse gradients",
        ),
        ErrorOptimizerInput(
            OptimizerInput([p], {"lr": -1e-3}, "negative lr"),
            error_type=ValueError,
            error_regex=r"lr must be in \[0.0, inf\)",
        ),
        ErrorOptimizerInput(
            OptimizerInput([p], {"lr": torch.tensor(1)}, "integer Tensor lr"),
            error_type=ValueError,
            error_regex="lr must be a number or a floating-point tensor",
        ),
        *(
            ErrorOptimizerInput(
                OptimizerInput([p], {flag: True}, f"{flag} is not offered"),
                error_type=TypeError,
                error_regex=f"unexpected keyword argument '{flag}'",
            )
            for flag in NOT_OFFERED
        ),
    ]
    return inputs


def _info(cls, specific: list[OptimizerInput]) -> OptimizerInfo:
    return OptimizerInfo(
        cls,
        optim_inputs_func=_inputs(specific),
        optim_error_inputs_func=_error_inputs,
        scheduler_inputs=(
            [lambda opt: StepLR(opt, gamma=0.9, step_size=10)],
            [lambda opt: ReduceLROnPlateau(opt)],
            [
                lambda opt: StepLR(opt, gamma=0.9, step_size=10),
                lambda opt: ReduceLROnPlateau(opt),
            ],
        ),
        supported_impls=(),
        not_og_supported_flags=(),
        supports_complex=False,
        supports_fused_on=(),
    )


OPTIM_INFOS = [
    _info(SOAP, [OptimizerInput(None, {"lr": 1e-2, "precondition_1d": True}, "1-D factors")]),
    _info(KLShampoo, [OptimizerInput(None, {"lr": 1e-2, "init_factor": 0.5}, "init_factor")]),
    _info(
        Shampoo,
        # Meta's epsilon 1e-12 on singular statistics (one input vector): the roots' null space
        # is round-off, which Note [Round-off floor] keeps out of the direction
        [
            OptimizerInput(None, {"lr": 1e-2, "grafting": "sgd"}, "SGD grafting"),
            OptimizerInput(None, {"lr": 1e-2, "grafting": "rmsprop"}, "RMSprop grafting"),
            OptimizerInput(None, {"lr": 1e-2, "grafting": "none"}, "no grafting"),
        ],
    ),
]


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # as torch's TestCase seeds each test


@pytest.fixture(params=OPTIM_INFOS, ids=lambda info: info.name)
def optim_info(request) -> OptimizerInfo:
    return request.param


@pytest.fixture(params=["native", "runtime"])
def mode(request) -> str:
    return request.param


@pytest.fixture
def make(optim_info, mode):
    """``make(params, **kwargs)``: the optimizer under test, with a runtime attached in runtime
    mode (closed at teardown)."""
    runtimes: list[Runtime] = []

    def make_optimizer(params, **kwargs):
        opt = optim_info.optim_cls(params, **kwargs)
        if mode == "runtime":
            runtimes.append(Runtime(None, opt, RUNTIME_CONFIG))
        return opt

    yield make_optimizer
    for runtime in runtimes:
        runtime.close()


def _configs(optim_info: OptimizerInfo) -> list[dict]:
    """Fresh kwargs of every configuration (a Tensor lr is mutated by schedulers)."""
    return [i.kwargs for i in optim_info.optim_inputs_func(device="cpu")]


def _weight_bias(contiguous: bool = True) -> tuple[Parameter, Parameter, torch.Tensor]:
    if contiguous:
        return Parameter(torch.randn(10, 5)), Parameter(torch.randn(10)), torch.randn(5)
    weight = Parameter(torch.randn(10, 5, 2)[..., 0])
    return weight, Parameter(torch.randn(10, 2)[..., 0]), torch.randn(5)


def _loss(w, b, x) -> torch.Tensor:
    return (w.mv(x) + b).pow(2).sum()


def _fwd_bwd(opt, w, b, x) -> torch.Tensor:
    opt.zero_grad()
    loss = _loss(w, b, x)
    loss.backward()
    return loss


def _prime(opt, closure, mode: str, steps: int = 9) -> None:
    """``steps`` steps, and with a runtime on until a refresh is in flight (its save then holds
    it: Note [Runtime state in the optimizer's checkpoint])."""
    for _ in range(steps):
        opt.step(closure)
    for _ in range(20):
        if mode == "native" or RUNTIME_STATE_KEY in opt.state_dict():
            return
        opt.step(closure)
    raise AssertionError("no refresh in flight after 29 steps with a runtime")


def _named(params, named: bool):
    return [(f"name{i}", p) for i, p in enumerate(params)] if named else params


def _without_param_names(state_dict: dict) -> dict:
    out = copy.deepcopy(state_dict)
    for group in out["param_groups"]:
        group.pop("param_names", None)
    return out


def _conv_bn() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 2, 1, stride=2), torch.nn.BatchNorm2d(2))
    return model, torch.rand(1, 4, 16, 16)


def _model_step(opt, model, x) -> None:
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


# -- construction -----------------------------------------------------------------------------


def test_errors(optim_info, make, mode):
    """torch's error inputs for every optimizer (a single tensor as params: TypeError;
    duplicates; names on some parameters only; a Tensor lr of two elements) and Asteria's (no
    complex, no sparse, no implementation flags), at construction or at the step."""
    for error in optim_info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        given = error.optimizer_error_input
        if error.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
            if mode == "runtime":
                continue  # refused before any runtime can attach
            check = (pytest.warns if issubclass(error.error_type, Warning) else pytest.raises)(
                error.error_type, match=error.error_regex
            )
            with check:
                optim_info.optim_cls(given.params, **given.kwargs)
        else:
            opt = make(given.params, **given.kwargs)
            with pytest.raises(error.error_type, match=error.error_regex):
                opt.step()


def test_optimizer_can_be_printed(optim_info, make):
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for kwargs in _configs(optim_info):
        text = repr(make(params, **kwargs))
        assert text.startswith(optim_info.name) and "precondition_frequency" in text


# -- the update goes the right way ------------------------------------------------------------


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("with_lrsched", [True, False])
def test_goes_right_direction(optim_info, make, contiguous, with_lrsched):
    for schedulers_c in optim_info.scheduler_inputs if with_lrsched else [[]]:
        for kwargs in _configs(optim_info):
            w, b, x = _weight_bias(contiguous)
            opt = make([w, b], **kwargs)
            schedulers = [s(opt) for s in schedulers_c]
            initial = _loss(w, b, x).item()
            for _ in range(20):
                loss = _fwd_bwd(opt, w, b, x)
                opt.step()
                for s in schedulers:
                    s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
            assert _loss(w, b, x).item() < initial, kwargs


def test_param_group_with_lrscheduler_goes_right_direction(optim_info, make):
    for schedulers_c in optim_info.scheduler_inputs:
        w, b, x = _weight_bias()
        opt = make([{"params": [w]}, {"params": [b], "lr": 1e-2}], lr=1e-2)
        schedulers = [s(opt) for s in schedulers_c]
        initial = _loss(w, b, x).item()
        for _ in range(20):
            loss = opt.step(functools.partial(_fwd_bwd, opt, w, b, x))
            for s in schedulers:
                s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
        assert _loss(w, b, x).item() < initial


def test_tensor_lr(optim_info, make):
    """A Tensor lr steps as the same float does (to float32 rounding: the step size is then
    computed in the tensor's precision, as in torch), and a scheduler fills it in place."""
    for kwargs in _configs(optim_info):
        kwargs["lr"] = 1e-2
        w, b, x = _weight_bias()
        w_c, b_c = (Parameter(t.detach().clone()) for t in (w, b))
        opt = make([w, b], **kwargs)
        lr = torch.tensor(1e-2)
        opt_c = make([w_c, b_c], **{**kwargs, "lr": lr})
        sched, sched_c = StepLR(opt, step_size=2, gamma=0.5), StepLR(opt_c, step_size=2, gamma=0.5)
        for _ in range(6):
            opt.step(functools.partial(_fwd_bwd, opt, w, b, x))
            opt_c.step(functools.partial(_fwd_bwd, opt_c, w_c, b_c, x))
            sched.step()
            sched_c.step()
            torch.testing.assert_close(w_c, w)
            torch.testing.assert_close(b_c, b)
        assert opt_c.param_groups[0]["lr"] is lr
        assert lr.item() == pytest.approx(opt.param_groups[0]["lr"]) and lr.item() < 1e-2


def test_param_groups_weight_decay(optim_info, make):
    for kwargs in _configs(optim_info):
        w, b, x = _weight_bias()
        opt = make([{"params": [w], **kwargs}, {"params": [b], **kwargs, "weight_decay": 0.0}])
        initial = _loss(w, b, x).item()
        for _ in range(20):
            _fwd_bwd(opt, w, b, x)
            opt.step()
        assert _loss(w, b, x).item() < initial


def test_param_groups_lr(optim_info, make):
    """A group's lr is its own: the group with an lr of 1e-28 does not move."""
    for kwargs in _configs(optim_info):
        w, b, x = _weight_bias()
        irrelevant = Parameter(torch.randn(2))
        before = irrelevant.detach().clone()
        opt = make([{"params": [w, b], **kwargs}, {"params": [irrelevant]}], lr=1e-28)
        initial = _loss(w, b, x).item()
        for _ in range(20):
            _fwd_bwd(opt, w, b, x)
            irrelevant.grad = torch.rand_like(irrelevant)
            opt.step()
        assert _loss(w, b, x).item() < initial
        assert torch.equal(irrelevant, before)


def test_step_is_noop_when_params_have_no_grad(optim_info, make):
    params = [torch.randn(2, 3, requires_grad=False) for _ in range(2)]
    before = [p.clone() for p in params]
    for kwargs in _configs(optim_info):
        opt = make(params, **kwargs)
        assert opt.step(lambda: torch.tensor([1.0])).item() == 1.0
        assert all(torch.equal(p, q) for p, q in zip(params, before)) and not opt.state


def test_step_is_noop_for_zero_grads(optim_info, make):
    for kwargs in _configs(optim_info):
        param = torch.randn(5, 1, requires_grad=True)
        before = param.detach().clone()
        opt = make([param], **kwargs)
        if opt.param_groups[0]["weight_decay"] != 0:
            continue  # decay moves a parameter whatever its gradient
        for _ in range(3):
            param.grad = torch.zeros_like(param)
            opt.step()
        assert torch.equal(param, before), kwargs


def test_non_empty_state(optim_info, make):
    model = torch.nn.Linear(5, 5)
    for kwargs in _configs(optim_info):
        opt = make(model.parameters(), **kwargs)
        opt.zero_grad()
        model(torch.rand(2, 5)).sum().backward()
        opt.step()
        assert len(opt.state) == 2 and all(len(s) > 0 for s in opt.state.values())


# -- state_dict ---------------------------------------------------------------------------------


@pytest.mark.parametrize("named0", [True, False])
@pytest.mark.parametrize("named1", [True, False])
def test_state_dict_deterministic(optim_info, make, mode, named0, named1):
    """Loaded into equal (not identical) parameters, a state_dict continues the run bit for bit
    (with a runtime: the refreshes in flight at the save included), and saving is
    deterministic; a repeated parameter is saved as its first occurrence."""
    for kwargs in _configs(optim_info):
        w, b = Parameter(torch.randn(2, 3)), Parameter(torch.randn(2))
        x = torch.randn(3)
        opt = make(_named([w, b], named0), **kwargs)
        _prime(opt, functools.partial(_fwd_bwd, opt, w, b, x), mode)
        w_c, b_c = (Parameter(t.detach().clone()) for t in (w, b))
        opt_c = make(_named([w_c, b_c], named1), **kwargs)
        opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
        for _ in range(10):
            opt.step(functools.partial(_fwd_bwd, opt, w, b, x))
            opt_c.step(functools.partial(_fwd_bwd, opt_c, w_c, b_c, x))
            assert torch.equal(w, w_c) and torch.equal(b, b_c)
        assert_state_equal(
            _without_param_names(opt.state_dict()), _without_param_names(opt_c.state_dict())
        )
        opt_c.param_groups.extend(opt_c.param_groups)
        last = _without_param_names(opt_c.state_dict())["param_groups"][-1]
        assert_state_equal(_without_param_names(opt.state_dict())["param_groups"][-1], last)


@pytest.mark.parametrize("named0", [True, False])
@pytest.mark.parametrize("named1", [True, False])
def test_can_load_from_to_named_state_dict(optim_info, make, named0, named1):
    """``named_parameters()`` is taken; ``param_names`` are saved, and kept by a load into an
    optimizer made without names."""
    for kwargs in _configs(optim_info):
        model, x = _conv_bn()
        opt = make(model.named_parameters() if named0 else model.parameters(), **kwargs)
        for _ in range(3):
            _model_step(opt, model, x)
        saved = copy.deepcopy(opt.state_dict())
        opt2 = make(model.named_parameters() if named1 else model.parameters(), **kwargs)
        opt2.load_state_dict(saved)
        _model_step(opt2, model, x)
        names = ["0.weight", "0.bias", "1.weight", "1.bias"]
        if named0 or named1:
            assert opt2.state_dict()["param_groups"][0]["param_names"] == names
            assert opt2.param_names == dict(enumerate(names))  # and in messages
        else:
            assert "param_names" not in opt2.state_dict()["param_groups"][0]


@pytest.mark.parametrize("named", [True, False])
def test_save_load_equality_with_weights_only(optim_info, make, named):
    for kwargs in _configs(optim_info):
        w, b, x = _weight_bias()
        opt = make(_named([w, b], named), **kwargs)
        for _ in range(3):
            opt.step(functools.partial(_fwd_bwd, opt, w, b, x))
        saved = opt.state_dict()
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        for weights_only in (False, True):
            buffer.seek(0)
            assert_state_equal(torch.load(buffer, weights_only=weights_only), saved)


@pytest.mark.gpu
def test_state_dict_with_cuda_params(optim_info, make):
    """A state saved on the CPU loads into the same optimizer on CUDA (tensors moved, dtypes
    kept) and both continue alike (to the device's rounding: other kernels)."""
    for kwargs in _configs(optim_info):
        params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = make(params, **kwargs)
        for _ in range(3):
            opt.step()
        with torch.no_grad():
            params_cuda = [Parameter(p.to("cuda")) for p in params]
        for p, q in zip(params, params_cuda):
            q.grad = p.grad.to("cuda")
        opt_cuda = make(params_cuda, **{**kwargs, "lr": 1.0})
        saved = copy.deepcopy(opt.state_dict())
        opt_cuda.load_state_dict(copy.deepcopy(saved))
        assert_state_equal(saved, opt.state_dict())  # loading changed nothing it was given
        for state in opt_cuda.state.values():
            assert all(t.is_cuda for t in state.values() if isinstance(t, torch.Tensor))
        for _ in range(5):
            opt.step()
            opt_cuda.step()
            for p, q in zip(params, params_cuda):
                torch.testing.assert_close(q.cpu(), p, rtol=1e-4, atol=1e-5)


# -- hooks ------------------------------------------------------------------------------------


def _state_dict_pre_hook(opt) -> None:
    opt.state["test"] = 1


def _state_dict_post_hook(opt, state_dict):
    state_dict["ran_state_dict_pre_hook"] = state_dict["state"].pop("test", None) == 1
    return state_dict


def test_state_dict_pre_hook(optim_info, make):
    for kwargs in _configs(optim_info):
        opt = make([torch.rand(2, 3, requires_grad=True)], **kwargs)
        opt.register_state_dict_pre_hook(_state_dict_pre_hook)
        assert opt.state_dict()["state"]["test"] == 1
        opt.step()  # an entry of state that is not a parameter's is left alone


def test_state_dict_post_hook(optim_info, make):
    for kwargs in _configs(optim_info):
        opt = make([torch.rand(2, 3, requires_grad=True)], **kwargs)
        opt.register_state_dict_post_hook(_state_dict_post_hook)
        assert opt.state_dict()["ran_state_dict_pre_hook"] is False


def test_state_dict_pre_post_hook(optim_info, make):
    for kwargs in _configs(optim_info):
        p = torch.rand(2, 3, requires_grad=True)
        opt = make([p], **kwargs)
        p.grad = torch.rand_like(p)
        opt.step()
        opt.register_state_dict_pre_hook(_state_dict_pre_hook)
        opt.register_state_dict_post_hook(_state_dict_post_hook)
        replaced = {"replaced": True}
        opt.register_state_dict_post_hook(
            lambda o, sd, r=replaced: r if sd["ran_state_dict_pre_hook"] else None
        )
        assert opt.state_dict() is replaced  # what the last post-hook returns is the result
        assert "test" in opt.state


def _load_pre_hook1(opt, state_dict) -> None:
    state_dict["param_groups"][0]["lr"] = 0.002


def _load_pre_hook2(opt, state_dict):
    mine = copy.deepcopy(state_dict)
    mine["param_groups"][0]["lr"] = 0.003
    return mine


def _load_post_hook(opt) -> None:
    opt.state["ran_load_state_dict_pre_hook2"] = bool(opt.param_groups[0]["lr"] == 0.003)
    opt.state["ran_load_state_dict_post_hook"] = True


def test_load_state_dict_pre_hook_and_prepend(optim_info, make):
    for kwargs in _configs(optim_info):
        opt = make([torch.rand(2, 3, requires_grad=True)], **kwargs)
        saved = opt.state_dict()
        opt.register_load_state_dict_pre_hook(_load_pre_hook1)
        opt.load_state_dict(saved)
        assert opt.param_groups[0]["lr"] == 0.002
        opt.register_load_state_dict_pre_hook(_load_pre_hook2, prepend=True)
        opt.load_state_dict(saved)
        assert opt.param_groups[0]["lr"] == 0.002  # hook1 runs last and wins


def test_load_state_dict_pre_hook_sees_the_state(optim_info, make):
    """A pre-hook sees the state it is given (not an emptied one) and may replace it."""
    for kwargs in _configs(optim_info):
        p = torch.rand(2, 3, requires_grad=True)
        opt = make([p], **kwargs)
        p.grad = torch.rand_like(p)
        opt.step()
        saved = copy.deepcopy(opt.state_dict())
        seen = []

        def pre_hook(o, state_dict, seen=seen):
            seen.append(sorted(state_dict["state"][0]))
            fresh = copy.deepcopy(state_dict)
            fresh["param_groups"][0]["lr"] = 0.004
            return fresh

        opt.register_load_state_dict_pre_hook(pre_hook)
        opt.load_state_dict(saved)
        assert seen == [sorted(saved["state"][0])]
        assert opt.param_groups[0]["lr"] == 0.004
        assert opt.state[p]["step"] == saved["state"][0]["step"]


def test_load_state_dict_post_hook(optim_info, make):
    for kwargs in _configs(optim_info):
        p = torch.rand(2, 3, requires_grad=True)
        opt = make([p], **kwargs)
        p.grad = torch.rand_like(p)
        opt.step()
        restored = []
        opt.register_load_state_dict_post_hook(
            lambda o, p=p, restored=restored: restored.append(o.state[p]["step"])
        )
        opt.register_load_state_dict_post_hook(_load_post_hook)
        saved = opt.state_dict()
        opt.load_state_dict(saved)
        assert restored == [saved["state"][0]["step"]]  # the post-hooks run once it is back
        assert opt.state["ran_load_state_dict_pre_hook2"] is False
        assert opt.state["ran_load_state_dict_post_hook"] is True
        opt.step()


def test_load_state_dict_pre_post_hook(optim_info, make):
    for kwargs in _configs(optim_info):
        opt = make([torch.rand(2, 3, requires_grad=True)], **kwargs)
        opt.register_load_state_dict_pre_hook(_load_pre_hook2)
        opt.register_load_state_dict_post_hook(_load_post_hook)
        opt.load_state_dict(opt.state_dict())
        assert opt.state["ran_load_state_dict_pre_hook2"] is True
        assert opt.state["ran_load_state_dict_post_hook"] is True


def _stepping_params() -> list[torch.Tensor]:
    p = torch.randn(3, 2, requires_grad=True)
    p.grad = torch.randn_like(p)
    return [p]


def test_step_pre_and_post_hooks(optim_info, make):
    data = []
    for kwargs in _configs(optim_info):
        opt = make(_stepping_params(), **kwargs)
        data.clear()
        pre = opt.register_step_pre_hook(lambda o, args, kw: data.append("pre"))
        post = opt.register_step_post_hook(lambda o, args, kw: data.append("post"))
        opt.step()
        opt.step()
        assert data == ["pre", "post"] * 2
        pre.remove()
        post.remove()
        opt.step()
        assert data == ["pre", "post"] * 2


def test_step_all_hooks(optim_info, make):
    """Global and per-optimizer step hooks run in torch's order, beside a torch optimizer."""
    data = []
    for kwargs in _configs(optim_info):
        params = _stepping_params()
        opt, opt2 = make(params, **kwargs), SGD(params)
        data.clear()
        handles = [
            register_optimizer_step_pre_hook(lambda o, a, k: data.append(0)),
            register_optimizer_step_post_hook(lambda o, a, k: data.append(5)),
            opt.register_step_pre_hook(lambda o, a, k: data.append(1)),
            opt.register_step_post_hook(lambda o, a, k: data.append(2)),
            opt2.register_step_pre_hook(lambda o, a, k: data.append(1)),
            opt2.register_step_post_hook(lambda o, a, k: data.append(2)),
        ]
        try:
            opt.step()
            opt2.step()
            opt.step()
        finally:
            for h in handles:
                h.remove()
        assert data == [0, 1, 2, 5] * 3
        opt.step()
        opt2.step()
        assert data == [0, 1, 2, 5] * 3


# -- copies -----------------------------------------------------------------------------------


def _public(obj) -> dict:
    return {k: v for k, v in obj.__dict__.items() if not k.startswith("_")}


def test_deepcopy_copies_all_public_attrs(optim_info, make):
    for kwargs in _configs(optim_info):
        params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
        for p in params:
            p.grad = torch.rand_like(p)
        opt = make(_named(params, True), **kwargs)
        opt.skip_nonfinite_grads, opt.max_consecutive_failures = False, 7
        for _ in range(3):
            opt.step()
        copied = copy.deepcopy(opt)
        assert _public(opt).keys() == _public(copied).keys()
        for name in ("skip_nonfinite_grads", "max_consecutive_failures", "nonfinite_grads"):
            assert getattr(copied, name) == getattr(opt, name)
        assert copied.param_names == opt.param_names == {0: "name0", 1: "name1"}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_continues_bit_for_bit(optim_info, mode, how):
    """A deep copy or an unpickled copy steps on (natively), and with a runtime attached to it
    follows the original run bit for bit: the refreshes in flight at the copy go along."""
    for kwargs in _configs(optim_info):
        w, b, x = _weight_bias()
        opt = optim_info.optim_cls([w, b], **kwargs)
        runtime = Runtime(None, opt, RUNTIME_CONFIG) if mode == "runtime" else None
        try:
            _prime(opt, functools.partial(_fwd_bwd, opt, w, b, x), mode, steps=5)
            in_flight = RUNTIME_STATE_KEY in opt.state_dict()
            assert in_flight == (mode == "runtime")
            copied = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
            w_c, b_c = copied.param_groups[0]["params"]
            assert w_c is not w and torch.equal(w_c, w)
            assert (copied._resumed_refreshes is not None) == in_flight
            copy_runtime = Runtime(None, copied, RUNTIME_CONFIG) if mode == "runtime" else None
            try:
                for _ in range(6):
                    opt.step(functools.partial(_fwd_bwd, opt, w, b, x))
                    copied.step(functools.partial(_fwd_bwd, copied, w_c, b_c, x))
                    assert torch.equal(w, w_c) and torch.equal(b, b_c)
            finally:
                if copy_runtime is not None:
                    copy_runtime.close()
        finally:
            if runtime is not None:
                runtime.close()


def test_copy_with_a_runtime_attached_steps_natively(optim_info):
    w, b, x = _weight_bias()
    opt = optim_info.optim_cls([w, b], lr=1e-2, precondition_frequency=2)
    with Runtime(None, opt, RUNTIME_CONFIG) as runtime:
        opt.step(functools.partial(_fwd_bwd, opt, w, b, x))
        copied = copy.deepcopy(opt)
        assert opt.refresher is runtime and copied.refresher is not runtime
        w_c, b_c = copied.param_groups[0]["params"]
        for _ in range(4):
            copied.step(functools.partial(_fwd_bwd, copied, w_c, b_c, x))
        assert runtime.stats()["steps"] == 1
