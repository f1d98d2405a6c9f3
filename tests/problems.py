"""Seeded test problems shared by the optimizer tests, and ``state_tensors`` to walk state.

A separable stochastic objective per parameter, ``sum((p - a)^2) + 0.1 sum(p^4) + <p, noise_t>``:
fresh noise every step keeps consecutive gradients generic, so the eigenbases are well defined
(a repeated or rank-deficient gradient makes SOAP's Adam-in-eigenbasis normalise round-off, and
any two correct implementations then diverge; see the note in tests/unit/test_against_peers.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch


class StochasticQuartic:
    """Identical initial parameters and gradient noise for every optimizer that runs on it."""

    def __init__(
        self, shapes: Sequence[tuple[int, ...]], steps: int, dtype: torch.dtype, seed: int = 0
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.shapes = [tuple(s) for s in shapes]
        self.dtype = dtype
        self.steps = steps
        self.init = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
        self.targets = [
            torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes
        ]
        self.noise = [
            [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
            for _ in range(steps)
        ]

    def params(self) -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(t.clone()) for t in self.init]

    def loss(self, params: Sequence[torch.Tensor], t: int) -> torch.Tensor:
        total = torch.zeros((), dtype=self.dtype)
        for p, a, n in zip(params, self.targets, self.noise[t]):
            total = total + ((p - a) ** 2).sum() + 0.1 * (p**4).sum() + (p * n).sum()
        return total

    def grads(self, params: Sequence[torch.Tensor], t: int) -> list[torch.Tensor]:
        ps = [p.detach().requires_grad_(True) for p in params]
        return list(torch.autograd.grad(self.loss(ps, t), ps))

    def run(
        self,
        make_opt: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
        steps: int | None = None,
    ) -> list[torch.Tensor]:
        """Train fresh parameters with ``make_opt(params)``; the final parameters."""
        params = self.params()
        opt = make_opt(params)
        for t in range(self.steps if steps is None else steps):
            opt.zero_grad()
            self.loss(params, t).backward()
            opt.step()
        return [p.detach().clone() for p in params]


def max_rel_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """Largest relative difference ``|a - b| / |b|`` (Frobenius) over a list of tensors."""
    return max(
        float((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-300))
        for x, y in zip(a, b)
    )


def state_tensors(value: object, floating_only: bool = False) -> Iterator[torch.Tensor]:
    """Every tensor in a nested optimizer state (dicts, lists and tuples of tensors and None);
    with ``floating_only``, the floating-point ones."""
    if isinstance(value, torch.Tensor):
        if not floating_only or value.is_floating_point():
            yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from state_tensors(v, floating_only)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from state_tensors(v, floating_only)


def assert_state_equal(a: object, b: object) -> None:
    """Two nested states are equal: same structure, tensors of the same dtype and bits."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_state_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_state_equal(x, y)
    else:
        assert a == b


def mlp_24_32_32_4() -> torch.nn.Module:
    """The small seeded MLP (24 -> 32 -> 32 -> 4, tanh) the tier and window tests train."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(24, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )  # fmt: skip


def mlp_12_16_3(layers: int) -> torch.nn.Module:
    """A seeded MLP 12 -> 16 -> (16 ->) x ``layers`` -> 3 (tanh): the depth-varied model of the
    host-work and window-install tests."""
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = [torch.nn.Linear(12, 16), torch.nn.Tanh()]
    for _ in range(layers):
        mods += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
    mods.append(torch.nn.Linear(16, 3))
    return torch.nn.Sequential(*mods)


def mlp_12_16_3_step(model: torch.nn.Module, opt: torch.optim.Optimizer, t: int) -> None:
    """One step of ``mlp_12_16_3`` on the seeded batch ``t`` (8 points, MSE)."""
    gen = torch.Generator().manual_seed(t)
    x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 3, generator=gen)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
