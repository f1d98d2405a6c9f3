"""Parameters as users lay them out (issue 48, items 1 and 2).

* Any layout trains like its contiguous copy, bit for bit: transposed and permuted views,
  strided slices, storage offsets, channels-last, each with its gradient contiguous or in the
  parameter's own strides; for SOAP, KL-Shampoo and Shampoo, natively and under a runtime
  (``S = 0`` and a fixed delay) on every bases tier a CPU runs (the block's own tensors, the CPU
  stand-in of a discrete GPU's device memory and of its host window, unified memory), on the
  batched step and the per-parameter one, the statistics lane on or off. The twin is the same
  optimizer over contiguous copies, in the same groups, so both take the same path
  (Note [Working copies] in asteria/optim/base.py).
* A parameter listed twice trains as if listed once, after torch's warning (Note [Duplicate
  parameters] in base.py), natively and under a runtime.
* A factor over the budget is not built: a ``(1, 100000)`` SOAP parameter takes its first step
  in well under a second and warns once (Note [Factor budget] in asteria/optim/blocking.py).
"""

from __future__ import annotations

import contextlib
import time
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asteria.memory.tiers import Arch
from asteria.optim import SOAP, FactorBudgetWarning, KLShampoo, Shampoo
from asteria.optim.blocking import FACTOR_BUDGET_DIM, make_layout
from asteria.runtime import Runtime, RuntimeConfig
from asteria.runtime.testing import pretend_arch

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}
SETTINGS = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# (shape, how the parameter is laid out): every kind of layout a user's model can hand in
LAYOUTS = {
    "transposed": ((5, 8), lambda t: t.t().contiguous().t()),  # the issue's (5, 8) stride (1, 5)
    "permuted": ((3, 4, 5), lambda t: t.permute(2, 0, 1).contiguous().permute(1, 2, 0)),
    "strided": ((6, 4), lambda t: _strided(t)),
    "offset": ((7, 3), lambda t: _offset(t)),
    "channels_last": ((4, 3, 2, 2), lambda t: t.contiguous(memory_format=torch.channels_last)),
    "column": ((9, 1), lambda t: t.t().contiguous().t()),
    "contiguous": ((6, 5), lambda t: t.clone()),
}

