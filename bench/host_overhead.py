"""The host's work per training step, counted: what a GPU step pays before its kernels run.

On a GPU the host launches the step's work and must stay ahead of it, so the runtime's own
Python and the ATen ops it dispatches are paid at every step (docs/gpu.md). Times on this CPU
machine say little about that; counts do, and they do not depend on the machine. For each
variant this benchmark trains a decoder of the ``--model`` preset's widths with byte tokens for
``--steps`` steps (batch ``--batch`` x ``--seq-len``) and counts, per step, separately for the
optimizer's step and for the module signals (``hooks``: each module forward pre-hook the runtime
registered, with all it calls), in two passes over the same steps (Note [Two passes]):

* ops pass: ``ops``, the ATen ops dispatched (a ``TorchDispatchMode`` counter); views and
  metadata ops (``func.is_view``, ``detach``, ``alias``, ...) are counted apart as ``views``;
  ``syncs``, the ops that would make the host wait for the device:
  ``aten::_local_scalar_dense`` (``.item()``, ``.tolist()``, a tensor in an ``if``) and copies
  between two devices that are not ``non_blocking`` (none exist on a CPU-only run;
  ``bench/gpu_check.sh`` runs this on a GPU); ``install_ops``, ``request_ops``;
* calls pass: ``py_calls``, the Python function calls (``sys.setprofile``'s ``call`` events;
  the C functions called from Python apart, ``c_calls``), the bench's own wrappers not
  counted (``INSTRUMENTATION``);
* both: ``signals``, the module signals (hook calls), ``installs``, the ``install_refresh``
  calls in the step (its ops, ``install_ops``, are the optimizer's own math, which native mode
  runs at its refresh steps too), ``requests``, the refresh requests.

Note [Two passes]: a ``TorchDispatchMode`` runs Python for every op and view it sees (about 12
calls each), native's and Asteria's alike, so Python calls counted under it are diluted towards
1x; the calls pass runs the same variant, seed and steps again with the profiler alone (and the
ops pass runs without the profiler). The runs are the same step by step: between steps, outside
the counts, every refresh in flight is waited for (``_settle``), so each step installs and
requests the same in both passes whatever the worker's speed, and ``merge_passes`` fails the
variant where a step's installs, requests or signals differ. The JSON's ``passes`` says which
pass each figure comes from.

Variants: ``adamw`` (``torch.optim.AdamW``, ``foreach=True``), ``<opt>_native``, and for each of
``soap``, ``kl_shampoo`` and ``shampoo`` the runtime with the GPU strategies forced through
``asteria.runtime.testing`` on the CPU (no statistics lane, staged snapshots through the staging
ring): ``<opt>_window`` (``pretend_arch(Arch(cuda=True))`` with ``--device-free-gib`` free: the
bases in host memory behind the window, its slots a shape group's bases where the bases budget
leaves room), ``<opt>_device`` (the same with ``placement={'bases': 'device'}``) and
``<opt>_mapped`` (``Arch(cuda=True, unified_memory=True)``: the bases in host memory read
through mapped views; nothing is mapped on the CPU, so it counts the strategy's own work; not
in the default run, ask for it with ``--variants``). The runtime's
refreshes are ``refresh='interval'`` so that an ordinary step installs nothing (the staggered
default spreads the same installs over every step; its per-interval totals are the same work).

Goals (``goals`` in the JSON; Asteria against native of the same optimizer, same run):

* ``quiet_ops``: on steps that install nothing, ops at most 1.05x native's ordinary step;
* ``install_ops``: on steps that install, ops at most native's ordinary step x 1.05 plus the
  optimizer's install math plus ``INSTALL_BATCH_OPS`` (one batched install: a grouped copy per
  tier and dtype group and an event);
* ``py_calls``: Python calls on steps that install nothing at most 1.2x native's;
* ``quiet_syncs``: zero syncs on steps that install nothing;
* ``growth``: from 1x to 4x the layers, the growth of the quiet step's ops and Python calls no
  steeper than native's (ratio of the increments at most 1.05 and 1.2).

The model's layers are ``--layers`` x 1, 2 and 4 (default: the preset's for ``tiny``; 3 for
``olmo-150m``, so that 4x is the real 12 layers and the run fits two busy cores).

On a GPU (``--device cuda``: ``bench/gpu_check.sh``'s ``host_overhead`` phase) the same counts
come from the runtime's real strategies (``window``: ``placement={'bases': 'host'}``), and a
sync is an ``.item()`` of a device tensor or a blocking copy between devices (the host tensors'
``.item()``, AdamW's step counters, are no sync there; on the CPU every ``.item()`` counts).

Usage: ``python bench/host_overhead.py [--device cpu] [--model tiny] [--steps 14]``; the last
line is JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asteria.memory.tiers import Arch  # noqa: E402
from asteria.runtime import Runtime, RuntimeConfig, testing  # noqa: E402
from asteria.runtime.hooks import ModuleSignals  # noqa: E402
from asteria.runtime.refreshes import Refreshes  # noqa: E402
from asteria.train.data import VOCAB_SIZE  # noqa: E402
from asteria.train.models import build_model, get_preset  # noqa: E402
from asteria.train.optimizers import build_optimizer  # noqa: E402
from bench._common import emit_json, env_header, print_table, set_threads  # noqa: E402

OPTIMIZERS = ("soap", "kl_shampoo", "shampoo")
MODES = ("native", "window", "device", "mapped")
#: Ops one batched install may add to a step: a grouped copy per tier and dtype group and one
#: event (two tiers x two dtypes x one copy, with the event's record and its wait).
INSTALL_BATCH_OPS = 8
VIEW_OPS = frozenset(
    {"detach", "alias", "lift_fresh", "_unsafe_view", "view", "as_strided", "set_", "resize_"}
)
METADATA_OPS = frozenset({"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim"})
DEFAULT_LAYERS = {"olmo-150m": 3}


class Counts:
    """Per-tag counters of one step (a tag is active while its code runs; nested tags count).

    ``ops``: count ATen ops (the ``TorchDispatchMode``, the ops pass); ``calls``: count Python
    calls (``sys.setprofile``, the calls pass). Note [Two passes]: the two are never on
    together."""

    def __init__(self, host_is_device: bool = True, ops: bool = True, calls: bool = True) -> None:
        #: whether a CPU tensor's ``.item()`` counts as a sync (a CPU run: it stands for the
        #: device tensor it would be on a GPU; on a GPU only device tensors' count)
        self.host_is_device = host_is_device
        self.ops, self.calls = ops, calls
        self.active: list[str] = []
        self.by_tag: dict[str, dict[str, int]] = {}
        self._mode: OpCounter | None = None

    def add(self, what: str, n: int = 1) -> None:
        for tag in self.active:
            row = self.by_tag.setdefault(tag, {})
            row[what] = row.get(what, 0) + n

    def begin(self, name: str) -> None:
        """``name`` active; the outermost tag turns the counters on (untagged code, the model's
        forward and backward, runs without them). Plain calls, not a context manager: the
        profiler skips them (``INSTRUMENTATION``), a ``with`` would add its own calls."""
        if self.active:
            self.active.append(name)
            return
        if self.ops:
            self._mode = OpCounter(self)
            self._mode.__enter__()
        self.active.append(name)
        if self.calls:
            sys.setprofile(_profiler(self))

    def end(self, name: str) -> None:
        """The end of ``begin(name)``; the outermost turns the counters off."""
        self.active.remove(name)
        if self.active:
            return
        if self.calls:
            sys.setprofile(None)
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def get(self, tag: str, what: str) -> int:
        return self.by_tag.get(tag, {}).get(what, 0)


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while a tag is active (views and syncs apart)."""

    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts
        self.host_is_device = counts.host_is_device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counts.active:
            name = func.overloadpacket.__name__
            if func.is_view or name in VIEW_OPS or name in METADATA_OPS:
                self.counts.add("views")
            else:
                self.counts.add("ops")
            scalar = name == "_local_scalar_dense" and (
                self.host_is_device or args[0].device.type != "cpu"
            )
            if scalar or _blocking_cross_device(name, args, kwargs):
                self.counts.add("syncs")
        return func(*args, **kwargs)


