"""What differs between the torch releases Asteria supports, in one place.

Owns: each behaviour of torch that changed inside the supported range (torch 2.11 to 2.15,
asteria/_supported.py) and Asteria's side of it, decided once from the running torch's release
(Note [Per-release differences]). The rest of asteria asks here instead of comparing versions.

Must not: import anything of asteria beyond ``asteria._supported`` (the optimizers' base imports
this module), or hold a difference without a test that runs on every release
(tests/unit/test_torch_compat.py).

Note [Per-release differences]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Measured by running the whole suite on 2.11.0, 2.13.0, 2.14.1 and 2.15.0 (docs/versions.md):

* A bare *set* of parameters given to an optimizer's constructor. torch up to 2.14 accepts it
  silently (its ``add_param_group`` refuses a set inside a group, from 2.11 on); torch 2.15 warns
  (``FutureWarning``, "optimizer parameters need to be organized in ordered collections ... This
  will be an error in a future release") and goes on, and its conformance suite
  (``torch.testing._internal``'s ``get_error_inputs_for_all_optims``) expects that warning.
  A set's order changes between runs, and an optimizer's state_dict keys its state by position,
  so Asteria refuses one where torch does not speak (``TypeError``) and, from 2.15 on, gives
  torch's own warning and takes the set's order, as torch does: the same rule as ``torch.optim``
  on each release, stricter only where torch is silent. A set inside a parameter group stays a
  ``TypeError`` on every release, as in torch.
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
