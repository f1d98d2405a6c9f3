"""Checks of the optimizers' constructor inputs: hyperparameter ranges and parameters.

Owns: ``check_range`` and its pair/optional variants (a ``ValueError`` that names the argument and
the allowed range) and the parameters as torch.optim takes them (``param_list``,
``drop_duplicates``: Note [torch.optim conventions]). A step's own checks are overflow.py's.

Must not: change anything it checks.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from asteria import _compat

__all__ = [
    "check_betas",
    "check_lr",
    "check_range",
    "check_shampoo_beta",
    "drop_duplicates",
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


# Note [torch.optim conventions]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# SOAP, KL-Shampoo and Shampoo keep every generic convention of ``torch.optim.Optimizer`` that
# torch's own tests check (test/test_optim.py), as tests/unit/test_torch_conformance.py checks on
# an ``OptimizerInfo`` per optimizer, natively and with a runtime: params as tensors, groups or
# ``(name, tensor)`` pairs (names into ``param_names`` and the ``state_dict``; anything else a
# ``TypeError`` in torch's words; duplicates warn and are kept once, Note [Duplicate
# parameters]; a parameter in two groups a ``ValueError``; an empty list one empty group);
# a 1-element tensor ``lr``; ``state_dict``/``load_state_dict`` with their pre- and post-hooks,
# deterministic, loading into equal parameters and surviving ``torch.load(weights_only=True)``;
# ``copy.deepcopy`` and pickling (less the hooks, the refresher and the layout cache); step
# hooks in torch's order. Not offered: foreach, fused, capturable, differentiable (a
# ``TypeError``), maximize, complex or sparse parameters or gradients (a ``RuntimeError``).


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


def drop_duplicates(group: dict[str, Any]) -> None:
    """A parameter listed twice in ``group`` kept once, at its first place (and its name).

    Note [Duplicate parameters]: ``torch.optim`` warns and steps a duplicate once per listing on one
    state: a Kronecker-factored optimizer would add its statistics twice, and a runtime give one
    block two keys (an internal AssertionError). So after torch's warning the group keeps the first
    listing only, natively and under a runtime (tests/unit/test_layouts.py)."""
    params = group["params"]
    seen: set[int] = set()
    keep = [i for i, p in enumerate(params) if not (id(p) in seen or seen.add(id(p)))]
    if len(keep) == len(params):
        return
    group["params"] = [params[i] for i in keep]
    if "param_names" in group:
        group["param_names"] = [group["param_names"][i] for i in keep]