def _blocking_cross_device(name: str, args: tuple, kwargs: dict) -> bool:
    """A copy between two devices that the host would wait for."""
    if name == "copy_" and len(args) >= 2:
        dst, src = args[0], args[1]
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return blocking and dst.device != src.device
    if name == "_to_copy" and args:
        device = kwargs.get("device")
        blocking = not kwargs.get("non_blocking", False)
        return blocking and device is not None and torch.device(device) != args[0].device
    return False


def _profiler(counts: Counts) -> Callable:
    skip = INSTRUMENTATION

    def profile(frame: Any, event: str, arg: Any) -> None:
        if counts.active and frame.f_code not in skip:
            if event == "call":
                counts.add("py_calls")
            elif event == "c_call":
                counts.add("c_calls")

    return profile


def _counted(
    counts: Counts, tag: str, extra: str | None, fn: Callable, many: bool = False
) -> Callable:
    """``fn`` run under ``tag``, counting ``extra`` once per call (``many``: once per item of
    its first argument after ``self``, a list of blocks or requests)."""

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        counts.begin(tag)
        try:
            if extra is not None:
                counts.add(extra, len(args[1]) if many else 1)
            return fn(*args, **kwargs)
        finally:
            counts.end(tag)

    return counted


@contextlib.contextmanager
def _patched(
    cls: type, name: str, counts: Counts, tag: str, extra: str | None, many: bool = False
) -> Iterator[None]:
    """``cls.name`` runs under ``tag`` (and counts ``extra`` once per call, or per item:
    ``_counted``) while active."""
    own, original = name in cls.__dict__, getattr(cls, name)
    setattr(cls, name, _counted(counts, tag, extra, original, many))
    try:
        yield
    finally:
        if own:
            setattr(cls, name, original)
        else:
            delattr(cls, name)


