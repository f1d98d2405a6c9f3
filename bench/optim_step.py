"""Time of one optimizer step, ordinary steps and refresh steps apart, for Asteria and its peers.

Every optimizer gets the same parameters (the shapes of a small transformer, all dims <= 1024)
and the same random gradients, in native (synchronous) mode with a preconditioner refresh due
every 10 steps. After ``--warmup`` steps (the first one initialises factors with an eigh) it
times ``--steps`` calls of ``step()`` one by one, the optimizers taking their steps in turn (Note
[Interleaved timing]), and reports the median of the ordinary steps and the median of the
refresh steps. A step counts as a refresh when the optimizer itself would
refresh at it:

* asteria: ``optimizer.is_refresh_step()``;
* pytorch-optimizer SOAP: a call refreshes when ``group["step"]`` (before the call) is a positive
  multiple of ``precondition_frequency``;
* heavyball 3.2.1 SOAP / KLShampoo: with ``use_precond_schedule=False`` the schedule is
  fractional: each step adds ``1 / precondition_frequency`` to ``inner_group["cumulative_prob"]``
  and a refresh runs when its integer part increases. With ``precondition_frequency=10`` the
  float sum refreshes at steps 11, 20, 30, 40, 51, 61, ... (gaps of 9 to 11, 10 on average),
  which is as close to "every 10" as heavyball can be configured. torch.compile is off
  (``heavyball.utils.compile_mode = None``), as on CPU it only adds minutes of compilation;
* Meta's Distributed Shampoo (the copy in ../shared/peers/meta_distributed_shampoo; left out,
  with a line saying so, where that folder is absent): a call refreshes when the group's step
  after it is Meta's ``perform_amortized_computation`` step (``start_preconditioning_step`` -1,
  so every 10th). Three configurations, eager (no PT2 compile), fp32 factors: Shampoo with Adam
  grafting (``RootInvShampooPreconditionerConfig``, against asteria Shampoo's same options),
  SOAP-like (``DefaultSOAPConfig``: eigenvalue-corrected, one QR iteration) and KL-Shampoo
  (``EigendecomposedKLShampooPreconditionerConfig``), both at ``max_preconditioner_dim=10000``
  and SOAP's / KL-Shampoo's betas and weight decay, without grafting.

Usage: ``python bench/optim_step.py [--threads 1] [--steps 60] [--only asteria_soap,...]
[--sequential] [--device cuda]``. On CUDA every contender steps on the GPU (timed with the
device drained before and after each step) and heavyball's steps are ``torch.compile``d as it
ships; asking for CUDA where torch sees none is an error that says so.

``--count [--models tiny,olmo-150m] [--max-dim 1024] [--baseline JSON]``: no timing; the ATen
ops each contender dispatches per ordinary step and per refresh step (a ``TorchDispatchMode``
counter, views and metadata apart: Note [Counted steps]) on the weight shapes of ``tiny`` and of
OLMo-150m, with issue 38's goals against an earlier count (``--baseline``).
The last line of output is one JSON object: env, results {name: {median_ms, refresh_ms, ...}},
and ratios ``ours / peer`` (below 1: ours is faster) for every Asteria-vs-peer pair and every
optimizer against torch.optim.AdamW.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from _common import (
    emit_json,
    env_header,
    median,
    partial_json,
    print_table,
    ratio,
    set_threads,
    time_ms,
)
from torch.optim import Optimizer
from torch.utils._python_dispatch import TorchDispatchMode

FREQ = 10
Params = list[torch.nn.Parameter]


def transformer_shapes(d: int, layers: int, mlp: int, vocab: int) -> list[tuple[int, ...]]:
    """Weight shapes of an OLMo-2-style decoder: attention, SwiGLU MLP, 4 norms per layer."""
    layer = [(d, d)] * 4 + [(mlp, d), (mlp, d), (d, mlp)] + [(d,)] * 4
    return [(vocab, d), *(layer * layers), (d,), (vocab, d)]


@dataclass(frozen=True)
class Contender:
    """One optimizer under test: how to build it and how to tell that its next step refreshes."""

    name: str
    build: Callable[[Params], Optimizer]
    refreshes: Callable[[Optimizer], bool]


def _never(_: Optimizer) -> bool:
    return False


def _asteria_refreshes(opt: Optimizer) -> bool:
    return bool(opt.is_refresh_step())


def _pytorch_optimizer_refreshes(opt: Optimizer) -> bool:
    group = opt.param_groups[0]
    step = group.get("step", 0)
    return step > 0 and step % group["precondition_frequency"] == 0


def _heavyball_refreshes(opt: Optimizer) -> bool:
    cumulative = opt.inner_group.get("cumulative_prob", 0)
    return int(cumulative + opt.precond_schedule) > int(cumulative)


#: Meta's Distributed Shampoo: ``$ASTERIA_META_SHAMPOO`` where set (a copy that travels with the
#: tree to a GPU machine: bench/gpu_check.sh's peers), else ../shared/peers beside the checkout.
META_PATH = Path(
    os.environ.get("ASTERIA_META_SHAMPOO")
    or Path(__file__).resolve().parents[1].parent / "shared/peers/meta_distributed_shampoo"
)


def _meta_refreshes(opt: Optimizer) -> bool:
    state = opt._per_group_state_lists[0]
    step = int(state["step"]) + 1  # the group's step count this call will reach
    group = opt.param_groups[0]
    start, freq = group["start_preconditioning_step"], group["precondition_frequency"]
    return step == start or (step > start and step % freq == 0)


def meta_contenders(max_dim: int | None = None, freq: int = FREQ) -> list[Contender]:
    """Meta's Distributed Shampoo in three configurations, or none where it is absent;
    ``max_dim`` (default: each configuration's own) caps every factor's dim."""
    if not META_PATH.is_dir():
        print(f"   (Meta's Distributed Shampoo is not at {META_PATH}: its rows are left out)")
        return []
    sys.path.insert(0, str(META_PATH))
    import distributed_shampoo as ds

    logging.getLogger("distributed_shampoo").setLevel(logging.ERROR)
    return [
        Contender(
            "meta_shampoo",
            lambda p: ds.DistributedShampoo(
                p,
                lr=3e-3,
                precondition_frequency=freq,
                grafting_config=ds.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-10),
                max_preconditioner_dim=max_dim or 1024,
            ),
            _meta_refreshes,
        ),
        Contender(
            "meta_soap",
            lambda p: ds.DistributedShampoo(
                p,
                lr=3e-3,
                betas=(0.95, 0.95),
                epsilon=1e-8,
                weight_decay=0.01,
                max_preconditioner_dim=max_dim or 10000,
                precondition_frequency=freq,
                preconditioner_config=ds.DefaultSOAPConfig,
            ),
            _meta_refreshes,
        ),
        Contender(
            "meta_kl_shampoo",
            lambda p: ds.DistributedShampoo(
                p,
                lr=3e-3,
                betas=(0.9, 0.98),
                epsilon=1e-8,
                weight_decay=0.01,
                max_preconditioner_dim=max_dim or 10000,
                precondition_frequency=freq,
                preconditioner_config=ds.EigendecomposedKLShampooPreconditionerConfig(),
            ),
            _meta_refreshes,
        ),
    ]


def contenders(
    max_dim: int | None = None, freq: int = FREQ, compile_heavyball: bool = False
) -> dict[str, Contender]:
    """Every optimizer the benchmark knows, configured alike (lr 3e-3, wd 0.01, refresh every
    ``freq``); ``max_dim`` caps every factor's dim (default: each optimizer's own, 10000 for the
    SOAP family and KL-Shampoo, 1024 for Shampoo). heavyball's steps are compiled as it ships
    only with ``compile_heavyball`` (on a GPU; on the CPU compiling only adds minutes)."""
    import heavyball
    import pytorch_optimizer

    from asteria.optim import SOAP, KLShampoo, Shampoo

    if not compile_heavyball:
        heavyball.utils.compile_mode = None
    ours = {} if max_dim is None else {"max_preconditioner_dim": max_dim}
    hb_common = {
        "weight_decay": 0.01,
        "precondition_frequency": freq,
        "max_precond_dim": max_dim or 10000,
        "merge_dims": False,
        "precondition_1d": False,
        "use_precond_schedule": False,
    }
    table = [
        Contender(
            "torch_adamw", lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01), _never
        ),
        Contender(
            "torch_adamw_foreach",
            lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01, foreach=True),
            _never,
        ),
        Contender(
            "asteria_soap",
            lambda p: SOAP(p, lr=3e-3, betas=(0.95, 0.95), precondition_frequency=freq, **ours),
            _asteria_refreshes,
        ),
        Contender(
            "asteria_kl_shampoo",
            lambda p: KLShampoo(p, lr=3e-3, betas=(0.9, 0.98), precondition_frequency=freq, **ours),
            _asteria_refreshes,
        ),
        Contender(
            "asteria_shampoo",
            lambda p: Shampoo(p, lr=3e-3, precondition_frequency=freq, grafting="adam", **ours),
            _asteria_refreshes,
        ),
        Contender(
            "pytorch_optimizer_soap",
            lambda p: pytorch_optimizer.SOAP(
                p,
                lr=3e-3,
                betas=(0.95, 0.95),
                precondition_frequency=freq,
                max_precondition_dim=max_dim or 10000,
            ),
            _pytorch_optimizer_refreshes,
        ),
        Contender(
            "heavyball_soap",
            lambda p: heavyball.SOAP(
                p, lr=3e-3, betas=(0.95, 0.95), shampoo_beta=0.95, **hb_common
            ),
            _heavyball_refreshes,
        ),
        Contender(
            "heavyball_kl_shampoo",
            lambda p: heavyball.KLShampoo(
                p, lr=3e-3, betas=(0.9, 0.98), shampoo_beta=0.98, init_factor=0.1, **hb_common
            ),
            _heavyball_refreshes,
        ),
        *meta_contenders(max_dim, freq),
    ]
    return {c.name: c for c in table}


# (ours, peer) pairs whose ratio the JSON reports, besides everything against torch_adamw.
PAIRS = [
    ("asteria_soap", "pytorch_optimizer_soap"),
    ("asteria_soap", "heavyball_soap"),
    ("asteria_kl_shampoo", "heavyball_kl_shampoo"),
    ("asteria_shampoo", "meta_shampoo"),
    ("asteria_soap", "meta_soap"),
    ("asteria_kl_shampoo", "meta_kl_shampoo"),
]


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


class _Run:
    """One contender's optimizer over its own parameters, stepped one timed step at a time."""

    def __init__(self, contender: Contender, shapes, seed: int, device: torch.device) -> None:
        self.contender, self.seed, self.device = contender, seed, device
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.params = [
            torch.nn.Parameter(0.02 * torch.randn(s, generator=gen).to(device)) for s in shapes
        ]
        self.opt = contender.build(self.params)
        self.gen = gen
        self.ordinary: list[float] = []
        self.refresh: list[float] = []

    def step(self, i: int, timed: bool) -> None:
        """Step ``i``: gradients that depend only on seed and step, then one timed ``step()``."""
        self.gen.manual_seed(self.seed + 1 + i)
        for p in self.params:
            p.grad = torch.randn(p.shape, generator=self.gen).to(self.device)
        is_refresh = self.contender.refreshes(self.opt)
        ms = time_ms(self.opt.step, self.device)
        if timed:
            (self.refresh if is_refresh else self.ordinary).append(ms)

    def result(self, steps: int) -> dict[str, float | int | None]:
        times = self.ordinary + self.refresh
        return {
            "median_ms": _round(median(self.ordinary), 3),
            "refresh_ms": _round(median(self.refresh), 3),
            "mean_ms": _round(sum(times) / len(times), 3),
            "refreshes": len(self.refresh),
            "steps": steps,
        }


