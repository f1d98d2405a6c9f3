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

    Note [Flat optimizer state]: ``state_dict()`` writes each parameter's state as one flat dict,
    ``{"step": 12, "blocks.0.exp_avg": t, "blocks.0.bases.1": t, ...}``, because that is what
    ``torch.distributed.checkpoint.state_dict`` takes: its flattening
    (``flatten_optimizer_state_dict=True``, OLMo-core's default) accepts tensors, ints, floats and
    dicts, not lists or None, and ``cpu_offload=True`` accepts no ``torch.dtype`` (so
    ``refresh_dtype`` is saved by name, ``"float32"``, and read back as the dtype; the live groups
    keep what was given). A None whose place the layout fixes (a dim without a factor) is left
    out; a refresh result not computed yet (Shampoo's roots before the first refresh) is written as
    zeros of the factor's shape: a basis or an inverse root is never zero, so zeros read back as
    None. The keys and shapes thus depend on the parameter and the options only, never on the
    step, so a checkpoint fits the placeholders of a fresh optimizer (Note
    [State-initialisation probe]), as DCP requires.

    ``load_state_dict`` rebuilds the nested state by walking ``_state_template`` (meta tensors),
    which checks every key and shape (a missing, extra or misshapen entry is a ValueError that
    names it). It takes the flat form, the same nested in dicts with string keys (torch's
    unflattening), and, as it is, the nested form of earlier versions (lists of blocks). Tensors
    pass through unchanged, so an in-memory round trip is exact, dtypes and strides included;
    through DCP a tensor takes the layout of the placeholder it is loaded into, which
    ``_state_template`` makes the optimizers' own (bases column-major).
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

    Note [Sharded state and torch's state-dict API]: under FSDP2 / HSDP the optimizer state is
    that of each rank's local shard, in plain tensors (Note [Local shards]), and DCP keeps one
    rank's copy of a plain tensor saved under one key: ``get_optimizer_state_dict`` + DCP would
    write, without a word, a checkpoint with one rank's state for all. ``state_dict()`` and
    ``load_state_dict()`` cannot tell their callers apart by their arguments, so they read the
    caller's module from the stack (``caller``, a frame): called from
    ``torch.distributed.checkpoint.state_dict`` while a parameter is sharded over more than one
    rank, they raise, pointing to ``asteria.checkpoint``, which writes each rank's state under
    keys of its own (Note [Sharded optimizer checkpoints] in asteria/checkpoint.py) and calls
    them as before. Parameters whole on every rank (DDP, one process) go through torch's API
    unchanged.
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

    Note [State-initialisation probe]: ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``
    (and the trainers built on them: torchtitan, OLMo-core) make an optimizer with no state create
    it, by calling ``step()`` with every gradient zero and every ``lr`` 0, and then rely on its
    structure: DCP loads a checkpoint into the tensors of that state (in place: their shapes,
    dtypes and layouts), and a flattened state is unflattened by the keys of the live state. For
    Adam the step is harmless; for SOAP and KL-Shampoo the first step initialises the eigenbases
    from the first gradient (the authors' rule), so zeros would leave bases of zero statistics and
    shift every later step by one. A first step (no state yet) whose gradients are all exactly
    zero with every ``lr`` 0 (a real first step never has both) therefore makes *placeholders*:
    each parameter's state as ``_state_template`` describes it, in zeros, with ``"step"`` set to
    ``PLACEHOLDER_STEP``. A placeholder counts as no state: the next real step initialises the
    parameter as a first step does, ``blocks()`` and ``is_refresh_step()`` pass over it, and
    loading a checkpoint replaces it. A checkpoint taken before the first step holds placeholders,
    which load back as placeholders.
    """
    if any(float(g["lr"]) != 0.0 for g in groups):
        return False
    return all(not bool(local_tensor(p.grad).any()) for _, _, p in todo)
