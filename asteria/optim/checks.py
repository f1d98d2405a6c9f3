"""Checks of the optimizers' inputs: hyperparameter ranges, parameters and finite gradients.

Owns: ``check_range`` and its pair/optional variants (a ``ValueError`` that names the argument and
the allowed range), ``gradient_verdicts`` (Notes [Non-finite gradients] and [Overflowing
gradients] in overflow.py: which gradients of a step have NaN or Inf values or would overflow the
optimizer's statistics, one fused reduction per gradient, agreed over a DTensor's mesh), the
parameters as torch.optim takes them (``param_list``, ``drop_duplicates``: Note [torch.optim
conventions]) and a group's options as a step compares them (``options_of``: Note [Refused
steps] in base.py).

Must not: change anything it checks.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from asteria import _compat

__all__ = [
    "NONFINITE",
    "OVERFLOW",
    "check_betas",
    "check_lr",
    "check_range",
    "check_shampoo_beta",
    "drop_duplicates",
    "finite_flags",
    "gradient_verdicts",
    "options_of",
    "param_list",
]


def check_range(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    integer: bool = False,
) -> None:
    """Raise ``ValueError`` naming ``name`` and the allowed range when ``value`` is outside it."""
    kind = "an integer" if integer else "a finite number"
    lo = "-inf" if low is None else f"{low}"
    hi = "inf" if high is None else f"{high}"
    closed_high = high_inclusive and high is not None
    allowed = f"{'[' if low_inclusive else '('}{lo}, {hi}{']' if closed_high else ')'}"
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    # NaN and +-inf are never meaningful hyperparameters (a bound of None means "no limit").
    if isinstance(value, bool) or not ok_type or (not integer and not math.isfinite(value)):
        raise ValueError(f"{name} must be {kind} in {allowed}, got {value!r}")
    if low is not None and (value < low or (value == low and not low_inclusive)):
        raise ValueError(f"{name} must be in {allowed}, got {value!r}")
    if high is not None and (value > high or (value == high and not high_inclusive)):
        raise ValueError(f"{name} must be in {allowed}, got {value!r}")


def check_lr(lr: Any) -> None:
    """``lr`` must be a number in ``[0, inf)``, or a 1-element floating-point tensor holding one
    (``torch.optim`` takes a Tensor lr, which LR schedulers then fill in place)."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:  # torch.optim's words
            raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
        if not lr.is_floating_point():
            raise ValueError(f"lr must be a number or a floating-point tensor, got {lr.dtype}")
        lr = lr.item()
    check_range("lr", lr, 0.0)


