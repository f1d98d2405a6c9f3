"""examples/one_sided_soap.py, docs/extending.md's example (a): an optimizer written on the public
base gets the runtime's orchestration as SOAP does. Over its settings (hypothesis, derandomized):
``staleness=0`` is native mode bit for bit; ``fixed_delay`` runs are reproducible; the basis
every step reads is within the staleness bound, with a slowed pool; a checkpoint taken with
refreshes in flight resumes the uninterrupted run bit for bit; through the bases window of a
(pretended) discrete GPU it trains bitwise as directly, in the memory planned from its state
template. Its math: without a factor (1-D parameters) it is Adam, one step behind (the first
step only initialises)."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import asteria
from asteria.memory.tiers import Arch
from asteria.runtime.schedule import basis_age_bound
from asteria.runtime.testing import pretend_arch, slow_pool
from examples.one_sided_soap import OneSidedSOAP

SETTINGS = settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _model() -> torch.nn.Module:
    """A weight with more rows than columns (12 x 6: the right side is factored), a 3-D one with
    fewer (3 x 4 x 2, the matrix 3 x 8: the left side), and biases (Adam)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Unflatten(1, (4, 3))]
    return torch.nn.Sequential(*layers, torch.nn.Conv1d(4, 3, 2))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(16, 6, generator=torch.Generator().manual_seed(100 + step))


def _optimizer(model, frequency: int, max_dim: int) -> OneSidedSOAP:
    return OneSidedSOAP(
        model.parameters(),
        lr=1e-2,
        precondition_frequency=frequency,
        max_preconditioner_dim=max_dim,
    )


def _train(model, opt, steps, first=0, runtime=None, seen=None):
    for step in range(first, first + steps):
        opt.zero_grad()
        model(_batch(step)).sin().square().mean().backward()
        opt.step()
        if seen is not None:
            seen.append(runtime.stats()["basis_age"])
    return [p.detach().clone() for p in model.parameters()]


def _run(config, steps, frequency, max_dim, delay_s=0.0):
    model = _model()
    opt = _optimizer(model, frequency, max_dim)
    if config is None:
        return _train(model, opt, steps), None
    seen: list = []
    with slow_pool(delay_s), asteria.Runtime(model, opt, config) as rt:
        params = _train(model, opt, steps, runtime=rt, seen=seen)
    return params, seen


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


common = dict(
    frequency=st.integers(1, 6),
    max_dim=st.sampled_from([3, 4, 64]),  # 3 and 4 split dims into blocks
    lane=st.booleans(),
)


@SETTINGS
@given(**common)
def test_staleness_zero_is_native_bit_for_bit(frequency, max_dim, lane):
    native, _ = _run(None, 14, frequency, max_dim)
    config = asteria.RuntimeConfig(staleness=0, workers=1, statistics_lane=lane)
    orchestrated, _ = _run(config, 14, frequency, max_dim)
    assert _equal(native, orchestrated)


@SETTINGS
@given(**common, delay=st.integers(1, 3))
def test_fixed_delay_is_reproducible_and_delays(frequency, max_dim, lane, delay):
    config = asteria.RuntimeConfig(staleness=3, fixed_delay=delay, workers=1, statistics_lane=lane)
    first, _ = _run(config, 14, frequency, max_dim)
    again, _ = _run(config, 14, frequency, max_dim, delay_s=0.003)  # a slower pool
    assert _equal(first, again)
    native, _ = _run(None, 14, frequency, max_dim)
    assert not _equal(first, native)  # the delay is real: later bases, other parameters


@SETTINGS
@given(**common, staleness=st.integers(0, 5), delay_s=st.sampled_from([0.0, 0.01]))
def test_the_basis_in_use_stays_within_the_bound(frequency, max_dim, lane, staleness, delay_s):
    config = asteria.RuntimeConfig(
        staleness=staleness, workers=1, statistics_lane=lane, barrier_timeout_s=60.0
    )
    steps = 2 * basis_age_bound(frequency, staleness) + 6
    _, seen = _run(config, steps, frequency, max_dim, delay_s)
    assert all(age["within_bound"] for age in seen), seen
    assert seen[-1]["bound"] == basis_age_bound(frequency, staleness)
    assert seen[-1]["max"] <= seen[-1]["bound"]


