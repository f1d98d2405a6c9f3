"""The checks of a step before it changes anything: refused inputs, non-finite gradients and
gradients that would overflow the optimizer's statistics.

Owns: ``GradientChecks``, the part of ``KroneckerOptimizer`` (base.py) that refuses a step whose
groups or parameters no longer fit (Note [Refused steps] in checks.py) and decides, before any
update, which parameters a step skips, counts the skips and warns once.

Note [Non-finite gradients]: before any update, every gradient of the step is checked with one
fused reduction per gradient (its 2-norm; when that is not finite, its inf-norm, a max of absolute
values, so that large finite values cannot overflow into a false alarm) and one host sync per
device. A parameter whose gradient has a NaN or an Inf is skipped for that step as a whole: its
step count, factors, moments, pending refreshes and the parameter itself stay exactly as they were
(the algorithms' math runs per parameter, so a per-block skip would leave the parameter
half-updated). Other parameters update as usual, with arithmetic identical to a step without the
check. Skips are counted in ``nonfinite_grads`` (``Runtime.stats()["nonfinite_grads"]``) and the
first one warns (``RuntimeWarning`` naming the parameter). ``skip_nonfinite_grads = False`` turns
the check off.

Note [Overflowing gradients]: a gradient can be finite and still make the optimizer's statistics
inf (a gradient of 1e30 squares to 1e60, past float32's 3.4e38), and an inf factor or moment
then fails every refresh, or stops the parameter, far from the step that caused it. So the same
check skips, counts (``nonfinite_grads``) and warns about (once, with the parameter's name and the
2-norm) a gradient whose 2-norm is above the limit its update allows (``_gradient_limit``, from
the 2-norms the check computes anyway: no extra reduction or sync): every new statistic term is
at most ``gain * ||g||^2`` (an entry of ``G G^T`` or ``g^2``; KL-Shampoo's whitening by
``lambda^{-1/2} <= clamp`` along the other dims is its ``gain``), an average (EMA) of finite
terms stays finite, and a sum (Shampoo's factors at ``betas[1] == 1``, Adagrad grafting) needs
room for it: a host-side bound on its largest entry, taken from the state once and raised by
each accepted term. The limit keeps a margin of 4 below the dtype's largest value. Nothing
non-finite then reaches a matrix function from a step; one that still fails (a checkpoint's inf
factor) is a counted refresh failure, whose error names the parameter's block.
tests/unit/test_overflow.py has the cases of issue 22 (1e30 gradients, sums creeping up to
float32's limit) for every optimizer, natively and with a runtime.

Must not: update any state (a skipped parameter's state stays as it was) or know the runtime.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch

from asteria.optim.checks import OVERFLOW, gradient_verdicts, options_of
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

    def _check_before_step(self, todo: list[tuple[int, dict[str, Any], torch.Tensor]]) -> dict:
        """Note [Refused steps] in checks.py: what a step would fail on midway, refused before it
        changes anything: a group's options edited since they were last checked
        (``param_groups[i]["lr"] = -1``: the constructor's checks, ``_validate_group``), and a
        parameter whose shape, dtype or blocking options changed under its state (``p.data =
        ...`` of another shape, ``max_preconditioner_dim`` edited after the first step). Returns
        each group's options (by identity)."""
        name = type(self).__name__
        seen_options: dict[int, tuple] = {}
        for pid, group, p in todo:
            options = seen_options.get(id(group))
            if options is None:
                options = seen_options[id(group)] = self._checked_group(group)
            state = self.state.get(p)
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
