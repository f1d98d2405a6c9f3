"""What dynamo makes of an Asteria optimizer's ``step()`` when it is not disabled (docs/compile.md).

``KroneckerOptimizer.step`` is ``torch.compiler.disable``d (Note [torch.compile] in
asteria/optim/base.py). This traces the function underneath with ``torch.compile`` for a few
steps of a two-Linear model, next to an eager twin, and prints, per optimizer: the graph breaks
by place in Asteria's code and dynamo's explanation, and how far the traced run's parameters
are from the eager run's. ``--ops`` routes the optimizers' matrix functions through the
``torch.ops.asteria`` custom ops (asteria/ops.py) to show what those remove.

    python tools/traced_step_breaks.py [--steps 4] [--ops] [--backend eager]
"""

from __future__ import annotations

import argparse
import collections
import copy
import logging
import re

import torch
import torch._dynamo

import asteria
from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.optim.base import KroneckerOptimizer

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}
WHERE = re.compile(r"Graph break in user code at (\S+):(\d+)")
WHY = re.compile(r"Explanation: (.*)")


class _Breaks(logging.Handler):
    """Collects dynamo's graph-break log records: (place, explanation) -> count."""

    def __init__(self) -> None:
        super().__init__()
        self.found: collections.Counter[tuple[str, str]] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        where = WHERE.search(text)
        if where is None:
            return
        path = re.sub(r".*/(asteria|torch)/", r"\1/", where.group(1))
        why = WHY.search(text)
        self.found[(f"{path}:{where.group(2)}", why.group(1)[:120] if why else "?")] += 1


def _route_through_ops() -> None:
    """The optimizers call ``asteria.optim.matrix_functions`` as ``mf``; point them at the ops'
    functions of the same names."""
    from asteria.optim import kl_shampoo, refresher, soap

    for module in (refresher, soap, kl_shampoo):
        module.mf = asteria.ops


def run(name: str, steps: int, backend: str) -> tuple[_Breaks, float]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    kwargs = {"lr": 1e-2, "precondition_frequency": 2}
    opt, eager = (
        OPTIMIZERS[name](model.parameters(), **kwargs),
        OPTIMIZERS[name](twin.parameters(), **kwargs),
    )
    inner = KroneckerOptimizer.__dict__["step"].__wrapped__
    traced = torch.compile(lambda: inner(opt), backend=backend)
    breaks = _Breaks()
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(breaks)
    try:
        for _ in range(steps):
            x = torch.randn(32, 8)
            for m, o, step in ((model, opt, traced), (twin, eager, eager.step)):
                m(x).square().mean().backward()
                step()
                o.zero_grad()
    finally:
        logger.removeHandler(breaks)
    gap = max(
        float((a - b).abs().max() / b.abs().max())
        for a, b in zip(model.parameters(), twin.parameters())
    )
    return breaks, gap


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--ops", action="store_true", help="matrix functions through torch.ops.asteria"
    )
    parser.add_argument(
        "--backend", default="eager", help="torch.compile backend (eager: dynamo alone)"
    )
    args = parser.parse_args()
    torch._logging.set_logs(graph_breaks=True)
    torch._dynamo.config.cache_size_limit = 64
    if args.ops:
        _route_through_ops()
    print(
        f"torch {torch.__version__}, backend {args.backend}, {args.steps} steps, "
        f"matrix functions {'through torch.ops.asteria' if args.ops else 'as written'}"
    )
    for name in OPTIMIZERS:
        breaks, gap = run(name, args.steps, args.backend)
        total = sum(breaks.found.values())
        print(f"\n{name}: {total} graph breaks; parameters vs eager: {gap:.2e}", end="")
        print(" (max |diff| / max |param|)")
        for (where, why), n in sorted(breaks.found.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {n:3d}  {where:32s} {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