def check_betas(betas: Any, *, second_may_be_one: bool = False) -> None:
    """``betas`` must be a pair in ``[0, 1)`` (the second may be 1 where sums are allowed)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    check_range("betas[0]", betas[0], 0.0, 1.0, high_inclusive=False)
    check_range("betas[1]", betas[1], 0.0, 1.0, high_inclusive=second_may_be_one)


def check_shampoo_beta(value: Any) -> None:
    """``None`` or a negative number (the authors' spelling) mean ``betas[1]``; else ``[0, 1)``."""
    if value is not None and not (isinstance(value, (int, float)) and value < 0):
        check_range("shampoo_beta", value, 0.0, 1.0, high_inclusive=False)


def finite_flags(grads: list[torch.Tensor]) -> list[bool]:
    """Whether each gradient is finite (``gradient_verdicts`` without a limit)."""
    verdicts, _ = gradient_verdicts(grads, [math.inf] * len(grads))
    return [v != NONFINITE for v in verdicts]


#: ``gradient_verdicts``' verdicts: a NaN or Inf value; finite but over its limit.
NONFINITE, OVERFLOW = "non-finite", "overflow"


def gradient_verdicts(
    grads: list[torch.Tensor], limits: list[float]
) -> tuple[list[str | None], list[float]]:
    """Per gradient: ``None`` (use it), ``NONFINITE`` or ``OVERFLOW`` (its 2-norm is above its
    entry of ``limits``: Note [Overflowing gradients] in overflow.py), and an upper bound on its
    2-norm (a host float).

    One 2-norm per gradient, one host sync per device, and an inf-norm for a gradient whose
    2-norm is not finite: NaN and Inf propagate into both norms, and the 2-norm can overflow on
    large finite values where the inf-norm, a max of absolute values, cannot (such a gradient's
    2-norm is bounded by ``inf-norm * sqrt(numel)``). Sharded (DTensor) gradients are checked
    on their local shards, and the "skip" flags are max-reduced over every dim of their mesh
    (one small collective per mesh dim, issued in the same order on every rank), so every rank
    of a shard group takes the same decision.
    """
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


# Note [torch.optim conventions]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# SOAP, KL-Shampoo and Shampoo keep every generic convention of ``torch.optim.Optimizer`` that
# torch's own optimizer tests check (test/test_optim.py, TestOptimRenewed), and the project's
# conformance suite checks the same on an ``OptimizerInfo`` per optimizer
# (tests/unit/test_torch_conformance.py), natively and with a runtime attached:
#   * params: tensors, parameter groups, or ``(name, tensor)`` pairs (``named_parameters()``),
#     whose names go to the group's ``param_names`` and so into the ``state_dict``; what is not
#     an ordered iterable of those is a ``TypeError`` in torch's words (a single tensor
#     included), duplicates warn (and are kept once: Note [Duplicate
#     parameters]) and a parameter in two groups is a ``ValueError``, as in torch;
#     an empty list is one empty group that steps as a no-op (torch raises).
#   * ``lr`` may be a 1-element floating-point tensor (checked before the parameters, as torch
#     does, "Tensor lr must be 1-element"); schedulers fill it in place.
#   * ``state_dict``: pre-hooks, then the dict, then post-hooks, whose result is what is
#     returned; entries of ``state`` that are not a parameter's (a hook's) are kept as they
#     are. ``load_state_dict``: pre-hooks on a shallow copy of what is given (a result
#     replaces it), the groups (saved options; live ``param_names`` where the saved have none)
#     and the state restored, then post-hooks. Saving is deterministic, loads into equal but
#     not identical parameters, and survives ``torch.save`` / ``torch.load(weights_only=True)``.
#   * ``copy.deepcopy`` and pickling keep every attribute but the hooks (as torch), the
#     refresher (a copy steps natively; a runtime's refreshes in flight go along as a loaded
#     checkpoint's would) and the layout cache (keyed by parameter identity, rebuilt).
#   * Step pre/post hooks, global and per optimizer, run in torch's order (torch's own wrapper of
#     ``step``).
# Not offered: foreach, fused, capturable and differentiable (implementation flags of torch's
# element-wise optimizers; a constructor given one raises TypeError), maximize, complex and
# sparse parameters or gradients (a RuntimeError that names them).


def param_list(name: str, params: Any) -> list:
    """``params`` as a list; an empty one becomes one empty group (an optimizer with nothing to
    do steps as a no-op, where ``torch.optim`` raises). What is not an ordered iterable is a
    ``TypeError`` in torch's words (Note [torch.optim conventions])."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, "
            f"but got {torch.typename(params)} ({name}: a single tensor goes in a list)"
        )
    _compat.check_params_not_a_set(name, params)  # torch 2.15 warns: Note [Per-release differences]
    try:
        params = list(params)
    except TypeError:
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, "
            f"but got {type(params).__name__} ({name})"
        ) from None
    return params if params else [{"params": []}]


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


def drop_duplicates(group: dict[str, Any]) -> None:
    """A parameter listed twice in ``group`` kept once, at its first place (and its name).

    Note [Duplicate parameters]: ``torch.optim`` warns of a parameter group with duplicate
    parameters and carries on, stepping the parameter once per listing on one state. For a
    Kronecker-factored optimizer that would add its statistics twice a step, and under a
    runtime give one block two keys (the registry's bookkeeping of one block, twice: an
    internal AssertionError). So, after torch's warning, the group keeps the first listing only:
    the parameter trains as if listed once, natively and under a runtime alike
    (tests/unit/test_layouts.py). ``state_dict`` then has one entry per distinct parameter."""
    params = group["params"]
    seen: set[int] = set()
    keep = [i for i, p in enumerate(params) if not (id(p) in seen or seen.add(id(p)))]
    if len(keep) == len(params):
        return
    group["params"] = [params[i] for i in keep]
    if "param_names" in group:
        group["param_names"] = [group["param_names"][i] for i in keep]