def run_one(
    contender: Contender,
    shapes: list[tuple[int, ...]],
    *,
    warmup: int,
    steps: int,
    seed: int,
    device: torch.device,
) -> dict[str, float | int | None]:
    """Time ``steps`` optimizer steps after ``warmup``; gradients depend only on seed and step."""
    run = _Run(contender, shapes, seed, device)
    for i in range(warmup + steps):
        run.step(i, timed=i >= warmup)
    return run.result(steps)


def run_interleaved(
    contenders: list[Contender],
    shapes: list[tuple[int, ...]],
    *,
    warmup: int,
    steps: int,
    seed: int,
    device: torch.device,
) -> dict[str, dict[str, float | int | None]]:
    """``run_one`` for every contender at once, step ``i`` of each in turn (Note [Interleaved
    timing])."""
    runs = [_Run(c, shapes, seed, device) for c in contenders]
    for i in range(warmup + steps):
        for run in runs:
            run.step(i, timed=i >= warmup)
    return {run.contender.name: run.result(steps) for run in runs}


# Note [Interleaved timing]: this machine is shared (2 vCPUs, other jobs come and go), and a
# contender timed alone for its 60 steps meets whatever load those minutes bring: one run of the
# sequential schedule measured asteria SOAP at 1.08x pytorch-optimizer's ordinary step and 1.52x its
# refresh under a load average near 4, against 0.77x and 0.97x on a quiet machine. So by default
# every contender steps in turn (step i of each, then step i + 1), and a load change reaches all
# of them within one round; the ratios then compare steps taken under the same load. Each keeps its
# own parameters, state and gradient stream (the same values for all), so the work timed is the
# same as alone; ``--sequential`` restores one contender after the other (less memory).


