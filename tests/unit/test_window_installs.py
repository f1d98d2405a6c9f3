"""The window's host work on the steps that install, and its slot views, counted (issue 37).

* Note [Slot views by layout] (asteria/memory/window.py): a refill of a slot with a layout it
  packed before dispatches its copy and no view op, and whatever the sequence of fills every copy
  handed out equals its sources, in their layout; ``BasesWindow.part`` hands out the copies of
  tensors a slot holds among those it was filled with, and nothing else.
* Note [Reads together] (window.py): copies handed out together stay what they were copied from
  until the next ``finish``, which one event orders every later refill of their slots after;
  more reads together than slots raise. Through the runtime (Note [Pieces of the window] in
  asteria/runtime/window_bases.py): a step whose shape groups the ring holds at once reads them
  together, quiet steps fill nothing, and new blocks are read in with their groups, bitwise as
  without the window.
* Note [Host copies of a step's installs] (asteria/runtime/window_bases.py): however many
  blocks a step installs, the window copies new bases to host memory at most twice a step (the
  signal's batch before the step's reads, the plan's installs at its end), every basis is
  in host memory between steps, and training is bitwise that of native mode.

The properties run over layouts, dtypes and slot counts (the ring), and over the optimizers, the
depth of the model, the staleness and the refresh frequency (the runtime, the window forced with
``asteria.runtime.testing.pretend_arch``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from asteria.memory import is_host_tensor
from asteria.memory.copies import HostCopies
from asteria.memory.tiers import Arch
from asteria.memory.window import BasesWindow
from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.runtime import Runtime, RuntimeConfig
from asteria.runtime.refreshes import Refreshes
from asteria.runtime.testing import pretend_arch
from asteria.runtime.window_bases import WindowBases
from tests.problems import mlp_12_16_3, mlp_12_16_3_step

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}
SETTINGS = settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


class _Dispatched(TorchDispatchMode):
    """Counts the view ops and the other ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.views = self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view or func.overloadpacket.__name__ in ("detach", "alias", "as_strided"):
            self.views += 1
        else:
            self.ops += 1
        return func(*args, **(kwargs or {}))


# ---- the ring ------------------------------------------------------------------------------------

LAYOUT = st.tuples(
    st.integers(1, 5),
    st.integers(1, 5),
    st.sampled_from([torch.float32, torch.float64]),
    st.booleans(),
)


