"""Distributed coherence: topology, block ownership and hierarchical sync of replicated blocks.

Owns: what the runtime needs under ``torch.distributed`` (DDP, FSDP2, HSDP): the attach-time
checks, made collectively so that a bad setting is an error on every rank, never a hang (node
size, the same settings and hyperparameters everywhere, one device a rank); the
:class:`Topology` (nodes of ``ranks_per_node`` consecutive ranks, from ``LOCAL_WORLD_SIZE`` or
given, with the node and cross-node groups made once, in one order); one owner per replicated
block, balancing refresh cost (``sum d^3``) across nodes, then ranks; and the sync of a block's
refresh from its owner to its replica group (``Coherence.exchange``: owner -> its node ->
representatives -> their nodes, the bytes sent counted against a flat exchange's).

Note [Distributed coherence]: a *replica group* is the ranks holding the same block (every rank
for DDP, the ``Replicate`` mesh dim for HSDP, none for an FSDP2 shard: local blocks). Its owner
alone computes the refresh requested at ``t``; every rank installs it at ``t + D`` exactly
(``D``: ``fixed_delay`` else ``S``) from the owner's outcome (``OK`` with the results,
``FAILED``, ``CRASHED``), in the optimizer's block order, on process groups of its own: the
replicas stay bit-identical without a per-step agreement. A round that fails or outlasts
``barrier_timeout_s`` raises :class:`CoherenceTimeoutError` naming the block, owner and step.

Must not: decide when a block refreshes or how a result is installed; issue collectives outside
``Runtime``'s calls.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asteria.optim.base import KroneckerOptimizer
from asteria.optim.refresher import BlockKey
from asteria.optim.tensors import local_tensor
from asteria.runtime.registry import StalenessTimeoutError

__all__ = [
    "CRASHED",
    "Coherence",
    "CoherenceBrokenError",
    "CoherenceTimeoutError",
    "FAILED",
    "OK",
    "Topology",
    "assign_owners",
]

#: The outcomes of a sync, sent in front of a result (floats, exact): the owner's refresh
#: succeeded (its results follow), failed in float32 and float64 (every rank keeps its previous
#: version and counts the failure), or crashed in a worker (every rank raises).
OK, FAILED, CRASHED = 1.0, 0.0, -1.0


class CoherenceTimeoutError(StalenessTimeoutError):
    """A sync round did not complete within ``barrier_timeout_s`` (a peer slow, gone, or out of
    step); the message names the block, its owner rank and the step."""


class CoherenceBrokenError(CoherenceTimeoutError):
    """A rank's step stopped before its end, or a sync failed, in a distributed run: the
    replicas may differ and the runtime stops on that rank (Note [A fault on one rank]). A
    ``CoherenceTimeoutError``, so that a step keeps it for its end as it keeps the first."""


#: The key prefix, in the default process group's store, of what a rank reports as the fault
#: that stopped it (Note [A fault on one rank]).
_FAULT_KEY = "asteria/fault/"


# Note [A fault on one rank]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A step that stops before its end on one rank leaves its syncs out of step with the others', so
# the one-process repair (Note [Interrupted steps] in plan.py) would part the replicas silently.
# In a distributed run the runtime does not repair: the rank whose step stopped, or whose sync
# failed or timed out, marks its coherence broken (``Coherence.fail``) and reports why in the
# default group's store (``asteria/fault/<rank>``); from then on it raises
# ``CoherenceBrokenError`` at every step, signal and sync, and ``close()`` runs no collective. A
# rank waiting for it times out naming it and its reason: every rank ends within the timeout
# (tests/distributed, ``interrupt``). Resuming means restarting from a checkpoint.


class Topology:
    """``world`` ranks as ``world // ranks_per_node`` nodes of consecutive ranks."""

    def __init__(self, world: int, rank: int, ranks_per_node: int) -> None:
        check_ranks_per_node(ranks_per_node, world, "ranks_per_node")
        self.world, self.rank, self.ranks_per_node = world, rank, ranks_per_node
        self.nodes = world // ranks_per_node
        self.node, self.local = divmod(rank, ranks_per_node)
        self.node_groups: list[Any] = []
        self.cross_groups: list[Any] = []

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def representative(self, node: int) -> int:
        """The rank that speaks for ``node`` across nodes (its first rank)."""
        return node * self.ranks_per_node

    def build_groups(self, timeout_s: float) -> None:
        """Every node's group, then every cross-node group (local index l of every node), on
        every rank in this order (``new_group`` is collective)."""
        timeout = timedelta(seconds=timeout_s)
        g = self.ranks_per_node
        self.node_groups = [
            dist.new_group(list(range(n * g, (n + 1) * g)), timeout=timeout)
            for n in range(self.nodes)
        ]
        self.cross_groups = [
            dist.new_group([n * g + local for n in range(self.nodes)], timeout=timeout)
            for local in range(g)
        ]

    def __repr__(self) -> str:
        return (
            f"Topology(world={self.world}, nodes={self.nodes}, "
            f"ranks_per_node={self.ranks_per_node}, rank={self.rank})"
        )


