"""The ``torch.optim`` conventions, for each of the three optimizers (parametrized, not copied).

Param groups, ``state_dict`` round trips (in memory, and through ``torch.distributed.checkpoint``'s
state-dict API and DCP with the options trainers use, on one process and 2 DDP ranks), LR
schedulers, ``zero_grad``, parameters without gradients, fp32 state for low-precision
parameters, blocking of large dims, bad input.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.optim.tensors import PLACEHOLDER_STEP
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


def _layouts(opt) -> list[tuple]:
    """Dtype, shape and strides of every tensor of the live state, in parameter order."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return [(t.dtype, t.shape, t.stride()) for p in params for t in state_tensors(opt.state[p])]


def test_state_dict_round_trip_is_exact(optimizer):
    problem = StochasticQuartic(SHAPES, 20, torch.float32)
    params = problem.params()
    opt = optimizer(params)
    _train(opt, params, problem, 10)

    saved = copy.deepcopy(opt.state_dict())
    # Note [Flat optimizer state]: one flat dict of tensors and numbers per parameter
    assert all(
        isinstance(v, (torch.Tensor, int, float))
        for s in saved["state"].values()
        for v in s.values()
    )
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = optimizer(params2, lr=1.0)  # hyperparameters come from the state_dict
    opt2.load_state_dict(saved)
    assert_state_equal(opt.state_dict(), opt2.state_dict())
    assert _layouts(opt2) == _layouts(opt)  # transposed bases stay transposed

    _train(opt, params, problem, 10, start=10)
    _train(opt2, params2, problem, 10, start=10)
    for a, b in zip(params, params2):
        assert torch.equal(a, b)


def test_nested_state_dict_of_earlier_versions_loads(optimizer):
    """The nested form (lists of blocks, ``refresh_dtype`` a dtype) that ``state_dict`` wrote
    before Note [Flat optimizer state] still loads, exactly."""
    problem = StochasticQuartic(SHAPES, 16, torch.float32)
    params = problem.params()
    opt = optimizer(params)
    _train(opt, params, problem, 8)
    old = copy.deepcopy(torch.optim.Optimizer.state_dict(opt))  # the nested form
    assert any(isinstance(v, list) for s in old["state"].values() for v in s.values())
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = optimizer(params2, lr=1.0)
    opt2.load_state_dict(old)
    assert_state_equal(opt.state_dict(), opt2.state_dict())
    _train(opt, params, problem, 8, start=8)
    _train(opt2, params2, problem, 8, start=8)
    assert all(torch.equal(a, b) for a, b in zip(params, params2))


def test_refresh_dtype_is_saved_by_name():
    """``cpu_offload=True`` takes no ``torch.dtype``: the state_dict names it, the live groups
    and a loaded optimizer keep the dtype."""
    opt = SOAP([torch.nn.Parameter(torch.zeros(3, 2))], refresh_dtype=torch.float64)
    saved = opt.state_dict()
    assert saved["param_groups"][0]["refresh_dtype"] == "float64"
    assert opt.param_groups[0]["refresh_dtype"] is torch.float64
    opt2 = SOAP([torch.nn.Parameter(torch.zeros(3, 2))])
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["refresh_dtype"] is torch.float64
    saved["param_groups"][0]["refresh_dtype"] = "float128"
    with pytest.raises(ValueError, match="refresh_dtype 'float128'"):
        opt2.load_state_dict(saved)


def test_load_state_dict_rejects_state_that_does_not_fit():
    def trained(cls, shape, **options):
        p = torch.nn.Parameter(torch.randn(shape))
        opt = cls([p], **options)
        p.grad = torch.randn(shape)
        opt.step()
        return opt

    saved = trained(SOAP, (6, 5)).state_dict()
    with pytest.raises(ValueError, match=r"'blocks.0.exp_avg' is \(6, 5\), its layout needs"):
        trained(SOAP, (5, 6)).load_state_dict(saved)
    # another class's state: its groups lack this class's options (issue 22: checked first)
    with pytest.raises(ValueError, match=r"has no \['init_factor', 'max_clamp_value'\]"):
        trained(KLShampoo, (6, 5)).load_state_dict(saved)
    with_momentum = trained(Shampoo, (6,), momentum=0.5).state_dict()
    with pytest.raises(ValueError, match=r"has no \['shampoo_beta', 'eps', 'init_factor'"):
        trained(KLShampoo, (6,)).load_state_dict(with_momentum)
    # the same class with other options: the state names the entries that do not fit
    kl = trained(KLShampoo, (6, 5)).state_dict()
    for key in [k for k in kl["state"][0] if "eigen_sqrt_inv.0" in k]:
        del kl["state"][0][key]
    with pytest.raises(ValueError, match="no 'blocks.0.eigen_sqrt_inv.0'"):
        trained(KLShampoo, (6, 5)).load_state_dict(kl)
    with_momentum["param_groups"][0]["momentum"] = 0.0  # the state keeps a momentum buffer
    with pytest.raises(ValueError, match=r"entries \[.*'momentum_buffer'\] that this optimizer"):
        trained(Shampoo, (6,)).load_state_dict(with_momentum)