@contextlib.contextmanager
def _signals_counted(counts: Counts) -> Iterator[None]:
    """Each module signal hook ``ModuleSignals`` makes runs under ``hooks`` (the hook and all
    it calls: the runtime's host work of that signal) and counts one ``signals``."""
    original = ModuleSignals.__dict__["_forward"]

    def make(signal: Any) -> Callable:
        return _counted(counts, "hooks", "signals", original.__func__(signal))

    ModuleSignals._forward = staticmethod(make)
    try:
        yield
    finally:
        ModuleSignals._forward = original


#: The bench's own code, which the profiler does not count (nor the C functions it calls)
INSTRUMENTATION = frozenset(
    f.__code__ for f in (Counts.add, Counts.begin, Counts.end, _counted(Counts(), "", None, len))
)


def _forced(mode: str, device: torch.device, free_bytes: int) -> contextlib.ExitStack:
    """The GPU strategies forced on the CPU for ``mode`` (module docstring), on a pretended
    GPU with ``free_bytes`` of device memory free (what the window's slots are sized within:
    Note [Window by shape group] in asteria/memory/tiers.py); on a GPU, the runtime's own."""
    stack = contextlib.ExitStack()
    if mode in ("window", "device", "mapped") and device.type == "cpu":
        arch = Arch(cuda=True, unified_memory=mode == "mapped")
        stack.enter_context(testing.staged_snapshots())
        stack.enter_context(testing.pretend_arch(arch, device_free_bytes=free_bytes))
    return stack


