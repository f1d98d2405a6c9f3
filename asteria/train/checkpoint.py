"""Checkpoints of `asteria.train`: one file per run of a comparison, written atomically.

Owns: what a checkpoint holds and how it is written and read. A checkpoint is everything needed
to continue a run exactly where it stopped: model and optimizer ``state_dict``, the LR schedule,
the data position (batches drawn and the generator state), the RNG states, the metrics records
so far, the wall-clock and energy so far, and the run's status (``"running"`` when it stopped
early, ``"finished"`` or ``"diverged"``). Must not: decide when to save (loop.py does).

Under FSDP/HSDP the model and optimizer states are gathered into full (unsharded) state dicts on
rank 0 (``torch.distributed.checkpoint.state_dict``), so a checkpoint does not depend on the
number of processes that wrote it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

CHECKPOINTS = "checkpoints"


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


def load_model_and_optimizer_state(
    model: torch.nn.Module, opt: torch.optim.Optimizer, payload: dict, distributed: bool
) -> None:
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
