"""Property tests (issue 7, item 4): shapes 1-D to 4-D with dims around
``max_preconditioner_dim``, blocking options and dtypes, drawn by hypothesis.

* finite gradients (of any scale from 1e-4 to 1e3) give finite parameters and state;
* a blocked parameter is exactly its blocks, each trained by its own optimizer (the per-block
  reference), and Shampoo's blocking equals tests/reference.py's;
* ``state_dict`` survives ``torch.save``/``torch.load`` exactly: the run continues bitwise.

Examples are few and derandomized (the suite runs on 2 cores in CI); each is a short run.
"""

from __future__ import annotations

import copy
import io
import math

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.optim.blocking import make_layout
from tests.problems import StochasticQuartic, assert_state_equal, max_rel_diff, state_tensors
from tests.reference import RefShampoo

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}
SETTINGS = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def shape_and_max_dim(draw, max_order: int = 4):
    """A shape of order 1-4 (dims 1-9) and a max_preconditioner_dim near one of its dims."""
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=max_order)))
    near = draw(st.sampled_from(shape))
    max_dim = max(1, near + draw(st.integers(-2, 1)))
    return shape, max_dim


def _options(draw, name: str) -> dict:
    kw: dict = dict(lr=1e-2, precondition_frequency=2)
    if name == "soap":
        kw.update(
            merge_dims=draw(st.booleans()),
            precondition_1d=draw(st.booleans()),
            block_large_dims=draw(st.booleans()),
        )
    if name == "shampoo":
        kw.update(epsilon=1e-6, grafting=draw(st.sampled_from(["adam", "rmsprop", "sgd"])))
        kw.update(rel_epsilon=draw(st.sampled_from([0.0, 1e-4, 1e-2])))
    return kw


@SETTINGS
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    sm=shape_and_max_dim(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    log_scale=st.integers(-4, 3),
    data=st.data(),
)
def test_finite_gradients_give_finite_parameters_and_state(name, sm, dtype, log_scale, data):
    shape, max_dim = sm
    kw = _options(data.draw, name)
    gen = torch.Generator().manual_seed(hash((shape, max_dim, log_scale)) % 2**31)
    p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
    opt = OPTIMIZERS[name]([p], max_preconditioner_dim=max_dim, **kw)
    for _ in range(7):
        p.grad = (torch.randn(shape, generator=gen) * 10.0**log_scale).to(dtype)
        opt.step()
    assert torch.isfinite(p).all()
    state = list(state_tensors(opt.state[p], floating_only=True))
    assert state and all(torch.isfinite(v).all() for v in state)
    assert all(v.dtype == torch.promote_types(dtype, torch.float32) for v in state)
    assert opt.nonfinite_grads == 0


@SETTINGS
@given(name=st.sampled_from(sorted(OPTIMIZERS)), sm=shape_and_max_dim(), data=st.data())
def test_blocked_parameter_equals_its_blocks_trained_separately(name, sm, data):
    shape, max_dim = sm
    kw = _options(data.draw, name)
    cls = OPTIMIZERS[name]
    squeeze = name != "soap"
    if squeeze:
        # KL-Shampoo and Shampoo drop size-1 dims of a parameter before blocking; a block that
        # is a size-1 chunk keeps its dim, while a parameter of that shape would drop it.
        view = [d for d in shape if d != 1]
        assume(all(d <= max_dim or (max_dim > 1 and d % max_dim != 1) for d in view))
    kw["merge_dims"] = False if name == "soap" else None
    kw = {k: v for k, v in kw.items() if v is not None}
    problem = StochasticQuartic([shape], 8, torch.float64)
    blocked = problem.run(lambda ps: cls(ps, max_preconditioner_dim=max_dim, **kw))[0]

    # the per-block reference: one parameter per block of the layout, each its own tensor
    layout = make_layout(
        tuple(d for d in shape if d != 1) if squeeze else shape,
        max_dim,
        squeeze=False,
        block_large_dims=kw.get("block_large_dims", True),
        factor_1d=True,
    )
    view = problem.init[0].reshape(layout.view_shape)
    params = [torch.nn.Parameter(view[b.index].clone()) for b in layout.blocks]
    opt = cls(params, max_preconditioner_dim=max_dim, **kw)
    full = problem.init[0].clone()
    for t in range(problem.steps):
        grad = problem.grads([full], t)[0].reshape(layout.view_shape)
        for p, b in zip(params, layout.blocks):
            p.grad = grad[b.index].clone()
        opt.step()
        assembled = torch.empty(layout.view_shape, dtype=torch.float64)
        for p, b in zip(params, layout.blocks):
            assembled[b.index] = p.detach()
        full = assembled.reshape(shape)
    assert max_rel_diff([blocked], [full]) < 1e-10


@SETTINGS
@given(sm=shape_and_max_dim(max_order=3), data=st.data())
def test_shampoo_blocking_matches_the_reference(sm, data):
    shape, max_dim = sm
    assume(all(d > 1 for d in shape) and len(shape) >= 2)  # the reference does not squeeze
    grafting = data.draw(st.sampled_from(["adam", "rmsprop", "adagrad"]))
    kw = dict(
        lr=1e-2,
        epsilon=1e-6,
        rel_epsilon=data.draw(st.sampled_from([0.0, 1e-4, 1e-2])),
        grafting=grafting,
        precondition_frequency=2,
        max_preconditioner_dim=max_dim,
        refresh_dtype=torch.float64,
    )
    problem = StochasticQuartic([shape], 10, torch.float64)
    ours = problem.run(lambda ps: Shampoo(ps, **kw))
    params = [t.clone() for t in problem.init]
    ref = RefShampoo(params, **kw)
    for t in range(problem.steps):
        ref.step(problem.grads(params, t))
    assert max_rel_diff(ours, params) < 1e-10
    assert max_rel_diff(ours, problem.init) > 1e-4


@SETTINGS
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    shapes=st.lists(shape_and_max_dim(), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    split=st.integers(1, 6),
    data=st.data(),
)
def test_state_dict_round_trip_is_exact(name, shapes, dtype, split, data):
    kw = _options(data.draw, name)
    max_dim = shapes[0][1]
    problem = StochasticQuartic([s for s, _ in shapes], split + 4, torch.float64)
    cls = OPTIMIZERS[name]

    def make(params):
        return cls(params, max_preconditioner_dim=max_dim, **kw)

    def train(opt, params, start, stop):
        for t in range(start, stop):
            opt.zero_grad()
            problem.loss([p.double() for p in params], t).backward()
            opt.step()

    params = [torch.nn.Parameter(x.to(dtype)) for x in problem.init]
    opt = make(params)
    train(opt, params, 0, split)
    buffer = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "params": [p.detach() for p in params]}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    params2 = [torch.nn.Parameter(x.clone()) for x in saved["params"]]
    opt2 = cls(params2, lr=1.0)  # every hyperparameter comes from the state_dict
    opt2.load_state_dict(saved["opt"])
    assert_state_equal(copy.deepcopy(opt.state_dict()), opt2.state_dict())
    train(opt, params, split, split + 4)
    train(opt2, params2, split, split + 4)
    for a, b in zip(params, params2):
        assert torch.equal(a, b)
    assert all(math.isfinite(float(p.detach().double().sum())) for p in params2)