@SETTINGS
@given(**common, save_at=st.integers(3, 9))
@example(frequency=2, max_dim=3, lane=True, save_at=5)  # refreshes in flight, blocks, the lane
def test_a_checkpoint_with_refreshes_in_flight_resumes_bit_for_bit(
    frequency, max_dim, lane, save_at
):
    config = asteria.RuntimeConfig(staleness=3, fixed_delay=2, workers=1, statistics_lane=lane)
    steps = 14
    whole, _ = _run(config, steps, frequency, max_dim)

    model = _model()
    opt = _optimizer(model, frequency, max_dim)
    with asteria.Runtime(model, opt, config):
        _train(model, opt, save_at)
        buffer = io.BytesIO()  # the plain torch pattern: model and optimizer, weights only
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    # with fixed_delay 2, the refreshes of the last two optimizer steps (t = save_at - 1 and
    # save_at - 2; the first step, t = 0, only initialises) are in flight, and saved with it
    due = [t for t in (save_at - 1, save_at - 2) if t > 0 and t % frequency == 0]
    assert ("asteria_runtime" in saved["optimizer"]) == bool(due)

    model = _model()
    opt = _optimizer(model, frequency, max_dim)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    resaved = opt.state_dict()
    assert resaved["state"].keys() == saved["optimizer"]["state"].keys()
    for key, state in saved["optimizer"]["state"].items():
        for name, value in state.items():
            got = resaved["state"][key][name]
            assert torch.equal(got, value) if torch.is_tensor(value) else got == value, name
    with asteria.Runtime(model, opt, config):
        resumed = _train(model, opt, steps - save_at, first=save_at)
    assert _equal(whole, resumed)


def test_without_a_factor_it_is_adam_one_step_behind():
    """On 1-D parameters (no factor) each step after the first is Adam's (eps 0, no decay)."""
    torch.manual_seed(0)
    a = torch.randn(7, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    ours = OneSidedSOAP([a], lr=1e-2, eps=0.0, weight_decay=0.0, betas=(0.9, 0.99))
    adam = torch.optim.Adam([b], lr=1e-2, eps=0.0, betas=(0.9, 0.99))
    grads = [torch.randn(7, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    a.grad = grads[0]
    ours.step()  # the first step initialises only
    assert torch.equal(a, b)
    for g in grads[1:]:
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        adam.step()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert not torch.equal(a, grads[0])  # it moved


@pytest.mark.parametrize("window_blocks", [None, 1])
def test_through_the_bases_window_it_trains_bitwise_and_as_planned(window_blocks):
    """``reads_bases_through_refresher``: where the runtime sees a discrete GPU (pretended on the
    CPU), the bases in use live in host memory and the update reads device copies through the
    window; the parameters are those of the direct path, and the memory the runtime planned from
    the example's ``_state_template`` is what it holds."""
    config = asteria.RuntimeConfig(staleness=3, fixed_delay=2, workers=1)
    direct, _ = _run(config, 14, 3, 4)
    model = _model()
    opt = _optimizer(model, 3, 4)
    with pretend_arch(Arch(cuda=True), window_blocks=window_blocks):
        with asteria.Runtime(model, opt, config) as rt:
            windowed = _train(model, opt, 14)
            report = rt.memory_report()
    assert _equal(direct, windowed)
    assert report["placement"]["bases_access"] == "window"
    assert report["placement"]["window"]["fills"] > 0
    planned = report["planned"]
    for tier, kind in [("device", "factors"), ("device", "moments"), ("host", "bases")]:
        assert report[tier][kind] == planned[tier][kind] > 0, (tier, kind)
