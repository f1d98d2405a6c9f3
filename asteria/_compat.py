"""What differs between the torch releases Asteria supports, in one place.

Owns: each behaviour of torch that changed inside the supported range (asteria/_supported.py)
and Asteria's side of it, decided once from the running release (Note [Per-release
differences]); the rest of asteria asks here instead of comparing versions. Must not: import
anything of asteria beyond ``asteria._supported``, or hold a difference without a test on every
release (tests/unit/test_torch_compat.py).

Note [Per-release differences]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Measured with the whole suite on 2.11.0, 2.13.0, 2.14.1 and 2.15.0 (docs/versions.md). A bare
*set* of parameters: torch up to 2.14 takes it silently, 2.15 warns (``FutureWarning``) and its
conformance suite expects the warning. A set's order changes between runs and a state_dict is
positional, so Asteria refuses one where torch is silent (``TypeError``) and from 2.15 gives
torch's warning and takes the set's order, as torch does; a set inside a group is a
``TypeError`` everywhere, as in torch.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from asteria import _supported

__all__ = [
    "SET_OF_PARAMS_WARNING",
    "TORCH_RELEASE",
    "check_params_not_a_set",
    "set_of_params_warns",
]

#: The running torch's (major, minor).
TORCH_RELEASE = _supported.release(torch.__version__)

#: torch 2.15's warning for a bare set of parameters (matched by its conformance suite).
SET_OF_PARAMS_WARNING = (
    "optimizer parameters need to be organized in ordered collections, but the ordering of "
    "tensors in sets will change between runs. Please use a list instead. This will be an error "
    "in a future release."
)


def set_of_params_warns(release: tuple[int, int] = TORCH_RELEASE) -> bool:
    """Whether torch ``release`` warns for a bare set of parameters (2.15 on) rather than
    accepting it silently (Note [Per-release differences])."""
    return release >= (2, 15)


def check_params_not_a_set(name: str, params: Any, *, in_group: bool = False) -> None:
    """The rule for ``params`` that is a set: torch's warning for the whole of the constructor's
    ``params`` where the running torch gives one, else a ``TypeError`` (and always inside a
    group, ``in_group``). Anything else passes."""
    if not isinstance(params, set):
        return
    if not in_group and set_of_params_warns():
        warnings.warn(f"{SET_OF_PARAMS_WARNING} ({name})", FutureWarning, stacklevel=3)
        return
    raise TypeError(f"params of {name} must be an ordered collection (a list), not a set")
