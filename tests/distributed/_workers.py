"""The rank side of tests/distributed: ``python -m tests.distributed._workers SCENARIO OUT_DIR``.

Launched once per rank by ``_launch.py`` (gloo on the CPU, a rendezvous file per launch); every
rank writes ``OUT_DIR/rank{r}.json`` with what the test asserts on. Rank 0 also runs the
single-process reference, after the distributed run, with the runtime's distributed mode off.

The model is a small MLP; the global batch of step ``t`` is seeded by ``t``, each rank takes its
half of the rows, and the loss is a mean over rows. The single-process reference computes the
gradient of each half and averages them, ``(g0 + g1) / 2``, which is bit-for-bit what DDP's and
FSDP2's averaging of the ranks' gradients gives on two ranks (a halving is exact).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.runtime import Runtime, RuntimeConfig
from tests.distributed._launch import init_gloo

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}
DIMS = (6, 5, 4)
ROWS = 8  # global batch


def model(seed: int = 0, dims: tuple[int, ...] = DIMS) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def batch(t: int, dims: tuple[int, ...] = DIMS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + t)
    return torch.randn(ROWS, dims[0], generator=gen), torch.randn(ROWS, dims[-1], generator=gen)


def loss(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((net(x) - y) ** 2).mean()


def make_opt(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return OPTIMIZERS[name](params, precondition_frequency=3, max_preconditioner_dim=4)


def my_rows(t: int, rank: int, world: int, dims: tuple[int, ...] = DIMS):
    x, y = batch(t, dims)
    return x.chunk(world)[rank], y.chunk(world)[rank]


# -- the single-process reference ------------------------------------------------------------


def reference(
    name: str, steps: int, shards: int | None = None, parts: int = 2
) -> list[list[torch.Tensor]]:
    """One process, the same global batches; ``shards``: the optimizer sees every parameter as
    ``shards`` separate parameters, its dim-0 chunks (FSDP2's local shards). Returns, per model
    parameter, its pieces (one piece without ``shards``). The gradient is that of each of the
    ``parts`` row blocks, combined as the 2 or 4 (2 x 2 HSDP: shard pairs first, then across
    replicas) ranks combine them; every scaling is by a power of two, hence exact."""
    net = model()
    params = list(net.parameters())
    if shards is None:
        pieces = [[p] for p in params]
    else:
        pieces = [
            [c.detach().clone().requires_grad_(True) for c in p.detach().chunk(shards)]
            for p in params
        ]
    opt = make_opt(name, [c for ps in pieces for c in ps])
    for t in range(steps):
        grads = []
        for part in range(parts):
            net.zero_grad()
            x, y = my_rows(t, part, parts)
            loss(net, x, y).backward()
            grads.append([p.grad.clone() for p in params])
        for p, ps, *gs in zip(params, pieces, *grads):
            g = gs[0] / 2 + gs[1] / 2 if parts == 2 else ((gs[0] + gs[1]) + (gs[2] + gs[3])) / 4
            if shards is None:
                p.grad = g
            else:
                for c, gc in zip(ps, g.chunk(shards)):
                    c.grad = gc.clone()
        opt.step()
        if shards is not None:
            with torch.no_grad():
                for p, ps in zip(params, pieces):
                    p.copy_(torch.cat([c.detach() for c in ps]))
    return [[c.detach().clone() for c in ps] for ps in pieces]


# -- scenarios ---------------------------------------------------------------------------------


def _train(net, opt, rank, world, steps, start=0, on_step=None):
    for t in range(start, steps):
        if on_step is not None:
            on_step(t)
        opt.zero_grad()
        x, y = my_rows(t, rank, world)
        loss(net, x, y).backward()
        opt.step()


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, Any]:
    equal = len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))
    diff = max(
        ((x - y).abs().max().item() if x.shape == y.shape and x.numel() else 0.0)
        for x, y in zip(a, b)
    )
    return {"equal": equal, "max_diff": diff}


def _replicas_agree(tensors: list[torch.Tensor]) -> bool:
    """Every rank holds the same tensors (rank 0's, broadcast, compared everywhere)."""
    ok = True
    for t in tensors:
        ref = t.clone()
        dist.broadcast(ref, 0)
        ok = ok and torch.equal(ref, t)
    flag = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0


def scenario_ddp(rank: int, world: int, out: dict) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    steps = 8
    refs = {}
    for name in OPTIMIZERS:
        for mode in ("native", "runtime", "runtime_2nodes"):
            net = DDP(model())
            opt = make_opt(name, list(net.parameters()))
            rt = None
            if mode != "native":
                rpn = 1 if mode == "runtime_2nodes" else None
                rt = Runtime(net, opt, RuntimeConfig(staleness=0, workers=1), ranks_per_node=rpn)
            _train(net, opt, rank, world, steps)
            final = [_local(p) for p in net.parameters()]
            case = {"replicas_agree": _replicas_agree(final)}
            if rt is not None:
                stats = rt.stats()
                case["distributed"] = stats["distributed"]
                case["histogram"] = stats["staleness_histogram"]
                case["hooks"] = stats["hooks"]
                rt.close()
            if rank == 0:
                if name not in refs:
                    refs[name] = [ps[0] for ps in reference(name, steps)]
                case.update(_same(final, refs[name]))
            out[f"{name}/{mode}"] = case


def scenario_contract(rank: int, world: int, out: dict) -> None:
    """DDP (every block replicated) with the frequency below the budget (issue 16): the basis in
    use stays within Note [Staleness contract]'s bound at every step, on every rank, and the
    replicas agree."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    steps = 16
    for name in OPTIMIZERS:
        for label, config in (
            ("s3", RuntimeConfig(staleness=3, workers=1)),
            ("fixed2", RuntimeConfig(staleness=2, fixed_delay=2, workers=1)),
        ):
            net = DDP(model())
            opt = OPTIMIZERS[name](list(net.parameters()), precondition_frequency=1)
            rt = Runtime(net, opt, config)
            within, ages = [], []
            for t in range(steps):
                _train(net, opt, rank, world, t + 1, start=t)
                stats = rt.stats()
                within.append(stats["basis_age"]["within_bound"])
                ages.append(stats["basis_age"]["max"])
            stats = rt.stats()
            rt.close()
            out[f"{name}/{label}"] = {
                "within": within,
                "max_age": ages[-1],
                "bound": stats["basis_age"]["bound"],
                "installs": stats["installs"],
                "coalesced": stats["jobs"]["coalesced_requests"],
                "replicas_agree": _replicas_agree([_local(p) for p in net.parameters()]),
            }
        # continuous refresh (issue 19): replicated blocks install at their deadline, so each
        # is requested again there, every B steps alike on every rank, by its owner alone.
        # Shampoo's refreshes up to 4f would be waited for at their step (Notes [First roots],
        # [Young factors]): the schedule itself is what is checked, without those waits
        net = DDP(model())
        opt = OPTIMIZERS[name](list(net.parameters()), precondition_frequency=10)
        config = RuntimeConfig(
            staleness=3, workers=1, refresh="continuous", wait_first_refresh=False
        )
        rt = Runtime(net, opt, config)
        within = []
        for t in range(steps):
            _train(net, opt, rank, world, t + 1, start=t)
            within.append(rt.stats()["basis_age"]["within_bound"])
        stats = rt.stats()
        rt.close()
        out[f"{name}/continuous3"] = {
            "within": within,
            "interval_max": stats["refresh"]["interval_max"],
            "installs": stats["installs"],
            "owned_refreshes": stats["distributed"]["owned_refreshes"],
            "blocks": {b: v["version"] for b, v in stats["blocks"].items()},
            "replicas_agree": _replicas_agree([_local(p) for p in net.parameters()]),
        }


def scenario_fsdp(rank: int, world: int, out: dict, hsdp: bool = False) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    steps = 8
    if hsdp:  # 2 replicas x 1 shard: replicated blocks through the mesh's replicate dim
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for name in OPTIMIZERS:
        for mode in ("native", "runtime"):
            net = model()
            fully_shard(net, mesh=mesh)
            opt = make_opt(name, list(net.parameters()))
            rt = None
            if mode == "runtime":
                rt = Runtime(net, opt, RuntimeConfig(staleness=0, workers=1))
            _train(net, opt, rank, world, steps)
            final = [_local(p) for p in net.parameters()]
            case: dict[str, Any] = {
                "dtensor": all(hasattr(p, "to_local") for p in net.parameters())
            }
            if hsdp:
                case["replicas_agree"] = _replicas_agree(final)
            if rt is not None:
                stats = rt.stats()
                case["distributed"] = stats["distributed"]
                case["histogram"] = stats["staleness_histogram"]
                case["hooks"] = stats["hooks"]
                rt.close()
            # each rank compares its shards against the reference's pieces for its rank
            ref = reference(name, steps, shards=None if hsdp else world)
            mine = [ps[0] if hsdp else ps[rank] for ps in ref]
            case.update(_same(final, mine))
            out[f"{name}/{mode}"] = case
    # a NaN in rank 1's shard only: every rank skips that parameter (the flags are reduced over
    # the mesh), and the others update as usual
    net = model()
    fully_shard(net, mesh=mesh)
    opt = make_opt("soap", list(net.parameters()))
    _train(net, opt, rank, world, 2)
    opt.zero_grad()
    x, y = my_rows(2, rank, world)
    loss(net, x, y).backward()
    params = list(net.parameters())
    before = [_local(p) for p in params]
    if rank == 1:
        with torch.no_grad():
            params[0].grad.to_local().fill_(float("nan"))
    opt.step()
    after = [_local(p) for p in params]
    out["nonfinite"] = {
        "skipped": opt.nonfinite_grads,
        "first_unchanged": torch.equal(before[0], after[0]),
        "others_changed": all(not torch.equal(a, b) for a, b in zip(before[1:], after[1:])),
    }


def scenario_hsdp(rank: int, world: int, out: dict) -> None:
    scenario_fsdp(rank, world, out, hsdp=True)


def scenario_hsdp4(rank: int, world: int, out: dict) -> None:
    """HSDP on a 2 x 2 mesh (replicate x shard), the 4 ranks as 2 nodes of 2: each shard is
    replicated across the nodes; the runtime at staleness 0 against one process whose optimizer
    sees the 2 shards of every parameter as separate parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    steps = 6
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard = rank % 2
    for name in OPTIMIZERS:
        net = model()
        fully_shard(net, mesh=mesh)
        opt = make_opt(name, list(net.parameters()))
        rt = Runtime(net, opt, RuntimeConfig(staleness=0, workers=1), ranks_per_node=2)
        _train(net, opt, rank, world, steps)
        final = [_local(p) for p in net.parameters()]
        case: dict[str, Any] = {"distributed": rt.stats()["distributed"]}
        rt.close()
        ref = reference(name, steps, shards=2, parts=4)
        case.update(_same(final, [ps[shard] for ps in ref]))
        out[name] = case


SLOW_S = 2.0  # how long rank 1's refreshes take in scenario "slow" (at least)
SLOW_WINDOWS = (7, 19)  # the first step of each 9-step window that slows them


def scenario_slow(rank: int, world: int, out: dict) -> None:
    """S=5, rank 1's refreshes requested in two windows of steps take at least ``SLOW_S``
    (``slow_pool``): no rank uses a version older than 5, and every rank waits at the deadline
    of those refreshes for them. Each rank records when each step ended (``time.monotonic``,
    one clock for the processes of a machine) and at which steps it installed; rank 1 when each
    window began, so that the test can tell that rank 0 waited for rank 1's results."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from asteria.runtime.testing import slow_pool

    dims = (24, 20, 16)
    torch.manual_seed(0)
    net = DDP(model(dims=dims))
    opt = SOAP(list(net.parameters()), precondition_frequency=6, max_preconditioner_dim=12)
    rt = Runtime(net, opt, RuntimeConfig(staleness=5, workers=1))
    oldest_pending = 0
    slowed_from, step_end, install_steps, installs = [], [], [], 0
    for t in range(30):
        slowed = rank == 1 and any(w <= t < w + 9 for w in SLOW_WINDOWS)
        if rank == 1 and t in SLOW_WINDOWS:
            slowed_from.append(time.monotonic())
        with slow_pool(SLOW_S if slowed else 0.0):
            opt.zero_grad()
            x, y = my_rows(t, rank, world, dims)
            loss(net, x, y).backward()
            opt.step()  # the parameters' step count is now t (step 0 initialises)
            if slowed:
                rt.sync()  # a submission queued on the statistics lane is made slow too
        step_end.append(time.monotonic())
        stats = rt.stats()
        if stats["installs"] > installs:
            install_steps.append(t)
        installs = stats["installs"]
        for block in stats["blocks"].values():
            if block["pending"] >= 0:
                oldest_pending = max(oldest_pending, t - block["pending"])
    stats = rt.stats()
    out["histogram"] = stats["staleness_histogram"]
    out["max_staleness"] = stats["max_staleness"]
    out["installs"] = stats["installs"]
    out["oldest_pending"] = oldest_pending
    out["distributed"] = stats["distributed"]
    out["replicas_agree"] = _replicas_agree([_local(p) for p in net.parameters()])
    out.update(slowed_from=slowed_from, step_end=step_end, install_steps=install_steps)
    out.update(slow_s=SLOW_S, slow_windows=list(SLOW_WINDOWS))
    rt.close()


def scenario_kill(rank: int, world: int, out: dict, hang: bool = False) -> None:
    """Rank 1 dies (``hang``: stops answering for 6 s, then dies) at step 7; the others must
    fail with the coherence timeout error. Plain replicated parameters with the full-batch
    gradient on every rank (no DDP), so that the only collectives are the runtime's."""
    from asteria.runtime.distributed import CoherenceTimeoutError

    net = model()
    opt = make_opt("soap", list(net.parameters()))
    rt = Runtime(net, opt, RuntimeConfig(staleness=1, workers=1, barrier_timeout_s=4.0))
    t0 = None
    try:
        for t in range(40):
            if rank == 1 and t == 7:
                if hang:
                    time.sleep(6.0)
                os._exit(3)  # no cleanup: a crashed rank
            if t == 7:
                t0 = time.perf_counter()
            opt.zero_grad()
            x, y = batch(t)
            loss(net, x, y).backward()
            opt.step()
        out["error"] = None
    except CoherenceTimeoutError as err:
        out["error"] = str(err)
        out["elapsed_s"] = time.perf_counter() - (t0 or time.perf_counter())
    finally:
        rt.close(install_pending=False)


def scenario_checkpoint(rank: int, world: int, out: dict, path: Path) -> None:
    """Save after 6 steps on both ranks, load on both ranks: the same continuation to step 14.
    The checkpoint is taken at a step with no refresh in flight (refreshes in flight are not
    part of an optimizer's ``state_dict``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def make():
        net = DDP(model())
        opt = make_opt("soap", list(net.parameters()))
        rt = Runtime(net, opt, RuntimeConfig(staleness=2, workers=1))
        return net, opt, rt

    net, opt, rt = make()
    _train(net, opt, rank, world, 6)
    pending = rt.stats()["jobs"]["in_flight"]
    torch.save({"model": net.module.state_dict(), "opt": opt.state_dict()}, path / f"ckpt{rank}.pt")
    _train(net, opt, rank, world, 14, start=6)
    straight = [_local(p) for p in net.parameters()]
    rt.close()

    net, opt, rt = make()
    saved = torch.load(path / f"ckpt{rank}.pt", weights_only=False)
    net.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    _train(net, opt, rank, world, 14, start=6)
    resumed = [_local(p) for p in net.parameters()]
    rt.close()
    out["in_flight_at_save"] = pending
    out.update(_same(resumed, straight))
    out["replicas_agree"] = _replicas_agree(resumed)


def _sharded(layout: str, world: int):
    """A fresh model, ``fully_shard``-ed over ``world`` ranks ("fsdp") or as ``world`` replicas
    of one shard ("hsdp", whose blocks are replicated: owners and syncs)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    shape, names = ((world,), ("shard",)) if layout == "fsdp" else ((world, 1), ("rep", "shard"))
    net = model()
    fully_shard(net, mesh=init_device_mesh("cpu", shape, mesh_dim_names=names))
    return net


def scenario_dcp(rank: int, world: int, out: dict, path: Path) -> None:
    """asteria.checkpoint under FSDP2 and HSDP: save after 7 steps with refreshes in flight
    (``fixed_delay=2``), load on the same ranks into a fresh model, optimizer and runtime: the
    same continuation to step 14, bit for bit. The FSDP2 checkpoints and their parameters, full,
    are left in ``path`` for ``scenario_dcp_one_rank``."""
    from asteria import checkpoint

    for layout in ("fsdp", "hsdp"):
        for name in OPTIMIZERS:
            # Shampoo requests one step ahead (Note [Refresh lead]): at steps 2 and 5, so a
            # delay of 3 keeps the second in flight at step 7, as 2 does the others' of step 6
            delay = 3 if name == "shampoo" else 2
            config = RuntimeConfig(staleness=delay, fixed_delay=delay, workers=1)
            ckpt = path / f"{layout}_{name}"
            net = _sharded(layout, world)
            opt = make_opt(name, list(net.parameters()))
            rt = Runtime(net, opt, config)
            _train(net, opt, rank, world, 7)
            in_flight = rt.stats()["jobs"]["in_flight"]
            checkpoint.save(ckpt, net, opt, rt, extra={"step": 7})
            if layout == "fsdp":
                full = [p.full_tensor() for p in net.parameters()]  # collective
                if rank == 0:
                    torch.save(full, path / f"full_{name}.pt")
            _train(net, opt, rank, world, 14, start=7)
            straight = [_local(p) for p in net.parameters()]
            rt.close()

            net = _sharded(layout, world)
            opt = make_opt(name, list(net.parameters()))
            rt = Runtime(net, opt, config)
            extra = checkpoint.load(ckpt, net, opt, rt)
            _train(net, opt, rank, world, 14, start=7)
            resumed = [_local(p) for p in net.parameters()]
            rt.close()
            case = {"in_flight_at_save": in_flight, "extra": extra, **_same(resumed, straight)}
            out[f"{layout}/{name}"] = case


def scenario_dcp_one_rank(rank: int, world: int, out: dict, path: Path) -> None:
    """One process loads the 2-rank FSDP2 checkpoints of ``scenario_dcp``: the model reshards
    (its parameters equal the saved ones, whole); the optimizer fails with a clear error."""
    from asteria import checkpoint

    for name in OPTIMIZERS:
        net = _sharded("fsdp", world)
        checkpoint.load(path / f"fsdp_{name}", net)
        saved = torch.load(path / f"full_{name}.pt", weights_only=True)
        case = _same([p.full_tensor() for p in net.parameters()], saved)
        try:
            checkpoint.load(path / f"fsdp_{name}", net, make_opt(name, list(net.parameters())))
            case["error"] = None
        except ValueError as err:
            case["error"] = str(err)
        out[name] = case


def scenario_bad(rank: int, world: int, out: dict) -> None:
    """Settings that differ across ranks or are wrong: a ValueError on every rank, no hang."""

    def attach(name, make_opt_, config, **kw):
        try:
            Runtime(None, make_opt_(), config, **kw).close()
            out[name] = None
        except ValueError as err:
            out[name] = str(err)

    def soap(**kw):
        return lambda: SOAP(list(model().parameters()), **kw)

    attach("bad_staleness", soap(), RuntimeConfig(staleness=2 + rank, workers=1))
    attach("bad_hyper", soap(lr=1e-3 * (1 + rank)), RuntimeConfig(staleness=2, workers=1))
    attach("bad_topology", soap(), RuntimeConfig(staleness=2, workers=1), ranks_per_node=3)

    def mixed():  # rank 1's parameters on two devices ('meta' stands in for a second one)
        params = [torch.nn.Parameter(torch.zeros(3, 3)) for _ in range(2)]
        if rank == 1:
            params[1] = torch.nn.Parameter(torch.zeros(3, 3, device="meta"))
        return SOAP(params)

    attach("bad_devices", mixed, RuntimeConfig(staleness=2, workers=1))
    # and a good attach afterwards still works: nothing was left half-built
    attach("good", soap(), RuntimeConfig(staleness=2, workers=1))


def scenario_hang(rank: int, world: int, out: dict) -> None:
    scenario_kill(rank, world, out, hang=True)


def scenario_interrupt(rank: int, world: int, out: dict, resume: bool = False) -> None:
    """Rank 1 is interrupted (KeyboardInterrupt, as Ctrl-C on that rank only) inside step 7's
    sync of a replicated block; ``resume``: it catches the interrupt and trains on, else it
    leaves its ``with Runtime(...)`` block (``close()``, collective) with the interrupt. Every
    rank must end within the collective timeout with an error naming the rank (or train on,
    all repaired): ``out`` has each rank's error and how long it took from step 7."""
    import asteria.runtime.refreshes as refreshes_module

    original = refreshes_module.Refreshes.sync_replicated
    state = {"armed": rank == 1}

    def interrupted(self, key, e, step, block):
        if state["armed"] and step >= 7:
            state["armed"] = False
            raise KeyboardInterrupt
        return original(self, key, e, step, block)

    refreshes_module.Refreshes.sync_replicated = interrupted
    net = model()
    opt = make_opt("soap", list(net.parameters()))
    config = RuntimeConfig(staleness=1, workers=1, barrier_timeout_s=4.0)
    t0 = None
    errors: list[str] = []
    try:
        with Runtime(net, opt, config):
            t = 0
            while t < 20:
                if t == 7:
                    t0 = time.perf_counter()
                opt.zero_grad()
                x, y = batch(t)
                loss(net, x, y).backward()
                try:
                    opt.step()
                except KeyboardInterrupt:
                    errors.append("KeyboardInterrupt")
                    if not resume:
                        raise
                t += 1
    except BaseException as err:  # noqa: BLE001 (what each rank ends with is the result)
        errors.append(f"{type(err).__name__}: {err}")
    out["errors"] = errors
    out["elapsed_s"] = time.perf_counter() - (t0 or time.perf_counter())
    out["params"] = [p.detach().sum().item() for p in net.parameters()]


def scenario_interrupt_resume(rank: int, world: int, out: dict) -> None:
    scenario_interrupt(rank, world, out, resume=True)


SCENARIOS = {
    "contract": scenario_contract,
    "ddp": scenario_ddp,
    "fsdp": scenario_fsdp,
    "hsdp": scenario_hsdp,
    "hsdp4": scenario_hsdp4,
    "slow": scenario_slow,
    "kill": scenario_kill,
    "hang": scenario_hang,
    "interrupt": scenario_interrupt,
    "interrupt_resume": scenario_interrupt_resume,
    "bad": scenario_bad,
}
WITH_PATH = {
    "checkpoint": scenario_checkpoint,
    "dcp": scenario_dcp,
    "dcp_one_rank": scenario_dcp_one_rank,
}


def main() -> None:
    scenario, path = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    init_gloo(timeout_s=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    if scenario in WITH_PATH:
        WITH_PATH[scenario](rank, world, out, path)
    else:
        SCENARIOS[scenario](rank, world, out)
    (path / f"rank{rank}.json").write_text(json.dumps(out))
    if scenario not in ("kill", "hang", "interrupt", "interrupt_resume"):
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
