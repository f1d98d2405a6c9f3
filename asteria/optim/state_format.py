"""The saved form of an Asteria optimizer's state: flat, portable, refused where it would be wrong.

Owns: how ``KroneckerOptimizer.state_dict`` turns each parameter's nested live state into the
flat form of Note [Flat optimizer state] and ``load_state_dict`` reads it back (``flat_state``,
``dotted``, ``fill``), ``refresh_dtype`` saved by name (``portable_group``,
``group_from_portable``), and the refusal of torch's state-dict API for per-shard state (Note
[Sharded state and torch's state-dict API]). Must not: know an algorithm's state (the optimizers'
``_state_template`` describes it) or decide when state is created (optim/base.py does).
"""

from __future__ import annotations

from typing import Any

import torch

from asteria.optim.tensors import local_tensor

__all__ = [
    "check_nested",
    "check_tensor",
    "checked_step",
    "dotted",
    "fill",
    "flat_state",
    "group_from_portable",
    "portable_group",
    "refuse_sharded_state_dict_api",
    "state_init_probe",
]


def flat_state(state: dict[str, Any], bases_field: str) -> dict[str, Any]:
    """One parameter's live state as dotted keys to tensors and numbers.

    Note [Flat optimizer state]: ``state_dict()`` writes a parameter's state as one flat dict,
    ``{"step": 12, "blocks.0.exp_avg": t, "blocks.0.bases.1": t, ...}``: what
    ``torch.distributed.checkpoint.state_dict``'s flattening takes (tensors, ints, floats and
    dicts; no lists, None or ``torch.dtype`` under ``cpu_offload``: ``refresh_dtype`` is saved by
    name). A None the layout fixes (a dim without a factor) is left out; a result not computed yet
    (Shampoo's roots before the first) is written as zeros, read back as None (a basis or a root
    is never zero). So keys and shapes depend on the parameter and options only, never on the
    step, and a checkpoint fits a fresh optimizer's placeholders (Note [State-initialisation
    probe]). ``load_state_dict`` rebuilds the nested state by walking ``_state_template``, which
    checks every key and shape; it takes the flat form, torch's unflattened one, and the nested
    form of earlier versions. Tensors pass unchanged (an in-memory round trip is exact); through
    DCP a tensor takes its placeholder's layout (``_state_template``'s: bases column-major).
    """
    flat: dict[str, Any] = {}

    def put(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                put(f"{prefix}{k}.", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                put(f"{prefix}{i}.", v)
        elif value is not None:
            flat[prefix[:-1]] = value

    for key, value in state.items():
        if key == "blocks":
            value = [_unset_results_as_zeros(b, bases_field) for b in value]
        put(f"{key}.", value)
    return flat


def _unset_results_as_zeros(block: dict[str, Any], bases_field: str) -> dict[str, Any]:
    factors = block.get("factors")
    if factors is None or bases_field not in block:
        return block
    results = [
        torch.zeros_like(f) if q is None and f is not None else q
        for q, f in zip(block[bases_field], factors)
    ]
    return {**block, bases_field: results}


def dotted(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts (torch's unflattening of the flat form) back to dotted keys."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(dotted(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def fill(template: Any, flat: dict[str, Any], prefix: str, where: str) -> Any:
    """``template`` with each leaf replaced by (popped from) ``flat``'s entry of its dotted key."""
    if isinstance(template, dict):
        return {k: fill(v, flat, f"{prefix}{k}.", where) for k, v in template.items()}
    if isinstance(template, list):
        return [fill(v, flat, f"{prefix}{i}.", where) for i, v in enumerate(template)]
    if template is None:
        return None
    key = prefix[:-1]
    if key not in flat:
        raise ValueError(
            f"{where} has no {key!r}: load a state_dict of the same optimizer class and options"
        )
    value = flat.pop(key)
    if isinstance(template, torch.Tensor):
        check_tensor(template, value, key, where)
    return value


def check_tensor(template: torch.Tensor, value: Any, key: str, where: str) -> None:
    """``value`` must be a tensor of ``template``'s shape and a floating-point dtype (the state
    keeps its saved dtype: fp32 state for bf16 parameters, Note [Flat optimizer state])."""
    if not isinstance(value, torch.Tensor) or value.shape != template.shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"{where} does not fit it: {key!r} is {got}, its layout needs "
            f"{tuple(template.shape)}; load it into the same model (sharded the same way) with "
            "the same optimizer options"
        )
    if not value.is_floating_point() or value.layout != torch.strided:
        raise ValueError(
            f"{where}: {key!r} is a {value.dtype} tensor (layout {value.layout}), a dense "
            "floating-point tensor is needed"
        )


def check_nested(template: Any, value: Any, prefix: str, where: str, results: str) -> None:
    """The nested form of earlier versions (lists of blocks) against ``template``: the same
    keys, list lengths and tensor shapes, floating-point dtypes; a refresh result (a list under
    ``results``) may be None where it was not computed yet."""
    key = prefix[:-1] or "the state"
    if isinstance(template, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {key!r} is {type(value).__name__}, a dict is needed")
        missing, extra = sorted(set(template) - set(value)), sorted(set(value) - set(template))
        if missing or extra:
            raise ValueError(
                f"{where}: {key!r} has no {missing} / has entries {extra} this optimizer does "
                "not keep: load a state_dict of the same optimizer class and options"
            )
        for k, v in template.items():
            check_nested(v, value[k], f"{prefix}{k}.", where, results)
    elif isinstance(template, list):
        if not isinstance(value, (list, tuple)) or len(value) != len(template):
            got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"{where}: {key!r} has {got} entries, {len(template)} are needed")
        for i, (t, v) in enumerate(zip(template, value)):
            if v is None and t is not None and prefix.endswith(f".{results}."):
                continue  # a refresh result not computed yet
            check_nested(t, v, f"{prefix}{i}.", where, results)
    elif template is None:
        if value is not None:
            raise ValueError(f"{where}: {key!r} must be None (a dim without a factor)")
    elif isinstance(template, torch.Tensor):
        check_tensor(template, value, key, where)


def checked_step(value: Any, where: str) -> int:
    """A parameter's ``"step"``: an integer ``>= -1`` (-1: a placeholder, Note
    [State-initialisation probe]); a one-element tensor holding one is taken as that int."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        number = value.item()
        if float(number).is_integer():
            value = int(number)
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(
            f"{where}: 'step' must be an integer >= -1 (-1: no step yet), got {value!r}"
        )
    return value


def portable_group(group: dict[str, Any]) -> dict[str, Any]:
    """A saved group with ``refresh_dtype`` by name (Note [Flat optimizer state])."""
    dtype = group.get("refresh_dtype")
    if not isinstance(dtype, torch.dtype):
        return group
    return {**group, "refresh_dtype": str(dtype).removeprefix("torch.")}


def group_from_portable(group: dict[str, Any]) -> dict[str, Any]:
    name = group.get("refresh_dtype")
    if not isinstance(name, str):
        return group
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the state_dict's refresh_dtype {name!r} is not a torch dtype")
    return {**group, "refresh_dtype": dtype}


#: The module whose functions call ``state_dict``/``load_state_dict`` in torch's state-dict API.
_TORCH_STATE_DICT_API = "torch.distributed.checkpoint.state_dict"


def refuse_sharded_state_dict_api(opt: torch.optim.Optimizer, caller: Any) -> None:
    """Refuse torch's state-dict API for state that is per local shard.

    Note [Sharded state and torch's state-dict API]: under FSDP2 / HSDP the state is each
    rank's local shard's, in plain tensors, and DCP keeps one rank's copy of a plain tensor: DCP's
    optimizer state-dict API would silently write one rank's state for all. ``state_dict()`` and
    ``load_state_dict()`` read their caller's module from the stack (``caller``): called from
    ``torch.distributed.checkpoint.state_dict`` while a parameter is sharded, they raise,
    pointing to ``asteria.checkpoint`` (Note [Sharded optimizer checkpoints]). Whole parameters
    (DDP, one process) go through torch's API unchanged.
    """
    if caller is None or caller.f_globals.get("__name__") != _TORCH_STATE_DICT_API:
        return
    for group in opt.param_groups:
        for p in group["params"]:
            placements = getattr(p, "placements", None) or ()
            mesh = getattr(p, "device_mesh", None)
            if any(pl.is_shard() and mesh.size(i) > 1 for i, pl in enumerate(placements)):
                raise RuntimeError(
                    f"{type(opt).__name__}'s state under sharded parameters (FSDP2 / HSDP) is "
                    "per local shard, in plain tensors, and torch.distributed.checkpoint keeps "
                    "one rank's copy of a plain tensor: get/set_optimizer_state_dict cannot "
                    "carry it. Save and load the model and optimizer with asteria.checkpoint "
                    "(docs/runtime.md, Checkpoints)"
                )


def state_init_probe(groups: list[dict[str, Any]], todo: list[tuple]) -> bool:
    """Whether this first step is ``torch.distributed.checkpoint.state_dict``'s probe, which
    makes placeholders instead of a step.

    Note [State-initialisation probe]: DCP's ``get/set_optimizer_state_dict`` (torchtitan,
    OLMo-core) make an optimizer without state create it by a ``step()`` with every gradient
    zero and every ``lr`` 0, then load into those tensors. For SOAP and KL-Shampoo the first step
    initialises the bases from the first gradient, so that would shift every later step. A first
    step with all-zero gradients and every ``lr`` 0 (no real first step has both) makes
    *placeholders* instead: the state ``_state_template`` describes, in zeros, ``"step"`` set to
    ``PLACEHOLDER_STEP``, counted as no state (the next real step initialises the parameter,
    ``blocks()`` and ``is_refresh_step()`` pass over it, a load replaces it).
    """
    if any(float(g["lr"]) != 0.0 for g in groups):
        return False
    return all(not bool(local_tensor(p.grad).any()) for _, _, p in todo)
