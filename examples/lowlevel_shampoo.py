"""Shampoo on Asteria's low-level API alone (docs/extending.md, example b).

A plain ``torch.optim.Optimizer``, with no Asteria base class and no runtime: it keeps Shampoo's
two factors per matrix parameter, ``L = EMA(G G^T)`` and ``R = EMA(G^T G)``, and steps along
``L^{-1/4} M R^{-1/4}`` (``M`` the momentum), scaled to the norm of ``M`` (SGD grafting, which
keeps the step size of momentum SGD while the roots change the direction). Other parameters run
momentum SGD. Every ``precondition_frequency`` steps it refreshes the roots itself:

1. at the end of step ``t`` the factors are copied into slots of a pinned ``StagingRing`` on the
   low-priority copy stream (``asteria.lowlevel.snapshot``), fenced so that the next statistics
   update waits for the copies on the device, not on the host;
2. once the copies have landed (at once on a CPU), each factor's inverse fourth root is submitted
   to the ``WorkerPool`` with the deadline of the step it is needed at;
3. at the start of step ``t + delay``, the boundary this optimizer chooses, the results are
   waited for and installed; from then on the update reads them.

``workers=0`` does the same work synchronously (``asteria.lowlevel.inverse_root`` on the factors
of step ``t``, installed at the same boundary): tests/unit/test_example_lowlevel_shampoo.py
checks that both give the same parameters, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from asteria import lowlevel as ll

__all__ = ["LowLevelShampoo"]


class LowLevelShampoo(torch.optim.Optimizer):
    """Shampoo with SGD grafting whose roots are refreshed on Asteria's worker pool."""

    def __init__(self, params, lr: float = 1e-2, momentum: float = 0.9, beta: float = 0.95,
                 epsilon: float = 1e-6, precondition_frequency: int = 10, delay: int = 1,
                 workers: int = 1, timeout_s: float = 600.0) -> None:  # fmt: skip
        if not 1 <= delay <= precondition_frequency:  # one refresh per factor in flight
            raise ValueError(f"delay must be in [1, precondition_frequency], got {delay}")
        if workers < 0:
            raise ValueError(f"workers must be >= 0 (0: synchronous), got {workers}")
        defaults = dict(lr=lr, momentum=momentum, beta=beta, epsilon=epsilon)
        super().__init__(params, defaults)
        self.frequency, self.delay, self.timeout_s = precondition_frequency, delay, timeout_s
        self.pool = ll.WorkerPool(workers=workers, lapack_threads=1) if workers else None
        self.ring: ll.StagingRing | None = None  # made at the first refresh, sized to fit
        self._copies: ll.CopyStream | None = None
        self._staged: list[tuple[ll.Snapshot, list, int]] = []  # copies not yet submitted
        self._pending: list[tuple[int, dict, str, Any]] = []  # (install step, state, side, result)
        self.steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        self.steps += 1
        self._install(self.steps)  # the step boundary: refreshes due here go in first
        factored: list[tuple[dict, float]] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self._update(p, p.grad, group)
                    if "L" in state:
                        factored.append((state, group["epsilon"]))
        if self.steps % self.frequency == 0 and factored:
            self._request(factored, install_at=self.steps + self.delay)
        self._submit_landed()
        return loss

    def _update(self, p: torch.Tensor, g: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if not state:
            state["momentum"] = torch.zeros_like(p)
            if p.dim() == 2:
                state["L"] = torch.zeros(p.shape[0], p.shape[0], dtype=p.dtype, device=p.device)
                state["R"] = torch.zeros(p.shape[1], p.shape[1], dtype=p.dtype, device=p.device)
        m = state["momentum"].mul_(group["momentum"]).add_(g)
        direction = m
        if "L" in state:
            state["L"].lerp_(g @ g.T, 1 - group["beta"])  # the statistics of this step
            state["R"].lerp_(g.T @ g, 1 - group["beta"])
            if "root_L" in state:
                direction = state["root_L"] @ m @ state["root_R"]
                direction = direction * (m.norm() / direction.norm().clamp_min(1e-30))
        p.add_(direction, alpha=-group["lr"])
        return state

    # -- the refresh: snapshot, submit, install -------------------------------------------------

    def _request(self, factored: list[tuple[dict, float]], install_at: int) -> None:
        jobs = [(state, eps, side) for state, eps in factored for side in ("L", "R")]
        factors = [state[side] for state, _, side in jobs]
        if self.pool is None:  # synchronous: the same function, here and now
            for (state, eps, side), f in zip(jobs, factors):
                root = ll.inverse_root(f, 4, epsilon=eps, dtype=f.dtype)
                self._pending.append((install_at, state, side, root))
            return
        slot_bytes = max(f.nbytes for f in factors)
        ring = self.ring
        if ring is None or ring.slots < len(factors) or ring.slot_bytes < slot_bytes:
            self.ring = ll.StagingRing(slots=len(factors), slot_bytes=slot_bytes)  # pinned once
            self._copies = ll.copy_stream(factors[0].device.type)
        snap = ll.snapshot(factors, self.ring, self._copies, timeout=self.timeout_s)
        snap.fence()  # the next statistics update waits for the copies (on the device)
        self._staged.append((snap, jobs, install_at))

    def _submit_landed(self, wait: bool = False) -> None:
        """Submit the refreshes of every snapshot whose copies have landed (of all, waiting for
        their copies, with ``wait``)."""
        staged, self._staged = self._staged, []
        for snap, jobs, install_at in staged:
            if not (wait or snap.ready()):
                self._staged.append((snap, jobs, install_at))
                continue
            hosts = snap.wait(timeout=self.timeout_s)
            for (state, eps, side), host in zip(jobs, hosts):
                future = self.pool.submit_inverse_root(  # copies the slot at submission
                    f"{id(state)}.{side}", host, 4, epsilon=eps, dtype=host.dtype,
                    deadline=install_at)  # fmt: skip
                self._pending.append((install_at, state, side, future))
            del hosts
            snap.release()  # the slots go back to the ring

    def _install(self, step: int) -> None:
        if any(at <= step for _, _, at in self._staged):
            self._submit_landed(wait=True)
        pending, self._pending = self._pending, []
        for at, state, side, result in pending:
            if at > step:
                self._pending.append((at, state, side, result))
                continue
            root = result if self.pool is None else result.result(timeout=self.timeout_s)
            state[f"root_{side}"] = root.to(state[side].device)

    def close(self) -> None:
        """Stop the pool (refreshes still queued are cancelled; installed roots stay)."""
        if self.pool is not None:
            self.pool.shutdown()
