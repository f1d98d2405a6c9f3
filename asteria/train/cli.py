"""Command line of `asteria.train` (``python -m asteria.train`` / ``asteria-train``).

Owns: argument parsing (bad inputs: a usage error, exit 2, nothing written), the run folder
(refused when it exists without ``--resume``; ``run.json`` keeps what a resume must match), one
optimizer or a comparison on identical init and data, repeats over ``--seeds``, Ctrl-C (stop
after the step, checkpoint, exit 130), and the printed results, each run's time to the target
loss among them. Must not: contain training math (loop.py), the time-to-target figures
(targets.py) or output formats (report.py, plots.py). With no arguments it compares AdamW,
native SOAP and Asteria SOAP on ``tiny`` for 200 CPU steps into
``runs/tiny-adamw-soap_native-soap_asteria/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from asteria.train import checkpoint as ckpt
from asteria.train import distributed as dist_util
from asteria.train.data import DEFAULT_MAX_BYTES, STDLIB, TOKEN_DTYPES, load_corpus
from asteria.train.energy import EnergyMeter
from asteria.train.env import environment
from asteria.train.loop import RunResult, StopFlag, TrainConfig, train
from asteria.train.models import PRESETS
from asteria.train.optimizers import MODES, OPTIMIZERS, parse_runs
from asteria.train.report import (
    PLOTS,
    MetricsWriter,
    add_efficiency,
    write_plots,
    write_report,
    write_summary,
)
from asteria.train.targets import time_to_target

DEFAULT_COMPARE = "adamw,soap:native,soap:asteria"
RUN_JSON = "run.json"
EXIT_USAGE, EXIT_INTERRUPTED = 2, 130

# Settings that decide a run's result: a --resume must not change them (run.json keeps them).
FIXED_ON_RESUME = (
    "model", "optimizer", "compare", "mode", "steps", "batch_size", "seq_len", "lr", "seed",
    "val_every", "val_batches", "data", "data_bytes", "token_dtype", "vocab_size", "fsdp", "hsdp",
    "hsdp_shards", "seeds",
)  # fmt: skip


# -- the runtime's knobs as flags, straight from RuntimeConfig's fields --------------------------


def _runtime_fields() -> list[dataclasses.Field]:
    from asteria.runtime import RuntimeConfig

    return list(dataclasses.fields(RuntimeConfig))


def _knob_parser(annotation: str) -> Any:
    """argparse ``type``/``action`` for a RuntimeConfig field's annotation (None: no flag)."""
    a = str(annotation).replace(" ", "")
    if a.startswith("bool"):
        return "bool"
    if a.startswith("tuple[int"):
        return lambda text: tuple(int(x) for x in text.split(",") if x.strip())
    if a.startswith("int"):
        return int
    if a.startswith("float"):
        return float
    if a.startswith(("str", "Path", "os.PathLike")):
        return str
    return None


def _add_runtime_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "Asteria runtime (asteria mode only; every default is asteria.RuntimeConfig's)"
    )
    taken = {s for a in p._actions for s in a.option_strings}
    for f in _runtime_fields():
        kind = _knob_parser(f.type)
        if kind is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if flag in taken:
            flag = "--runtime-" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = "cores - 1" if f.name == "workers" and default is None else default
        help_text = f"RuntimeConfig.{f.name} (library default: {shown})"
        if kind == "bool":
            g.add_argument(
                flag, dest=f"rt_{f.name}", action=argparse.BooleanOptionalAction, default=None,
                help=help_text,
            )  # fmt: skip
        else:
            g.add_argument(flag, dest=f"rt_{f.name}", type=kind, default=None, help=help_text)


def runtime_config(args: argparse.Namespace) -> Any:
    """A RuntimeConfig with the knobs given on the command line, the library's defaults else."""
    from asteria.runtime import RuntimeConfig

    given = {
        f.name: getattr(args, f"rt_{f.name}")
        for f in _runtime_fields()
        if getattr(args, f"rt_{f.name}", None) is not None
    }
    return RuntimeConfig(**given)