def run_variant(name: str, mode: str, preset: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Per-step counts of one variant (its first step, which makes the state, is skipped): the
    ops pass and the calls pass, step by step (Note [Two passes])."""
    ops = run_pass(name, mode, preset, args, "ops")
    calls = run_pass(name, mode, preset, args, "calls")
    return {**ops, "steps": merge_passes(ops["steps"], calls["steps"], f"{name}_{mode}")}


#: What each pass counts (Note [Two passes]); both count ``AGREE``
PASS_KEYS = {
    "ops": ("ops", "step_ops", "hook_ops", "views", "syncs", "install_ops", "request_ops"),
    "calls": ("py_calls", "hook_py_calls", "c_calls"),
}
#: Per step, what makes it quiet or not: the same in both passes, or the bench fails
AGREE = ("installs", "requests", "signals")


def merge_passes(ops: list[dict], calls: list[dict], name: str) -> list[dict[str, int]]:
    """Each step's ops-pass figures and calls-pass figures in one row; a ``RuntimeError`` where
    the two passes' steps differ in what they install, request or signal (Note [Two passes])."""
    if len(ops) != len(calls):
        raise RuntimeError(f"{name}: {len(ops)} steps in the ops pass, {len(calls)} in the calls")
    rows = []
    for i, (o, c) in enumerate(zip(ops, calls)):
        if any(o[k] != c[k] for k in AGREE):
            seen = {k: (o[k], c[k]) for k in AGREE}
            raise RuntimeError(
                f"{name}: step {i + 2} is not the same kind of step in the two passes "
                f"((ops pass, calls pass): {seen}); their counts cannot be put together"
            )
        rows.append(
            {**{k: o[k] for k in PASS_KEYS["ops"]}, **{k: c[k] for k in PASS_KEYS["calls"]},
             **{k: o[k] for k in AGREE}}
        )  # fmt: skip
    return rows


def run_pass(
    name: str, mode: str, preset: Any, args: argparse.Namespace, count: str
) -> dict[str, Any]:
    """One pass of a variant: ``count`` is ``"ops"`` (the dispatch mode) or ``"calls"`` (the
    profiler); the rows have that pass's figures (``PASS_KEYS``) and ``AGREE``."""
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = build_model(preset, vocab_size=VOCAB_SIZE, max_seq_len=args.seq_len, seed=args.seed)
    model = model.to(device)
    if name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    else:
        opt = build_optimizer(name.replace("_", "-"), model.parameters())
    counts = Counts(host_is_device=device.type == "cpu", ops=count == "ops", calls=count == "calls")
    gen = torch.Generator().manual_seed(args.seed)
    tokens = [
        torch.randint(0, VOCAB_SIZE, (args.batch, args.seq_len), generator=gen).to(device)
        for _ in range(args.steps)
    ]
    runtime = None
    steps: list[dict[str, int]] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(_signals_counted(counts))
        patch = _patched(Refreshes, "request_many", counts, "request", "requests", many=True)
        stack.enter_context(patch)
        if name != "adamw":
            cls = type(opt)  # (every install goes through ``install_refresh_many``)
            patch = _patched(cls, "install_refresh_many", counts, "install", "installs", many=True)
            stack.enter_context(patch)
        if mode != "native":
            with _forced(mode, device, int(args.device_free_gib * 2**30)):
                placement = {"bases": "device" if mode == "device" else "host"}
                config = RuntimeConfig(
                    workers=args.workers,
                    statistics_lane=False,
                    refresh="interval",
                    placement=placement,
                )
                runtime = stack.enter_context(Runtime(model, opt, config))
        for i, batch in enumerate(tokens):
            counts.by_tag.clear()
            loss = _counted_step(model, opt, batch, counts)
            if not loss == loss:  # NaN
                raise FloatingPointError(f"{name}_{mode}: loss {loss} at step {i + 1}")
            if i > 0:
                steps.append(_row(counts))
            if runtime is not None:
                _settle(runtime)
    return {
        "optimizer": name,
        "mode": mode,
        "layers": preset.num_layers,
        "blocks": None if runtime is None else len(runtime.registry.entries),
        "steps": steps,
    }


def _settle(runtime: Runtime, timeout_s: float = 120.0) -> None:
    """Between two steps, uncounted: every refresh in flight finished (its snapshots submitted,
    its jobs done), so that the next step's first signal finds the same ones ready in both
    passes (Note [Two passes])."""
    refreshes, deadline = runtime._refreshes, time.monotonic() + timeout_s
    for e in list(runtime.registry.in_flight.values()):
        if e.pending is not None and e.pending.copies:
            refreshes.collect(e, wait=True)
    while not all(e.pending.done() for e in list(runtime.registry.in_flight.values())):
        if time.monotonic() > deadline:
            raise TimeoutError(f"refreshes still in flight after {timeout_s} s")
        time.sleep(0.001)


def _counted_step(model: torch.nn.Module, opt: Any, batch: torch.Tensor, counts: Counts) -> float:
    """Forward, backward and step; only tagged code is counted (``Counts.begin``): the step,
    and the module signals of the forward."""
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    counts.begin("step")
    try:
        opt.step()
    finally:
        counts.end("step")
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _row(counts: Counts) -> dict[str, int]:
    g = counts.get
    return {
        "ops": g("step", "ops") + g("hooks", "ops"),
        "step_ops": g("step", "ops"),
        "hook_ops": g("hooks", "ops"),
        "views": g("step", "views") + g("hooks", "views"),
        "syncs": g("step", "syncs") + g("hooks", "syncs"),
        "py_calls": g("step", "py_calls") + g("hooks", "py_calls"),
        "hook_py_calls": g("hooks", "py_calls"),
        "c_calls": g("step", "c_calls") + g("hooks", "c_calls"),
        "install_ops": g("install", "ops"),
        "request_ops": g("request", "ops"),
        "installs": g("install", "installs"),
        "requests": g("request", "requests"),
        "signals": g("hooks", "signals"),
    }


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over the steps that install nothing (``quiet``) and over those that install."""
    steps = result["steps"]
    quiet = [s for s in steps if s["installs"] == 0 and s["requests"] == 0]
    busy = [s for s in steps if s["installs"] > 0 and s["requests"] == 0]
    asking = [s for s in steps if s["requests"] > 0]

    def med(rows: list[dict[str, int]], key: str) -> float | None:
        return statistics.median(r[key] for r in rows) if rows else None

    keys = ("ops", "hook_ops", "views", "syncs", "py_calls", "hook_py_calls", "c_calls", "signals")
    return {
        "quiet_steps": len(quiet),
        "install_steps": len(busy),
        "quiet": {k: med(quiet, k) for k in keys},
        "max_quiet_syncs": max((s["syncs"] for s in quiet), default=None),
        "install": {k: med(busy, k) for k in (*keys, "install_ops", "installs")},
        "max_install_excess": max((s["ops"] - s["install_ops"] for s in busy), default=None),
        "request_steps": len(asking),
        "request": {k: med(asking, k) for k in ("ops", "request_ops", "py_calls", "syncs")},
        "total_ops": sum(s["ops"] for s in steps),
        "total_py_calls": sum(s["py_calls"] for s in steps),
    }


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or not theirs else ours / theirs


def goals(summaries: dict[str, dict[str, Any]], layers: list[int]) -> dict[str, Any]:
    """Each Asteria variant against its optimizer's native run at the same layers (module
    docstring); ``met`` is None where a goal had nothing to judge (no such steps)."""
    out: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        for mode in MODES[1:]:
            for n in layers:
                ours = summaries.get(f"{opt}_{mode}@{n}")
                native = summaries.get(f"{opt}_native@{n}")
                if ours is None or native is None:
                    continue
                base_ops = native["quiet"]["ops"]
                excess = ours["max_install_excess"]
                limit = None if base_ops is None else 1.05 * base_ops + INSTALL_BATCH_OPS
                out[f"{opt}_{mode}@{n}"] = {
                    "quiet_ops_ratio": _ratio(ours["quiet"]["ops"], base_ops),
                    "quiet_py_calls_ratio": _ratio(
                        ours["quiet"]["py_calls"], native["quiet"]["py_calls"]
                    ),
                    "quiet_syncs": ours["max_quiet_syncs"],
                    "install_excess_ops": excess,
                    "install_excess_limit": limit,
                    "signals_quiet": ours["quiet"]["signals"],
                }
            lo, hi = f"@{min(layers)}", f"@{max(layers)}"
            key = f"{opt}_{mode}"
            if key + lo in summaries and key + hi in summaries and len(layers) > 1:
                out[key + "_growth"] = {
                    what: _growth_ratio(
                        _grow(summaries, key, lo, hi, what),
                        _grow(summaries, f"{opt}_native", lo, hi, what),
                    )
                    for what in ("ops", "py_calls")
                }
    return {"by_variant": out, "met": _met(out)}


def _growth_ratio(ours: float | None, theirs: float | None) -> float | None:
    """Our growth over native's; 1.0 where neither grows (batched updates: flat counts)."""
    if ours is not None and theirs == 0:
        return 1.0 if ours == 0 else float("inf")
    return _ratio(ours, theirs)


