"""A refused ``step()`` or ``load_state_dict()`` changes nothing (issue 48, items 1b, 1c and 4;
Notes [Refused steps] in asteria/optim/overflow.py and [Transactional loads] in state_io.py).

Every bad input the issue's probe found (docs/runtime.md, "Faults"), drawn with hypothesis over
the three optimizers, natively and under a runtime (``S = 0``, a budget, a fixed delay), after a
drawn number of steps: a sparse gradient on any parameter beside dense ones, a group option
edited after construction to a value the constructor refuses, a parameter resized or recast
under its state, a blocking option edited after the first step, a closure that raises; another
optimizer's ``state_dict``, one of other shapes, one with a tensor cut short. Each must raise
(a ``ValueError`` naming the value, or the sparse/closure error) and leave a deep snapshot of
everything observable as it was: parameters (values and strides), groups, ``opt.state``, the
optimizer's counters, and the runtime's versions, requests, installs, failures, refreshes in
flight (by identity) and job counters. The issue's two cases by name first.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.runtime import Runtime, RuntimeConfig
from tests.faults import picture, same

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}
SHAPES = [(6, 5), (5,), (4, 3)]
MODES = {
    "native": None,
    "S=0": dict(staleness=0),
    "S=2": dict(staleness=2),
    "fixed_delay=2": dict(staleness=2, fixed_delay=2),
}
#: the job counters a refused step cannot move (``completed`` and ``in_flight`` move with the
#: pool's own progress between any two reads)
JOB_COUNTERS = ("submitted", "cancelled", "coalesced_requests", "urgent_waits", "helped", "failed")


def snapshot(opt: Any, rt: Any) -> Any:
    """``tests.faults.picture`` (parameters, groups, state, the runtime's refreshes in flight and
    per-block figures) and the rest of what is observable: strides, counters, every field of
    ``Runtime.blocks()`` and the runtime's step and job counts."""
    out = picture(opt, rt)
    out["groups"] = repr(out["groups"])  # (a NaN lr is the same group again)
    params = [p for g in opt.param_groups for p in g["params"]]
    out["strides"] = [p.stride() for p in params]
    out["counters"] = (opt.nonfinite_grads, opt.max_consecutive_failures)
    if rt is not None:
        out["blocks"] = {
            key: (b.version, b.requested_step, b.installed_step, b.installs, b.failures,
                  b.consecutive_failures, b.owed, None if b.pending is None else id(b.pending))
            for key, b in rt.blocks().items()
        }  # fmt: skip
        stats = rt.stats()
        out["stats"] = (stats["steps"], {k: stats["jobs"][k] for k in JOB_COUNTERS})
    return out


