"""How far ``S = 0`` under the runtime is from native mode, per optimizer, size and dtype.

On the CPU the two are bit for bit (Notes [Aligned operands] and [One thread per refresh] in
csrc/core/aligned.cpp): every distance printed here is 0. On a GPU native mode refreshes with
cuSOLVER and the runtime's pool with LAPACK, so ``S = 0`` is native's schedule with refreshes
equal to rounding (docs/runtime.md, "What is bitwise where"); this bench measures that bound.
For each optimizer (SOAP, Shampoo, KL-Shampoo), each set of layer widths and each dtype
(float32, float64), a stack of dense layers' parameters is trained ``--steps`` steps on the same
seeded gradients three ways: native in ``dtype``, the runtime at ``S = 0`` in ``dtype`` (refreshes
on the pool: ``device_refresh=False``), and native in float64 (the reference). Reported: the
largest parameter difference runtime vs native (``gap``), native's own rounding error
(``own``: native in ``dtype`` vs float64; 0 for float64 itself), ``gap / own``, which
tests/gpu/test_s0_gpu.py bounds (``RATIO``) for float32, and the gap in units of ``dtype``'s
epsilon times the largest parameter (``gap_ulps``: float64's measure).

Usage: ``python bench/s0_gap.py [--device cuda] [--steps 12] [--widths 17,33,45 64,128,96]``.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asteria.optim import SOAP, KLShampoo, Shampoo  # noqa: E402
from asteria.runtime import Runtime, RuntimeConfig  # noqa: E402
from bench._common import emit_json, env_header, print_table, synchronize  # noqa: E402

OPTIMIZERS = {"soap": SOAP, "shampoo": Shampoo, "kl_shampoo": KLShampoo}


def _params(device: str, dtype: torch.dtype, widths: list[int]) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(widths[i + 1], widths[i]) for i in range(len(widths) - 1)] + [(widths[-1],)]
    return [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype))
        for s in shapes
    ]


def train(cls, device: str, dtype: torch.dtype, widths: list[int], steps: int, runtime: bool):
    """The parameters (float64, on the CPU) after ``steps`` steps, native or at ``S = 0``."""
    params = _params(device, dtype, widths)
    opt = cls(params, lr=1e-2, precondition_frequency=2)
    gen = torch.Generator().manual_seed(1)
    config = RuntimeConfig(staleness=0, device_refresh=False)
    rt = Runtime(None, opt, config) if runtime else None
    try:
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(device, dtype)
            opt.step()
        synchronize(torch.device(device))
    finally:
        if rt is not None:
            rt.close()
    return [p.detach().double().cpu() for p in params]


def _distance(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--widths", nargs="+", default=["17,33,45", "64,128,96", "256,512,384"])
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    args = ap.parse_args()
    env = env_header("S = 0 against native mode")
    rows, results = [], {}
    for name in args.optimizers.split(","):
        cls = OPTIMIZERS[name]
        for spec in args.widths:
            widths = [int(w) for w in spec.split(",")]
            exact = train(cls, args.device, torch.float64, widths, args.steps, runtime=False)
            for dtype in (torch.float32, torch.float64):
                native = train(cls, args.device, dtype, widths, args.steps, runtime=False)
                ours = train(cls, args.device, dtype, widths, args.steps, runtime=True)
                gap = _distance(ours, native)
                own = _distance(native, exact)
                key = f"{name}@{spec}@{str(dtype).removeprefix('torch.')}"
                ratio = gap / own if own > 0 else (0.0 if gap == 0 else float("inf"))
                ulp = torch.finfo(dtype).eps * max(float(p.abs().max()) for p in exact)
                results[key] = {"gap": gap, "own": own, "ratio": ratio, "gap_ulps": gap / ulp}
                rows.append([key, f"{gap:.3e}", f"{own:.3e}", f"{ratio:.2f}", f"{gap / ulp:.1f}"])
    print_table(["optimizer@widths@dtype", "gap", "own", "gap/own", "gap in ulps"], rows)
    bitwise = all(r["gap"] == 0.0 for r in results.values())
    emit_json({"benchmark": "s0_gap", "env": env, "args": vars(args), "results": results,
               "bitwise": bitwise})  # fmt: skip


if __name__ == "__main__":
    main()
