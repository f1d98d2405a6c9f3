"""How many cores a refresh round needs: block and factor counts of large models, measured.

For each model preset (``--models``, default the ``olmo2-1b`` and ``olmo2-7b`` presets of
``asteria.train.models``, vocabulary ``--vocab`` 100352, OLMo-2's padded embedding) and each
``max_preconditioner_dim`` (``--max-dims``, default 1024 and 2048), the parameters are made on the
``meta`` device (nothing allocated, no model built) and SOAP, KL-Shampoo and Shampoo are asked for
their blocks' refresh jobs (``refresh_jobs`` of ``state_template``, what the runtime submits): the
blocks that refresh and the factors by kind (QR refresh or inverse root) and size.

Then each (kind, size) that occurs is run on one core: a ``WorkerPool(workers=1,
lapack_threads=1)`` with the training thread at one intra-op thread, ``--repeats`` times after a
warm-up, on a random SPD factor (and an orthonormal basis for a QR refresh); the median is the
job's time. A round, every block refreshed once, is ``core_s`` = sum over jobs of count x time.
With staleness ``S`` (``--staleness``, 5) and frequency ``f`` (``--frequency``, 10) at step time
``t`` (``--step-times``, default 0.25, 0.5, 1, 2 s):

  * every block falls due at the same step under the native schedule and must be installed
    ``S`` steps later, so the pool must finish a round in ``S t``: ``cores_needed`` =
    ceil(core_s / (S t));
  * over a run the pool does one round per ``f`` steps: ``cores_for_throughput`` =
    ceil(core_s / (f t)), what spreading requests over the interval (continuous refresh) would
    need at best;
  * no number of cores helps once one job is longer than ``S t`` (a job runs on one core):
    ``longest_job_fits`` says whether the largest factor's job does.

Where CUDA is present the same jobs run through ``torch`` (``RefreshJob.run``) on the device, what
the device-stream executor does: ``device_round_s`` and, per step time, ``device_share`` =
device_round_s / (f t), the fraction of the GPU a round takes when spread over ``f`` steps.

Last line: JSON with ``models`` (per model, max dim and optimizer: ``blocks``, ``factors`` as
``kind:size`` -> count, ``core_s``, ``longest_job_s``, ``cores`` per step time), ``job_s`` (the
measured one-core times) and ``device_job_s`` (None without CUDA).
Usage: ``python bench/capacity.py [--models olmo2-1b,olmo2-7b] [--max-dims 1024,2048]
[--repeats 3] [--step-times 0.25,0.5,1,2] [--staleness 5] [--frequency 10]``; ``--quick`` (the
``nano`` preset at a byte vocabulary, max dims 32 and 64) for a test.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asteria._ext import load_extension  # noqa: E402
from asteria.optim import SOAP, KLShampoo, Shampoo  # noqa: E402
from asteria.optim.refresher import QRRefresh, RefreshJob, RootRefresh  # noqa: E402
from asteria.runtime.placement import Submission  # noqa: E402
from asteria.train.models import get_preset  # noqa: E402
from bench._common import emit_json, env_header, median, print_table  # noqa: E402

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}
#: OLMo-2's padded vocabulary (bench/memory.py sizes the same models with it).
OLMO2_VOCAB = 100352


def model_shapes(preset_name: str, vocab: int) -> list[tuple[int, ...]]:
    """The parameters of an ``asteria.train`` preset in ``named_parameters`` order: embedding,
    per layer q, k, v, o, q_norm, k_norm, gate, up, down and two norms, final norm, lm_head."""
    p = get_preset(preset_name)
    d, mlp = p.hidden_size, p.intermediate_size
    shapes: list[tuple[int, ...]] = [(vocab, d)]
    for _ in range(p.num_layers):
        shapes += [(d, d)] * 4 + [(d,), (d,)]
        shapes += [(mlp, d), (mlp, d), (d, mlp)]
        shapes += [(d,), (d,)]
    return shapes + [(d,), (vocab, d)]


def count_jobs(
    optimizer: str, shapes: Sequence[tuple[int, ...]], max_dim: int
) -> tuple[int, Counter[tuple[str, int]], dict[tuple[str, int], RefreshJob]]:
    """The blocks of ``optimizer`` over ``meta`` parameters of ``shapes`` that refresh, the
    count of refresh jobs per (kind, factor size), and one job (without tensors) per key."""
    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in shapes]
    opt = OPTIMIZERS[optimizer](params, max_preconditioner_dim=max_dim)
    blocks = 0
    counts: Counter[tuple[str, int]] = Counter()
    example: dict[tuple[str, int], RefreshJob] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for block in opt.state_template(p, group, device="meta").get("blocks", ()):
                jobs = [j for j in opt.refresh_jobs(block, group) if j is not None]
                blocks += bool(jobs)
                for job in jobs:
                    key = (job.kind, int(job.factor.shape[0]))
                    counts[key] += 1
                    example.setdefault(key, job)
    return blocks, counts, example


def job_inputs(job: RefreshJob, n: int, device: str = "cpu") -> RefreshJob:
    """``job`` with a random SPD ``n x n`` factor (and an orthonormal basis for a QR refresh)."""
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    factor = (a @ a.T / n + 1e-3 * torch.eye(n, dtype=torch.float64)).float().to(device)
    if isinstance(job, QRRefresh):
        basis = torch.linalg.qr(torch.randn(n, n, generator=gen)).Q.to(device)
        return QRRefresh(factor, basis, sort=job.sort, dtype=job.dtype)
    assert isinstance(job, RootRefresh)
    return RootRefresh(factor, root=job.root, epsilon=job.epsilon or 1e-12, dtype=job.dtype)


def time_on_one_core(pool: Any, job: RefreshJob, repeats: int) -> float:
    """Median seconds of ``job`` on a one-worker pool (a warm-up first)."""
    times = []
    for r in range(repeats + 1):
        start = time.perf_counter()
        job.submit(pool, Submission(job, "capacity", r, r)).result()
        times.append(time.perf_counter() - start)
    return median(times[1:])


def time_on_device(job: RefreshJob, repeats: int) -> float:
    """Median seconds of ``job.run()`` (torch) on the current CUDA device (a warm-up first)."""
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        job.run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return median(times[1:])


def cores(core_s: float, longest_s: float, step_s: float, staleness: int, freq: int) -> dict:
    """What holding ``staleness`` at ``freq`` takes at a step time of ``step_s`` seconds."""
    return {
        "cores_needed": math.ceil(core_s / (staleness * step_s)),
        "cores_for_throughput": math.ceil(core_s / (freq * step_s)),
        "longest_job_fits": longest_s <= staleness * step_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="olmo2-1b,olmo2-7b")
    parser.add_argument("--vocab", type=int, default=OLMO2_VOCAB)
    parser.add_argument("--max-dims", default="1024,2048")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-times", default="0.25,0.5,1,2")
    parser.add_argument("--staleness", type=int, default=5)
    parser.add_argument("--frequency", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="nano at max dims 32, 64")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.vocab, args.max_dims, args.repeats = "nano", 256, "32,64", 3
    models = args.models.split(",")
    max_dims = [int(x) for x in args.max_dims.split(",")]
    step_times = [float(x) for x in args.step_times.split(",")]
    optimizers = args.optimizers.split(",")
    if args.repeats < 1 or args.staleness < 1 or args.frequency < 1 or min(step_times) <= 0:
        raise SystemExit("--repeats, --staleness, --frequency must be >= 1, step times > 0")
    if unknown := set(optimizers) - set(OPTIMIZERS):
        raise SystemExit(f"unknown optimizers {sorted(unknown)}; choose from {list(OPTIMIZERS)}")

    env = env_header("asteria bench/capacity.py")
    torch.set_num_threads(1)
    pool = load_extension().WorkerPool(workers=1, lapack_threads=1)
    cuda = torch.cuda.is_available()

    counted: dict[tuple[str, int, str], tuple[int, Counter]] = {}
    examples: dict[tuple[str, int], RefreshJob] = {}
    for model in models:
        shapes = model_shapes(model, args.vocab)
        for max_dim in max_dims:
            for name in optimizers:
                blocks, counts, ex = count_jobs(name, shapes, max_dim)
                counted[(model, max_dim, name)] = (blocks, counts)
                examples.update(ex)

    job_s: dict[tuple[str, int], float] = {}
    device_s: dict[tuple[str, int], float] = {}
    for key in sorted(examples):
        job = job_inputs(examples[key], key[1])
        job_s[key] = time_on_one_core(pool, job, args.repeats)
        if cuda:
            device_s[key] = time_on_device(job_inputs(examples[key], key[1], "cuda"), args.repeats)
    pool.shutdown()
    print_table(
        ["job", "one core s", "device s"],
        [[f"{k}:{n}", job_s[(k, n)], device_s.get((k, n))] for k, n in sorted(job_s)],
    )

    out_models: dict[str, Any] = {}
    rows = []
    for (model, max_dim, name), (blocks, counts) in counted.items():
        core_s = sum(c * job_s[k] for k, c in counts.items())
        longest = max((job_s[k] for k in counts), default=0.0)
        entry: dict[str, Any] = {
            "blocks": blocks,
            "factors": {f"{k}:{n}": c for (k, n), c in sorted(counts.items())},
            "core_s": core_s,
            "longest_job_s": longest,
            "cores": {
                str(t): cores(core_s, longest, t, args.staleness, args.frequency)
                for t in step_times
            },
            "device_round_s": None,
        }
        if cuda:
            dev = sum(c * device_s[k] for k, c in counts.items())
            entry["device_round_s"] = dev
            for t in step_times:
                entry["cores"][str(t)]["device_share"] = dev / (args.frequency * t)
        out_models.setdefault(model, {}).setdefault(str(max_dim), {})[name] = entry
        rows.append(
            [f"{model} {max_dim} {name}", blocks, sum(counts.values()), core_s]
            + [entry["cores"][str(t)]["cores_needed"] for t in step_times]
        )
    print(f"cores to hold S={args.staleness} at f={args.frequency}, per step time (s):")
    print_table(["model max_dim optimizer", "blocks", "factors", "core s/round"]
                + [f"t={t}" for t in step_times], rows)  # fmt: skip
    emit_json(
        {
            "benchmark": "capacity",
            "env": env,
            "config": {
                "models": models,
                "vocab": args.vocab,
                "max_dims": max_dims,
                "optimizers": optimizers,
                "repeats": args.repeats,
                "step_times": step_times,
                "staleness": args.staleness,
                "frequency": args.frequency,
            },
            "job_s": {f"{k}:{n}": v for (k, n), v in sorted(job_s.items())},
            "device_job_s": {f"{k}:{n}": v for (k, n), v in sorted(device_s.items())}
            if cuda
            else None,
            "models": out_models,
        }
    )


if __name__ == "__main__":
    main()
