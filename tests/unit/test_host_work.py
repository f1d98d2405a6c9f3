"""The runtime's host work per step does not grow with the blocks (issue 37), counted, never timed.

* Note [One install batch per step] (runtime.py): however many modules signal, a step makes at
  most one batch install (one ``Refreshes.install_ready``, one ``BasesAccess.install_many``);
  every other signal returns at a flag.
* Note [In-flight index] (registry.py): the registry's index of the refreshes in flight is
  exactly the entries with one, whatever the run did; the batch looks only at it.
* Note [Bases made by a step] (bases.py): the host strategies stop visiting every block at the
  step's end once no block can be made.
* ``Runtime.pieces``: the bases a step's pieces hand out are the blocks' own, bitwise, a fill a
  run of a slot through the window.
* Note [Window by shape group] (asteria/memory/tiers.py): a window slot holds the largest shape
  group's bases within the room; a step reads the window per shape group, not per block.
* Note [Disarmed signals] (hooks.py): a step calls the runtime from one module signal, whatever
  the depth and the forwards.
* Note [One plan per step] (plan.py): a plan whose blocks have nothing due, in flight or owed
  makes as many Python calls whatever the depth (none per block).

The properties run over the optimizers, the depth of the model (blocks), the staleness and the
bases strategy (the window forced with ``asteria.runtime.testing.pretend_arch``).
"""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asteria.memory.accounting import estimate_blocks
from asteria.memory.tiers import Arch, BlockSizes, window_slot
from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.optim.groups import build
from asteria.optim.refresher import Update
from asteria.runtime import Runtime, RuntimeConfig
from asteria.runtime.refreshes import Refreshes
from asteria.runtime.testing import pretend_arch, slow_pool
from asteria.runtime.window_bases import WindowBases
from tests.problems import mlp_12_16_3, mlp_12_16_3_step

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}
SETTINGS = settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@contextlib.contextmanager
def _counting(owner: object, name: str, calls: list[int]):
    """Count the calls of ``owner.name`` (a class's method, or an instance's) while active."""
    original = getattr(owner, name)
    own = isinstance(owner, type) and name in owner.__dict__
    raw = owner.__dict__[name] if own else original

    def wrapper(*args, **kwargs):
        calls[0] += 1
        return raw(*args, **kwargs)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, raw)
        else:
            delattr(owner, name)


def _opt(name: str, model: torch.nn.Module):
    return OPTIMIZERS[name](model.parameters(), precondition_frequency=3, max_preconditioner_dim=8)


@SETTINGS
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    layers=st.integers(1, 4),
    staleness=st.integers(1, 4),
    window=st.booleans(),
)
def test_a_step_makes_at_most_one_install_batch_however_many_modules_signal(
    name, layers, staleness, window
):
    model = mlp_12_16_3(layers)
    opt = _opt(name, model)
    ready, many = [0], [0]
    arch = pretend_arch(Arch(cuda=True)) if window else contextlib.nullcontext()
    with arch, _counting(Refreshes, "install_ready", ready):
        rt = Runtime(model, opt, RuntimeConfig(staleness=staleness, workers=1))
    with rt, _counting(Refreshes, "install_ready", ready):
        for t in range(10):
            before = ready[0]
            with _counting(rt._bases, "install_many", many):
                many_before = many[0]
                # forward and backward: every module signals
                gen = torch.Generator().manual_seed(t)
                x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 3, generator=gen)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                assert ready[0] - before <= 1  # one batch, at the first signal
                assert many[0] - many_before <= 1
                opt.step()
        assert len(rt._parts.signals) == layers + 2  # a forward signal on every Linear
        in_flight = {k for k, v in rt.blocks().items() if v.pending is not None}
        assert set(rt.registry.in_flight) == in_flight  # Note [In-flight index]


