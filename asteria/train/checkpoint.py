"""Checkpoints of `asteria.train`: one file per run of a comparison, written atomically.

Owns: what a checkpoint holds (model and optimizer ``state_dict``, the LR schedule, the data
position, the RNG states, the records, wall clock and energy so far, and the status:
``"running"``, ``"finished"`` or ``"diverged"``) and how it is written and read. Must not: decide
when to save (loop.py does).

Under FSDP/HSDP AdamW's states are gathered into full state dicts on rank 0, independent of the
number of processes. Asteria's state is per local shard (Note [Sharded optimizer checkpoints] in
asteria/checkpoint.py): its model and optimizer go through :mod:`asteria.checkpoint` into a
directory per step next to the file (``<label>.step<N>.dcp``), which names it; older ones are
deleted once the file is written, so a crash leaves a file naming a complete directory. Such a
run resumes on the same number of processes only (else a message says so).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

CHECKPOINTS = "checkpoints"


class ResumeError(ValueError):
    """A checkpoint that cannot be continued here (e.g. on another number of processes)."""


def checkpoint_path(out: Path, label: str) -> Path:
    return out / CHECKPOINTS / f"{label.replace(':', '_')}.pt"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_and_optimizer_state(
    model: torch.nn.Module, opt: torch.optim.Optimizer, distributed: bool
) -> tuple[dict, dict]:
    """(model, optimizer) state dicts; full and on the CPU when ``distributed``."""
    if not distributed:
        return model.state_dict(), opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, opt, options=options)


def per_shard_state(opt: torch.optim.Optimizer, distributed: bool) -> bool:
    """Whether ``opt``'s checkpoint goes through :mod:`asteria.checkpoint` (see the docstring)."""
    from asteria.optim.base import KroneckerOptimizer

    return distributed and isinstance(opt, KroneckerOptimizer)


def save_sharded(
    path: Path,
    step: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    runtime: Any | None = None,
) -> str:
    """Collective: write ``model``, ``opt`` and ``runtime`` (its refreshes in flight) through
    :mod:`asteria.checkpoint` into the step's directory next to ``path``; returns its name (for
    the run's file)."""
    from asteria import checkpoint

    name = f"{path.stem}.step{step}.dcp"
    checkpoint.save(path.parent / name, model, opt, runtime)
    return name


def load_runtime_state(runtime: Any, payload: dict, path: Path | None = None) -> None:
    """Put back the refreshes that were in flight when ``payload`` was saved (none if the run's
    runtime was closed then, as at the end of a run)."""
    if payload.get("runtime_state") is not None:
        runtime.load_state_dict(payload["runtime_state"])
    elif payload.get("sharded") and path is not None:
        from asteria import checkpoint

        directory = path.parent / payload["sharded"]
        if "runtime" in checkpoint.parts(directory):
            checkpoint.load(directory, runtime=runtime)


def prune_sharded(path: Path, keep: str) -> None:
    """Delete the directories of older steps than ``keep`` (after the file naming it is written)."""
    for old in path.parent.glob(f"{path.stem}.step*.dcp"):
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


def load_model_and_optimizer_state(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    payload: dict,
    distributed: bool,
    path: Path | None = None,
) -> None:
    """Load what :func:`model_and_optimizer_state` or :func:`save_sharded` saved; ``path``: the
    run's checkpoint file (the sharded directory lies next to it)."""
    if payload.get("sharded"):
        from asteria import checkpoint

        if path is None:
            raise ValueError("a sharded checkpoint needs the path of its run file")
        try:
            checkpoint.load(path.parent / payload["sharded"], model, opt)
        except ValueError as err:
            raise ResumeError(
                f"--resume: {err} (with asteria-train: resume under torchrun with as many "
                "processes as the run had)"
            ) from None
        return
    if not distributed:
        model.load_state_dict(payload["model"])
        opt.load_state_dict(payload["optimizer"])
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(
        model,
        opt,
        model_state_dict=payload["model"],
        optim_state_dict=payload["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )


def save(path: Path, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pt.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load(path: Path) -> dict:
    # Our own files: optimizer state holds dtypes and Python containers; weights_only stays on.
    return torch.load(path, map_location="cpu", weights_only=True)
