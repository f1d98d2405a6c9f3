"""Each per-release difference of asteria/_compat.py (Note [Per-release differences]) checked
against the running torch's own behaviour: this file runs on every release of the range (CI's
two, ``make test-torch TORCH=<release>`` for the others), so a difference decided for the wrong
releases fails on the release where torch and Asteria part."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn import Parameter

from asteria import _compat
from asteria.optim import SOAP, KLShampoo, Shampoo

OPTIMIZERS = [SOAP, KLShampoo, Shampoo]


def _params() -> list[Parameter]:
    return [Parameter(torch.randn(3, 2)), Parameter(torch.randn(4))]


def _torch_warns_for_a_set() -> bool:
    """Whether the running torch's own optimizer warns for a bare set (or accepts it silently)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.optim.SGD(set(_params()), lr=0.1)
    return any(
        issubclass(w.category, FutureWarning) and "ordered collections" in str(w.message)
        for w in seen
    )


def test_the_release_boundary_of_the_set_rule_is_torchs():
    assert _compat.set_of_params_warns() == _torch_warns_for_a_set()
    assert _compat.set_of_params_warns((2, 14)) is False
    assert _compat.set_of_params_warns((2, 15)) is True


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_bare_set_of_params_follows_the_running_torch(cls):
    """torch 2.15 on: torch's warning (its conformance suite's regex) and the set's parameters
    all taken; before: a TypeError where torch is silent (a set's order changes between runs)."""
    params = set(_params())
    if _torch_warns_for_a_set():
        with pytest.warns(FutureWarning, match="optimizer parameters need to be organized"):
            opt = cls(params, precondition_frequency=2)
        assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in params}
    else:
        with pytest.raises(TypeError, match="ordered collection .a list., not a set"):
            cls(params, precondition_frequency=2)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_set_inside_a_group_is_refused_on_every_release(cls):
    with pytest.raises(TypeError):
        torch.optim.SGD([{"params": set(_params())}], lr=0.1)
    with pytest.raises(TypeError, match="not a set"):
        cls([{"params": set(_params())}], precondition_frequency=2)
    opt = cls(_params(), precondition_frequency=2)
    with pytest.raises(TypeError, match="not a set"):
        opt.add_param_group({"params": set(_params())})
    assert len(opt.param_groups) == 1
