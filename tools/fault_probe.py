"""Issue 48's bad-input and fault probe over Asteria's public surface.

Runs each case (the three optimizers natively and under a runtime; ``Runtime`` and
``RuntimeConfig``; ``asteria.lowlevel``; ``asteria-train``'s options) and prints one line per
case: what it gave (ran, or the error raised) and, for a refused ``step()`` or
``load_state_dict()``, whether a deep snapshot of everything observable stayed the same
(``tests.faults.picture``). docs/runtime.md ("Faults") lists the cases and their outcomes; the
tests hold them (tests/unit/test_refusals.py, test_layouts.py, test_deadlines.py,
tests/distributed). Usage, from the repository root:

    .venv/bin/python tools/fault_probe.py            # every case
    .venv/bin/python tools/fault_probe.py step load  # sections: step load runtime lowlevel train
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from asteria import lowlevel as ll  # noqa: E402
from asteria.optim import SOAP, KLShampoo, Shampoo  # noqa: E402
from asteria.runtime import Runtime, RuntimeConfig  # noqa: E402
from tests.faults import picture, same  # noqa: E402

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}
MODES = {"native": None, "S=0": dict(staleness=0), "S=2": dict(staleness=2)}


def _setup(name: str, mode: str, steps: int = 4) -> tuple[Any, Any, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(6, 5), (5,), (4, 3)]]
    opt = OPTIMIZERS[name]([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    config = MODES[mode]
    rt = (
        None
        if config is None
        else Runtime(None, opt, RuntimeConfig(workers=1, hooks=False, **config))
    )
    for _ in range(steps + 1):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if _ < steps:
            opt.step()
    return opt, rt, params


def _edit(key: str, value: Any) -> Callable:
    def edit(opt, params):
        opt.param_groups[1][key] = value

    edit.__name__ = f"param_groups[1][{key!r}] = {value!r}"
    return edit


def _sparse(opt, params):
    params[2].grad = params[2].grad.to_sparse()


def _resized(opt, params):
    params[2].data, params[2].grad = torch.randn(5, 3), torch.randn(5, 3)


def _recast(opt, params):
    params[2].data, params[2].grad = params[2].data.double(), params[2].grad.double()


STEP_CASES = [
    ("a sparse gradient beside dense ones", _sparse),
    ("p.data resized under its state", _resized),
    ("p.data recast to float64 under its state", _recast),
    *[
        (f"{key} edited to {value!r}", _edit(key, value))
        for key, value in [
            ("lr", -1e-3), ("lr", math.nan), ("lr", "x"), ("betas", (1.5, 0.9)),
            ("betas", (0.9, 2.0)), ("precondition_frequency", 0),
            ("precondition_frequency", 1.5), ("weight_decay", -1.0),
            ("max_preconditioner_dim", 0), ("max_preconditioner_dim", 2),
            ("refresh_dtype", torch.float16),
        ]
    ],
]  # fmt: skip


def _snapshot(opt: Any, rt: Any) -> Any:
    """``tests.faults.picture``, its groups as text (a NaN lr is the same group again)."""
    out = picture(opt, rt)
    out["groups"] = repr(out["groups"])
    return out


def _outcome(fn: Callable[[], Any]) -> str:
    try:
        result = fn()
        return f"ran{'' if result is None else ': ' + str(result)[:60]}"
    except BaseException as err:  # noqa: BLE001 (what each case gives is the output)
        return f"{type(err).__name__}: {str(err)[:100]}"


def probe_steps() -> None:
    for what, edit in STEP_CASES:
        for name in OPTIMIZERS:
            for mode in MODES:
                opt, rt, params = _setup(name, mode)
                edit(opt, params)
                before = _snapshot(opt, rt)
                got = _outcome(opt.step)
                if not got.startswith("ran"):
                    got += f" | unchanged={same(before, _snapshot(opt, rt))}"
                print(f"step  {what:45s} {name:10s} {mode:6s} {got}")
                if rt is not None:
                    rt.close(install_pending=False)


def probe_loads() -> None:
    for name in OPTIMIZERS:
        for other in OPTIMIZERS:
            for mode in MODES:
                opt, rt, _ = _setup(name, mode)
                saved = _setup(other, "native")[0].state_dict()
                if other == name:  # the same class: a tensor cut short
                    key = next(k for k, v in saved["state"][0].items() if torch.is_tensor(v))
                    saved["state"][0][key] = saved["state"][0][key].reshape(-1)[:-1].clone()
                before = _snapshot(opt, rt)
                got = _outcome(lambda opt=opt, saved=saved: opt.load_state_dict(saved))
                got += f" | unchanged={same(before, _snapshot(opt, rt))}"
                what = "a tensor cut short" if other == name else f"{other}'s state_dict"
                print(f"load  {what:45s} {name:10s} {mode:6s} {got}")
                if rt is not None:
                    rt.close(install_pending=False)


def probe_runtime() -> None:
    p = torch.nn.Parameter(torch.randn(4, 3))
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("Runtime over torch.optim.AdamW", lambda: Runtime(None, torch.optim.AdamW([p]))),
        ("Runtime with a model holding none of the parameters",
         lambda: Runtime(torch.nn.Linear(2, 2), SOAP([p]))),
        ("RuntimeConfig(affinity=[9999]) attached",
         lambda: Runtime(None, SOAP([p]), RuntimeConfig(workers=1, affinity=[9999]))),
        ("RuntimeConfig(device_refresh=True) on CPU parameters",
         lambda: Runtime(None, SOAP([p]), RuntimeConfig(workers=1, device_refresh=True))),
    ]  # fmt: skip
    for key, value in [
        ("staleness", -1), ("workers", 0), ("barrier_timeout_s", 0),
        ("barrier_timeout_s", math.nan), ("max_consecutive_failures", 0),
        ("refresh", "sometimes"), ("lapack_threads", 0), ("worker_nice", 25),
        ("nvme_path", "/nonexistent"),
    ]:  # fmt: skip
        cases.append(
            (f"RuntimeConfig({key}={value!r})", lambda k=key, v=value: RuntimeConfig(**{k: v}))
        )
    cases.append(("RuntimeConfig(staleness=1, fixed_delay=3)",
                  lambda: RuntimeConfig(staleness=1, fixed_delay=3)))  # fmt: skip
    for what, fn in cases:
        print(f"runtime  {what:60s} {_outcome(fn)}")


def probe_lowlevel() -> None:
    eye = torch.eye(3)
    with ll.WorkerPool(workers=1) as pool:
        cases = [
            ("submit_eigh, a 3 x 4 factor", lambda: pool.submit_eigh("x", torch.randn(3, 4))),
            ("submit_eigh, a 1-D factor", lambda: pool.submit_eigh("x", torch.randn(3))),
            ("submit_eigh, a complex factor",
             lambda: pool.submit_eigh("x", torch.randn(3, 3, dtype=torch.complex64))),
            ("submit_eigh, an integer factor",
             lambda: pool.submit_eigh("x", torch.ones(3, 3, dtype=torch.int64))),
            ("submit_eigh, a NaN factor",
             lambda: pool.submit_eigh("x", torch.full((3, 3), math.nan))),
            ("submit_eigh, dtype float16", lambda: pool.submit_eigh("x", eye, dtype=torch.float16)),
            ("submit_inverse_root, root 0", lambda: pool.submit_inverse_root("x", eye, root=0)),
            ("submit_inverse_root, epsilon -1",
             lambda: pool.submit_inverse_root("x", eye, root=2, epsilon=-1)),
            ("submit_qr_refresh, a basis of another shape",
             lambda: pool.submit_qr_refresh("x", eye, torch.eye(4))),
        ]  # fmt: skip
        for what, fn in cases:
            print(f"lowlevel {what:50s} {_outcome(lambda fn=fn: fn().result(timeout=10))}")
        for timeout in (-1.0, math.nan):
            future = pool.submit_eigh("y", eye)
            got = _outcome(lambda f=future, t=timeout: f.result(timeout=t))
            print(f"lowlevel {f'result(timeout={timeout})':50s} {got}")
    for what, fn in [
        ("WorkerPool(workers=0)", lambda: ll.WorkerPool(workers=0)),
        ("WorkerPool(workers=-1)", lambda: ll.WorkerPool(workers=-1)),
        ("WorkerPool(lapack_threads=0)", lambda: ll.WorkerPool(workers=1, lapack_threads=0)),
        ("eigh_descending, a 3 x 4 matrix", lambda: ll.eigh_descending(torch.randn(3, 4))),
        ("inverse_root, a NaN factor",
         lambda: ll.inverse_root(torch.full((3, 3), math.nan), 2.0, 1e-12)),
    ]:  # fmt: skip
        print(f"lowlevel {what:50s} {_outcome(fn)}")
    pool = ll.WorkerPool(workers=1)
    pool.shutdown()
    print(
        f"lowlevel {'a submit after shutdown()':50s} {_outcome(lambda: pool.submit_eigh('z', eye))}"
    )


def probe_train() -> None:
    for args in (["--lr", "-1"], ["--lr", "nan"], ["--optimizer", "nope"], ["--staleness", "-2"],
                 ["--steps", "0"], ["--workers", "0"]):  # fmt: skip
        run = subprocess.run([sys.executable, "-m", "asteria.train", *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        last = (run.stderr.strip().splitlines() or [""])[-1]
        print(f"train    asteria-train {' '.join(args):40s} exit {run.returncode}: {last[:100]}")


SECTIONS = {
    "step": probe_steps,
    "load": probe_loads,
    "runtime": probe_runtime,
    "lowlevel": probe_lowlevel,
    "train": probe_train,
}


def main() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for section in sys.argv[1:] or list(SECTIONS):
        SECTIONS[section]()


if __name__ == "__main__":
    main()
