"""Helpers of the fault tests of issue 22 (test_transactional_loads, test_all_or_nothing_steps,
test_overflow): a small two-group model, a bitwise picture of an optimizer (and its runtime) to
compare before and after a fault, and the count of the process's threads."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch

from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.runtime import StatisticsLaneError

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def two_groups(net: torch.nn.Module, name: str, **options: Any):
    """The optimizer ``name`` over ``net``'s two layers as two parameter groups."""
    groups = [{"params": list(net[0].parameters())}, {"params": list(net[2].parameters())}]
    options.setdefault("lr", 1e-2)
    options.setdefault("precondition_frequency", 2)
    return OPTIMIZERS[name](groups, **options)


def train(net: torch.nn.Module, opt: Any, steps: int, scale: float = 1.0, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 6, generator=gen)
        (net(x).square().mean() * scale).backward()
        opt.step()
        opt.zero_grad()


def picture(opt: Any, runtime: Any = None) -> Any:
    """Everything a fault must leave as it was: parameters, groups, per-parameter state and,
    with a runtime, its refreshes in flight and per-block bookkeeping. The statistics lane's
    queued updates run first (a load or a refused step waits for them too)."""
    with contextlib.suppress(StatisticsLaneError):
        opt.refresher.sync()
    params = [p for g in opt.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = {
        (index[id(k)] if isinstance(k, torch.Tensor) else k): _plain(v)
        for k, v in opt.state.items()
    }
    out = {
        "params": [p.detach().clone() for p in params],
        "groups": _plain(groups),
        "state": state,
        "nonfinite": opt.nonfinite_grads,
    }
    if runtime is not None:
        out["pending"] = {
            key: (e.pending.requested, [id(f) for f in e.pending.futures])
            for key, e in runtime.blocks().items()
            if e.pending is not None
        }
        out["entries"] = {
            key: (e.version, e.owed, e.installs, e.consecutive_failures)
            for key, e in runtime.blocks().items()
        }
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.detach().clone(), value.dtype, value.stride())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of two ``picture``s (tensors: values, dtype and strides)."""
    if isinstance(a, tuple) and a and a[0] == "tensor":
        return (
            isinstance(b, tuple)
            and b[0] == "tensor"
            and a[2] == b[2]
            and a[3] == b[3]
            and torch.equal(a[1], b[1])
        )
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def threads() -> int:
    """The process's OS threads (the pool's C++ workers included), counted once torch's own
    intra-op threads exist (they start at the first parallel op and stay)."""
    x = torch.ones(256, 256)
    (x @ x).sum()
    return len(os.listdir("/proc/self/task"))


def threads_back_to(baseline: int, timeout_s: float = 10.0) -> bool:
    """Whether the thread count comes back to ``baseline`` within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while threads() > baseline:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