#: Process groups are created once per default process group, node size and timeout, and reused
#: by later runtimes (``new_group`` is collective, and its groups live until
#: ``destroy_process_group``). The cache holds the default group it belongs to, so a new one
#: (after a re-init) starts a new cache.
_CACHE: dict[str, Any] = {"world": None, "topologies": {}, "groups": {}}


def _cache() -> dict[str, Any]:
    if _CACHE["world"] is not dist.group.WORLD:
        _CACHE.update(world=dist.group.WORLD, topologies={}, groups={})
    return _CACHE


def _topology(world: int, rank: int, ranks_per_node: int, timeout_s: float) -> Topology:
    topologies = _cache()["topologies"]
    key = (world, ranks_per_node, timeout_s)
    if key not in topologies:
        top = Topology(world, rank, ranks_per_node)
        top.build_groups(timeout_s)
        topologies[key] = top
    return topologies[key]


def _group(ranks: tuple[int, ...], timeout_s: float) -> Any:
    groups = _cache()["groups"]
    key = (ranks, timeout_s)
    if key not in groups:
        groups[key] = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s))
    return groups[key]


def _store() -> Any:
    """The default process group's store (where every rank of the run reaches)."""
    return dist.distributed_c10d._get_default_store()


def check_ranks_per_node(value: Any, world: int, source: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or world % value:
        raise ValueError(
            f"ranks_per_node={value!r} (from {source}) must be a positive integer that divides "
            f"the world size {world}"
        )


def assign_owners(
    blocks: Sequence[tuple[BlockKey, float]], members: Sequence[int], ranks_per_node: int
) -> dict[BlockKey, int]:
    """One owner per block among ``members``: largest blocks first, each to the least-loaded
    node, then to that node's least-loaded member (ties: lowest node, lowest rank). Pure and
    deterministic, so every rank computes the same map."""
    load = dict.fromkeys(members, 0.0)
    by_node: dict[int, list[int]] = {}
    for r in sorted(members):
        by_node.setdefault(r // ranks_per_node, []).append(r)
    owners = {}
    for key, cost in sorted(blocks, key=lambda kc: (-kc[1], kc[0])):
        node = min(by_node, key=lambda n: (sum(load[r] for r in by_node[n]), n))
        rank = min(by_node[node], key=lambda r: (load[r], r))
        owners[key] = rank
        load[rank] += cost
    return owners


def block_cost(spec: Any) -> float:
    """A block's refresh cost, about ``sum d^3`` over its factored dims."""
    return float(sum(d**3 for d, f in zip(spec.shape, spec.factored) if f))


class _Replicas:
    """A replica group: its ranks and how a result travels through it."""

    def __init__(self, ranks: tuple[int, ...], group: Any, hierarchical: bool) -> None:
        self.ranks, self.group, self.hierarchical = ranks, group, hierarchical


class Coherence:
    """The distributed side of a ``Runtime`` (Note [Distributed coherence])."""

    def __init__(
        self,
        optimizer: KroneckerOptimizer,
        config: Any,
        ranks_per_node: int | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "distributed mode needs an initialized torch.distributed process group "
                "(torchrun, or torch.distributed.init_process_group)"
            )
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.timeout_s = float(config.barrier_timeout_s)
        self.delay = config.fixed_delay if config.fixed_delay is not None else config.staleness
        params = [p for g in optimizer.param_groups for p in g["params"]]
        rpn, error = self._resolve_ranks_per_node(ranks_per_node)
        if error is None:
            error = self._local_errors(params)
        self._check_agreement(optimizer, config, rpn, error)  # raises on every rank alike
        self.topology = _topology(self.world, self.rank, rpn, self.timeout_s)
        backend = dist.get_backend()
        self.wire_device = (
            torch.device("cuda", torch.cuda.current_device())
            if "nccl" in str(backend)
            else torch.device("cpu")
        )
        self._replicas_of: dict[int, _Replicas | None] = {}
        self._mesh_groups: dict[tuple[int, ...], Any] = {}
        self._build_replicas(params)
        self.owners: dict[BlockKey, int] = {}
        self._assign(optimizer)
        self.counts = {
            "intra_node_bytes": 0,
            "inter_node_bytes": 0,
            "flat_intra_node_bytes": 0,
            "flat_inter_node_bytes": 0,
            "synced_blocks": 0,
            "owned_refreshes": 0,
        }
        #: why this rank's coherence is broken (Note [A fault on one rank]); None: it is not
        self.broken: str | None = None
        try:  # a fault an earlier runtime of this process group reported is not this one's
            _store().delete_key(f"{_FAULT_KEY}{self.rank}")
        except Exception:  # noqa: BLE001
            pass

    # -- attach-time checks -----------------------------------------------------------------

    def _resolve_ranks_per_node(self, value: int | None) -> tuple[int, str | None]:
        """The node size and, when it is unusable, the error (reported collectively)."""
        source = "ranks_per_node"
        if value is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            source = "LOCAL_WORLD_SIZE" if env else "the world size (one node)"
            try:
                value = int(env) if env else self.world
            except ValueError:
                return 1, f"LOCAL_WORLD_SIZE={env!r} is not an integer"
        try:
            check_ranks_per_node(value, self.world, source)
        except ValueError as err:
            return 1, str(err)
        return value, None

    @staticmethod
    def _local_errors(params: list[torch.Tensor]) -> str | None:
        devices = sorted({str(local_tensor(p).device) for p in params})
        if len(devices) > 1:
            return (
                f"the optimizer's parameters are on mixed devices ({', '.join(devices)}); "
                "every parameter of a rank must be on that rank's one device"
            )
        return None

    def _check_agreement(
        self, optimizer: KroneckerOptimizer, config: Any, rpn: int, error: str | None
    ) -> None:
        """All-gather every rank's settings; raise the same ``ValueError`` on every rank when
        one rank has an error or the ranks disagree."""
        desc = describe(optimizer, config, rpn)
        digest = hashlib.sha256(repr(sorted(desc.items())).encode()).hexdigest()
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, (digest, desc, error))
        for r, (_, _, err) in enumerate(gathered):
            if err is not None:
                raise ValueError(f"Asteria distributed attach, rank {r}: {err}")
        base_digest, base, _ = gathered[0]
        for r, (dg, d, _) in enumerate(gathered):
            if dg == base_digest:
                continue
            diffs = [
                f"{k}: rank 0 has {base.get(k)!r}, rank {r} has {d.get(k)!r}"
                for k in sorted(set(base) | set(d))
                if base.get(k) != d.get(k)
            ]
            raise ValueError(
                "Asteria distributed attach: the ranks must run the same staleness budget, "
                "runtime settings and optimizer hyperparameters; " + "; ".join(diffs)
            )

    # -- replica groups and owners ----------------------------------------------------------

    def _build_replicas(self, params: list[torch.Tensor]) -> None:
        world = _Replicas(tuple(range(self.world)), None, hierarchical=True)
        for pid, p in enumerate(params):
            mesh = getattr(p, "device_mesh", None)
            if mesh is None:
                self._replicas_of[pid] = world  # a plain parameter: DDP-replicated
                continue
            dims = [
                i for i, pl in enumerate(p.placements) if pl.is_replicate() and mesh.size(i) > 1
            ]
            if not dims:
                self._replicas_of[pid] = None  # a plain FSDP2 shard: local blocks
                continue
            if len(dims) > 1:
                raise ValueError(
                    f"parameter {pid} is replicated over {len(dims)} mesh dims; Asteria's "
                    "coherence supports one replicate dim (HSDP)"
                )
            rows = mesh.mesh.movedim(dims[0], -1).reshape(-1, mesh.size(dims[0])).tolist()
            rows = sorted(tuple(int(r) for r in row) for row in rows)
            mine = next(row for row in rows if self.rank in row)
            if sorted(mine) == list(range(self.world)):
                self._replicas_of[pid] = world
                continue
            for row in rows:  # every rank creates every row's group, in the same order
                if row not in self._mesh_groups:
                    self._mesh_groups[row] = _group(row, self.timeout_s)
            self._replicas_of[pid] = _Replicas(mine, self._mesh_groups[mine], hierarchical=False)

    def _assign(self, optimizer: KroneckerOptimizer) -> None:
        by_group: dict[tuple[int, ...], list[tuple[BlockKey, float]]] = {}
        pid = -1
        for group in optimizer.param_groups:
            for p in group["params"]:
                pid += 1
                rep = self._replicas_of.get(pid)
                if rep is None:
                    continue
                layout = optimizer.layout(p, group)
                blocks = by_group.setdefault(rep.ranks, [])
                blocks.extend(((pid, bi), block_cost(s)) for bi, s in enumerate(layout.blocks))
        for ranks, blocks in by_group.items():
            self.owners.update(assign_owners(blocks, ranks, self.topology.ranks_per_node))

    def replicated(self, key: BlockKey) -> bool:
        return self._replicas_of.get(key[0]) is not None

    @property
    def replicates(self) -> bool:
        """Whether some block of this rank is replicated (synced with other ranks)."""
        return any(r is not None for r in self._replicas_of.values())

    # -- faults (Note [A fault on one rank]) --------------------------------------------------

    def fail(self, reason: str) -> None:
        """Mark this rank's coherence broken (the first reason stays) and report it in the
        default group's store for the ranks that time out waiting for this one."""
        if self.broken is not None:
            return
        self.broken = reason
        try:
            _store().set(f"{_FAULT_KEY}{self.rank}", reason[:2000])
        except Exception:  # noqa: BLE001 (a store gone with its rank 0: nothing to tell)
            pass

    def check(self) -> None:
        """Raise ``CoherenceBrokenError`` once this rank's coherence is broken."""
        if self.broken is not None:
            raise CoherenceBrokenError(
                f"Asteria (rank {self.rank}): the distributed run cannot go on: {self.broken}. "
                "The replicas may differ; every rank stops (restart from the last checkpoint)"
            )

    def reported_faults(self) -> str:
        """What the other ranks reported as their faults (``fail``), '' if none or no store."""
        try:
            store = _store()
            keys = [f"{_FAULT_KEY}{r}" for r in range(self.world) if r != self.rank]
            found = [k for k in keys if store.check([k])]
            return "; ".join(
                f"rank {k.removeprefix(_FAULT_KEY)} reported: {store.get(k).decode()[:500]}"
                for k in found
            )
        except Exception:  # noqa: BLE001
            return ""

    def owner(self, key: BlockKey) -> int:
        owner = self.owners.get(key)
        if owner is None:  # a block the attach-time layout did not have: same rule everywhere
            ranks = self._replicas_of[key[0]].ranks
            owner = self.owners[key] = ranks[(key[0] * 7919 + key[1]) % len(ranks)]
        return owner

    def is_owner(self, key: BlockKey) -> bool:
        return self.owner(key) == self.rank

    # -- one block's sync -------------------------------------------------------------------

    def exchange(
        self,
        key: BlockKey,
        name: str,
        step: int,
        jobs: list[Any],
        dims: list[int],
        dtype: torch.dtype,
        status: float,
        results: list[Any] | None,
    ) -> tuple[float, list[Any] | None]:
        """Move the owner's ``status`` and ``results`` (one per job, ``None`` where a dim has no
        job) to every rank of the block's replica group; returns them, unpacked, on every rank
        (the owner too, so that every rank installs the same tensors)."""
        self.check()
        owner = self.owner(key)
        floats, ints = self._buffers(jobs, dims, dtype)
        if owner == self.rank:
            self._pack(floats, ints, jobs, dims, status, results)
            self.counts["owned_refreshes"] += 1
        tensors = [floats] if ints is None else [floats, ints]
        replicas = self._replicas_of[key[0]]
        try:
            self._broadcast(replicas, tensors, owner)
        except Exception as err:  # gloo/NCCL timeouts, a peer that is gone
            ranks = [r for r in replicas.ranks if r != self.rank]
            who = self.reported_faults() or f"a peer of ranks {ranks} did not answer"
            message = (
                f"Asteria: the sync of block '{name}' (owner rank {owner}) at step {step} "
                f"failed on rank {self.rank}: {who} (within barrier_timeout_s="
                f"{self.timeout_s:g} s, gone, or out of step; {type(err).__name__}: "
                f"{str(err)[:300]})"
            )
            self.fail(message)
            raise CoherenceTimeoutError(message) from err
        self.counts["synced_blocks"] += 1
        status = float(floats[0].item())
        if status != OK:
            return status, None
        return status, self._unpack(floats, ints, jobs, dims)

    def _buffers(
        self, jobs: list[Any], dims: list[int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n_float = 1 + len(jobs) + sum(d * d for j, d in zip(jobs, dims) if j is not None)
        n_int = sum(d for j, d in zip(jobs, dims) if j is not None and j.permutes)
        floats = torch.zeros(n_float, dtype=dtype, device=self.wire_device)
        ints = torch.zeros(n_int, dtype=torch.int64, device=self.wire_device) if n_int else None
        return floats, ints

    @staticmethod
    def _pack(floats, ints, jobs, dims, status, results) -> None:
        floats[0] = status
        if status != OK:
            return
        fo, io = 1 + len(jobs), 0
        for k, (job, d, r) in enumerate(zip(jobs, dims, results)):
            if job is None:
                continue
            q, perm = job.parts(r)
            # the matrix travels in its memory order (LAPACK's bases are column-major), so that
            # every rank installs a tensor with the owner's strides, hence the owner's bits
            column_major = d > 1 and q.T.is_contiguous() and not q.is_contiguous()
            floats[1 + k] = 1.0 if column_major else 0.0
            floats[fo : fo + d * d].copy_((q.T if column_major else q).reshape(-1))
            fo += d * d
            if job.permutes:
                ints[io : io + d].copy_(perm.reshape(-1))
                io += d

    @staticmethod
    def _unpack(floats, ints, jobs, dims) -> list[Any]:
        out: list[Any] = []
        fo, io = 1 + len(jobs), 0
        for k, (job, d) in enumerate(zip(jobs, dims)):
            if job is None:
                out.append(None)
                continue
            q = floats[fo : fo + d * d].reshape(d, d).clone()
            if floats[1 + k].item() == 1.0:
                q = q.T
            fo += d * d
            perm = None
            if job.permutes:
                perm = ints[io : io + d].clone()
                io += d
            out.append(job.from_parts(q, perm))
        return out

    def _broadcast(self, rep: _Replicas, tensors: list[torch.Tensor], src: int) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        top = self.topology
        if not rep.hierarchical:
            if len(rep.ranks) > 1:
                for t in tensors:
                    dist.broadcast(t, src, group=rep.group)
            if self.rank == src:
                others = [r for r in rep.ranks if r != src]
                inter = sum(top.node_of(r) != top.node_of(src) for r in others)
                self._count(nbytes, len(others) - inter, inter, flat=True)
                self._count(nbytes, len(others) - inter, inter)
            return
        g, src_node = top.ranks_per_node, top.node_of(src)
        # 1. inside the owner's node
        if top.node == src_node and g > 1:
            for t in tensors:
                dist.broadcast(t, src, group=top.node_groups[src_node])
            if self.rank == src:
                self._count(nbytes, g - 1, 0)
        # 2. node representatives across nodes
        if top.local == 0 and top.nodes > 1:
            rep_src = top.representative(src_node)
            for t in tensors:
                dist.broadcast(t, rep_src, group=top.cross_groups[0])
            if self.rank == rep_src:
                self._count(nbytes, 0, top.nodes - 1)
        # 3. each other node's representative to its node
        if top.node != src_node and g > 1:
            for t in tensors:
                dist.broadcast(t, top.representative(top.node), group=top.node_groups[top.node])
            if top.local == 0:
                self._count(nbytes, g - 1, 0)
        if self.rank == src:
            self._count(nbytes, g - 1, self.world - g, flat=True)

    def _count(self, nbytes: int, intra: int, inter: int, flat: bool = False) -> None:
        prefix = "flat_" if flat else ""
        self.counts[prefix + "intra_node_bytes"] += nbytes * intra
        self.counts[prefix + "inter_node_bytes"] += nbytes * inter

    def stats(self) -> dict[str, Any]:
        """This rank's counters (sum them over ranks for the job's totals)."""
        top = self.topology
        return {
            **self.counts,
            "world": self.world,
            "rank": self.rank,
            "nodes": top.nodes,
            "ranks_per_node": top.ranks_per_node,
            "owned_blocks": sum(o == self.rank for o in self.owners.values()),
            "replicated_blocks": len(self.owners),
            "delay": self.delay,
        }


def describe(optimizer: KroneckerOptimizer, config: Any, ranks_per_node: int) -> dict[str, Any]:
    """What every rank must agree on: runtime settings, node size, optimizer hyperparameters and
    the parameters' global shapes (reprs, so that the comparison is exact and picklable)."""
    groups = [
        {k: repr(v) for k, v in sorted(g.items()) if k != "params"} for g in optimizer.param_groups
    ]
    params = [(tuple(p.shape), str(p.dtype)) for g in optimizer.param_groups for p in g["params"]]
    return {
        "optimizer": type(optimizer).__name__,
        "staleness": config.staleness,
        "fixed_delay": config.fixed_delay,
        "refresh_lead": config.refresh_lead,  # when Shampoo's replicated blocks request
        "wait_first_refresh": config.wait_first_refresh,
        "barrier_timeout_s": config.barrier_timeout_s,
        "max_consecutive_failures": config.max_consecutive_failures,
        "ranks_per_node": ranks_per_node,
        "param_groups": repr(groups),
        "params": repr(params),
    }