def build_parser() -> argparse.ArgumentParser:
    opt_help = ", ".join(f"{s.name} (lr {s.lr_for('tiny'):g} on tiny)" for s in OPTIMIZERS.values())
    p = argparse.ArgumentParser(
        prog="asteria-train",
        description=(
            "Train an OLMo-2-style LM with AdamW and second-order optimizers (native or "
            "Asteria-orchestrated) and write a report with plots."
        ),
    )
    p.add_argument(
        "--model", default="tiny", choices=list(PRESETS),
        help=f"model preset: {', '.join(PRESETS)}",
    )  # fmt: skip
    which = p.add_mutually_exclusive_group()
    which.add_argument("--optimizer", help=f"train with one optimizer: {opt_help}")
    which.add_argument(
        "--compare",
        help=(
            "comma-separated runs to compare on identical data and init, each NAME or "
            f"NAME:MODE (default {DEFAULT_COMPARE})"
        ),
    )
    p.add_argument(
        "--mode", default="native", choices=MODES,
        help="mode of second-order optimizers named without :MODE (default native; continuous: "
        "asteria with RuntimeConfig(refresh='continuous'))",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, help="peak learning rate for every run")
    p.add_argument("--seed", type=int, default=0, help="model init and data order seed")
    p.add_argument(
        "--seeds", type=int, default=1,
        help="repeat every run over N seeds (--seed, --seed + 1, ...): figures over the seeds, "
        "bands in the plots",
    )  # fmt: skip
    p.add_argument(
        "--target-loss", type=float,
        help="the validation loss each run's steps and time are measured to (default: the first "
        "run's final validation loss, the mean over the seeds)",
    )  # fmt: skip
    p.add_argument("--val-every", type=int, default=50, help="validation interval in steps")
    p.add_argument("--val-batches", type=int, default=4, help="validation batches per check")
    d = p.add_argument_group("data")
    d.add_argument(
        "--data",
        default=STDLIB,
        help=(
            f"{STDLIB!r} (embedded: CPython 3.11.7's standard library .py sources, byte-level, "
            "the same bytes on every Python), a text file, a directory of text files, or a token "
            "file (OLMo's numpy layout with --token-dtype, or a .npy)"
        ),
    )
    d.add_argument(
        "--data-bytes", type=int, default=DEFAULT_MAX_BYTES, help="bytes read from the data"
    )
    d.add_argument(
        "--token-dtype", choices=list(TOKEN_DTYPES), help="--data is a flat token file of these"
    )
    d.add_argument("--vocab-size", type=int, help="token files: vocabulary (default max id + 1)")
    r = p.add_argument_group("run folder, checkpoints, machine")
    r.add_argument("--out", type=Path, help="run folder (default runs/<model>-<runs>)")
    r.add_argument("--resume", action="store_true", help="continue the run in --out")
    r.add_argument(
        "--checkpoint-every", type=int, default=0,
        help="also checkpoint every N steps (default: at the end and on Ctrl-C only)",
    )  # fmt: skip
    r.add_argument(
        "--stop-after", type=int,
        help="stop after N steps of this invocation with a checkpoint; --resume continues",
    )  # fmt: skip
    r.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda[:i]")
    r.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads (default on a CPU: all cores but one, which the refresh "
        "workers get; elsewhere torch's)",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    sharding = r.add_mutually_exclusive_group()
    sharding.add_argument("--fsdp", action="store_true", help="FSDP2 under torchrun")
    sharding.add_argument(
        "--hsdp", action="store_true", help="HSDP (FSDP2, 2-D mesh) under torchrun"
    )
    r.add_argument("--hsdp-shards", type=int, help="processes per HSDP shard group (default: node)")
    _add_runtime_flags(p)
    return p


def _explicit(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The ``dest`` of every option given on the command line."""
    saved = {a.dest: a.default for a in parser._actions}
    try:
        for a in parser._actions:
            a.default = argparse.SUPPRESS
        ns, _ = parser.parse_known_args(argv)
    finally:
        for a in parser._actions:
            a.default = saved[a.dest]
    return set(vars(ns))


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    s = {k: getattr(args, k) for k in FIXED_ON_RESUME}
    s |= {k: v for k, v in vars(args).items() if k.startswith("rt_")}
    return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
            for k, v in s.items()}  # fmt: skip


def _flag(dest: str) -> str:
    return "--" + (dest[3:] if dest.startswith("rt_") else dest).replace("_", "-")


def _prepare_folder(
    parser: argparse.ArgumentParser, args: argparse.Namespace, explicit: set[str]
) -> None:
    """Refuse an existing run folder without --resume; with it, take the stored settings."""
    out: Path = args.out
    if not args.resume:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            parser.error(
                f"run folder {out} already exists; pass --resume to continue it, or choose "
                "another --out (nothing was written)"
            )
        return
    stored_path = out / RUN_JSON
    if not stored_path.is_file():
        parser.error(f"--resume: {out} holds no run to continue ({RUN_JSON} is missing)")
    stored = json.loads(stored_path.read_text("utf-8"))["settings"]
    current = _settings(args)
    changed = [
        f"{_flag(k)} {current[k]!r} (the run has {stored.get(k)!r})"
        for k in current
        if k in explicit and current[k] != stored.get(k)
    ]
    if changed:
        parser.error("--resume cannot change a run's settings: " + "; ".join(changed))
    for k, v in stored.items():
        if hasattr(args, k):
            setattr(args, k, Path(v) if k == "out" else tuple(v) if isinstance(v, list) else v)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    explicit = _explicit(parser, argv)
    ctx = None
    try:
        if args.out is None:
            labels = [
                r.label
                for r in parse_runs(args.optimizer or args.compare or DEFAULT_COMPARE, args.mode)
            ]
            args.out = Path("runs") / "-".join([args.model, *labels]).replace(":", "_")
        _prepare_folder(parser, args, explicit)
        specs = parse_runs(args.optimizer or args.compare or DEFAULT_COMPARE, args.mode)
        configs = [
            TrainConfig(
                model=args.model,
                optimizer=spec.name,
                mode=spec.mode,
                steps=args.steps,
                batch_size=args.batch_size,
                seq_len=args.seq_len,
                lr=args.lr,
                seed=seed,
                val_every=args.val_every,
                val_batches=args.val_batches,
            )
            for seed in range(args.seed, args.seed + max(1, args.seeds))
            for spec in specs  # seed by seed: the runs compared are run close together in time
        ]
        rt_config = runtime_config(args)
        for name in ("threads", "stop_after", "seeds"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
                )
        if args.target_loss is not None and not 0.0 < args.target_loss < float("inf"):
            raise ValueError(f"--target-loss must be a finite loss > 0, got {args.target_loss}")
        if args.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
        corpus = load_corpus(
            args.data,
            max_bytes=args.data_bytes,
            min_tokens=args.seq_len,
            token_dtype=args.token_dtype,
            vocab_size=args.vocab_size,
        )
        device = _device(args.device)
        if (args.fsdp or args.hsdp) and any(s.name == "muon" for s in specs):
            raise ValueError(  # Note [Muon as people use it] in asteria/train/optimizers.py
                "muon under --fsdp/--hsdp: torch.optim.Muon orthogonalizes whole matrices, and "
                "each process holds a shard of them; run muon without sharding"
            )
        if args.fsdp or args.hsdp:
            kind = "fsdp" if args.fsdp else "hsdp"
            ctx = dist_util.init(kind, args.hsdp_shards)
            if args.batch_size % ctx.world:
                raise ValueError(
                    f"--batch-size {args.batch_size} is not divisible by the {ctx.world} processes"
                )
    except ValueError as err:
        dist_util.shutdown(ctx)
        parser.error(str(err))
    try:
        return _run(args, configs, rt_config, corpus, device, ctx)
    except ckpt.ResumeError as err:
        print(f"asteria-train: error: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        dist_util.shutdown(ctx)


def _device(text: str) -> torch.device:
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError as err:
        raise ValueError(f"--device {text!r}: {err}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {text}: torch sees no CUDA device")
    return device


def training_threads(
    requested: int | None, device: torch.device, distributed: bool
) -> tuple[int | None, str | None]:
    """The intra-op threads every run of this invocation trains with, and the report's note: on a
    CPU-only machine the training leaves one core for Asteria's workers and lane (issue 24: with
    every core training, refreshes were spikes again); ``--threads`` overrides; under torchrun and
    on CUDA torch's default stays."""
    cores = os.cpu_count() or 1
    if requested is None and device.type == "cpu" and not distributed and cores > 1:
        requested = cores - 1
        why = "by default"
    else:
        why = "as asked (--threads)" if requested is not None else "torch's default"
    if device.type != "cpu":
        return requested, None
    n = requested if requested is not None else torch.get_num_threads()
    spare = cores - n
    note = (
        f"Training on {n} of {cores} CPU cores ({why}). On a CPU-only machine the training "
        f"threads stand for the GPU and the other cores for its host, where Asteria's refresh "
        f"workers run: "
        + (
            f"{spare} core{'s' if spare != 1 else ''} left for them."
            if spare > 0
            else "none is left for them, so the refreshes compete with the training."
        )
    )
    return requested, note


def _run(args, configs, rt_config, corpus, device, ctx) -> int:
    main_rank = ctx is None or ctx.is_main
    out: Path = args.out
    say = print if main_rank else (lambda *a, **k: None)
    threads, threads_note = training_threads(args.threads, device, ctx is not None)
    if threads is not None:
        torch.set_num_threads(threads)
    env = environment("transformers") | {
        "threads_note": threads_note,
        "data": corpus.name,
        "data_sha256": corpus.sha256,  # Note [Embedded corpus] in asteria/train/corpus.py
        "data_tokens": corpus.num_tokens,
        "vocab_size": corpus.vocab_size,
        "device": str(ctx.device if ctx else device),
        "distributed": f"{ctx.kind} over {ctx.world} processes" if ctx else None,
    }
    meter = EnergyMeter.probe() if main_rank else None
    energy_info = (
        {"sources": meter.sources, "unavailable": meter.unavailable} if meter is not None else {}
    )
    dist_util.barrier(ctx)
    if main_rank:
        out.mkdir(parents=True, exist_ok=True)
        if not args.resume:
            payload = {"settings": _settings(args), "argv": sys.argv[1:]}
            (out / RUN_JSON).write_text(json.dumps(payload, indent=2) + "\n", "utf-8")
    say(
        f"asteria.train: model {args.model}, {corpus.num_tokens:,} tokens "
        f"({corpus.kind}, vocab {corpus.vocab_size}) from {corpus.name}, sha256 "
        f"{corpus.sha256}, torch {env['torch']} "
        f"({env['torch_threads']} threads) on {env['device']}"
        f"{', ' + env['distributed'] if ctx else ''}; energy: "
        f"{meter.describe() if meter is not None else '-'}",
        flush=True,
    )
    writer = MetricsWriter(out) if main_rank else None
    runs: dict[str, dict] = {}
    records: dict[str, list[dict]] = {}
    incomplete = False  # a run was stopped early or not started: --resume continues
    budget = args.stop_after  # steps this invocation may still train (None: no limit)
    with StopFlag() as stop:
        try:
            for cfg in configs:
                key = run_key(cfg, args.seeds)
                path = ckpt.checkpoint_path(out, key)
                resume = ckpt.load(path) if args.resume and path.is_file() else None
                if resume is not None and resume["status"] in ("finished", "diverged"):
                    result = RunResult.from_checkpoint(cfg, resume)
                    say(f"{key:>14}: done in an earlier invocation", flush=True)
                    for rec in result.records if writer is not None else ():
                        writer(rec)
                else:
                    if budget == 0:
                        incomplete = True
                        break
                    if resume is not None:
                        say(f"{key:>14}: resuming at step {resume['step']}", flush=True)
                        for rec in resume["records"] if writer is not None else ():
                            writer(rec)
                    result = train(
                        cfg,
                        corpus,
                        runtime_config=rt_config if cfg.mode != "native" else None,
                        on_record=writer,
                        progress=not args.no_progress,
                        checkpoint=path,
                        resume=resume,
                        stop=stop,
                        stop_after=budget,
                        checkpoint_every=args.checkpoint_every,
                        energy=meter,
                        device=device,
                        ctx=ctx,
                    )
                    if budget is not None:
                        budget -= len(result.records) - (len(resume["records"]) if resume else 0)
                runs[key], records[key] = result.summary(), result.records
                if result.status == "stopped":
                    incomplete = True
                    say(
                        f"{key:>14}: stopped at step {len(result.records)} of {cfg.steps}",
                        flush=True,
                    )
                    break
                say(_result_line(key, runs[key]), flush=True)
        finally:
            if writer is not None:
                writer.close()
    if main_rank and runs and any(records.values()):
        add_efficiency(runs, corpus.vocab_size)
        groups = run_groups(configs, args.seeds, records)
        targets = None
        if groups and next(iter(groups)) == configs[0].label:  # the first run is the reference
            by_seed = {lb: {sd: records[k] for sd, k in g.items()} for lb, g in groups.items()}
            lrs = {c.label: {"lr": c.peak_lr} for c in configs}
            targets = time_to_target(by_seed, configs[0].label, args.target_loss, lrs)
            for line in _target_lines(targets):
                say(line, flush=True)
        write_summary(out, env, runs, energy_info, targets)
        runs_with_steps = {k: v for k, v in records.items() if v}
        write_plots(out, runs_with_steps, {k: runs[k] for k in runs_with_steps},
                    "byte" if corpus.kind == "bytes" else "token", groups,
                    targets["target"] if targets else None)  # fmt: skip
        labels = list(dict.fromkeys(c.label for c in configs))
        write_report(out, env, runs, f"asteria.train: {' vs '.join(labels)}", energy_info,
                     corpus.vocab_size, targets)  # fmt: skip
    if incomplete:
        say(
            f"checkpoints in {out / ckpt.CHECKPOINTS}/; continue with: "
            f"asteria-train --resume --out {out}",
            flush=True,
        )
        return EXIT_INTERRUPTED if stop.requested else 0
    say(f"report: {(out / 'report.md').resolve()}")
    say(f"  also in {out}/: metrics.jsonl summary.json {' '.join(PLOTS)} checkpoints/")
    return 0


def run_key(cfg: TrainConfig, seeds: int) -> str:
    """A run's name in the folder: its label, with ``@seedN`` where the runs repeat over seeds."""
    return cfg.label if seeds <= 1 else f"{cfg.label}@seed{cfg.seed}"


def run_groups(
    configs: Sequence[TrainConfig], seeds: int, records: dict[str, list[dict]]
) -> dict[str, dict[int, str]]:
    """label -> seed -> run key, for the runs that trained at least a step."""
    groups: dict[str, dict[int, str]] = {}
    for cfg in configs:
        key = run_key(cfg, seeds)
        if records.get(key):
            groups.setdefault(cfg.label, {})[cfg.seed] = key
    return groups


def _target_lines(t: dict) -> list[str]:
    if t["target"] is None:
        return []
    out = [f"time to val loss {t['target']:.4f} (training seconds; ratio to {t['reference']}'s):"]
    for label, r in t["runs"].items():
        secs = r["seconds_to_target"].values()
        q = r["ratio_to_reference"]
        ratio = "-" if q["median"] is None else f"{q['median']:.2f}"
        if len(secs) > 1 and q["median"] is not None:
            ratio += f" ({q['min']:.2f}-{q['max']:.2f})"
        times = ", ".join("-" if x is None else f"{x:.1f}" for x in secs)
        out.append(f"{label:>14}: {times} s, ratio {ratio}, reached {r['reached']}/{r['of_seeds']}")
    return out


def _result_line(name: str, s: dict) -> str:
    val = "-" if s["final_val_loss"] is None else f"{s['final_val_loss']:.4f}"
    wait = s.get("barrier_wait_ms_total")
    return (
        f"{name:>14}: lr {s['lr']:g}  final loss {s['final_loss_mean10']:.4f} (mean of last 10)"
        f"  val loss {val}  median step {s['median_step_ms']:.0f} ms"
        f" (optimizer {s['median_opt_ms']:.0f} ms)"
        f"{'' if wait is None else f'  barrier wait {wait / 1e3:.2f} s'}"
        f"{'  DIVERGED' if s['diverged'] else ''}"
    )


if __name__ == "__main__":
    sys.exit(main())
