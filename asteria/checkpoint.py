"""Model, Asteria optimizer and runtime checkpoints through ``torch.distributed.checkpoint``.

Owns: how a model, an Asteria optimizer and a :class:`~asteria.Runtime` are written to and read
from a DCP checkpoint, on one process or every rank of a ``torch.distributed`` job (DDP, FSDP2,
HSDP). Must not: decide when to save, or hold the caller's other state (pass it as ``extra``).

Note [Sharded optimizer checkpoints]: DCP reshards DTensors and treats plain tensors as
replicated (one rank writes a key), right for the model, wrong for an optimizer under FSDP2,
whose state is per *local shard*. So each rank writes its optimizer's (and runtime's)
``state_dict`` under keys of its own, ``asteria_optimizer.rank<r>``: the tensors as tensors
(written in parallel) and the rest as a pickled *skeleton* naming each tensor's shape and dtype,
read first on load. The state cannot be resharded (two half-shards' factors are not the whole's):
a load on another number of ranks fails saying what to do, unless every parameter was replicated
(then rank 0's state loads everywhere).
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist

from asteria.optim.tensors import local_tensor

__all__ = ["load", "parts", "save"]

MODEL, OPTIMIZER, RUNTIME, EXTRA, META = (
    "model",
    "asteria_optimizer",
    "asteria_runtime",
    "extra",
    "asteria_meta",
)
FORMAT = 1
_TENSOR = "__tensor__"


def save(
    checkpoint_id: Any,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    runtime: Any | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write ``model``, ``optimizer`` (its ``state_dict``), ``runtime`` (its refreshes in
    flight, Note [Checkpoints with work in flight]) and ``extra`` (anything picklable, rank 0's)
    to ``checkpoint_id``. Under ``torch.distributed`` every rank calls it (it is collective)."""
    rank, world = _rank_world()
    state: dict[str, Any] = {
        META: _pack_bytes(
            {
                "format": FORMAT,
                "world": world,
                "replicated": optimizer is None or _all_replicated(optimizer),
                "parts": [
                    name
                    for name, value in (
                        ("model", model),
                        ("optimizer", optimizer),
                        ("runtime", runtime),
                        ("extra", extra),
                    )
                    if value is not None
                ],
            }
        )
    }
    if model is not None:
        state[MODEL] = _model_state(model)
    if optimizer is not None:
        params = _params(optimizer)
        shapes = [tuple(local_tensor(p).shape) for p in params]
        state[OPTIMIZER] = {f"rank{rank}": _pack(optimizer.state_dict(), {"shapes": shapes})}
    if runtime is not None:
        state[RUNTIME] = {f"rank{rank}": _pack(runtime.state_dict(), {})}
    if extra is not None:
        state[EXTRA] = _pack_bytes(extra)
    _dcp().save(state, checkpoint_id=checkpoint_id)


def load(
    checkpoint_id: Any,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    runtime: Any | None = None,
) -> dict[str, Any] | None:
    """Read what :func:`save` wrote into ``model``, ``optimizer`` and ``runtime`` (each if given;
    the runtime attached to the loaded optimizer) and return its ``extra`` (None if none).
    Collective under ``torch.distributed``; the optimizer and runtime need the saving number of
    ranks unless every parameter was replicated (Note [Sharded optimizer checkpoints])."""
    dcp = _dcp()
    rank, world = _rank_world()
    meta = _meta(dcp, checkpoint_id)
    for name, value in (("model", model), ("optimizer", optimizer), ("runtime", runtime)):
        if value is not None and name not in meta["parts"]:
            raise ValueError(
                f"{checkpoint_id}: has no {name} (it holds "
                f"{', '.join(meta['parts']) or 'nothing'}); pass {name}=None to load the rest"
            )
    source = rank
    if (optimizer is not None or runtime is not None) and meta["world"] != world:
        if not meta["replicated"]:
            raise ValueError(
                f"{checkpoint_id}: the optimizer state was saved by {meta['world']} ranks with "
                f"sharded parameters and cannot be loaded on {world}: a shard's preconditioner "
                "blocks depend on the number of ranks, so this state cannot be resharded "
                "(Note [Sharded optimizer checkpoints] in asteria/checkpoint.py). Load it on "
                f"{meta['world']} ranks, or load the model alone (optimizer=None; DCP reshards "
                "it) and let the optimizer start fresh"
            )
        source = 0  # replicated: every rank saved the same state
    if model is not None:
        _load_model(dcp, checkpoint_id, model)
    if optimizer is not None:
        saved, info = _unpack(dcp, checkpoint_id, OPTIMIZER, source)
        shapes = [tuple(local_tensor(p).shape) for p in _params(optimizer)]
        if [tuple(s) for s in info["shapes"]] != shapes:
            raise ValueError(
                f"{checkpoint_id}: the optimizer state of rank {source} is for parameters of "
                f"local shapes {info['shapes']}, this rank's are {shapes}: load it into the "
                "same model, sharded the same way"
            )
        optimizer.load_state_dict(saved)
    if runtime is not None:
        saved, _ = _unpack(dcp, checkpoint_id, RUNTIME, source)
        runtime.load_state_dict(saved)
    if (optimizer is not None or runtime is not None) and dist.is_initialized():
        dist.barrier()  # no rank trains on before every rank has read its part
    if "extra" not in meta["parts"]:
        return None
    extra: dict[str, Any] = {EXTRA: None}
    dcp.load(extra, checkpoint_id=checkpoint_id)
    return _unpack_bytes(extra[EXTRA])