# the bases tiers a CPU can run (None: the block's own tensors)
TIERS = {
    None: (None, None),
    "device": (Arch(cuda=True), {"bases": "device"}),
    "window": (Arch(cuda=True), {"bases": "host"}),
    "mapped": (Arch(cuda=True, unified_memory=True), None),
}


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in every other row of a buffer twice its size."""
    buf = torch.full((2 * t.shape[0], *t.shape[1:]), float("nan"))
    buf[::2] = t
    return buf[::2]


def _offset(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values at a storage offset of 3 elements (not 64-byte aligned)."""
    buf = torch.full((t.numel() + 5,), float("nan"))
    view = buf[3 : 3 + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def _params(names: list[str], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters laid out as ``names`` say, and their contiguous copies."""
    gen = torch.Generator().manual_seed(seed)
    odd, plain = [], []
    for name in names:
        shape, lay = LAYOUTS[name]
        values = torch.randn(shape, generator=gen)
        p = torch.nn.Parameter(lay(values))
        assert torch.equal(p.detach(), values)
        odd.append(p)
        plain.append(torch.nn.Parameter(values.clone()))
    return odd, plain


def _train(params, opt, steps: int, seed: int, grad_like_param: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            g = torch.randn(p.shape, generator=gen)
            if grad_like_param:  # the gradient in the parameter's strides, as autograd gives
                g = torch.empty_strided(p.shape, p.stride()).copy_(g)
            p.grad = g
        opt.step()


def _groups(params: list[torch.Tensor], split: bool) -> list[dict]:
    return [{"params": [p]} for p in params] if split else [{"params": params}]


@pytest.mark.filterwarnings("ignore::asteria.runtime.NoSpareCoreWarning")
@SETTINGS
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    layouts=st.lists(st.sampled_from(sorted(LAYOUTS)), min_size=1, max_size=4),
    split=st.booleans(),
    mode=st.sampled_from(["native", "S=0", "fixed_delay=2"]),
    tier=st.sampled_from(list(TIERS)),
    momentum=st.booleans(),
    tensor_lr=st.booleans(),
    lane=st.sampled_from([None, True, False]),
    grad_like_param=st.booleans(),
    frequency=st.integers(1, 3),
    steps=st.integers(1, 8),
)
def test_any_layout_trains_like_its_contiguous_copy(
    name, layouts, split, mode, tier, momentum, tensor_lr, lane, grad_like_param, frequency, steps
):
    cls = OPTIMIZERS[name]
    kw = dict(lr=torch.tensor(1e-2) if tensor_lr else 1e-2, precondition_frequency=frequency)
    if name == "shampoo" and momentum:
        kw["momentum"] = 0.5  # Shampoo's per-parameter path (so is a tensor lr's)
    odd, plain = _params(layouts, seed=len(layouts) + steps)
    strides = [p.stride() for p in odd]
    results = []
    for params in (odd, plain):
        opt = cls(_groups(params, split), **kw)
        if mode == "native":
            _train(params, opt, steps, seed=steps, grad_like_param=grad_like_param)
        else:
            arch, placement = TIERS[tier]
            delay = (
                dict(staleness=2, fixed_delay=2) if mode == "fixed_delay=2" else {"staleness": 0}
            )
            tiers = {} if placement is None else {"placement": placement}
            config = RuntimeConfig(workers=1, hooks=False, statistics_lane=lane, **delay, **tiers)
            ctx = (
                contextlib.nullcontext()
                if arch is None
                else pretend_arch(arch, device_free_bytes=1 << 40)
            )
            with ctx, Runtime(None, opt, config):
                _train(params, opt, steps, seed=steps, grad_like_param=grad_like_param)
        results.append([p.detach().clone() for p in params])
    assert [p.stride() for p in odd] == strides  # the user's layout, updated in place
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_issues_transposed_view_trains_like_its_copy(name):
    """Issue 48's case: a (5, 8) view of stride (1, 5), 8 steps at frequency 2 (Shampoo's batched
    step wrote into a reshaped copy, 5.3e-2 away)."""
    base = torch.randn(8, 5, generator=torch.Generator().manual_seed(0))
    a = base.clone().t().requires_grad_()
    assert a.stride() == (1, 5)
    b = torch.nn.Parameter(a.detach().contiguous())
    oa = OPTIMIZERS[name]([a], lr=1e-2, precondition_frequency=2)
    ob = OPTIMIZERS[name]([b], lr=1e-2, precondition_frequency=2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(8):
        g = torch.randn(5, 8, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert a.stride() == (1, 5)
    assert torch.equal(a.detach(), b.detach())


# -- a parameter listed twice -------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::asteria.runtime.NoSpareCoreWarning")
@pytest.mark.parametrize("runtime", [None, 0, 1, 5])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_parameter_listed_twice_trains_as_if_listed_once(name, runtime):
    """torch.optim warns and carries on; here the warning is torch's and the parameter is kept
    once, so it trains as if listed once (under a runtime the same block got two keys and
    failed an internal assertion)."""
    gen = torch.Generator().manual_seed(3)
    w0, b0 = torch.randn(6, 5, generator=gen), torch.randn(6, generator=gen)
    results = []
    for twice in (True, False):
        w, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = OPTIMIZERS[name](
                [w, b, w] if twice else [w, b], lr=1e-2, precondition_frequency=1
            )
        assert any("duplicate parameters" in str(x.message) for x in caught) == twice
        assert opt.param_groups[0]["params"] == [w, b]
        config = RuntimeConfig(staleness=runtime or 0, workers=1, hooks=False)
        ctx = contextlib.nullcontext() if runtime is None else Runtime(None, opt, config)
        with ctx:
            grads = torch.Generator().manual_seed(4)
            for _ in range(10):
                w.grad = torch.randn(6, 5, generator=grads)
                b.grad = torch.randn(6, generator=grads)
                opt.step()
        results.append((w.detach().clone(), b.detach().clone(), len(opt.state_dict()["state"])))
    assert results[0][2] == results[1][2] == 2
    if runtime in (None, 0):  # native mode and its bitwise twin
        assert all(torch.equal(x, y) for x, y in zip(results[0][:2], results[1][:2]))


def test_named_duplicates_keep_their_first_name():
    w = torch.nn.Parameter(torch.randn(3, 3))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = SOAP([("a", w), ("b", w)], lr=1e-2)
    assert opt.param_groups[0]["param_names"] == ["a"]


# -- the factor budget ----------------------------------------------------------------------------


def test_a_long_dim_is_not_blocked_into_factors_over_the_budget():
    """SOAP on (1, 100000) built ten 10000-wide factors (4 GB, no first step within 100 s):
    now one block, a 1 x 1 factor, the long dim unpreconditioned; the first step is fast, the
    warning comes once and names the shape, the dim and the budget."""
    p = torch.nn.Parameter(torch.randn(1, 100000))
    q = torch.nn.Parameter(torch.randn(100000, 2))
    opt = SOAP([p, q], lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        for _ in range(2):
            p.grad, q.grad = torch.randn(1, 100000), torch.randn(100000, 2)
            opt.step()
        elapsed = time.perf_counter() - t0
    assert elapsed < 1.0
    budget = [x for x in caught if issubclass(x.category, FactorBudgetWarning)]
    assert len(budget) == 1
    text = str(budget[0].message)
    assert "(1, 100000)" in text and "dim 1" in text and str(FACTOR_BUDGET_DIM) in text
    shapes = [tuple(f.shape) for b in opt.state[p]["blocks"] for f in b["factors"] if f is not None]
    assert shapes == [(1, 1)]
    assert all(f is None or f.shape[0] <= 2 for b in opt.state[q]["blocks"] for f in b["factors"])


@pytest.mark.parametrize("name", ["kl_shampoo", "shampoo"])
def test_optimizers_that_factor_every_dim_leave_such_a_parameter_without_factors(name):
    p = torch.nn.Parameter(torch.randn(2, 100000))
    opt = OPTIMIZERS[name]([p], lr=1e-3, max_preconditioner_dim=10000)
    with pytest.warns(FactorBudgetWarning, match="every dim"):
        p.grad = torch.randn(2, 100000)
        opt.step()
    assert "blocks" not in opt.state[p]


@pytest.mark.parametrize(
    "shape,max_dim,over",
    [
        ((1, 100000), 10000, (1,)),  # the issue's: ten (1, 10000) blocks
        ((1, 10000), 10000, (1,)),  # one block, the same factor
        ((512, 10000), 10000, (1,)),  # a 10000-wide factor for 5M elements (20x)
        ((10000, 768), 10000, ()),  # an embedding's block (13x): kept, as documented
        ((4096, 11008), 10000, ()),  # an MLP's blocks
        ((3000, 2500), 10000, ()),  # square-ish blocks never
        ((1, 2048), 10000, ()),  # at the budget's width
        ((8192,), 8192, (0,)),  # a 1-D factor (Shampoo's) wider than the budget
        ((1024,), 1024, ()),  # Shampoo's default 1-D blocks
    ],
)
def test_the_budget_on_layouts(shape, max_dim, over):
    layout = make_layout(shape, max_dim, squeeze=False, factor_1d=True)
    assert layout.over_budget == over
    for i in over:  # left whole, without a factor
        assert all(b.shape[i] == shape[i] and not b.factored[i] for b in layout.blocks)