class _Net(torch.nn.Module):
    """The quartic problem's parameters as a module (the torch state-dict API takes one)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(params)


def test_torch_distributed_state_dict_api_round_trips(optimizer):
    """``get_optimizer_state_dict`` keys the state by parameter name and probes a fresh optimizer
    with a zero-gradient, ``lr=0`` step first (Note [State-initialisation probe] in
    optim/base.py): the probe makes placeholders, which change nothing, and the name-keyed state
    loads back exactly."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    problem = StochasticQuartic(SHAPES, 20, torch.float32)
    plain = problem.params()
    probed = [torch.nn.Parameter(p.detach().clone()) for p in plain]
    opt_plain, opt_probed = optimizer(plain), optimizer(probed)
    net = _Net(probed)
    placeholders = get_optimizer_state_dict(net, opt_probed)["state"]
    assert len(placeholders) == len(SHAPES)
    assert all(s["step"] == PLACEHOLDER_STEP for s in placeholders.values())
    assert opt_probed.param_groups[0]["lr"] == opt_plain.param_groups[0]["lr"]
    assert opt_probed.is_refresh_step() and not list(opt_probed.blocks())
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


#: StateDictOptions of the save; the load uses the same flattening and ``strict=True``, as
#: OLMo-core does ("olmo_core" is its default save).
SAVE_OPTIONS = {
    "nested": {},
    "flatten": {"flatten_optimizer_state_dict": True},
    "cpu_offload": {"cpu_offload": True},
    "olmo_core": {"flatten_optimizer_state_dict": True, "cpu_offload": True},
}


