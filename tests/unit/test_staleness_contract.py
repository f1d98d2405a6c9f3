"""The staleness contract (Note [Staleness contract] in asteria/runtime/schedule.py), issue 16.

Invariant, checked after every step of every run: the basis each block's update read is at most
``max(f, B) + B`` steps old (``f``: precondition_frequency, ``B``: fixed_delay or staleness),
once the block has a basis; every block installs again and again; nothing in flight is ever
cancelled by a newer request. Over optimizer x frequency 1..12 x staleness 0..8 x fixed_delay x
an artificially slowed pool (``asteria.runtime.testing.slow_pool``) x the statistics lane on/off
x module hooks on/off x interval, staggered or continuous refresh (Notes [Staggered refresh],
[Continuous refresh]), drawn by
hypothesis (derandomized: the same examples in every run).
The configurations that starved before (0 installs in 30 steps) are named regression tests.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asteria
from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.runtime.schedule import basis_age_bound
from asteria.runtime.testing import slow_pool

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}


def _optimizer(name, params, **kwargs):
    """``OPTIMIZERS[name]``; Shampoo's small weights unmerged (Meta's merge makes a 6 x 5
    weight a 1-D block of 30, rank-deficient for 30 steps, whose roots the runtime waits for
    at their step: Note [Rank-deficient factors]), so that the schedule under test has blocks
    of full rank to place from the first steps on."""
    if name == "shampoo":
        kwargs.setdefault("merge_dims", False)
    return OPTIMIZERS[name](params, **kwargs)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _run(name, frequency, config, steps, delay_s=0.0):
    """Train ``steps`` steps; per step, the per-block ages and bounds that stats() reports."""
    model = _model()
    opt = _optimizer(name, model.parameters(), lr=1e-2, precondition_frequency=frequency)
    x = torch.randn(32, 6)
    seen = []
    with slow_pool(delay_s), asteria.Runtime(model, opt, config) as rt:
        for _ in range(steps):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            seen.append(rt.stats())
    return seen


def _check_contract(seen, frequency, budget):
    """The bound at every step; steady installs; nothing superseded."""
    bound = basis_age_bound(frequency, budget)
    steps = len(seen)
    for step, stats in enumerate(seen, start=1):
        assert stats["basis_age"]["within_bound"], (step, stats["basis_age"])
        for name, block in stats["blocks"].items():
            if block["basis_age_bound"] is None:
                continue  # no basis yet (Shampoo before its first roots, unfactored blocks)
            assert block["basis_age_bound"] == bound
            assert 0 <= block["basis_age"] <= bound, (step, name, block)
    last = seen[-1]
    assert last["basis_age"]["max"] <= bound
    assert last["jobs"]["cancelled"] == 0  # a newer request never cancels the one in flight
    measured = [b for b in last["blocks"].values() if b["basis_age_bound"] is not None]
    assert measured, "no block had a basis"
    for block in measured:
        # an age <= bound at every step needs an install at least every bound + 1 steps
        assert block["installs"] >= (steps - bound - 2) // (bound + 1), block
    if steps > 2 * bound + 2:
        assert last["installs"] > 0


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    frequency=st.integers(1, 12),
    staleness=st.integers(0, 8),
    fixed=st.one_of(st.none(), st.floats(0.0, 1.0)),
    delay_s=st.sampled_from([0.0, 0.0, 0.004, 0.02]),
    lane=st.booleans(),
    hooks=st.booleans(),
    refresh_lead=st.booleans(),
    refresh=st.sampled_from(["interval", "staggered", "continuous"]),
)
def test_the_basis_in_use_is_never_older_than_the_bound(
    name, frequency, staleness, fixed, delay_s, lane, hooks, refresh_lead, refresh
):
    fixed_delay = None if fixed is None else round(fixed * staleness)
    config = asteria.RuntimeConfig(
        staleness=staleness,
        fixed_delay=fixed_delay,
        workers=1,
        statistics_lane=lane,
        hooks=hooks,
        refresh_lead=refresh_lead,
        refresh=refresh,
        barrier_timeout_s=60.0,
    )
    budget = staleness if fixed_delay is None else fixed_delay
    steps = min(2 * basis_age_bound(frequency, budget) + 6, 40)
    seen = _run(name, frequency, config, steps, delay_s)
    _check_contract(seen, frequency, budget)
    if refresh != "interval" and budget >= 1:
        # f is the longest interval allowed: between two installs of a block, at most
        # max(f, B) + B steps (a request at most max(f, B) after the last, installed within B)
        for block in seen[-1]["refresh"]["blocks"].values():
            assert block["max"] <= basis_age_bound(frequency, budget), block


# -- the configurations that starved (issue 16): 0 installs in 30 steps ---------------------------


@pytest.mark.parametrize(
    "name, frequency, staleness, fixed_delay",
    [
        ("soap", 2, 3, 3),  # each due request superseded the one in flight
        ("shampoo", 1, 2, 2),  # the roots never arrived: silently grafting forever
        ("kl_shampoo", 3, 4, 4),
    ],
)
def test_fixed_delay_above_the_frequency_installs_steadily(name, frequency, staleness, fixed_delay):
    config = asteria.RuntimeConfig(staleness=staleness, fixed_delay=fixed_delay, workers=1)
    seen = _run(name, frequency, config, 30)
    _check_contract(seen, frequency, fixed_delay)
    last = seen[-1]
    # installs exactly every max(f, d) = d steps: the due requests in between are coalesced
    first = 1 if name != "shampoo" else frequency  # Shampoo's first request: the step before f
    assert last["installs"] >= (30 - first - fixed_delay) // fixed_delay
    assert last["jobs"]["coalesced_requests"] > 0
    assert set(last["staleness_histogram"]) == {fixed_delay}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_pool_slower_than_the_frequency_still_installs(name):
    """f = 1 with a pool that takes ~3 steps per job: the requests coalesce, and each install
    happens when its refresh is ready or at its deadline (S = 4)."""
    config = asteria.RuntimeConfig(staleness=4, workers=1, barrier_timeout_s=60.0)
    seen = _run(name, 1, config, 30, delay_s=0.03)
    _check_contract(seen, 1, 4)
    assert seen[-1]["jobs"]["coalesced_requests"] > 0


def test_fixed_delay_runs_stay_reproducible_with_coalescing():
    """The schedule under fixed_delay depends on steps only, never on the pool's speed."""
    config = asteria.RuntimeConfig(staleness=3, fixed_delay=3, workers=1)

    def params(delay_s):
        model = _model()
        opt = SOAP(model.parameters(), lr=1e-2, precondition_frequency=2)
        x = torch.randn(32, 6, generator=torch.Generator().manual_seed(1))
        with slow_pool(delay_s), asteria.Runtime(model, opt, config):
            for _ in range(20):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(params(0.0), params(0.02)):
        assert torch.equal(a, b)


