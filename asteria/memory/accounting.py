"""State sizes of Asteria's optimizers, from shapes alone: what the tier policy is fed.

Owns: ``estimate_blocks``, the bytes each preconditioner block of an optimizer will hold, by kind
(``tiers.BlockSizes``), in the order a step touches them, computed from the parameters' shapes
and the groups' options through the optimizer's own blocking (``optimizer.layout``); nothing is
allocated, so it works on parameters on the ``meta`` device (bench/memory.py sizes OLMo-2 1B and
7B that way). ``detect_arch``: the architecture facts of a device. The runtime's
``memory_report()`` measures the same kinds on the tensors actually allocated, and
tests/unit/test_tiers.py checks that the two agree to the byte.

Must not: place anything (``tiers.py``) or allocate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asteria.memory.tiers import Arch, BlockSizes
from asteria.optim.base import KroneckerOptimizer, local_tensor, state_dtype
from asteria.optim.kl_shampoo import KLShampoo
from asteria.optim.shampoo import Shampoo
from asteria.optim.soap import SOAP

__all__ = ["detect_arch", "estimate_blocks"]

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


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def estimate_blocks(
    optimizer: KroneckerOptimizer,
    name: Callable[[int, int], str] | None = None,
) -> list[BlockSizes]:
    """Per block of ``optimizer`` (parameters that require grad), the state bytes by kind.

    Counted: ``factors`` (one ``d x d`` factor per factored dim), ``moments`` (SOAP: ``m``, ``v``
    per block; KL-Shampoo: ``m`` and the eigenvalue estimates per block, AdamW's ``m``, ``v``
    for vectors; Shampoo: the first moment, the grafting second moment and the momentum buffer
    per parameter), ``bases`` (one ``d x d`` basis or inverse root per factored dim, in the state
    dtype), ``results`` (a finished refresh: the basis/root in ``refresh_dtype``, plus SOAP's
    int64 permutation) and ``snapshots`` (a refresh's inputs: factor, and basis where the job
    takes one). Parameters that are not preconditioned appear as blocks with only moments.
    ``name(pid, block_index)`` names a block (default ``param{pid}[{bi}]``; -1 for
    parameter-level state).
    """
    if not isinstance(optimizer, (SOAP, KLShampoo, Shampoo)):
        raise ValueError(
            f"no state-size model for {type(optimizer).__name__}; the tier policy knows SOAP, "
            "KLShampoo and Shampoo"
        )
    if name is None:

        def name(pid: int, bi: int) -> str:
            return f"param{pid}[{bi}]"

    out: list[BlockSizes] = []
    pid = -1
    for group in optimizer.param_groups:
        refresh_item = _itemsize(group["refresh_dtype"])
        for p in group["params"]:
            pid += 1
            if not p.requires_grad:
                continue
            item = _itemsize(state_dtype(p))
            layout = optimizer.layout(p, group)
            numel = local_tensor(p).numel()  # a DTensor's local shard (FSDP2 / HSDP)
            if isinstance(optimizer, Shampoo):
                moments = numel * (
                    1
                    + (group["grafting"] in ("adam", "rmsprop", "adagrad"))
                    + (group["momentum"] > 0)
                )
                out.append(BlockSizes(name(pid, -1), pid, moments=moments * item))
                if not layout.blocks[0].factored[0]:
                    continue
            if isinstance(optimizer, KLShampoo) and not layout.blocks[0].factored[0]:
                out.append(BlockSizes(name(pid, -1), pid, moments=2 * numel * item))
                continue
            for bi, spec in enumerate(layout.blocks):
                dims = [d for d, f in zip(spec.shape, spec.factored) if f]
                square = sum(d * d for d in dims)
                if isinstance(optimizer, SOAP):
                    moments = 2 * spec.numel
                    results = square * refresh_item + 8 * sum(dims)  # Q, int64 permutation
                    snapshots = 2 * square * item
                elif isinstance(optimizer, KLShampoo):
                    moments = spec.numel + sum(spec.shape)
                    results = square * refresh_item
                    snapshots = 2 * square * item
                else:  # Shampoo: moments are per parameter (above)
                    moments = 0
                    results = square * refresh_item
                    snapshots = square * item
                out.append(
                    BlockSizes(
                        name(pid, bi),
                        pid,
                        factors=square * item,
                        moments=moments * item,
                        bases=square * item,
                        results=results,
                        snapshots=snapshots,
                    )
                )
    return out
