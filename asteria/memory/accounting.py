"""State sizes of Asteria's optimizers, from shapes alone: what the tier policy is fed.

Owns: ``estimate_blocks``, the bytes each block of an optimizer will hold, by kind
(``tiers.BlockSizes``), in the order a step touches them, from the optimizer's own description
of its state (``state_template`` on the ``meta`` device) and jobs, never from which optimizer it
is: nothing is allocated (bench/memory.py sizes OLMo-2 7B that way); and ``detect_arch``.
``memory_report()`` measures the same kinds on the allocated tensors (tests/unit/test_tiers.py:
equal to the byte). Must not: place anything (``tiers.py``) or allocate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from asteria.memory.tiers import Arch, BlockSizes

__all__ = ["detect_arch", "estimate_blocks", "snapshot_tensors"]

#: GPUs that read host memory coherently over NVLink-C2C (Grace Hopper / Grace Blackwell).
UNIFIED_MEMORY_GPUS = ("GH200", "GB200", "GB10", "GH100 Grace", "Grace")


def detect_arch(device: torch.device | str) -> Arch:
    """``Arch`` of the device the optimizer's tensors are on: ``unified_memory`` for integrated
    GPUs and Grace Hopper / Grace Blackwell (``torch.cuda.get_device_properties``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return Arch(cuda=False)
    props = torch.cuda.get_device_properties(device)
    unified = bool(getattr(props, "is_integrated", False)) or any(
        tag in props.name for tag in UNIFIED_MEMORY_GPUS
    )
    return Arch(cuda=True, unified_memory=unified)


def estimate_blocks(
    optimizer: Any,
    name: Callable[[int, int], str] | None = None,
) -> list[BlockSizes]:
    """Per block of ``optimizer`` (parameters that require grad), the state bytes by kind:
    ``factors``, ``bases`` (its ``bases_field``, in the state dtype), ``moments`` (every other
    tensor of a block, and parameter-level state as a block of index -1), ``results``
    (``RefreshJob.result_bytes``) and ``snapshots`` (``RefreshJob.input_bytes``), from the
    optimizer's ``state_template`` on the ``meta`` device and its ``refresh_jobs``. Parameters
    not preconditioned are blocks with moments only. ``name(pid, block_index)`` names a block.
    ``ValueError``: an optimizer without a state template or refresh jobs.
    """
    if name is None:

        def name(pid: int, bi: int) -> str:
            return f"param{pid}[{bi}]"

    out: list[BlockSizes] = []
    pid = -1
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            pid += 1
            if not p.requires_grad:
                continue
            try:
                template = optimizer.state_template(p, group, device="meta")
                moments = sum(_nbytes(v) for k, v in template.items() if k != "blocks")
                if moments:
                    out.append(BlockSizes(name(pid, -1), pid, moments=moments))
                for bi, block in enumerate(template.get("blocks", ())):
                    out.append(_block_sizes(optimizer, group, block, name(pid, bi), pid, gi))
            except NotImplementedError:
                raise ValueError(
                    f"no state-size model for {type(optimizer).__name__}: it describes no state "
                    "template or refresh jobs (KroneckerOptimizer._state_template, refresh_jobs)"
                ) from None
    return out


def snapshot_tensors(optimizer: Any) -> list[int]:
    """The bytes of every tensor a refresh of ``optimizer``'s blocks snapshots (each job's
    factor, and the basis it starts from), from the same templates as ``estimate_blocks``: what
    the runtime's staging ring holds on a GPU. ``ValueError`` as ``estimate_blocks``."""
    out: list[int] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            try:
                template = optimizer.state_template(p, group, device="meta")
                for block in template.get("blocks", ()):
                    for job in optimizer.refresh_jobs(block, group):
                        if job is not None:
                            out.extend(t.nbytes for t in (job.factor, job.basis) if t is not None)
            except NotImplementedError:
                raise ValueError(
                    f"no state-size model for {type(optimizer).__name__}: it describes no state "
                    "template or refresh jobs (KroneckerOptimizer._state_template, refresh_jobs)"
                ) from None
    return out


def _block_sizes(
    optimizer: Any, group: dict, block: dict, name: str, pid: int, gi: int
) -> BlockSizes:
    field = optimizer.bases_field
    jobs = [j for j in optimizer.refresh_jobs(block, group) if j is not None]
    return BlockSizes(
        name,
        pid,
        factors=_nbytes(block["factors"]),
        moments=sum(_nbytes(v) for k, v in block.items() if k not in ("factors", field)),
        bases=_nbytes(block[field]),
        results=sum(j.result_bytes() for j in jobs),
        snapshots=sum(j.input_bytes() for j in jobs),
        group=(gi, _shapes(block[field])),
    )


def _shapes(bases: list) -> tuple:
    """The shapes and dtypes of a block's bases (what blocks read together share: Note [Window
    by shape group] in tiers.py)."""
    return tuple(None if q is None else (tuple(q.shape), q.dtype) for q in bases)


def _nbytes(value: object) -> int:
    """Bytes of a tensor, or of the tensors in a list or tuple (None counts nothing)."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0