def test_slow_pool_refuses_a_negative_delay():
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        with slow_pool(-1.0):
            pass


@pytest.mark.distributed
def test_replicated_blocks_keep_the_bound_on_two_ranks(tmp_path):
    """DDP on 2 gloo ranks, every block replicated, the frequency (1) below the budget: the
    requests coalesce on every rank alike, installs happen at their deadline, the bound holds at
    every step and the replicas agree (these ran on their first basis forever before)."""
    from tests.distributed._launch import launch

    codes, results, logs, _ = launch("contract", tmp_path, timeout_s=120.0)
    assert codes == [0, 0], logs
    for r in results:
        for name in OPTIMIZERS:
            for label, budget in (("s3", 3), ("fixed2", 2)):
                case = r[f"{name}/{label}"]
                assert all(case["within"]), (name, label, case)
                assert case["bound"] == basis_age_bound(1, budget)
                assert case["max_age"] <= case["bound"]
                assert case["installs"] >= 16 // (budget + 1) - 1, (name, label, case)
                assert case["coalesced"] > 0
                assert case["replicas_agree"], (name, label)
            # continuous refresh at f = 10, B = 3: every replicated block is requested again at
            # its install, every 3 steps on both ranks, each computed by its owner only (without
            # Shampoo's waits for first roots and young factors: _workers.scenario_contract)
            case = r[f"{name}/continuous3"]
            assert all(case["within"]) and case["replicas_agree"], (name, case)
            assert case["interval_max"] == 3, (name, case)
            assert case["installs"] >= 16 // 3 - 1, (name, case)
    for name in OPTIMIZERS:  # the same versions on both ranks; both compute refreshes
        cases = [r[f"{name}/continuous3"] for r in results]
        assert cases[0]["blocks"] == cases[1]["blocks"], name
        assert all(c["owned_refreshes"] > 0 for c in cases), name


# -- staggered refresh (issue 24, Note [Staggered refresh]) ---------------------------------------