@SETTINGS
@given(name=st.sampled_from(sorted(OPTIMIZERS)), staleness=st.integers(1, 3))
def test_finished_refreshes_are_installed_by_the_first_signal_in_one_batch(name, staleness):
    model = mlp_12_16_3(2)
    opt = _opt(name, model)
    many: list[int] = [0]
    config = RuntimeConfig(staleness=staleness, workers=1, statistics_lane=False)
    with Runtime(model, opt, config) as rt:
        for t in range(4):
            mlp_12_16_3_step(model, opt, t)
        for v in rt.blocks().values():  # every refresh in flight has finished
            if v.pending is not None:
                for f in v.pending.futures:
                    if f is not None:
                        f.result()
        in_flight = len(rt.registry.in_flight)
        before = sum(v.installs for v in rt.blocks().values())
        with _counting(rt._bases, "install_many", many):
            model(torch.randn(2, 12))  # one forward: its first signal installs them all
        after = sum(v.installs for v in rt.blocks().values())
        assert after - before == in_flight
        assert many[0] == (1 if in_flight else 0)
        assert not rt.registry.in_flight


@SETTINGS
@given(name=st.sampled_from(sorted(OPTIMIZERS)), layers=st.integers(1, 3), delay=st.booleans())
def test_the_in_flight_index_is_the_entries_with_a_refresh_in_flight(name, layers, delay):
    model = mlp_12_16_3(layers)
    opt = _opt(name, model)
    slow = slow_pool(0.02) if delay else contextlib.nullcontext()
    with slow, Runtime(model, opt, RuntimeConfig(staleness=2, workers=1)) as rt:
        for t in range(7):
            mlp_12_16_3_step(model, opt, t)
            expected = {k for k, e in rt.registry.entries.items() if e.pending is not None}
            assert set(rt.registry.in_flight) == expected
            assert rt.registry.pending_count() == len(expected)
        saved = opt.state_dict()
        opt.load_state_dict(saved)  # drops what is in flight and restores it
        expected = {k for k, e in rt.registry.entries.items() if e.pending is not None}
        assert set(rt.registry.in_flight) == expected


@SETTINGS
@given(name=st.sampled_from(sorted(OPTIMIZERS)), layers=st.integers(1, 3))
def test_step_ends_stop_visiting_every_block_once_none_can_be_made(name, layers):
    model = mlp_12_16_3(layers)
    opt = _opt(name, model)
    visits = [0]
    with pretend_arch(Arch(cuda=True)), Runtime(model, opt, RuntimeConfig(workers=1)) as rt:
        assert isinstance(rt._bases, WindowBases)
        with _counting(rt._bases, "_host_bases_many", visits):
            for t in range(3):
                mlp_12_16_3_step(model, opt, t)
            visits[0] = 0
            rt._bases.step_end()
            assert visits[0] == 0  # the step end no longer looks at the blocks
            opt.load_state_dict(opt.state_dict())
            rt._bases.step_end()
            assert visits[0] == 1  # a loaded state's bases are looked at again


def _groups(opt) -> list:
    """The shape groups of every block of ``opt`` (a step's, with zero gradients)."""
    updates = [
        Update(pid, p, torch.zeros_like(p), opt.state[p], opt.layout(p, group))
        for (pid, bi), p, _, group in opt.blocks()
        if bi == 0
    ]
    return build(updates, {"grad": [u.grad for u in updates]}, opt.bases_field)


@SETTINGS
@given(name=st.sampled_from(sorted(OPTIMIZERS)), layers=st.integers(1, 3), window=st.booleans())
def test_pieces_hand_out_each_blocks_own_bases_a_fill_a_run(name, layers, window):
    model = mlp_12_16_3(layers)
    opt = _opt(name, model)
    arch = pretend_arch(Arch(cuda=True)) if window else contextlib.nullcontext()
    with arch, Runtime(model, opt, RuntimeConfig(staleness=0, workers=1)) as rt:
        for t in range(4):
            mlp_12_16_3_step(model, opt, t)
        rt.sync()  # the installs queued on the statistics lane have run
        groups = _groups(opt)
        stats = rt._bases.stats()
        fills = None if stats is None else stats["fills"]
        pieces = rt.pieces(groups)
        runs = 0
        for piece in pieces:
            got = piece.bases()
            runs += len(getattr(piece, "runs", [piece.groups]))
            for g, bases in zip(piece.groups, got):
                assert len(bases) == len(g.blocks)
                for mine, block in zip(bases, g.blocks):
                    theirs = block[opt.bases_field]
                    assert len(mine) == len(theirs)
                    for a, b in zip(mine, theirs):
                        assert (a is None) == (b is None)
                        assert a is None or torch.equal(a, b)
        if window:
            assert rt._bases.stats()["fills"] - fills <= runs  # a run of a slot each
        else:
            assert len(pieces) == 1


