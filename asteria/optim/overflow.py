"""The checks of a step before it changes anything: refused inputs, non-finite gradients and
gradients that would overflow the optimizer's statistics.

Owns: ``GradientChecks``, the part of ``KroneckerOptimizer`` (base.py) that refuses a step whose
groups or parameters no longer fit (Note [Refused steps]; ``options_of``) and decides, before any
update, which parameters a step skips (``gradient_verdicts``: one fused reduction per gradient,
agreed over a DTensor's mesh), counts the skips and warns once.

Note [Non-finite gradients]: every gradient of the step is checked before any update, one fused
reduction each (its 2-norm; where not finite, its inf-norm, which cannot overflow) and one host
sync per device. A parameter whose gradient has a NaN or an Inf skips the step whole (its count,
factors, moments, refreshes and values stay), the others update with unchanged arithmetic; skips
count in ``nonfinite_grads`` and the first warns. ``skip_nonfinite_grads = False`` turns it off.

Note [Overflowing gradients]: a finite gradient can still make the statistics inf (1e30 squares
past float32), which then fails every refresh far from its cause. So the same check skips,
counts and warns about a gradient whose 2-norm is above the limit its update allows
(``_gradient_limit``, from the same norms: every new statistic term is at most ``gain *
||g||^2``, KL-Shampoo's ``gain`` its clamp; an EMA of finite terms stays finite, and a sum,
Shampoo's factors at ``betas[1] == 1`` or Adagrad grafting, keeps a host-side bound of its
largest entry), with a margin of 4 below the dtype's largest value. tests/unit/test_overflow.py
has issue 22's cases for every optimizer, natively and with a runtime.

Must not: update any state (a skipped parameter's state stays as it was) or know the runtime.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch

from asteria.optim.tensors import PLACEHOLDER_STEP, _is_placeholder, local_tensor, state_dtype

#: Statistics are kept this far below the dtype's largest value: their EMAs and sums add two
#: terms that are each below it (Note [Overflowing gradients]).
_OVERFLOW_MARGIN = 4.0


@functools.cache
def _float_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


class GradientChecks:
    """The gradient checks of ``KroneckerOptimizer`` (a mixin of it: the attributes it reads,
    ``skip_nonfinite_grads``, ``nonfinite_grads``, ``param_names`` and ``_summed_bounds``,
    are set in its ``__init__``)."""

    def _check_before_step(
        self, todo: list[tuple[int, dict[str, Any], torch.Tensor]], states: dict[int, Any]
    ) -> dict:
        """Note [Refused steps]: what a step would fail on midway, refused before it changes
        anything: a group's options edited since last checked (the constructor's checks) and a
        parameter whose shape, dtype or blocking no longer fits its state (``states``: the states by
        identity). Returns each group's options (by identity)."""
        name = type(self).__name__
        seen_options: dict[int, tuple] = {}
        for pid, group, p in todo:
            options = seen_options.get(id(group))
            if options is None:
                options = seen_options[id(group)] = self._checked_group(group)
            state = states.get(id(p))
            if not state or state.get("step") == PLACEHOLDER_STEP:
                continue
            quick = (p.shape, p.dtype, options)
            kept = self._state_keys.get(id(p))
            if kept is not None and kept[0] == quick:
                continue
            now = (self._layout_key(local_tensor(p), group), state_dtype(p))
            seen = now if kept is None else kept[1]
            if seen != now:
                what = self.param_names.get(pid, f"param{pid}")
                raise ValueError(
                    f"{name}.step: parameter '{what}' (index {pid}) has state for shape, "
                    f"blocking options and state dtype {seen}, but is now {now}: its state does "
                    "not fit it. Nothing was updated; to change a parameter's shape, dtype or "
                    "blocking after its first step, make a new optimizer (or clear its state: "
                    "del opt.state[p])"
                )
            self._state_keys[id(p)] = (quick, now)
        return seen_options

    def _checked_group(self, group: dict[str, Any]) -> tuple:
        """``group``'s options, checked with the constructor's checks where they changed."""
        options = options_of(group)
        if self._checked_options.get(id(group)) != options:
            try:
                self._validate_group(group)
            except (ValueError, TypeError, KeyError) as err:
                index = next(i for i, g in enumerate(self.param_groups) if g is group)
                raise ValueError(
                    f"{type(self).__name__}.step: param_groups[{index}] was changed to a value "
                    f"the optimizer does not take: {err}; nothing was updated"
                ) from None
            self._checked_options[id(group)] = options
        return options

    def _check_grad_kind(self, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        if grad.is_complex():
            raise RuntimeError(f"{type(self).__name__} does not support complex gradients")

    def _skip_nonfinite(self, pid: int, p: torch.Tensor, verdict: str, norm: float) -> None:
        """Count a skipped update (Notes [Non-finite gradients], [Overflowing gradients]); the
        first of each kind warns."""
        self.nonfinite_grads += 1
        overflow = verdict == OVERFLOW
        if self._overflow_warned if overflow else self._nonfinite_warned:
            return
        name = self.param_names.get(pid, f"param{pid}")
        if overflow:
            self._overflow_warned = True
            what = (
                f"is finite but so large (2-norm up to {norm:.3g}) that its update would "
                f"overflow the optimizer's factors or moments ({state_dtype(p)})"
            )
        else:
            self._nonfinite_warned = True
            what = "has NaN or Inf values"
        warnings.warn(
            f"{type(self).__name__}: the gradient of parameter '{name}' (index {pid}, shape "
            f"{tuple(p.shape)}) {what}; its update is skipped for this step "
            "(factors, moments and the parameter are left unchanged). Later skips are counted "
            "in optimizer.nonfinite_grads without a warning.",
            RuntimeWarning,
            stacklevel=4,
        )

    def _gradient_verdicts(self, todo: list[tuple]) -> tuple[list[str | None], list[float]]:
        """``checks.gradient_verdicts`` of a step's gradients (``todo``: ``(pid, group, p)``)
        against their limits (``_gradient_limit``, cached per parameter), and what the updated
        ones add to their summed statistics' bounds; one frame for every parameter."""
        bounds = self._summed_bounds
        per_group: dict[int, tuple] = {}
        limits, sums = [], []
        for _, group, p in todo:
            kept = per_group.get(id(group))
            if kept is None:
                kept = (self._gain_options(group), self._sums_statistics(group))
                per_group[id(group)] = kept
            cached = bounds.get(("limit", id(p)))
            if cached is None or cached[0] != (p.dtype, p.shape, kept[0]):
                cached = self._limit_of(p, group, (p.dtype, p.shape, kept[0]))
            big, gain = cached[1], cached[2]
            if kept[1]:
                summed = bounds.get(id(p))
                if summed is None:
                    summed = self._summed_bound(p, group)
                if math.isfinite(summed):  # (a loaded non-finite sum fails its refreshes)
                    big -= summed
                sums.append(p)
            limits.append(math.sqrt(max(big, 0.0) / gain))
        verdicts, norms = gradient_verdicts([p.grad for _, _, p in todo], limits)
        if sums:  # a step of p with a gradient of 2-norm n adds at most gain * n^2 to each sum
            for (_, _, p), verdict, norm in zip(todo, verdicts, norms):
                if verdict is None and id(p) in bounds:
                    bounds[id(p)] += bounds[("limit", id(p))][2] * norm * norm
        return verdicts, norms

    def _limit_of(self, p: torch.Tensor, group: dict[str, Any], key: tuple) -> tuple:
        cached = (
            key,
            _float_max(state_dtype(p)) / _OVERFLOW_MARGIN,
            self._statistics_gain(p, group),
        )
        self._summed_bounds[("limit", id(p))] = cached
        return cached

    def _gain_options(self, group: dict[str, Any]) -> Any:
        """The group options ``_statistics_gain`` depends on (with the parameter's shape)."""
        return None

    def _statistics_gain(self, p: torch.Tensor, group: dict[str, Any]) -> float:
        """How much larger than ``||g||^2`` a statistic's new term may be (KL-Shampoo whitens the
        gradient before its factors see it); 1 where each term is a product of two gradients."""
        return 1.0

    def _sums_statistics(self, group: dict[str, Any]) -> bool:
        """Whether some statistic of ``group``'s parameters is a sum over steps (Shampoo's
        factors with ``betas[1] == 1``, Adagrad grafting), not an average."""
        return False

    def _largest_summed(self, p: torch.Tensor, state: dict[str, Any], group: dict) -> float:
        """The largest entry of ``p``'s summed statistics in ``state`` (a host sync)."""
        return 0.0

    def _summed_bound(self, p: torch.Tensor, group: dict[str, Any]) -> float:
        bound = self._summed_bounds.get(id(p))
        if bound is None:
            state = self.state.get(p)
            fresh = not state or _is_placeholder(state)
            bound = 0.0 if fresh else self._largest_summed(p, state, group)
            self._summed_bounds[id(p)] = bound
        return bound


def finite_flags(grads: list[torch.Tensor]) -> list[bool]:
    """Whether each gradient is finite (``gradient_verdicts`` without a limit)."""
    verdicts, _ = gradient_verdicts(grads, [math.inf] * len(grads))
    return [v != NONFINITE for v in verdicts]


#: ``gradient_verdicts``' verdicts: a NaN or Inf value; finite but over its limit.
NONFINITE, OVERFLOW = "non-finite", "overflow"


def gradient_verdicts(
    grads: list[torch.Tensor], limits: list[float]
) -> tuple[list[str | None], list[float]]:
    """Per gradient: ``None`` (use it), ``NONFINITE`` or ``OVERFLOW`` (its 2-norm above its
    ``limits`` entry: Note [Overflowing gradients]), and a bound on its 2-norm (a host float). One
    2-norm per gradient and one host sync per device, an inf-norm where the 2-norm is not finite
    (which cannot overflow; the 2-norm is then at most ``inf-norm * sqrt(numel)``). DTensor
    gradients are checked on their local shards, the flags max-reduced over their mesh, so every
    rank of a shard group decides alike."""
    verdicts: list[str | None] = [None] * len(grads)
    norms = [0.0] * len(grads)
    by_device: dict[torch.device, list[int]] = {}
    sharded: list[int] = []
    for i, g in enumerate(grads):
        if hasattr(g, "to_local"):
            sharded.append(i)
        else:
            by_device.setdefault(g.device, []).append(i)
    for indices in by_device.values():
        # A finite 2-norm means finite values, and on the CPU it is several times cheaper than
        # the inf-norm; a 2-norm that overflowed on large finite values is told apart by the
        # inf-norm of that gradient.
        two = torch.stack(torch._foreach_norm([grads[i] for i in indices], 2)).tolist()
        suspects = [i for i, v in zip(indices, two) if not math.isfinite(v)]
        for i, v in zip(indices, two):
            norms[i] = v
        if suspects:
            inf = torch.stack(torch._foreach_norm([grads[i] for i in suspects], math.inf)).tolist()
            for i, v in zip(suspects, inf):
                norms[i] = v * math.sqrt(grads[i].numel()) if math.isfinite(v) else math.inf
                if not math.isfinite(v):
                    verdicts[i] = NONFINITE
        for i in indices:
            if verdicts[i] is None and norms[i] > limits[i]:
                verdicts[i] = OVERFLOW
    if sharded:
        _sharded_verdicts(grads, sharded, limits, verdicts, norms)
    return verdicts, norms


def _sharded_verdicts(
    grads: list[torch.Tensor],
    indices: list[int],
    limits: list[float],
    verdicts: list[str | None],
    norms: list[float],
) -> None:
    """``gradient_verdicts`` for DTensor gradients: local inf-norms (a shard's 2-norm bounded by
    ``inf-norm * sqrt(global numel)``), the flags (1: overflow, 2: non-finite) max-reduced over
    the mesh."""
    import torch.distributed as dist

    by_mesh: dict[int, tuple[Any, list[int]]] = {}
    for i in indices:
        mesh = grads[i].device_mesh
        by_mesh.setdefault(id(mesh), (mesh, []))[1].append(i)
    for mesh, members in by_mesh.values():
        locals_ = [grads[i].to_local() for i in members]
        flags = torch.zeros(len(members), dtype=torch.float32, device=locals_[0].device)
        device = locals_[0].device
        inf = torch.stack(
            [  # an empty shard (uneven sharding) is finite
                torch.linalg.vector_norm(g, math.inf).float()
                if g.numel()
                else torch.zeros((), device=device)
                for g in locals_
            ]
        ).tolist()
        for k, i in enumerate(members):
            bound = inf[k] * math.sqrt(grads[i].numel())
            norms[i] = bound if math.isfinite(inf[k]) else math.inf
            flags[k] = 2.0 if not math.isfinite(inf[k]) else float(bound > limits[i])
        for dim in range(mesh.ndim):
            if mesh.size(dim) > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        for i, v in zip(members, flags.tolist()):
            verdicts[i] = NONFINITE if v == 2.0 else OVERFLOW if v == 1.0 else None


def options_of(group: dict[str, Any]) -> tuple:
    """A group's options as ``_check_before_step`` compares them (a tensor by identity: a
    scheduler fills a tensor ``lr`` in place, and reading it would wait for its device)."""
    return tuple(
        (k, id(v) if isinstance(v, torch.Tensor) else v)
        for k, v in group.items()
        if k not in ("params", "param_names")
    )


# Note [Refused steps]
# ~~~~~~~~~~~~~~~~~~~~
# A ``step()`` either runs to its end or raises before it changes anything (parameters,
# ``opt.state``, a runtime's versions and refreshes in flight), for every input a caller can
# hand it: a sparse or complex gradient (``_check_grad_kind``, in the first pass over the
# parameters), a group option edited after construction to a value the constructor refuses
# (``param_groups[0]["lr"] = -1``, ``"x"``, NaN, ``betas`` out of range, a frequency of 0 or 1.5,
# a ``refresh_dtype`` of float16: each ran, silently wrong, or failed midway with a parameter
# updated), and a parameter whose shape, dtype or blocking options no longer fit its state
# (``p.data = torch.randn(5, 3)`` over a (4, 3) state, ``max_preconditioner_dim`` edited after
# the first step: failed midway). ``_check_before_step`` checks them all first, with the
# constructor's own checks, once per change of a group's options (a dict compare per group and
# step otherwise). A non-finite gradient is not refused: its parameter skips the step (Note
# [Non-finite gradients]). tests/unit/test_refusals.py draws the bad inputs with hypothesis and
# compares a deep snapshot of everything observable before and after the refused step.