def _tensor(
    rows: int, cols: int, dtype: torch.dtype, column_major: bool, seed: int
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(cols, rows, generator=gen, dtype=dtype)
    return t.T if column_major else t.T.contiguous()


def _groups(layouts: list, keys: int) -> list[list[torch.Tensor]]:
    """``keys`` groups of tensors, group ``k`` with the layouts ``layouts`` rotated by ``k``."""
    n = len(layouts)
    return [
        [_tensor(*layouts[(k + i) % n], seed=100 * k + i) for i in range(n)] for k in range(keys)
    ]


@SETTINGS
@given(
    layouts=st.lists(LAYOUT, min_size=1, max_size=4),
    keys=st.integers(1, 4),
    slots=st.integers(1, 3),
    order=st.lists(st.integers(0, 3), min_size=1, max_size=12),
)
def test_every_copy_handed_out_is_its_source_in_its_layout_whatever_the_views_kept(
    layouts, keys, slots, order
):
    groups = _groups(layouts, keys)
    room = max(BasesWindow.bytes_of(g) for g in groups)
    window = BasesWindow(HostCopies(), slots, room)
    for i, k in enumerate(order):
        k %= keys
        nxt = order[i + 1] % keys if i + 1 < len(order) else None
        upcoming = None if nxt is None else (nxt, groups[nxt])
        got = window.use(k, groups[k], upcoming)
        for a, b in zip(got, groups[k]):
            assert torch.equal(a, b) and a.dtype == b.dtype and a.stride() == b.stride()
        if i % 2 == 1:  # a new version of the group's first tensor, in the other layout
            q = groups[k][0] * 2
            q = q.T.contiguous().T if q.is_contiguous() else q.contiguous()
            groups[k] = [q, *groups[k][1:]]
    window.close()


@SETTINGS
@given(layouts=st.lists(LAYOUT, min_size=1, max_size=4), keys=st.integers(2, 4))
def test_a_refill_with_a_layout_packed_before_dispatches_its_copy_and_no_view(layouts, keys):
    groups = _groups(layouts, keys)
    room = max(BasesWindow.bytes_of(g) for g in groups)
    window = BasesWindow(HostCopies(), 1, room)  # one slot: every use of another key refills
    for k in range(keys):  # the first fill of each layout packs views
        window.use(k, groups[k])
    for k in range(keys):
        fresh = [t.clone() for t in groups[k]]  # (the same layouts: clone keeps them)
        counted = _Dispatched()
        with counted:
            got = window.use(("again", k), fresh)
        assert counted.views == 0 and counted.ops == 1  # one _foreach_copy_
        assert all(torch.equal(a, b) for a, b in zip(got, fresh))
    window.close()


@SETTINGS
@given(
    layouts=st.lists(LAYOUT, min_size=2, max_size=5),
    picks=st.lists(st.integers(0, 4), min_size=1, max_size=5),
)
def test_part_hands_out_what_a_slot_holds_and_nothing_else(layouts, picks):
    (group,) = _groups(layouts, 1)
    window = BasesWindow(HostCopies(), 2, BasesWindow.bytes_of(group))
    window.use("group", group)
    fills = window.stats()["fills"]
    part = [group[p % len(group)] for p in picks] + [None]
    got, other = window.parts([part, [group[0].clone()]])
    assert got is not None and got[-1] is None
    for a, b in zip(got, part):
        if b is not None:
            assert torch.equal(a, b) and a.stride() == b.stride()
    assert other is None  # equal values, another tensor: not held
    assert window.stats()["fills"] == fills and window.stats()["part_hits"] == 1
    window.close()


@SETTINGS
@given(
    layouts=st.lists(LAYOUT, min_size=1, max_size=3),
    slots=st.integers(1, 4),
    reads=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), min_size=1, max_size=6),
)
def test_copies_handed_out_together_stay_valid_until_the_event_after_their_readers(
    layouts, slots, reads
):
    groups = _groups(layouts, 6)
    copies = HostCopies(auto_complete=False)
    window = BasesWindow(copies, slots, max(BasesWindow.bytes_of(g) for g in groups))
    for read in reads:
        keys = list(dict.fromkeys(read))
        if len(keys) > slots:  # more slots' worths than the ring has
            window.use(keys[0], groups[keys[0]])
            with pytest.raises(ValueError, match="in use"):
                for k in keys[1:]:
                    window.use(k, groups[k], together=True)
            window.finish()
            _complete(copies)
            continue
        got = {}
        for j, k in enumerate(keys):
            _complete(copies)  # (what copies wait for ran: the ring's order is checked below)
            got[k] = window.use(k, groups[k], together=j > 0)
        for k in keys:  # none of the read's slots was refilled by a later part of it
            assert all(torch.equal(a, b) for a, b in zip(got[k], groups[k]))
        records = sum(1 for kind, *_ in copies.log if kind == "record")
        window.finish()
        assert sum(1 for kind, *_ in copies.log if kind == "record") == records + 1
        event = [e for kind, e, *_ in copies.log if kind == "record"][-1]
        for k in keys:  # every later copy into these slots waits for that one event
            for slot in window._slots:
                if slot.key == k:
                    assert slot.read is event
        _complete(copies)
    window.close()


def _complete(copies: HostCopies) -> None:
    for kind, e, *_ in copies.log:
        if kind in ("record", "to_host"):
            e.complete()
    copies.run()


# ---- the runtime's installs ---------------------------------------------------------------------


def _train(name: str, layers: int, freq: int, config: RuntimeConfig, window: bool, steps: int):
    """Train with the bases behind the window (or where the CPU keeps them); per step, the
    copies to host memory and the installs counted."""
    model = mlp_12_16_3(layers)
    opt = OPTIMIZERS[name](
        model.parameters(), precondition_frequency=freq, max_preconditioner_dim=8
    )
    counts = {"to_host": 0, "installs": 0}
    per_step = []
    install = Refreshes._installed

    def counted_install(self, ready, *args, **kwargs):
        counts["installs"] += len(ready)
        return install(self, ready, *args, **kwargs)

    arch = pretend_arch(Arch(cuda=True)) if window else contextlib.nullcontext()
    Refreshes._installed = counted_install
    try:
        with arch, Runtime(model, opt, config) as rt:
            if window:
                assert isinstance(rt._bases, WindowBases)
                copies = rt._bases.window.copies
                to_host = copies.to_host

                def counted_to_host(*args, **kwargs):
                    counts["to_host"] += 1
                    return to_host(*args, **kwargs)

                copies.to_host = counted_to_host
            for t in range(steps):
                counts["to_host"] = counts["installs"] = 0
                mlp_12_16_3_step(model, opt, t)
                per_step.append(dict(counts))
                if window:  # between steps every basis is in host memory
                    for _, _, block, _ in opt.blocks():
                        assert all(q is None or is_host_tensor(q) for q in block[opt.bases_field])
    finally:
        Refreshes._installed = install
    return [p.detach().clone() for p in model.parameters()], per_step


