"""FSDP2 / HSDP for `asteria.train` under ``torchrun``.

Owns: the process group and device mesh (``--fsdp``: one dim over every process; ``--hsdp``:
(replicate, shard), ``--hsdp-shards`` processes per shard group, default a node), sharding the
model with ``fully_shard`` (each decoder layer, then the root), and a mean over ranks. NCCL with
a GPU per process where CUDA is available, else gloo. Every rank draws the same global batch and
takes its rows: the same data in the same order whatever the number of processes. Must not: know
about optimizers or outputs (rank 0 writes everything: ``is_main``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    kind: str  # "fsdp" or "hsdp"
    rank: int
    world: int
    device: torch.device
    mesh: Any

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(kind: str, hsdp_shards: int | None = None) -> DistContext:
    """Join the ``torchrun`` process group and build the mesh for ``kind``."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError(
            f"--{kind} runs under torchrun (RANK and WORLD_SIZE are not set), e.g. "
            f"torchrun --nproc-per-node 2 -m asteria.train --{kind} ..."
        )
    from torch.distributed.device_mesh import init_device_mesh

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if kind == "fsdp":
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    elif kind == "hsdp":
        shards = hsdp_shards or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if shards < 1 or world % shards:
            raise ValueError(f"--hsdp-shards {shards} does not divide the {world} processes")
        mesh = init_device_mesh(
            device.type, (world // shards, shards), mesh_dim_names=("replicate", "shard")
        )
    else:
        raise ValueError(f"unknown distributed mode {kind!r}")
    return DistContext(kind, rank, world, device, mesh)


def shard_model(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """``fully_shard`` every decoder layer, then the whole model (FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    return model


def mean(value: float, ctx: DistContext | None) -> float:
    if ctx is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return float(t.item()) / ctx.world


def rows(batch: torch.Tensor, ctx: DistContext | None) -> torch.Tensor:
    """This rank's rows of the global batch."""
    if ctx is None:
        return batch
    if batch.shape[0] % ctx.world:
        raise ValueError(
            f"--batch-size {batch.shape[0]} is not divisible by the {ctx.world} processes"
        )
    return batch.chunk(ctx.world)[ctx.rank]


def barrier(ctx: DistContext | None) -> None:
    if ctx is not None:
        dist.barrier()


def broadcast_flag(flag: bool, ctx: DistContext | None) -> bool:
    """``flag`` of any rank (a max over ranks): all ranks stop together on Ctrl-C."""
    if ctx is None:
        return flag
    t = torch.tensor([1 if flag else 0], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def shutdown(ctx: DistContext | None) -> None:
    if ctx is not None and dist.is_initialized():
        dist.destroy_process_group()
