"""Note [Autocast] (asteria/optim/tensors.py): the caller's autocast never reaches the optimizers'
math. A refresh installed from a module's forward pre-hook runs inside the model's autocast
region, and an optimizer step may be called inside one; either way every state tensor keeps its
dtype and the step computes what it computes outside autocast.

CPU autocast stands in for the GPU's: it lowers matrix products to bf16 (or fp16) alike, and it
found the bug the H200 run hit first (SOAP's exp_avg rotated and stored in bf16 by a hook
install, then "expected mat1 and mat2 to have the same dtype" at the next step)."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.optim.tensors import no_autocast
from asteria.runtime import Runtime, RuntimeConfig
from tests.problems import state_tensors

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _train(
    name: str,
    low: torch.dtype,
    frequency: int,
    staleness: int | None,
    step_in_autocast: bool,
    steps: int = 8,
    seed: int = 0,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict | None]:
    """``steps`` steps with the forward under CPU autocast (``staleness`` None: native mode).
    Under the runtime each refresh is ready before the next forward, so that the forward
    pre-hooks install it inside the autocast region."""
    model = _model(seed)
    opt = OPTIMIZERS[name](model.parameters(), lr=1e-2, precondition_frequency=frequency)
    gen = torch.Generator().manual_seed(seed)
    data = [(torch.randn(32, 12, generator=gen), torch.randn(32, 4, generator=gen))]
    rt = None
    if staleness is not None:
        config = RuntimeConfig(staleness=staleness, workers=1, statistics_lane=False)
        rt = Runtime(model, opt, config)
    try:
        for _ in range(steps):
            if rt is not None:
                while any(e.pending and not e.pending.done() for e in rt.blocks().values()):
                    time.sleep(0.001)
            x, y = data[0]
            with torch.autocast("cpu", dtype=low):
                loss = (model(x).float() - y).square().mean()
            loss.backward()
            if step_in_autocast:
                with torch.autocast("cpu", dtype=low):
                    opt.step()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        stats = rt.stats() if rt is not None else None
    finally:
        if rt is not None:
            with torch.autocast("cpu", dtype=low):
                rt.close()  # installs what is in flight, under the caller's autocast
    return model, opt, stats


@settings(max_examples=24, deadline=None, derandomize=True)
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    low=st.sampled_from(sorted(LOW)),
    frequency=st.integers(1, 3),
    staleness=st.one_of(st.none(), st.integers(0, 3)),
    step_in_autocast=st.booleans(),
)
def test_state_keeps_its_dtype_under_the_callers_autocast(
    name, low, frequency, staleness, step_in_autocast
):
    model, opt, stats = _train(name, LOW[low], frequency, staleness, step_in_autocast)
    dtypes = {t.dtype for s in opt.state.values() for t in state_tensors(s, floating_only=True)}
    assert dtypes == {torch.float32}
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())
    if stats is not None and staleness:
        assert stats["installs"] > 0  # refreshes were installed, by hooks among others


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("staleness", [None, 0])
def test_a_step_inside_autocast_computes_what_it_computes_outside(name, staleness):
    # native mode and S = 0 are deterministic: the same forward and backward, the step called
    # inside the region or outside it, give the same state bit for bit
    _, inside, _ = _train(name, torch.bfloat16, 2, staleness, step_in_autocast=True)
    _, outside, _ = _train(name, torch.bfloat16, 2, staleness, step_in_autocast=False)
    a = [t for s in inside.state.values() for t in state_tensors(s, floating_only=True)]
    b = [t for s in outside.state.values() for t in state_tensors(s, floating_only=True)]
    assert a and len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)


def test_no_autocast_turns_off_only_what_was_on_and_restores_it():
    assert not torch.is_autocast_enabled("cpu")
    with no_autocast():
        assert not torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = torch.randn(4, 4)
        assert (a @ a).dtype == torch.bfloat16
        with no_autocast():
            assert not torch.is_autocast_enabled("cpu")
            assert (a @ a).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