def _grow(summaries: dict, key: str, lo: str, hi: str, what: str) -> float | None:
    a, b = summaries[key + lo]["quiet"][what], summaries[key + hi]["quiet"][what]
    return None if a is None or b is None else b - a


def _met(out: dict[str, Any]) -> dict[str, bool | None]:
    def all_of(values: list[bool | None]) -> bool | None:
        known = [v for v in values if v is not None]
        return None if not known else all(known)

    rows = [v for k, v in out.items() if not k.endswith("_growth")]
    grows = [v for k, v in out.items() if k.endswith("_growth")]
    le = _le
    return {
        "quiet_ops": all_of([le(r["quiet_ops_ratio"], 1.05) for r in rows]),
        "install_ops": all_of(
            [le(r["install_excess_ops"], r["install_excess_limit"]) for r in rows]
        ),
        "py_calls": all_of([le(r["quiet_py_calls_ratio"], 1.2) for r in rows]),
        "quiet_syncs": all_of([le(r["quiet_syncs"], 0) for r in rows]),
        "growth": all_of(
            [le(g["ops"], 1.05) for g in grows] + [le(g["py_calls"], 1.2) for g in grows]
        ),
    }


def _le(value: float | None, limit: float | None) -> bool | None:
    return None if value is None or limit is None else value <= limit