def ratios(results: dict[str, dict]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for ours, peer in PAIRS:
        if ours in results and peer in results:
            for key, field in (("median", "median_ms"), ("refresh", "refresh_ms")):
                value = ratio(results[ours][field], results[peer][field])
                out[f"{ours}_vs_{peer}_{key}"] = _round(value, 4)
    if "torch_adamw" in results:
        for name, res in results.items():
            if name != "torch_adamw":
                value = ratio(res["median_ms"], results["torch_adamw"]["median_ms"])
                out[f"{name}_vs_torch_adamw_median"] = _round(value, 4)
    return out


# -- ATen ops per step (--count) --------------------------------------------------------------

#: The models whose weight shapes ``--count`` steps: (d_model, layers, MLP width, vocab), those
#: of asteria.train's presets (tiny at the byte vocab, OLMo-150m at OLMo's 50k one).
COUNT_MODELS = {"tiny": (256, 4, 768, 257), "olmo-150m": (768, 12, 2048, 50304)}
#: Ops that only make views or read metadata: counted apart (a view is no kernel launch).
VIEW_OPS = frozenset(
    {"detach", "alias", "lift_fresh", "_unsafe_view", "view", "as_strided", "set_", "resize_"}
)
METADATA_OPS = frozenset({"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim"})


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched under it: ``ops`` (kernels) and ``views`` (views and
    metadata: ``func.is_view`` and the names above). A ``_foreach_*`` op counts once (one
    dispatch; on CUDA a few multi-tensor launches)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.views = 0
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.is_view or name in VIEW_OPS or name in METADATA_OPS:
            self.views += 1
        else:
            self.ops += 1
            self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def count_ops(contender: Contender, shapes, *, steps: int, seed: int, device) -> dict:
    """The ATen ops of each of ``steps`` steps of ``contender`` (refresh every 3 steps): the
    last ordinary step's and the last refresh step's counts (Note [Counted steps])."""
    run = _Run(contender, shapes, seed, device)
    ordinary = refresh = None
    for i in range(steps):
        run.gen.manual_seed(seed + 1 + i)
        for p in run.params:
            p.grad = torch.randn(p.shape, generator=run.gen).to(device)
        is_refresh = contender.refreshes(run.opt)
        with OpCounter() as counter:
            run.opt.step()
        row = {"ops": counter.ops, "views": counter.views, "step": i + 1, "top": _top(counter)}
        if i == 0:
            continue  # the first step initialises (eigh): neither ordinary nor a refresh
        if is_refresh:
            refresh = row
        else:
            ordinary = row
    blocks = len(list(run.opt.blocks())) if hasattr(run.opt, "blocks") else None
    return {"ordinary": ordinary, "refresh": refresh, "blocks": blocks}


def _top(counter: OpCounter, n: int = 6) -> dict[str, int]:
    return dict(sorted(counter.names.items(), key=lambda kv: -kv[1])[:n])


# Note [Counted steps]: ``--count`` steps each contender ``--count-steps`` times (7: the first
# initialises, refreshes fall every 3 steps, so steps 3 and 6 refresh and 2, 4, 5, 7 do not)
# and reports the last ordinary step (Shampoo's is then preconditioned: its roots came at step
# 3) and the last refresh step. An ordinary step's ops do not depend on the frequency; the
# refresh step's do not either, beyond which blocks are due (all, natively). On the CPU a
# ``_foreach_*`` op is one dispatch, as on CUDA it is a few launches per chunk of tensors; a
# peer's ``torch.compile``d step is counted eagerly (heavyball's compile is off, as in the
# timings).


def count_main(args, names: list[str], device: torch.device) -> None:
    env = env_header("ATen ops per optimizer step (bench/optim_step.py --count)", "heavyball",
                     "pytorch-optimizer")  # fmt: skip
    results: dict[str, dict] = {}
    for model in args.models.split(","):
        d, layers, mlp, vocab = COUNT_MODELS[model]
        shapes = transformer_shapes(d, layers, mlp, vocab)
        table = contenders(args.max_dim, freq=3, compile_heavyball=device.type == "cuda")
        for name in names:
            res = count_ops(table[name], shapes, steps=args.count_steps, seed=args.seed,
                            device=device)  # fmt: skip
            results[f"{name}@{model}"] = res
            o, r = res["ordinary"] or {}, res["refresh"] or {}
            print(f"   {model} {name}: ordinary {o.get('ops')} ops, refresh {r.get('ops')} "
                  f"ops, {res['blocks']} blocks", flush=True)  # fmt: skip
    env |= {"device": str(device), "max_dim": args.max_dim, "steps": args.count_steps}
    payload: dict = {"env": env, "counts": results}
    if args.baseline:
        payload["goals"] = count_goals(results, _load_counts(args.baseline))
        print(f"   goals met: {payload['goals']['met']}")
    emit_json(payload)


OURS = ("asteria_soap", "asteria_kl_shampoo", "asteria_shampoo")
PEERS = ("pytorch_optimizer_soap", "heavyball_soap", "heavyball_kl_shampoo", "meta_shampoo",
         "meta_soap", "meta_kl_shampoo")  # fmt: skip


def _load_counts(paths: str) -> dict[str, dict]:
    """The ``counts`` of earlier ``--count`` JSONs (comma-separated paths), merged."""
    merged: dict[str, dict] = {}
    for path in paths.split(","):
        merged |= json.loads(Path(path).read_text().strip().splitlines()[-1])["counts"]
    return merged


def count_goals(now: dict[str, dict], before: dict[str, dict]) -> dict:
    """Issue 38's goals on the ordinary step: each of ours at most a quarter of its ops in
    ``before`` (the same model), and fewer than every peer's (now, or in ``before``: a peer's
    code did not change)."""
    rows: dict[str, dict] = {}
    for key, res in now.items():
        name, model = key.split("@")
        if name not in OURS or not res.get("ordinary"):
            continue
        ops = res["ordinary"]["ops"]
        old = (before.get(key) or {}).get("ordinary") or {}
        peers = {p: ((now.get(f"{p}@{model}") or before.get(f"{p}@{model}") or {})
                     .get("ordinary") or {}).get("ops") for p in PEERS}  # fmt: skip
        peers = {p: n for p, n in peers.items() if n is not None}
        rows[key] = {
            "ops": ops,
            "before": old.get("ops"),
            "ratio_to_before": None if not old.get("ops") else round(ops / old["ops"], 4),
            "quarter": bool(old.get("ops")) and ops <= old["ops"] / 4,
            "fewest_peer": min(peers.values()) if peers else None,
            "below_every_peer": bool(peers) and ops < min(peers.values()),
            "refresh_ops": (res.get("refresh") or {}).get("ops"),
            "refresh_before": ((before.get(key) or {}).get("refresh") or {}).get("ops"),
        }
    met = {
        "quarter": all(r["quarter"] for r in rows.values()),
        "below_every_peer": all(r["below_every_peer"] for r in rows.values()),
    }
    return {"by_optimizer": rows, "met": met}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per optimizer")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", help="comma-separated subset of optimizers")
    ap.add_argument(
        "--sequential",
        action="store_true",
        help="time one optimizer after the other (default: interleaved, Note [Interleaved timing])",
    )
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--mlp", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--count", action="store_true", help="count ATen ops per step, no timing")
    ap.add_argument("--models", default="tiny", help="--count: tiny,olmo-150m")
    ap.add_argument("--count-steps", type=int, default=7)
    ap.add_argument("--max-dim", type=int, default=None, help="cap on every factor's dim")
    ap.add_argument("--baseline", help="--count: earlier --count JSONs (comma-separated)")
    args = ap.parse_args()

    set_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device")
    table = contenders(args.max_dim, compile_heavyball=device.type == "cuda")
    names = list(table) if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown optimizer(s) {unknown}; choose from {', '.join(table)}")
    if args.count:
        count_main(args, names, device)
        return
    env = env_header("optimizer step time (bench/optim_step.py)", "heavyball", "pytorch-optimizer")
    shapes = transformer_shapes(args.d_model, args.layers, args.mlp, args.vocab)
    n_params = sum(torch.Size(s).numel() for s in shapes)
    env |= {"device": str(device), "params": n_params, "tensors": len(shapes), "freq": FREQ}
    print(f"   model: {len(shapes)} tensors, {n_params:,} params, refresh every {FREQ} steps")

    kw = dict(warmup=args.warmup, steps=args.steps, seed=args.seed, device=device)
    if args.sequential:
        results: dict[str, dict] = {}
        for name in names:
            results[name] = run_one(table[name], shapes, **kw)
            r = results[name]
            print(f"   {name}: done ({r['refreshes']} refresh steps)", flush=True)
            partial_json({"env": env, "results": results})
    else:
        results = run_interleaved([table[n] for n in names], shapes, **kw)
    env["schedule"] = "sequential" if args.sequential else "interleaved"

    print()
    rows = [
        [n, r["median_ms"], r["refresh_ms"], r["mean_ms"], r["refreshes"], r["steps"]]
        for n, r in results.items()
    ]
    print_table(
        ["optimizer", "step ms (median)", "refresh ms (median)", "mean ms", "refreshes", "steps"],
        rows,
    )
    emit_json({"env": env, "results": results, "ratios": ratios(results)})


if __name__ == "__main__":
    main()