@SETTINGS
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    free=st.integers(0, 1 << 22),
    fraction=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
)
def test_bases_stay_on_the_device_exactly_when_the_device_state_fits_the_budget(
    name, free, fraction
):
    model = mlp_12_16_3(2)
    opt = _opt(name, model)
    config = RuntimeConfig(workers=1, device_bases_fraction=fraction)
    with pretend_arch(Arch(cuda=True), device_free_bytes=free), Runtime(model, opt, config) as rt:
        report = rt.memory_report()
    planned = report["planned"]["device"]
    placement = report["placement"]
    whole = planned["factors"] + planned["moments"]
    bases = sum(b.bases for b in estimate_blocks(opt))
    fits = fraction > 0 and free > 0 and whole + bases <= int(fraction * free)
    assert placement["tiers"]["bases"] == ("device" if fits else "host")
    assert placement["bases_access"] == (None if fits else "window")
    assert any("budget" in n for n in placement["notes"]) == (fraction * free >= 1)


def test_a_production_run_never_imports_the_test_hooks():
    # Note [Test overrides at build]: a runtime attached and stepped without the test hooks
    # imported takes no test branch (its parts hold none) and imports none
    code = """
import sys, torch
from asteria.optim import SOAP
from asteria.runtime import Runtime, RuntimeConfig
model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
opt = SOAP(model.parameters(), precondition_frequency=2)
with Runtime(model, opt, RuntimeConfig(staleness=1, workers=1)) as rt:
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
    assert rt._parts.testing is None and rt._test_settings is None
    assert rt._executors._delayed is None
assert "asteria.runtime.testing" not in sys.modules
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@SETTINGS
@given(
    blocks=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 12)), min_size=1, max_size=12),
    slots=st.integers(1, 3),
    room=st.one_of(st.none(), st.integers(0, 1 << 15)),
)
def test_a_window_slot_holds_the_largest_shape_group_within_the_room(blocks, slots, room):
    """Note [Window by shape group] (asteria/memory/tiers.py): a slot is the largest group's
    bases, at most ``room // slots``, never less than the largest block's."""
    sizes = [BlockSizes(f"b{i}", i, bases=n, group=g) for i, (g, n) in enumerate(blocks)]
    slot = window_slot(sizes, slots, room)
    largest = max(n for _, n in blocks)
    groups: dict[int, int] = {}
    for g, n in blocks:
        groups[g] = groups.get(g, 0) + n
    widest = max(groups.values())
    assert slot >= largest
    if room is None or room // slots >= widest:
        assert slot == widest  # every group fits a slot: one piece a group
    else:
        assert slot == max(largest, room // slots)
    alone = [BlockSizes(s.name, s.param, bases=s.bases) for s in sizes]  # no group: a block
    assert window_slot(alone, slots, room) == largest


@SETTINGS
@given(name=st.sampled_from(["soap", "shampoo"]), staleness=st.integers(0, 2))
def test_the_window_is_read_per_shape_group_not_per_block(name, staleness):
    """A step that installs nothing reads the bases through the window once per piece (Note
    [Window by shape group]): as many ``use`` calls at 1 and at 4 hidden layers, fewer than the
    blocks; a step that installs adds at most one per block it installs."""
    quiet_uses = {}
    for layers in (1, 4):
        model = mlp_12_16_3(layers)
        opt = _opt(name, model)
        uses, installs = [0], [0]
        config = RuntimeConfig(
            staleness=staleness, workers=1, refresh="interval", placement={"bases": "host"}
        )
        with (
            pretend_arch(Arch(cuda=True), device_free_bytes=1 << 30),
            Runtime(model, opt, config) as rt,
            _counting(type(opt), "install_refresh", installs),
        ):
            window = rt._bases.window
            assert window.slot_bytes > max(b.bases for b in estimate_blocks(opt))
            rows = []
            with _counting(window, "use", uses):
                for t in range(12):
                    before, installed = uses[0], installs[0]
                    mlp_12_16_3_step(model, opt, t)
                    rows.append((uses[0] - before, installs[0] - installed))
            blocks = len(rt.registry.entries)
        quiet = {used for used, installed in rows[3:] if installed == 0}
        assert len(quiet) == 1 and next(iter(quiet)) < blocks
        assert all(used <= installed + min(quiet) for used, installed in rows[3:])
        quiet_uses[layers] = quiet
    assert quiet_uses[1] == quiet_uses[4]


def test_every_kind_of_refresh_future_has_the_one_protocol():
    """Note [One future protocol] (registry.py): every future a refresh in flight may hold is a
    ``RefreshFuture``, and a live run's futures are."""
    from asteria import _C
    from asteria.runtime.placement import _StreamFuture
    from asteria.runtime.registry import RefreshFuture, Resolved
    from asteria.runtime.testing import _Delayed

    for cls in (_C.Future, _StreamFuture, Resolved, _Delayed):
        assert issubclass(cls, RefreshFuture), cls
    model = mlp_12_16_3(2)
    opt = _opt("soap", model)
    seen = 0
    with slow_pool(0.05), Runtime(model, opt, RuntimeConfig(staleness=3, workers=1)) as rt:
        for t in range(8):
            mlp_12_16_3_step(model, opt, t)
            for e in rt.registry.in_flight.values():
                for f in e.pending.futures:
                    assert f is None or isinstance(f, RefreshFuture)
                    seen += f is not None
    assert seen > 0


@SETTINGS
@given(frequency=st.integers(1, 6), staleness=st.integers(1, 3), layers=st.integers(1, 2))
def test_refresh_urgent_is_asked_once_per_block_and_interval(frequency, staleness, layers):
    """Note [One plan per step] (plan.py): the plans ask Shampoo's ``refresh_urgent`` once per
    block and refresh interval, and the answer they keep is the one it gives for that
    interval."""
    model = mlp_12_16_3(layers)
    opt = Shampoo(model.parameters(), precondition_frequency=frequency, max_preconditioner_dim=8)
    asked = []
    with Runtime(model, opt, RuntimeConfig(staleness=staleness, workers=1)) as rt:
        assert rt.schedule.wait_first
        plan = rt._plan
        ask = opt.refresh_urgent

        def spy(block, step, group):
            freq = group["precondition_frequency"]
            key = next(k for k, _, b, _ in opt.blocks() if b is block)
            asked.append((key, -(-step // freq) * freq))
            return ask(block, step, group)

        opt.refresh_urgent = spy
        for t in range(3 * frequency + 2):
            mlp_12_16_3_step(model, opt, t)
            for key, _, block, group in opt.blocks():
                due_at, _, _, urgent = plan._urgency[key]
                assert urgent == ask(block, due_at, group)
    blocks = len(list(opt.blocks()))
    assert len(asked) == len(set(asked)) >= blocks


@contextlib.contextmanager
def _python_calls(owner: type, name: str, per_call: list[list[str]], keep: Any = None):
    """Per call of ``owner.name`` (a class's method), the Python calls it makes (their names),
    itself included (``sys.setprofile``); ``keep(args)`` chooses the calls recorded (None: all)."""
    raw = owner.__dict__[name]

    def wrapper(*args, **kwargs):
        seen: list[str] = []

        def profile(frame, event, arg):
            if event == "call":
                seen.append(frame.f_code.co_name)

        kept = True if keep is None else keep(args)  # (before the call changes what it reads)
        collecting = gc.isenabled()
        gc.disable()  # (a collection's finalizers are no call of the code watched)
        sys.setprofile(profile)
        try:
            return raw(*args, **kwargs)
        finally:
            sys.setprofile(None)
            if collecting:
                gc.enable()
            if kept is True or (kept and kept()):  # (``keep`` may return a check for after)
                per_call.append(seen)  # (``raw`` itself included)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, raw)


@SETTINGS
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    layers=st.integers(1, 4),
    staleness=st.integers(0, 3),
    forwards=st.integers(1, 3),
    interrupt=st.booleans(),
)
def test_a_step_signals_the_runtime_once_however_many_modules_it_has(
    name, layers, staleness, forwards, interrupt
):
    """Note [Disarmed signals] (hooks.py): the first module signal of a step disarms the hooks,
    so the runtime is called at most once a step whatever the depth and the forwards; the step's
    end arms them again where a refresh is in flight (and a fresh runtime starts armed), or,
    after a step that raised before its end, the next step's beginning (its forward signals
    nothing, as the flag alone had it)."""
    model = mlp_12_16_3(layers)
    opt = _opt(name, model)
    signals = [0]
    armed = True  # (attached: armed)
    with _counting(Runtime, "_on_signal", signals):  # before attach: the hooks' weak method
        rt = Runtime(model, opt, RuntimeConfig(staleness=staleness, workers=1))
        with rt:
            hooked = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
            for t in range(6):
                before = signals[0]
                assert all(len(m._forward_pre_hooks) == armed for m in hooked)
                gen = torch.Generator().manual_seed(t)
                x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 3, generator=gen)
                opt.zero_grad()
                for _ in range(forwards):
                    torch.nn.functional.mse_loss(model(x), y).backward()
                assert signals[0] - before == armed
                assert all(not m._forward_pre_hooks for m in hooked)  # disarmed
                raised = interrupt and t == 2
                if raised:  # a step that raises before its end
                    with mock.patch.object(Runtime, "end", _raise_key_error):
                        with contextlib.suppress(KeyError):
                            opt.step()
                else:
                    opt.step()
                armed = not raised and bool(rt.registry.in_flight)
        assert all(not m._forward_pre_hooks for m in hooked)  # removed at close


def _raise_key_error(self) -> None:
    raise KeyError("a step that raised before its end")


def _quiet_plan(entries: dict) -> Callable:
    """A probe for ``_python_calls``: whether a plan's blocks had nothing due, in flight or
    owed, and it changed nothing (a plan after an install measures the install's interval:
    once per install, so the installs must be those of the last two plans' ends)."""
    seen = [None, None]

    def state() -> dict:
        return {k: (e.installs, e.requested_step, e.pending) for k, e in entries.items()}

    def still(args):
        before = state()
        installs = {k: v[0] for k, v in before.items()}
        quiet = installs == seen[0] == seen[1] and not any(
            p is not None or entries[k].owed for k, (_, _, p) in before.items()
        )

        def check() -> bool:
            after = state()
            seen[:] = [{k: v[0] for k, v in after.items()}, seen[0]]
            return quiet and before == after

        return check

    return still


@SETTINGS
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    staleness=st.integers(1, 3),
    start=st.integers(1, 8),
)
def test_a_quiet_plan_makes_no_call_per_block(name, staleness, start):
    """Note [One plan per step] (plan.py): a plan whose blocks have nothing due, in flight or
    owed, and that requests and installs nothing, makes no Python call per block, at 1 and at 3
    hidden layers, with a basis or without one yet (Shampoo before its first roots, ``start``).
    (Under staggered refresh some block decides at every step: tests/unit/test_seam.py counts
    a whole refresh period's calls.)"""
    quiet: dict[int, set[int]] = {}
    for layers in (1, 3):
        model = mlp_12_16_3(layers)
        kwargs = {"start_preconditioning_step": start} if name == "shampoo" else {}
        opt = OPTIMIZERS[name](
            model.parameters(), precondition_frequency=4, max_preconditioner_dim=8, **kwargs
        )
        config = RuntimeConfig(staleness=staleness, workers=1, refresh="interval")
        per_call: list[list[str]] = []
        with Runtime(model, opt, config) as rt:
            still = _quiet_plan(rt.registry.entries)
            for t in range(12):
                with _python_calls(Runtime, "plan", per_call, still):
                    mlp_12_16_3_step(model, opt, t)
        quiet[layers] = per_call
    # the quietest plan calls nothing per block (the first of an interval asks Shampoo's
    # urgency once per block; the optimizer's schedule is asked once per group)
    for calls in quiet.values():
        assert calls
        names = set(min(calls, key=len))
        assert not names & {"decide", "record_ages", "urgent", "entry"}, names
