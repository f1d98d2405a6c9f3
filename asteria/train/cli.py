"""Command line of `asteria.train` (``python -m asteria.train`` / ``asteria-train``).

Owns: argument parsing, turning bad inputs into clear usage errors, running one optimizer or a
comparison with identical model init and data order, and printing the final losses. Must not:
contain training math (loop.py) or output formats (report.py).

With no arguments it compares AdamW and SOAP on the ``tiny`` model for 200 steps (a few minutes
on 2 CPU cores) and writes ``runs/tiny-adamw-soap/``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from asteria.train.data import DEFAULT_MAX_BYTES, STDLIB, VOCAB_SIZE, load_corpus
from asteria.train.env import environment
from asteria.train.loop import TrainConfig, train
from asteria.train.models import PRESETS
from asteria.train.optimizers import OPTIMIZERS, parse_names
from asteria.train.report import MetricsWriter, plot_losses, write_report, write_summary

DEFAULT_COMPARE = "adamw,soap"


def build_parser() -> argparse.ArgumentParser:
    opt_help = "; ".join(f"{s.name} (lr {s.lr_for('tiny'):g} on tiny)" for s in OPTIMIZERS.values())
    p = argparse.ArgumentParser(
        prog="asteria-train",
        description="Train a small OLMo-2-style byte-level LM and compare optimizers.",
    )
    p.add_argument("--model", default="tiny", choices=list(PRESETS), help="model preset")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--optimizer", help=f"train with one optimizer: {opt_help}")
    which.add_argument(
        "--compare", help=f"comma-separated optimizers to compare (default {DEFAULT_COMPARE})"
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, help="peak learning rate for every optimizer run")
    p.add_argument("--seed", type=int, default=0, help="model init and data order seed")
    p.add_argument("--val-every", type=int, default=50, help="validation interval in steps")
    p.add_argument(
        "--data",
        default=STDLIB,
        help=f"{STDLIB!r} (Python's own .py sources), a text file, or a directory of text files",
    )
    p.add_argument("--data-bytes", type=int, default=DEFAULT_MAX_BYTES, help="corpus size cap")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", type=Path, help="output folder (default runs/<model>-<optimizers>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        names = parse_names(args.optimizer or args.compare or DEFAULT_COMPARE)
        configs = [
            TrainConfig(
                model=args.model,
                optimizer=name,
                steps=args.steps,
                batch_size=args.batch_size,
                seq_len=args.seq_len,
                lr=args.lr,
                seed=args.seed,
                val_every=args.val_every,
            )
            for name in names
        ]
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        corpus = load_corpus(args.data, max_bytes=args.data_bytes, min_tokens=args.seq_len)
    except ValueError as err:
        parser.error(str(err))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    out = args.out or Path("runs") / "-".join([args.model, *names])
    env = environment("transformers") | {"data": corpus.name, "data_tokens": corpus.num_tokens}
    print(
        f"asteria.train: model {args.model}, {corpus.num_tokens:,} tokens from "
        f"{corpus.num_documents} files, torch {env['torch']} ({env['torch_threads']} threads)",
        flush=True,
    )
    writer = MetricsWriter(out)
    runs: dict[str, dict] = {}
    records: dict[str, list[dict]] = {}
    try:
        for cfg in configs:
            result = train(
                cfg, corpus, vocab_size=VOCAB_SIZE, on_record=writer, progress=not args.no_progress
            )
            runs[cfg.optimizer], records[cfg.optimizer] = result.summary(), result.records
            print(_result_line(cfg.optimizer, runs[cfg.optimizer]), flush=True)
    finally:
        writer.close()
    write_summary(out, env, runs)
    plot_losses(out, records)
    write_report(out, env, runs, title=f"asteria.train: {' vs '.join(names)}")
    print(f"wrote {out}/: metrics.jsonl summary.json report.md loss.png")
    return 0


def _result_line(name: str, s: dict) -> str:
    val = "-" if s["final_val_loss"] is None else f"{s['final_val_loss']:.4f}"
    return (
        f"{name:>12}: lr {s['lr']:g}  final loss {s['final_loss_mean10']:.4f} (mean of last 10)"
        f"  val loss {val}  median step {s['median_step_ms']:.0f} ms"
        f" (optimizer {s['median_opt_ms']:.0f} ms){'  DIVERGED' if s['diverged'] else ''}"
    )


if __name__ == "__main__":
    sys.exit(main())
