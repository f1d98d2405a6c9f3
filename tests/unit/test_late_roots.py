"""Shampoo's late roots (issue 24, item 6; Note [Late roots] in asteria/optim/shampoo.py): under a
runtime that installs late the pool computes the factor's eigenvectors, and the install forms
the root in them with the eigenvalue estimates of the factor at the install."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asteria.optim import Shampoo
from asteria.optim import matrix_functions as mf
from asteria.optim.refresher import LateRootRefresh, RefreshJob, RootRefresh
from asteria.runtime import Runtime, RuntimeConfig

ROOTS = st.sampled_from([2.0, 4.0, 6.0])
EPSILONS = st.sampled_from([1e-12, 1e-8, 1e-4])


def _psd(d: int, rank: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.randn(d, rank, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (g @ g.T) * scale


@settings(max_examples=40, derandomize=True, deadline=None)
@given(
    d=st.integers(1, 12),
    rank=st.integers(0, 14),
    root=ROOTS,
    eps=st.sampled_from([1e-6, 1e-4, 1e-2]),
    log_scale=st.integers(-6, 6),
)
def test_in_the_factors_own_eigenvectors_it_is_the_inverse_root(d, rank, root, eps, log_scale):
    """No drift (the install in the snapshot's own step): the root of the factor itself. (The
    damping is relative to the factor's scale here: an eigenvalue at round-off level below an
    absolute epsilon has no digits that two computations of it share.)"""
    scale = 10.0**log_scale
    factor = _psd(d, rank, seed=d * 31 + rank, scale=scale)
    _, q = mf.eigh_descending(factor, dtype=torch.float64)
    got = mf.inverse_root_in_basis(q, factor, root, eps * scale, dtype=torch.float64)
    want = mf.inverse_root(factor, root, eps * scale, dtype=torch.float64)
    largest = (eps * scale) ** (-1.0 / root)  # the largest entry either can have
    assert torch.allclose(got, want, rtol=0, atol=1e-7 * largest)


@settings(max_examples=40, derandomize=True, deadline=None)
@given(
    d=st.integers(1, 12),
    rank=st.integers(0, 14),
    new=st.integers(1, 6),
    root=ROOTS,
    eps=EPSILONS,
    log_scale=st.integers(-6, 6),
)
def test_a_grown_factor_never_gets_a_larger_root_than_the_late_one(
    d, rank, new, root, eps, log_scale
):
    """Plain sums (Meta's default betas): L_t = L_s + the gradients since s, so every eigenvalue
    estimate of L_t in L_s's eigenvectors is at least L_s's own, and the formed root scales no
    direction of that basis by more than the late root of L_s does: the directions the new
    gradients bring are no longer multiplied by up to epsilon^(-1/root)."""
    old = _psd(d, rank, seed=d * 7 + rank, scale=10.0**log_scale)
    now = old + _psd(d, new, seed=d * 13 + new + 1000, scale=10.0**log_scale)
    _, q = mf.eigh_descending(old, dtype=torch.float64)
    late = mf.inverse_root(old, root, eps, dtype=torch.float64)
    formed = mf.inverse_root_in_basis(q, now, root, eps, dtype=torch.float64)
    in_basis = lambda r: torch.diagonal(q.T @ r @ q)  # noqa: E731 (the scale per direction)
    assert torch.all(in_basis(formed) <= in_basis(late) * (1 + 1e-9) + 1e-9)
    # and where the new gradients are diagonal in that basis, it is their exact root
    diagonal = old + q @ torch.diag(torch.rand(d, dtype=torch.float64) * 10.0**log_scale) @ q.T
    exact = mf.inverse_root(diagonal, root, eps, dtype=torch.float64)
    formed = mf.inverse_root_in_basis(q, diagonal, root, eps, dtype=torch.float64)
    assert torch.allclose(formed, exact, rtol=1e-6, atol=1e-9 * eps ** (-1.0 / root))


def test_the_job_round_trips_and_finishes_with_the_factor_of_the_install():
    factor = _psd(5, 3, seed=1)
    job = LateRootRefresh(factor, root=4.0, epsilon=1e-10, dtype=torch.float64, rel_epsilon=1e-6)
    restored = RefreshJob.from_options(job.options())
    assert isinstance(restored, LateRootRefresh)
    assert (restored.root, restored.epsilon, restored.rel_epsilon) == (4.0, 1e-10, 1e-6)
    result = job.run()  # (eigenvalues, eigenvectors), as the pool's submit_eigh
    assert job.parts(result)[0] is result[1]
    sent = job.from_parts(*job.parts(result))  # between ranks: the eigenvectors alone
    now = factor + _psd(5, 2, seed=2)
    want = mf.inverse_root_in_basis(result[1], now, 4.0, job.damping(now), dtype=torch.float64)
    assert torch.equal(job.finish(result, now), want)
    assert torch.equal(job.finish(sent, now), want)
    root = RootRefresh(factor, root=4.0, epsilon=1e-10, dtype=torch.float64).run()
    assert job.finish(root, now) is root  # a root installs as computed


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _job_kinds(opt: Shampoo) -> set[type]:
    return {type(j) for _, _, b, g in opt.blocks() for j in opt.refresh_jobs(b, g)}


def _train(model, opt, steps: int) -> None:
    data = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model(data).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize(
    ("config", "correct", "kind"),
    [
        (None, True, RootRefresh),  # native mode
        (RuntimeConfig(staleness=0, workers=1), True, RootRefresh),  # installs nothing late
        (RuntimeConfig(staleness=3, workers=1), True, LateRootRefresh),
        (RuntimeConfig(staleness=3, workers=1), False, RootRefresh),
        (RuntimeConfig(staleness=2, workers=1, fixed_delay=1), True, LateRootRefresh),
    ],
)
def test_which_refresh_shampoo_asks_for(config, correct, kind):
    model = _model()
    opt = Shampoo(
        model.parameters(), lr=1e-2, precondition_frequency=2, late_root_correction=correct
    )
    rt = Runtime(model, opt, config) if config is not None else None
    _train(model, opt, 9)
    assert _job_kinds(opt) == {kind}
    if rt is not None:
        assert rt.stats()["installs"] > 0
        assert opt._refresher.installs_late == (config.staleness > 0)
        # forming a root reads the factor: a cost, so that it runs after the factor's update
        # (on the statistics lane where one runs)
        assert all((opt.install_cost(b) > 0) == (kind is LateRootRefresh) for b in _blocks(opt))
        rt.close()
    assert _job_kinds(opt) == {RootRefresh}  # detached: native again
    for b in _blocks(opt):
        assert all(r is not None and torch.isfinite(r).all() for r in b["roots"])


def _blocks(opt):
    return [b for _, _, b, _ in opt.blocks()]


def test_fixed_delay_one_installs_the_roots_of_the_install_steps_factors_in_the_late_basis():
    """With the refresh lead, ``fixed_delay=1`` requests at step t - 1 and installs at t: the
    installed root is ``inverse_root_in_basis`` of L_{t-1}'s eigenvectors and L_t (float64 and a
    damping well above round-off, so that the comparison is well conditioned)."""
    model = _model().double()
    opt = Shampoo(
        model.parameters(), lr=1e-2, precondition_frequency=3, epsilon=1e-6,
        refresh_dtype=torch.float64, merge_dims=False,
    )  # fmt: skip
    rt = Runtime(model, opt, RuntimeConfig(staleness=2, workers=1, fixed_delay=1))
    gen = torch.Generator().manual_seed(1)
    factors = []
    for step in range(1, 8):
        data = torch.randn(8, 6, generator=gen, dtype=torch.float64)
        model(data).square().mean().backward()
        opt.step()
        opt.zero_grad()
        rt.sync()  # the statistics lane's updates of the step (Note [Statistics lane])
        factors.append({id(b): [f.clone() for f in b["factors"]] for b in _blocks(opt)})
        if step in (3, 6):  # due steps: the roots requested at step - 1 are installed
            for b in _blocks(opt):
                k = 2 * len(b["factors"])
                for old, now, root in zip(factors[-2][id(b)], b["factors"], b["roots"]):
                    _, q = mf.eigh_descending(old, dtype=torch.float64)
                    want = mf.inverse_root_in_basis(q, now, k, 1e-6, dtype=torch.float64)
                    assert torch.allclose(root, want, rtol=1e-9, atol=1e-12)
                    stale = mf.inverse_root(old, k, 1e-6, dtype=torch.float64)
                    assert not torch.allclose(root, stale, rtol=1e-6)  # not L_{t-1}'s own root
    rt.close()


def test_a_checkpoint_with_late_roots_in_flight_resumes_bit_for_bit():
    def run(split: bool) -> list[torch.Tensor]:
        model = _model()
        opt = Shampoo(model.parameters(), lr=1e-2, precondition_frequency=2)
        config = RuntimeConfig(staleness=2, workers=1, fixed_delay=2)
        rt = Runtime(model, opt, config)
        _train(model, opt, 5)
        if split:
            saved_model, saved_opt = model.state_dict(), opt.state_dict()
            rt.close()
            model = _model()
            model.load_state_dict(saved_model)
            opt = Shampoo(model.parameters(), lr=1e-2, precondition_frequency=2)
            opt.load_state_dict(saved_opt)
            rt = Runtime(model, opt, config)
        _train(model, opt, 6)
        rt.close()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_late_root_correction_must_be_a_bool():
    with pytest.raises(ValueError, match="late_root_correction"):
        Shampoo(_model().parameters(), late_root_correction=1)
