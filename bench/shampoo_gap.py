"""Where Asteria-Shampoo's loss departs from native Shampoo's: one knob at a time.

bench/step_time.py's setting (``tiny``, batch 16 x 128, 110 steps, constant lr from
asteria/train/optimizers.py, no clipping, seed 0) with Shampoo in native mode and in Asteria
mode under variations that each isolate one candidate cause of the gap:

* ``native``: the reference (roots of L_t at a due step t, Note [Refresh lead]);
* ``asteria``: the runtime's defaults (S = 5, refresh lead on; installs land when ready; the
  first roots waited for in the step that first uses them, Note [First roots]);
* ``asteria_nofirst``: the same with the first roots requested like the later ones
  (``wait_first_refresh=False``: one step ahead, from L_{t-1}, used when they arrive);
* ``asteria_nolead``: the runtime's defaults without the refresh lead (a due step keeps the
  previous roots; the roots of L_t arrive within the budget);
* ``fd1``: ``fixed_delay=1`` with the lead: every due step installs the roots of L_{t-1}, never
  late, never a grafting-only step beyond native's: the cost of roots one gradient older;
* ``fd1_first``: the same with the first roots native's (``wait_first_refresh=True``): the
  cost of the later rounds one gradient older (that of the first round: ``fd1`` less this);
* ``fd1_nolead``: ``fixed_delay=1`` without the lead: a due step keeps the previous roots (the
  first ones: the grafting direction) and the roots of L_t arrive at t + 1;
* ``fdS``: ``fixed_delay=S``: every refresh at its deadline, the slowest the budget allows;
* ``*_eps<e>``: the same with Shampoo's ``epsilon`` (the damping of the roots' eigenvalues)
  raised from its default 1e-12 to ``e``;
* ``*_rel<e>``: the same with Shampoo's ``rel_epsilon=e`` (the damping relative to the factor's
  largest row sum, a bound on its largest eigenvalue; Note [Damping stale roots] in
  asteria/optim/shampoo.py).

Per variant: the final training loss (mean of the last 10 steps, as step_time.py), the
validation loss at the end, the first and last step from the start (step 10) on at which a block
still had no roots (it took the grafting direction) and, for the asteria variants, the step of
the first install. The last line is JSON.

``--schedule cosine --seeds 1,2,3 --lr R``: each variant as bench/time_to_target.py trains it
(asteria.train's loop), over seeds, with the mean validation loss.

``--model mlp``: issue 39's MLP 32-64-64-16 regressing ``tanh(x @ W)`` (``run_mlp``), each
seed's data, ``--staleness``, ``--start``, ``--frequency``; per variant, the evaluation loss
against native's seed by seed (``vs_native``: mean, standard error, largest). Seconds a run:
``--model mlp --steps 60 --seeds 1,2,3,4,5,6,7,8 --variants native,asteria --staleness 1``
(bench/results/shampoo_gap_cpu_mlp_*.json).

Usage: ``python bench/shampoo_gap.py [--variants native,asteria,fd1] [--eps 1e-6] [--steps 110]``.
One ``nano`` cosine run (200 steps of 8 x 64) took 19-89 s on the shared 2-vCPU machine, a
``tiny`` one 8-14 minutes under load; bench/results/shampoo_gap_cpu_nano*.json:
``--schedule cosine --model nano --steps 200 --batch-size 8 --seq-len 64 --lr 1.5e-3 --seeds
1,2,3``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asteria.optim import Shampoo  # noqa: E402
from asteria.runtime import Runtime, RuntimeConfig  # noqa: E402
from asteria.train.data import VOCAB_SIZE, load_corpus, train_batches, val_batches  # noqa: E402
from asteria.train.loop import evaluate  # noqa: E402
from asteria.train.models import build_model, get_preset  # noqa: E402
from asteria.train.optimizers import OPTIMIZERS  # noqa: E402
from bench._common import emit_json, env_header, print_table  # noqa: E402

VARIANTS = (
    "native",
    "asteria",
    "asteria_nofirst",
    "asteria_nolead",
    "fd1",
    "fd1_first",
    "fd1_nolead",
    "fdS",
)


def _runtime_config(base: str, staleness: int) -> RuntimeConfig | None:
    if base == "native":
        return None
    if base == "asteria":
        return RuntimeConfig(staleness=staleness, workers=1)
    if base == "asteria_nofirst":
        return RuntimeConfig(staleness=staleness, workers=1, wait_first_refresh=False)
    if base == "asteria_nolead":
        return RuntimeConfig(staleness=staleness, workers=1, refresh_lead=False)
    if base == "fd1":
        return RuntimeConfig(staleness=staleness, workers=1, fixed_delay=1)
    if base == "fd1_first":
        return RuntimeConfig(staleness=staleness, workers=1, fixed_delay=1, wait_first_refresh=True)
    if base == "fd1_nolead":
        return RuntimeConfig(staleness=staleness, workers=1, fixed_delay=1, refresh_lead=False)
    if base == "fdS":
        return RuntimeConfig(staleness=staleness, workers=1, fixed_delay=staleness)
    raise ValueError(f"unknown variant {base!r}; choose from {', '.join(VARIANTS)}")


def split_variant(variant: str) -> tuple[str, dict]:
    """``fd1_eps1e-6`` -> ``("fd1", {"epsilon": 1e-6})``; ``native_rel1e-4`` -> ``rel_epsilon``
    1e-4; ``native_lrx1.000001`` -> the learning rate times 1.000001 (the protocol's own
    sensitivity: how far a perturbation far below any runtime's moves the evaluation loss)."""
    for tag, key in (("_eps", "epsilon"), ("_rel", "rel_epsilon"), ("_lrx", "lr_scale")):
        base, found, value = variant.partition(tag)
        if found:
            return base, {key: float(value)}
    return variant, {}


def make_shampoo(params, lr: float, **mod) -> Shampoo:
    """asteria/train/optimizers.py's Shampoo, with ``epsilon`` or ``rel_epsilon`` where given."""
    mod = dict(mod)
    kwargs = dict(lr=lr * mod.pop("lr_scale", 1.0), betas=(0.9, 1.0), precondition_frequency=10,
                  grafting="adam")  # fmt: skip
    return Shampoo(params, **(kwargs | mod))


def run(variant: str, args: argparse.Namespace, corpus) -> dict:
    base, mod = split_variant(variant)
    model = build_model(
        get_preset(args.model), vocab_size=VOCAB_SIZE, max_seq_len=args.seq_len, seed=args.seed
    )
    opt = make_shampoo(model.parameters(), OPTIMIZERS["shampoo"].lr_for(args.model), **mod)
    config = _runtime_config(base, args.staleness)
    runtime = Runtime(model, opt, config) if config is not None else None
    batches = train_batches(
        corpus, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed
    )
    val = val_batches(corpus, batch_size=args.batch_size, seq_len=args.seq_len, max_batches=4)
    losses, graft_only, first_install = [], [], None
    start = time.perf_counter()
    try:
        for step in range(1, args.steps + 1):
            x = next(batches)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            rootless = sum(
                1 for st in opt.state.values() for b in st.get("blocks", ()) if _rootless(b)
            )
            if rootless and step >= 10:  # from the start (precondition_frequency) on
                graft_only.append(step)
            if runtime is not None and first_install is None and runtime.stats()["installs"]:
                first_install = step
    finally:
        if runtime is not None:
            runtime.close()
    return {
        "final_loss": statistics.fmean(losses[-10:]),
        "val_loss": evaluate(model, val),
        "steps_with_rootless_blocks": [graft_only[0], graft_only[-1]] if graft_only else None,
        "first_install_step": first_install,
        "seconds": time.perf_counter() - start,
    }


def run_schedule(variant: str, args: argparse.Namespace, corpus, seed: int) -> dict:
    """``--schedule cosine``: the variant as bench/time_to_target.py trains it (asteria.train's
    loop: warmup + cosine, clipping, validation every 10 steps) at ``--lr``."""
    from asteria.train.loop import TrainConfig, train
    from asteria.train.optimizers import OptimizerSpec

    base, mod = split_variant(variant)
    name = "shampoo"
    if mod:  # the demo's Shampoo, damped otherwise, under a name of its own
        name = "shampoo-" + variant[len(base) + 1 :]
        OPTIMIZERS[name] = OptimizerSpec(
            name,
            OPTIMIZERS["shampoo"].lrs,
            name,
            lambda params, lr: make_shampoo(params, lr, **mod),
        )
    cfg = TrainConfig(
        model=args.model, optimizer=name, mode="native" if base == "native" else "asteria",
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        seed=seed, val_every=10, val_batches=args.val_batches,
    )  # fmt: skip
    result = train(
        cfg, corpus, runtime_config=_runtime_config(base, args.staleness), progress=False
    )
    s = result.summary()
    return {
        "final_loss": s["final_loss_mean10"],
        "val_loss": s["final_val_loss"],
        "staleness_histogram": (s.get("runtime") or {}).get("staleness_histogram"),
        "seconds": result.wall_s,
    }


def run_mlp(variant: str, args: argparse.Namespace, seed: int) -> dict:
    """``--model mlp``: issue 39's problem, as a new user would try it. An MLP 32-64-64-16
    (GELU) regressing ``tanh(x @ W)`` (``W`` and the data from ``seed``, the weights' init from
    seed 0), batch 64, ``Shampoo(lr, precondition_frequency=--frequency)`` at Meta's other
    defaults (betas (0.9, 1.0), epsilon 1e-12) with Adam grafting, ``--steps`` steps; the
    evaluation loss on 2,048 held-out points."""
    base, mod = split_variant(variant)
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.randn(32, 16, generator=gen) / 32**0.5 * 2
    xs = torch.randn(args.steps, 64, 32, generator=gen)
    x_eval = torch.randn(2048, 32, generator=gen)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
        torch.nn.Linear(64, 16),
    )  # fmt: skip
    mod = dict(mod)
    kwargs = dict(
        lr=(args.lr or 1e-3) * mod.pop("lr_scale", 1.0), precondition_frequency=args.frequency or 5
    )
    if args.start is not None:
        kwargs["start_preconditioning_step"] = args.start
    opt = Shampoo(model.parameters(), **(kwargs | mod))
    config = _runtime_config(base, args.staleness)
    runtime = Runtime(model, opt, config) if config is not None else None
    start = time.perf_counter()
    try:
        for x in xs:
            ((model(x) - torch.tanh(x @ w_true)) ** 2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        stats = runtime.stats() if runtime is not None else None
    finally:
        if runtime is not None:
            runtime.close()
    with torch.no_grad():
        val = float(((model(x_eval) - torch.tanh(x_eval @ w_true)) ** 2).mean())
    return {
        "val_loss": val,
        "staleness_histogram": stats and stats["staleness_histogram"],
        "urgent_waits": stats and stats["jobs"]["urgent_waits"],
        "barrier_wait_ms": stats and sum(stats["barrier_wait_ms"]),
        "seconds": time.perf_counter() - start,
    }


def paired_gaps(results: dict, names: list[str], seeds: list[int]) -> dict:
    """Per variant, its validation loss against native's, seed by seed: the per-seed relative
    gaps (%), their mean and standard error, and the largest."""
    out = {}
    for v in names:
        if v == "native" or "native" not in names:
            continue
        gaps = [
            100 * (results[f"{v}@seed{s}"]["val_loss"] / results[f"native@seed{s}"]["val_loss"] - 1)
            for s in seeds
        ]
        se = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else 0.0
        out[v] = {"gap_pct": gaps, "mean_pct": statistics.fmean(gaps), "se_pct": se,
                  "max_pct": max(gaps)}  # fmt: skip
    return out


def _rootless(block: dict) -> bool:
    return all(r is None for r in block["roots"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--eps", help="also run every variant with this epsilon (comma-separated)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=110)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--staleness", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--schedule", choices=("constant", "cosine"), default="constant",
        help="constant: step_time.py's loop; cosine: bench/time_to_target.py's (asteria.train)",
    )  # fmt: skip
    p.add_argument("--seeds", help="cosine: comma-separated seeds (default --seed)")
    p.add_argument("--lr", type=float, help="cosine: the peak rate (default the demo's)")
    p.add_argument(
        "--val-batches", type=int, default=4,
        help="cosine: validation batches (time_to_target.py's 4 by default)",
    )  # fmt: skip
    p.add_argument("--frequency", type=int, help="mlp: the precondition frequency (default 5)")
    p.add_argument("--start", type=int, help="mlp: start_preconditioning_step (default Meta's)")
    args = p.parse_args(argv)
    args.seeds = [int(x) for x in (args.seeds or str(args.seed)).split(",") if x.strip()]
    torch.set_num_threads(1)
    env = env_header("asteria bench/shampoo_gap.py")
    corpus = load_corpus(min_tokens=args.seq_len + 1)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    for e in (args.eps or "").split(","):
        if e.strip():
            names += [f"{v}_eps{e.strip()}" for v in list(names) if "_eps" not in v]
    results = {}
    if args.model == "mlp":
        for seed in args.seeds:
            for v in names:
                r = results[f"{v}@seed{seed}"] = run_mlp(v, args, seed)
                print(f"   {v} seed {seed}: eval loss {r['val_loss']:.5f}, staleness "
                      f"{r['staleness_histogram']}, urgent waits {r['urgent_waits']}",
                      flush=True)  # fmt: skip
        gaps = paired_gaps(results, names, args.seeds)
        print_table(
            ["variant", "mean vs native %", "se %", "max %"],
            [[v, g["mean_pct"], g["se_pct"], g["max_pct"]] for v, g in gaps.items()],
        )
        emit_json({"benchmark": "shampoo_gap", "env": env, "config": vars(args),
                   "results": results, "vs_native": gaps})  # fmt: skip
        return
    if args.schedule == "cosine":
        for seed in args.seeds:  # seed by seed
            for v in names:
                r = results[f"{v}@seed{seed}"] = run_schedule(v, args, corpus, seed)
                hist = r["staleness_histogram"]
                print(f"   {v} seed {seed}: final loss {r['final_loss']:.4f}, val "
                      f"{r['val_loss']:.4f}, staleness {hist}", flush=True)  # fmt: skip
        gaps = paired_gaps(results, names, args.seeds)
        for v in names:
            vals = [results[f"{v}@seed{s}"]["val_loss"] for s in args.seeds]
            results[v] = {"val_loss_mean": statistics.fmean(vals), "val_loss": vals}
            print(f"   {v}: mean val {results[v]['val_loss_mean']:.4f} over seeds {args.seeds}")
        emit_json({"benchmark": "shampoo_gap", "env": env, "config": vars(args),
                   "results": results, "vs_native": gaps})  # fmt: skip
        return
    for v in names:
        results[v] = run(v, args, corpus)
        r = results[v]
        print(f"   {v}: final loss {r['final_loss']:.4f}, val {r['val_loss']:.4f}", flush=True)
    rows = [
        [v, r["final_loss"], r["val_loss"], str(r["steps_with_rootless_blocks"]),
         r["first_install_step"]]
        for v, r in results.items()
    ]  # fmt: skip
    print_table(["variant", "final loss", "val loss", "rootless steps", "first install"], rows)
    emit_json({"benchmark": "shampoo_gap", "env": env, "config": vars(args), "results": results})


if __name__ == "__main__":
    main()