def parts(checkpoint_id: Any) -> list[str]:
    """What :func:`save` wrote to ``checkpoint_id``: a list of ``"model"``, ``"optimizer"``,
    ``"runtime"``, ``"extra"``. Collective under ``torch.distributed``."""
    return list(_meta(_dcp(), checkpoint_id)["parts"])


# -- internals ---------------------------------------------------------------------------------


def _pack(state: Any, info: dict[str, Any]) -> dict[str, Any]:
    """``{"skeleton": bytes, "t<i>": tensor, ...}``: ``state`` with its tensors taken out (each
    replaced by ``{"__tensor__": [key, shape, strides, dtype]}``) and ``info``, pickled."""
    tensors: dict[str, torch.Tensor] = {}

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            key, local = f"t{len(tensors)}", local_tensor(value)
            tensors[key] = local
            # strides too: a transposed basis must come back transposed, as BLAS results
            # depend on the operands' layout (Note [QR layout] in optim/matrix_functions.py)
            strides = list(local.stride()) if _dense(local) else None
            dtype = str(local.dtype).removeprefix("torch.")
            return {_TENSOR: [key, list(local.shape), strides, dtype]}
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(strip(v) for v in value)
        return value

    return {"skeleton": _pack_bytes({"state": strip(state), "info": info}), **tensors}


def _unpack(dcp: Any, checkpoint_id: Any, section: str, rank: int) -> tuple[Any, dict]:
    """What :func:`_pack` wrote for ``rank`` in ``section``: the skeleton, then the tensors it
    names, read into CPU buffers allocated from it."""
    part = f"rank{rank}"
    head: dict[str, Any] = {section: {part: {"skeleton": None}}}
    dcp.load(head, checkpoint_id=checkpoint_id)
    skeleton = _unpack_bytes(head[section][part]["skeleton"])
    buffers: dict[str, torch.Tensor] = {}

    def is_ref(value: Any) -> bool:
        return isinstance(value, dict) and len(value) == 1 and _TENSOR in value

    def find(value: Any) -> None:
        if is_ref(value):
            key, shape, strides, dtype = value[_TENSOR]
            if strides is None:
                buffers[key] = torch.empty(shape, dtype=getattr(torch, dtype))
            else:
                buffers[key] = torch.empty_strided(shape, strides, dtype=getattr(torch, dtype))
        elif isinstance(value, dict):
            for v in value.values():
                find(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                find(v)

    def rebuild(value: Any) -> Any:
        if is_ref(value):
            return buffers[value[_TENSOR][0]]
        if isinstance(value, dict):
            return {k: rebuild(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(rebuild(v) for v in value)
        return value

    find(skeleton["state"])
    if buffers:
        dcp.load({section: {part: buffers}}, checkpoint_id=checkpoint_id)
    return rebuild(skeleton["state"]), skeleton["info"]


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s strides are a permutation of a contiguous layout (``empty_strided`` can
    then make a buffer of the same layout)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _meta(dcp: Any, checkpoint_id: Any) -> dict[str, Any]:
    head: dict[str, Any] = {META: None}
    dcp.load(head, checkpoint_id=checkpoint_id)
    meta = _unpack_bytes(head[META])
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{checkpoint_id}: not an asteria.checkpoint of format {FORMAT}")
    return meta


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


def _model_state(model: torch.nn.Module) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def _load_model(dcp: Any, checkpoint_id: Any, model: torch.nn.Module) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {MODEL: get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=checkpoint_id)
    set_model_state_dict(model, state[MODEL])


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _all_replicated(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every rank holds every parameter whole (no DTensor with a ``Shard`` placement):
    then every rank's optimizer state is the same."""
    for p in _params(optimizer):
        placements = getattr(p, "placements", None)
        if placements is not None and any(pl.is_shard() for pl in placements):
            return False
    return True


def _pack_bytes(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unpack_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)