def variants(selected: str) -> list[tuple[str, str]]:
    """``(optimizer, mode)`` pairs: ``adamw``, then native, window and device of each (and
    mapped where asked for)."""
    out = [("adamw", "native")] + [(o, m) for o in OPTIMIZERS for m in MODES]
    if not selected:  # mapped: asked for (module docstring)
        return [(o, m) for o, m in out if m != "mapped"]
    wanted = set(selected.split(","))
    names = {f"{o}_{m}" if o != "adamw" else o for o, m in out}
    unknown = wanted - names
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {sorted(names)}")
    return [(o, m) for o, m in out if (o if o == "adamw" else f"{o}_{m}") in wanted]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (GPU strategies forced) or cuda")
    p.add_argument("--model", default="tiny")
    p.add_argument("--layers", type=int, default=None, help="the 1x layers (module docstring)")
    p.add_argument("--scales", default="1,2,4")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument(
        "--device-free-gib",
        type=float,
        default=70.0,
        help="on the CPU: the device memory the pretended GPU has free (an H100's, about)",
    )
    p.add_argument("--variants", default="", help="comma-separated; default: all")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step is skipped)")
    set_threads(args.threads)
    env = env_header("host_overhead: ATen ops, syncs and Python calls per training step")
    preset = get_preset(args.model)
    base = args.layers or DEFAULT_LAYERS.get(args.model, preset.num_layers)
    layers = [base * int(s) for s in args.scales.split(",")]
    summaries: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for n in layers:
        shaped = dataclasses.replace(preset, num_layers=n)
        for opt, mode in variants(args.variants):
            key = f"{opt if opt == 'adamw' else f'{opt}_{mode}'}@{n}"
            try:
                summaries[key] = summarize(run_variant(opt, mode, shaped, args))
            except Exception:  # one variant's failure is reported, the others still run
                errors[key] = traceback.format_exc(limit=3)
                print(f"{key}: FAILED\n{errors[key]}", file=sys.stderr)
            print(f"   {key} done", flush=True)
    _table(summaries)
    emit_json(
        {
            "benchmark": "host_overhead",
            "env": env,
            "args": vars(args),
            "layers": layers,
            "install_batch_ops": INSTALL_BATCH_OPS,
            "passes": {
                "ops": "TorchDispatchMode, no profiler: " + ", ".join(PASS_KEYS["ops"]),
                "calls": "sys.setprofile, no dispatch mode: " + ", ".join(PASS_KEYS["calls"]),
                "both, equal per step": ", ".join(AGREE),
            },
            "results": summaries,
            "goals": goals(summaries, layers),
            "errors": errors,
        }
    )


def _table(summaries: dict[str, dict[str, Any]]) -> None:
    rows = []
    for key, s in summaries.items():
        q, i = s["quiet"], s["install"]
        rows.append(
            [key, s["quiet_steps"], q["ops"], q["hook_ops"], q["syncs"], q["py_calls"],
             q["signals"], s["install_steps"], i["ops"], i["install_ops"], i["syncs"]]
        )  # fmt: skip
    print_table(
        ["variant", "quiet", "ops", "hook ops", "syncs", "py calls", "signals",
         "installing", "ops", "install math", "syncs"],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