@SETTINGS
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    layers=st.integers(1, 3),
    staleness=st.integers(0, 2),
    freq=st.integers(2, 4),
)
def test_a_step_copies_new_bases_to_host_at_most_twice_however_many_it_installs(
    name, layers, staleness, freq
):
    steps = 4 * freq
    config = RuntimeConfig(
        staleness=staleness, workers=1, refresh="interval", fixed_delay=staleness or None
    )
    ours, per_step = _train(name, layers, freq, config, window=True, steps=steps)
    theirs, _ = _train(name, layers, freq, config, window=False, steps=steps)
    # (the first step makes every block's bases: its step end copies them in one go)
    assert all(s["to_host"] <= 2 for s in per_step[1:]), per_step
    assert max(s["installs"] for s in per_step[1:]) >= 2  # steps installing several blocks
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def _pair() -> list[torch.nn.Module]:
    """Two shape groups (24 x 16 and 16 x 24 blocks), each a slot's worth for the window."""
    return [
        torch.nn.Linear(16, 24, bias=False),
        torch.nn.Tanh(),
        torch.nn.Linear(24, 16, bias=False),
    ]


class _Late(torch.nn.Module):
    """Layers of two shape groups, and a pair that joins at step ``late_at``: new blocks of
    both groups then."""

    def __init__(self, layers: int, late_at: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(*[m for _ in range(layers) for m in _pair()])
        self.late = torch.nn.Sequential(*_pair())
        self.late_at, self.t = late_at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return y + self.late(x) if self.t >= self.late_at else y


def _late_step(model: _Late, opt, t: int) -> None:
    gen = torch.Generator().manual_seed(t)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _train_late(name, layers, freq, late_at, window: bool, steps: int):
    model = _Late(layers, late_at)
    opt = OPTIMIZERS[name](
        model.parameters(), precondition_frequency=freq, max_preconditioner_dim=32
    )
    config = RuntimeConfig(
        staleness=1, workers=1, refresh="interval", fixed_delay=1, placement={"bases": "host"}
    )
    rows = []
    # a device with room for slots of a shape group's bases (Note [Window by shape group])
    free = 1 << 30
    arch = (
        pretend_arch(Arch(cuda=True), device_free_bytes=free)
        if window
        else contextlib.nullcontext()
    )
    installed = [0]
    with arch, Runtime(model, opt, config) as rt:
        install_many = rt._bases.install_many

        def counted(items):
            installed[0] += len(items)
            return install_many(items)

        rt._bases.install_many = counted
        for t in range(steps):
            model.t = t
            stats = rt._bases.stats() or {}
            _late_step(model, opt, t)
            after = rt._bases.stats() or {}
            rows.append(
                {
                    "ring": after.get("together", 0) > stats.get("together", 0),
                    "fills": after.get("fills", 0) - stats.get("fills", 0),
                    "installs": installed[0],
                    "blocks": len(list(opt.blocks())),
                }
            )
    return [p.detach().clone() for p in model.parameters()], rows


@SETTINGS
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    layers=st.integers(1, 3),
    freq=st.integers(3, 5),
    late_at=st.integers(2, 8),
)
def test_reads_together_fill_nothing_on_quiet_steps(name, layers, freq, late_at):
    steps = late_at + 3 * freq + 2
    ours, rows = _train_late(name, layers, freq, late_at, window=True, steps=steps)
    theirs, _ = _train_late(name, layers, freq, late_at, window=False, steps=steps)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    _check_reads_together(rows)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_loaded_state_trains_on_bitwise_as_without_the_window(name):
    """A load replaces the blocks (their bases new host tensors): the next step reads them in,
    and training goes on bitwise as without the window."""
    results = []
    for window in (True, False):
        model = _Late(2, late_at=100)
        opt = OPTIMIZERS[name](
            model.parameters(), precondition_frequency=3, max_preconditioner_dim=32
        )
        config = RuntimeConfig(staleness=0, workers=1, placement={"bases": "host"})
        arch = (
            pretend_arch(Arch(cuda=True), device_free_bytes=1 << 30)
            if window
            else contextlib.nullcontext()
        )
        with arch, Runtime(model, opt, config):
            for t in range(10):
                if t == 6:
                    opt.load_state_dict(opt.state_dict())
                _late_step(model, opt, t)
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_reads_together_are_taken_on_a_model_with_quiet_steps():
    """The property on one run where it happens: quiet steps read together, new blocks join."""
    ours, rows = _train_late("soap", 2, 3, 4, window=True, steps=12)
    theirs, _ = _train_late("soap", 2, 3, 4, window=False, steps=12)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert _check_reads_together(rows) > 0


def _check_reads_together(rows: list[dict]) -> int:
    """Quiet steps reading together filled nothing. Returns the number of quiet steps read
    together."""
    quiet_together = 0
    for earlier, _before, row in zip(rows, rows[1:], rows[2:]):
        # nothing installed or made in the step or the one before (new bases now)
        quiet = row["installs"] == earlier["installs"] and row["blocks"] == earlier["blocks"]
        if row["ring"] and quiet:
            assert row["fills"] == 0  # a quiet step reading together: the ring holds it all
            quiet_together += 1
    return quiet_together
