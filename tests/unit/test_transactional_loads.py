"""Loads check before they change (issue 22, item 1; Note [Transactional loads] in
asteria/optim/state_io.py): ``load_state_dict`` of SOAP, KL-Shampoo, Shampoo and of ``Runtime``
either loads everything or raises a ``ValueError`` that names the entry, leaving the optimizer,
its state and the runtime's refreshes in flight bitwise as they were; a later step and
``close()`` work. The cases of the issue by name, then hypothesis over optimizer x runtime on/off
x a generator of corruptions."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asteria.runtime import Runtime, RuntimeConfig
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

# refreshes stay in flight for 3 steps: at a load, some are (frequency 2)
FIXED = RuntimeConfig(staleness=3, fixed_delay=3, workers=1, hooks=False)


def _trained(name, runtime=False, steps=5, **options):
    net = model()
    opt = two_groups(net, name, **options)
    rt = Runtime(net, opt, FIXED) if runtime else None
    train(net, opt, steps)
    return net, opt, rt


def _refused(opt, rt, saved, match):
    """``saved`` is refused with a ValueError matching ``match``; nothing changed; training and
    ``close()`` go on."""
    before = picture(opt, rt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    assert same(before, picture(opt, rt))


# -- the cases of issue 22 by name ----------------------------------------------------------------


@pytest.mark.parametrize("runtime", [False, True])
def test_shampoo_refuses_a_soap_state_dict_and_keeps_its_own(runtime):
    soap = _trained("soap")[1].state_dict()
    net, opt, rt = _trained("shampoo", runtime)
    _refused(opt, rt, soap, r"param_groups\[0\] has no \[.*'grafting'")
    train(net, opt, 3)
    if rt is not None:
        rt.close()
        assert rt.stats()["basis_age"]["within_bound"]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_model_of_another_shape_leaves_every_state(name):
    other = model()
    other[2] = torch.nn.Linear(5, 4)
    opt_other = two_groups(other, name)
    train(other, opt_other, 3)
    net, opt, rt = _trained(name, runtime=True)
    _refused(opt, rt, opt_other.state_dict(), "does not fit it")
    assert opt.state  # the state was not dropped: the next step continues the run
    train(net, opt, 2)
    rt.close()


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda sd: sd["param_groups"][0].pop("betas"), r"has no \['betas'\]"),
        (lambda sd: sd["param_groups"][1].update(precondition_frequency=0), "precondition_freq"),
        (lambda sd: sd["state"][0].update(step="x"), "'step' must be an integer"),
        (lambda sd: _retype(sd["state"][2], torch.int64), "floating-point tensor is needed"),
    ],
    ids=["group_without_betas", "frequency_0", "step_x", "integer_tensor"],
)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bad_values_are_refused_at_the_load_not_at_a_later_step(name, corrupt, match):
    net, opt, rt = _trained(name, runtime=True)
    saved = copy.deepcopy(opt.state_dict())
    corrupt(saved)
    _refused(opt, rt, saved, match)
    train(net, opt, 3)
    rt.close()  # raised KeyError or AssertionError before
    assert rt.stats()["basis_age"]["within_bound"]


def _retype(flat, dtype):
    key = next(k for k, v in flat.items() if isinstance(v, torch.Tensor) and v.dim() >= 1)
    flat[key] = flat[key].to(dtype)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_runtime_refuses_results_of_a_model_of_another_shape(name):
    wide = model()
    wide[0] = torch.nn.Linear(6, 7)
    wide[2] = torch.nn.Linear(7, 3)
    opt_wide = two_groups(wide, name)
    with Runtime(wide, opt_wide, FIXED) as rt_wide:
        train(wide, opt_wide, 5)
        saved = rt_wide.state_dict()
    assert saved["pending"]
    net, opt, rt = _trained(name, runtime=True)
    before = picture(opt, rt)
    with pytest.raises(ValueError, match="matrix is needed|does not match"):
        rt.load_state_dict(saved)
    assert same(before, picture(opt, rt))
    train(net, opt, 4)
    rt.close()
    assert rt.stats()["basis_age"]["within_bound"]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_an_older_checkpoint_into_a_live_runtime_keeps_the_staleness_contract(name):
    """The refreshes in flight of the live run were requested after the checkpoint's steps:
    the load drops them (and restores the checkpoint's own), so no install breaks the bound."""
    net, opt, rt = _trained(name, runtime=True, steps=3)
    old_net, old_opt = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    train(net, opt, 6)
    assert any(b.pending is not None for b in rt.blocks().values())
    net.load_state_dict(old_net)
    opt.load_state_dict(old_opt)
    train(net, opt, 8)
    rt.close()
    stats = rt.stats()
    assert stats["basis_age"]["within_bound"], (stats["basis_age"], stats["blocks"])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_an_older_checkpoint_loads_while_the_dropped_refreshes_are_still_queued(name):
    """Note [Versions after a load] in placement.py: the refreshes the load drops may still be
    queued in the C++ pool, at later versions than the checkpoint's next requests (which the
    pool refuses by itself). One busy worker keeps them queued: the older requests supersede
    them instead of failing the step (a race before: it failed when the pool had not started
    the dropped job yet)."""
    net, opt, rt = _trained(name, runtime=True, steps=3)
    old_net, old_opt = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    train(net, opt, 6)
    g = torch.randn(2000, 2000, generator=torch.Generator().manual_seed(0))
    busy = rt.pool.submit_eigh("busy", 0, 0, g @ g.T)  # the one worker, for a second or more
    for _ in range(6):  # until a request at a later step than the checkpoint's is queued
        train(net, opt, 1)
        rt.sync()  # (the statistics lane submits some of them)
        if dict(rt.pool.stats())["queued"] > 0:
            break
    assert dict(rt.pool.stats())["queued"] > 0
    net.load_state_dict(old_net)
    opt.load_state_dict(old_opt)
    train(net, opt, 6)
    busy.result()
    rt.close()
    assert rt.stats()["basis_age"]["within_bound"]


def test_a_runtime_state_that_cannot_be_installed_in_time_is_refused():
    net, opt, rt = _trained("soap", runtime=True, steps=5)
    saved = rt.state_dict()
    assert saved["pending"]
    late = copy.deepcopy(saved)
    late["pending"][0]["requested"] -= 10
    before = picture(opt, rt)
    with pytest.raises(ValueError, match="within the budget 3"):
        rt.load_state_dict(late)
    assert same(before, picture(opt, rt))
    rt.load_state_dict(saved)  # the good one loads
    train(net, opt, 3)
    rt.close()


# -- the property: corruptions of a state_dict ----------------------------------------------------


def _corruptions():
    """(what, where) pairs: what to do to a state_dict, and an index to pick the entry."""
    kinds = st.sampled_from(
        [
            "another_class",
            "another_shape",
            "missing_group_key",
            "extra_state_key",
            "missing_state_key",
            "group_range",
            "group_type",
            "step_type",
            "step_range",
            "int_dtype",
            "complex_dtype",
            "truncated",
            "not_a_dict",
            "runtime_block",
            "runtime_results",
            "runtime_late",
        ]
    )
    return st.tuples(kinds, st.integers(0, 10**6))


def _corrupt(saved, kind, pick, name):
    """``saved`` corrupted by ``kind`` (an entry chosen by ``pick``), or None when it has no
    such entry (a runtime part without refreshes in flight)."""
    sd = copy.deepcopy(saved)
    flat = sd["state"][pick % len(sd["state"])]
    tensors = sorted(k for k, v in flat.items() if isinstance(v, torch.Tensor) and v.dim() >= 1)
    group = sd["param_groups"][pick % 2]
    pending = sd.get("asteria_runtime", {}).get("pending", [])
    if kind == "another_class":
        other = sorted(set(OPTIMIZERS) - {name})[pick % 2]
        return _trained(other, steps=2)[1].state_dict()
    if kind == "another_shape":
        net = model()
        net[0] = torch.nn.Linear(6, 4)
        net[2] = torch.nn.Linear(4, 3)
        opt = two_groups(net, name)
        train(net, opt, 2)
        return opt.state_dict()
    if kind == "missing_group_key":
        keys = sorted(k for k in group if k not in ("params", "param_names"))
        del group[keys[pick % len(keys)]]
    elif kind == "extra_state_key":
        flat["blocks.0.bogus"] = torch.zeros(2)
    elif kind == "missing_state_key":
        del flat[tensors[pick % len(tensors)]]
    elif kind == "group_range":
        key, value = [
            ("lr", -1.0),
            ("precondition_frequency", 0),
            ("weight_decay", -0.5),
            ("betas", (1.5, 0.9)),
            ("max_preconditioner_dim", 0),
            ("refresh_dtype", "int32"),
        ][pick % 6]
        group[key] = value
    elif kind == "group_type":
        group[["lr", "precondition_frequency", "betas"][pick % 3]] = "x"
    elif kind == "step_type":
        flat["step"] = ["x", 1.5, True, None][pick % 4]
    elif kind == "step_range":
        flat["step"] = -5
    elif kind == "int_dtype":
        key = tensors[pick % len(tensors)]
        flat[key] = flat[key].to(torch.int32)
    elif kind == "complex_dtype":
        key = tensors[pick % len(tensors)]
        flat[key] = flat[key].to(torch.complex64)
    elif kind == "truncated":
        key = tensors[pick % len(tensors)]
        flat[key] = flat[key].reshape(-1)[:-1]
    elif kind == "not_a_dict":
        where = pick % 3
        if where == 0:
            sd["state"][pick % len(sd["state"])] = [1, 2]
        elif where == 1:
            sd["param_groups"] = {"a": 1}
        else:
            sd["state"] = None
    elif not pending:
        return None
    elif kind == "runtime_block":
        pending[pick % len(pending)]["key"] = (99, 0)
    elif kind == "runtime_results":
        item = pending[pick % len(pending)]
        r = item["results"][0]
        matrix = r[0] if isinstance(r, tuple) else r
        cut = matrix[:-1, :-1].clone()
        item["results"][0] = (cut, *r[1:]) if isinstance(r, tuple) else cut
    elif kind == "runtime_late":
        pending[pick % len(pending)]["requested"] = -20
    return sd


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    runtime=st.booleans(),
    steps=st.integers(3, 7),
    corruption=_corruptions(),
)
def test_a_corrupted_state_dict_is_refused_and_changes_nothing(name, runtime, steps, corruption):
    kind, pick = corruption
    baseline = threads()
    net, opt, rt = _trained(name, runtime, steps=steps)
    saved = _corrupt(opt.state_dict(), kind, pick, name)
    if saved is None:
        if rt is not None:
            rt.close()
        return
    before = picture(opt, rt)
    with pytest.raises(ValueError):
        opt.load_state_dict(saved)
    assert same(before, picture(opt, rt)), kind
    if rt is not None and kind.startswith("runtime"):
        with pytest.raises(ValueError):
            rt.load_state_dict(saved["asteria_runtime"])
        assert same(before, picture(opt, rt)), kind
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(net, opt, 3)
    if rt is not None:
        rt.close()
        assert rt.stats()["basis_age"]["within_bound"]
        assert threads_back_to(baseline)


def test_an_option_added_later_takes_its_default_in_an_older_state_dict():
    class Later(OPTIMIZERS["soap"]):
        options_added_later = ("normalize_grads",)

    net = model()
    opt = Later(net.parameters(), normalize_grads=True)
    train(net, opt, 2)
    older = copy.deepcopy(opt.state_dict())
    del older["param_groups"][0]["normalize_grads"]  # saved before the option existed
    opt.load_state_dict(older)
    assert opt.param_groups[0]["normalize_grads"] is True  # this optimizer's default
    del older["param_groups"][0]["eps"]  # any other option missing is refused
    with pytest.raises(ValueError, match=r"has no \['eps'\]"):
        opt.load_state_dict(older)