def _request_steps(name, frequency, blocks, config, steps):
    """Per block, the steps its refreshes were requested at (equal blocks, one 8 x 8 weight
    each), from the runtime's block views after every step; every refresh finishes before the
    next step (a block moves onto its slot only when its refresh is ready by then)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(blocks)]
    opt = _optimizer(name, params, lr=1e-2, precondition_frequency=frequency)
    requests: dict[str, list[int]] = {}
    with asteria.Runtime(None, opt, config) as rt:
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn_like(p)
            for e in rt.blocks().values():  # every refresh ready before the next step
                for f in e.pending.futures if e.pending is not None else ():
                    if f is not None:
                        f.result(timeout_s=60)
            opt.step()
            for e in rt.blocks().values():
                seen = requests.setdefault(e.name, [])
                if e.pending is not None and (not seen or seen[-1] != e.pending.requested):
                    seen.append(e.pending.requested)
        assert rt.stats()["refresh"]["mode"] == "staggered"
    return requests


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    frequency=st.integers(2, 8),
    blocks=st.integers(1, 12),
    staleness=st.integers(1, 6),
    refresh_lead=st.booleans(),
)
def test_staggered_refresh_spreads_the_blocks_over_the_interval(
    name, frequency, blocks, staleness, refresh_lead
):
    """Each block is requested every ``f`` steps once it has a basis, at most ``f`` after its
    last request, and equal blocks share the ``f`` slots of the interval evenly: the steps of
    one interval request ``ceil(n / f)`` blocks at most, not all ``n`` at once."""
    config = asteria.RuntimeConfig(
        staleness=staleness,
        workers=1,
        statistics_lane=False,
        refresh="staggered",
        refresh_lead=refresh_lead,
    )
    steps = 5 * frequency + staleness + 4
    if name == "shampoo":  # its refreshes up to 4f are waited for at their step: no slots
        steps += 4 * frequency  # (Note [Young factors])
    requests = _request_steps(name, frequency, blocks, config, steps)
    assert len(requests) == blocks
    slots: dict[int, int] = {}
    for steps_of in requests.values():
        gaps = [b - a for a, b in zip(steps_of, steps_of[1:])]
        assert gaps and all(1 <= g <= frequency for g in gaps), steps_of
        # on its slot from the third request (Shampoo's first roots: version None until installed)
        assert all(g == frequency for g in gaps[2:]), steps_of
        slot = steps_of[-1] % frequency
        slots[slot] = slots.get(slot, 0) + 1
    assert max(slots.values()) <= -(-blocks // frequency), slots


# -- continuous refresh (issue 19, Note [Continuous refresh]) -------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_continuous_refresh_installs_more_often_than_the_frequency(name):
    """A fast pool and f = 10: interval refresh installs every 10 steps, continuous refresh as
    soon as the executors have room, well inside the interval; the bound holds for both.
    Shampoo's refreshes up to step 40 are young (Note [Young factors]), refreshed at their step
    in either mode: it runs 40 steps more."""
    frequency, steps = 10, 76 if name == "shampoo" else 36
    out = {}
    for refresh in ("interval", "continuous"):
        config = asteria.RuntimeConfig(staleness=3, workers=1, refresh=refresh)
        seen = _run(name, frequency, config, steps)
        _check_contract(seen, frequency, 3)
        out[refresh] = seen[-1]
    assert out["continuous"]["refresh"]["mode"] == "continuous"
    assert out["continuous"]["installs"] > 2 * out["interval"]["installs"]
    assert out["continuous"]["refresh"]["interval_mean"] < frequency / 2
    assert out["interval"]["refresh"]["interval_max"] >= frequency


@pytest.mark.parametrize("refresh", ["staggered", "continuous"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_continuous_refresh_at_a_zero_budget_is_native_bit_for_bit(name, refresh):
    def params(config):
        model = _model()
        opt = _optimizer(name, model.parameters(), lr=1e-2, precondition_frequency=3)
        x = torch.randn(32, 6, generator=torch.Generator().manual_seed(2))
        runtime = asteria.Runtime(model, opt, config) if config is not None else None
        for _ in range(12):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if runtime is not None:
            runtime.close()
        return [p.detach().clone() for p in model.parameters()]

    native = params(None)
    for a, b in zip(native, params(asteria.RuntimeConfig(staleness=0, refresh=refresh))):
        assert torch.equal(a, b)


def test_continuous_refresh_under_fixed_delay_requests_at_every_install():
    """Installs at fixed steps: a block is requested again at each install, every d steps, the
    same at any pool speed (what replicated blocks do on every rank alike)."""
    config = asteria.RuntimeConfig(staleness=3, fixed_delay=2, workers=1, refresh="continuous")
    runs = [_run("soap", 10, config, 20, delay_s=d)[-1] for d in (0.0, 0.01)]
    for last in runs:
        assert set(last["staleness_histogram"]) == {2}
        assert last["refresh"]["interval_max"] == 2
    assert runs[0]["blocks"] == runs[1]["blocks"]


def test_refresh_mode_is_validated():
    match = "refresh must be one of 'interval', 'staggered', 'continuous'"
    with pytest.raises(ValueError, match=match):
        asteria.RuntimeConfig(refresh="eager")