@pytest.mark.parametrize("save_at", [0, 2, 7], ids=["before_step_1", "no_refresh_yet", "refreshed"])
@pytest.mark.parametrize("options", sorted(SAVE_OPTIONS))
def test_dcp_resume_through_torch_state_dict_api_is_exact(optimizer, options, save_at, tmp_path):
    """What trainers do: save the model and optimizer with ``get_*_state_dict`` + DCP; resume in
    a fresh model and optimizer by loading the checkpoint into their own state dicts (the
    optimizer's: placeholders, Note [State-initialisation probe]) and ``set_*_state_dict``. The
    continuation equals the uninterrupted run bit for bit, saved before any step, before the
    first refresh (Shampoo's roots are still None) and after refreshes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    problem = StochasticQuartic(SHAPES, 14, torch.float32)
    straight = problem.params()
    _train(optimizer(straight), straight, problem, 14)

    save = StateDictOptions(**SAVE_OPTIONS[options])
    flatten = save.flatten_optimizer_state_dict
    load = StateDictOptions(flatten_optimizer_state_dict=flatten, strict=True)
    params = problem.params()
    net, saved = _Net(params), optimizer(params)
    _train(saved, params, problem, save_at)
    state = {
        "model": get_model_state_dict(net, options=save),
        "optim": get_optimizer_state_dict(net, saved, options=save),
    }
    dcp.save(state, checkpoint_id=str(tmp_path))

    params = problem.params()
    net, opt = _Net(params), optimizer(params)
    state = {
        "model": get_model_state_dict(net, options=load),
        "optim": get_optimizer_state_dict(net, opt, options=load),
    }
    dcp.load(state, checkpoint_id=str(tmp_path))
    set_model_state_dict(net, state["model"], options=load)
    set_optimizer_state_dict(net, opt, state["optim"], options=load)
    assert_state_equal(list(saved.state.values()), list(opt.state.values()))  # None stays None
    assert _layouts(opt) == _layouts(saved)
    _train(opt, params, problem, 14 - save_at, start=save_at)
    assert all(torch.equal(a, b) for a, b in zip(straight, params))


@pytest.mark.parametrize(
    "cls,options,dtype",
    [
        (SOAP, {}, torch.float32),
        (SOAP, {"precondition_1d": True, "max_preconditioner_dim": 4}, torch.bfloat16),
        (KLShampoo, {}, torch.float32),
        (KLShampoo, {"max_preconditioner_dim": 4}, torch.float64),
        (Shampoo, {}, torch.float32),
        (
            Shampoo,
            {"grafting": "sgd", "momentum": 0.5, "max_preconditioner_dim": 4},
            torch.bfloat16,
        ),
    ],
)
def test_placeholders_have_the_structure_of_the_state(cls, options, dtype):
    """The placeholders a checkpoint is loaded into have every key, shape, dtype and stride of
    the state after refreshes (each optimizer's ``_state_template``)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    def structure(state_dict):
        return {
            name: {
                k: (v.shape, v.dtype, v.stride()) if isinstance(v, torch.Tensor) else type(v)
                for k, v in state.items()
            }
            for name, state in state_dict["state"].items()
        }

    problem = StochasticQuartic(SHAPES, 8, torch.float32)
    params = [torch.nn.Parameter(p.to(dtype)) for p in problem.init]
    opt = cls(params, precondition_frequency=3, **options)
    placeholders = structure(get_optimizer_state_dict(_Net(params), opt))
    for t in range(8):
        opt.zero_grad()
        problem.loss([p.float() for p in params], t).backward()
        opt.step()
    assert structure(get_optimizer_state_dict(_Net(params), opt)) == placeholders


TWO_RANKS = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
        set_model_state_dict, set_optimizer_state_dict)
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tests.distributed._launch import init_gloo
    from tests.distributed._workers import OPTIMIZERS, _local, _sharded, _train, make_opt, model

    torch.set_num_threads(1)
    init_gloo(timeout_s=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    path, out = sys.argv[1], {}
    save = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
    load = StateDictOptions(flatten_optimizer_state_dict=True, strict=True)
    for name in OPTIMIZERS:
        net = DDP(model())
        opt = make_opt(name, list(net.parameters()))
        _train(net, opt, rank, world, 7)
        state = {"model": get_model_state_dict(net, options=save),
                 "optim": get_optimizer_state_dict(net, opt, options=save)}
        dcp.save(state, checkpoint_id=f"{path}/ddp_{name}")
        _train(net, opt, rank, world, 14, start=7)
        straight = [_local(p) for p in net.parameters()]
        net = DDP(model(seed=1))
        opt = make_opt(name, list(net.parameters()))
        state = {"model": get_model_state_dict(net, options=load),
                 "optim": get_optimizer_state_dict(net, opt, options=load)}
        dcp.load(state, checkpoint_id=f"{path}/ddp_{name}")
        set_model_state_dict(net, state["model"], options=load)
        set_optimizer_state_dict(net, opt, state["optim"], options=load)
        _train(net, opt, rank, world, 14, start=7)
        resumed = [_local(p) for p in net.parameters()]
        out[f"ddp/{name}"] = all(torch.equal(a, b) for a, b in zip(straight, resumed))

        net = _sharded("fsdp", world)
        opt = make_opt(name, list(net.parameters()))
        _train(net, opt, rank, world, 2)
        errors = []
        for call in (
            lambda: get_optimizer_state_dict(net, opt),
            lambda: set_optimizer_state_dict(net, opt, {"state": {}, "param_groups": []}),
        ):
            try:
                call()
                errors.append(None)
            except RuntimeError as e:
                errors.append(str(e))
        out[f"fsdp/{name}"] = errors
        opt.state_dict()  # what asteria.checkpoint calls: not refused
    with open(f"{path}/rank{rank}.json", "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.distributed
def test_torch_state_dict_api_on_two_ranks(tmp_path):
    """2 gloo ranks. DDP: OLMo-core's options through DCP resume bit for bit. FSDP2: the state is
    per local shard, of which DCP would keep one rank's copy: get/set_optimizer_state_dict refuse
    it (Note [Sharded state and torch's state-dict API]), ``state_dict()`` itself (what
    asteria.checkpoint calls) does not."""
    from tests.distributed._launch import ROOT, rendezvous_env

    script = tmp_path / "ranks.py"
    script.write_text(TWO_RANKS)
    rendezvous, procs = rendezvous_env(tmp_path), []
    for rank in range(2):
        env = {
            **os.environ,
            **rendezvous,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        cmd = [sys.executable, str(script), str(tmp_path)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True))
    errors = [proc.communicate(timeout=120)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], errors
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in ("soap", "kl_shampoo", "shampoo"):
            assert out[f"ddp/{name}"], (rank, name)
            refused = out[f"fsdp/{name}"]
            assert len(refused) == 2 and all(e and "asteria.checkpoint" in e for e in refused)


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
def test_bad_arguments_name_the_argument(optimizer, name, value, request):
    if name == "eps" and request.node.callspec.params["optimizer"] == "shampoo":
        name = "grafting_epsilon"  # Meta's name, Shampoo's
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