def _setup(name: str, mode: str, steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    groups = [{"params": params[:2]}, {"params": params[2:]}]
    opt = OPTIMIZERS[name](groups, lr=1e-2, precondition_frequency=2)
    config = MODES[mode]
    rt = (
        None
        if config is None
        else Runtime(None, opt, RuntimeConfig(workers=1, hooks=False, **config))
    )
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return opt, rt, params


# (what, how): each makes the next step() refused; ``index`` picks a parameter or group
def _sparse(opt, params, index):
    p = params[index % len(params)]
    p.grad = p.grad.to_sparse()


def _option(key, value):
    def edit(opt, params, index):
        opt.param_groups[index % 2][key] = value

    return edit


def _resized(opt, params, index):
    p = params[index % len(params)]
    shape = (p.shape[0] + 1, *p.shape[1:])
    p.data, p.grad = torch.randn(shape), torch.randn(shape)


def _recast(opt, params, index):
    p = params[index % len(params)]
    p.data, p.grad = p.data.double(), p.grad.double()


STEP_FAULTS = {
    "sparse gradient": (_sparse, RuntimeError, "sparse gradients"),
    "lr < 0": (_option("lr", -1e-3), ValueError, "lr must be"),
    "lr NaN": (_option("lr", math.nan), ValueError, "lr must be"),
    "lr a string": (_option("lr", "1e-3"), ValueError, "lr must be"),
    "betas[0] > 1": (_option("betas", (1.5, 0.9)), ValueError, r"betas\[0\]"),
    "betas[1] > 1": (_option("betas", (0.9, 2.0)), ValueError, r"betas\[1\]"),
    "frequency 0": (_option("precondition_frequency", 0), ValueError, "precondition_frequency"),
    "frequency 1.5": (_option("precondition_frequency", 1.5), ValueError, "precondition_frequency"),
    "weight_decay < 0": (_option("weight_decay", -1.0), ValueError, "weight_decay"),
    "max dim 0": (_option("max_preconditioner_dim", 0), ValueError, "max_preconditioner_dim"),
    "max dim edited": (_option("max_preconditioner_dim", 2), ValueError, "its state does not fit"),
    "refresh_dtype fp16": (_option("refresh_dtype", torch.float16), ValueError, "refresh_dtype"),
    "resized": (_resized, ValueError, "its state does not fit"),
    "recast": (_recast, ValueError, "its state does not fit"),
}


def _other_class(opt, name):
    other = next(n for n in OPTIMIZERS if n != name)
    return _setup(other, "native", 3)[0].state_dict()


def _other_shapes(opt, name):
    gen = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(s[::-1], generator=gen)) for s in SHAPES]
    o = OPTIMIZERS[name]([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        o.step()
    return o.state_dict()


def _truncated(opt, name):
    saved = opt.state_dict()
    key = next(k for k, v in saved["state"][0].items() if isinstance(v, torch.Tensor))
    saved["state"][0][key] = saved["state"][0][key].reshape(-1)[:-1].clone()
    return saved


LOAD_FAULTS = {
    "another optimizer's": _other_class,
    "other shapes": _other_shapes,
    "a tensor cut short": _truncated,
}


def _refused_step(name, mode, steps, fault, index) -> None:
    opt, rt, params = _setup(name, mode, steps)
    edit, error, match = STEP_FAULTS[fault]
    try:
        edit(opt, params, index)  # the caller's edit; the step must change nothing after it
        before = snapshot(opt, rt)
        with pytest.raises(error, match=match):
            opt.step()
        assert same(before, snapshot(opt, rt))
    finally:
        if rt is not None:
            rt.close(install_pending=False)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    mode=st.sampled_from(sorted(MODES)),
    steps=st.integers(1, 6),
    fault=st.sampled_from(sorted(STEP_FAULTS)),
    index=st.integers(0, 5),
)
def test_a_refused_step_changes_nothing(name, mode, steps, fault, index):
    _refused_step(name, mode, steps, fault, index)


@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    mode=st.sampled_from(sorted(MODES)),
    steps=st.integers(1, 6),
    fault=st.sampled_from(sorted(LOAD_FAULTS)),
)
def test_a_refused_load_changes_nothing(name, mode, steps, fault):
    opt, rt, _ = _setup(name, mode, steps)
    try:
        saved = LOAD_FAULTS[fault](opt, name)
        before = snapshot(opt, rt)
        with pytest.raises(ValueError, match="load_state_dict"):
            opt.load_state_dict(saved)
        assert same(before, snapshot(opt, rt))
    finally:
        if rt is not None:
            rt.close(install_pending=False)


@pytest.mark.parametrize("mode", ["native", "S=2"])
def test_the_issues_sparse_gradient_beside_dense_ones_under_shampoo(mode):
    _refused_step("shampoo", mode, 4, "sparse gradient", 2)


@pytest.mark.parametrize("mode", ["native", "S=2"])
def test_the_issues_soap_state_dict_into_shampoo(mode):
    opt, rt, _ = _setup("shampoo", mode, 5)
    saved = _setup("soap", "native", 5)[0].state_dict()
    before = snapshot(opt, rt)
    with pytest.raises(ValueError, match="same optimizer class"):
        opt.load_state_dict(saved)
    assert same(before, snapshot(opt, rt))
    if rt is not None:
        rt.close(install_pending=False)


def test_a_valid_edit_of_a_group_still_takes_effect():
    """The check before a step refuses only what the constructor refuses: a scheduler's lr (and a
    user's valid edit) goes through, and a parameter whose state was cleared starts again."""
    opt, _, params = _setup("soap", "native", 3)
    opt.param_groups[0]["lr"] = 0.0
    before = params[0].detach().clone()
    opt.step()
    assert torch.equal(params[0].detach(), before)  # lr 0: the parameter holds
    _resized(opt, params, 2)
    del opt.state[params[2]]
    opt.step()  # a new first step for it
    assert opt.state[params[2]]["step"] >= 0


def test_a_runtime_over_a_model_without_the_optimizers_parameters_is_refused():
    """Its module hooks would have signalled nothing (the probe: attached silently)."""
    opt, _, params = _setup("soap", "native", 1)
    with pytest.raises(ValueError, match="holds none of the optimizer's 3 parameters"):
        Runtime(torch.nn.Linear(2, 2), opt, RuntimeConfig(workers=1))
    with Runtime(torch.nn.ParameterList(params[:1]), opt, RuntimeConfig(workers=1)):
        pass  # a model holding some of them is the usual case (a frozen part, a second opt)
