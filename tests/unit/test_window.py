"""The bases window (Note [Bases window] in asteria/memory/window.py) on its CPU stand-in.

The ring's ordering is checked with stand-in events completed by hand: a slot is refilled only
after the event recorded after its last reader, the main stream never reads a slot before its
copy, a stale copy is never handed out. The runtime's window is run by making the CPU look like a
discrete GPU (``detect_arch`` patched): the bases live in Asteria host blocks, the optimizers read
them through a two-slot (or one-slot) window of "device" buffers, and training is bitwise equal
to training without the window. The same ring on real CUDA streams: tests/gpu/test_window_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from asteria.memory import (
    StagingRing,
    host_empty,
    host_memory_stats,
    is_host_tensor,
    release_host_cache,
)
from asteria.memory.accounting import estimate_blocks
from asteria.memory.copies import HostCopies
from asteria.memory.staging import snapshot
from asteria.memory.tiers import Arch
from asteria.memory.window import BasesWindow
from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.optim.groups import build
from asteria.optim.refresher import Update
from asteria.runtime import Runtime, RuntimeConfig
from asteria.runtime.testing import pretend_arch
from tests.problems import mlp_24_32_32_4

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}
STEPS = 20


# ---- the ring, with events completed by hand ----------------------------------------------------


def _bases(value: float, n: int = 2, d: int = 4) -> list[torch.Tensor]:
    return [torch.full((d, d), value + i) for i in range(n)]


def _manual_window(slots: int) -> tuple[BasesWindow, HostCopies]:
    copies = HostCopies(auto_complete=False)
    return BasesWindow(copies, slots, BasesWindow.bytes_of(_bases(0.0))), copies


def _reader_event(copies: HostCopies, n: int) -> object:
    """The n-th event recorded on the main stream (a reader event)."""
    return [e for kind, e, *_ in copies.log if kind == "record"][n]


def test_a_slot_is_refilled_only_after_its_last_reader_completed():
    window, copies = _manual_window(slots=2)
    a, b, c, d = _bases(10.0), _bases(20.0), _bases(30.0), _bases(40.0)
    got_a = window.use("a", a, upcoming=("b", b))  # fills slot 0, prefetches b into slot 1
    assert all(torch.equal(x, y) for x, y in zip(got_a, a))
    got_b = window.use("b", b, upcoming=("c", c))  # a's readers: event 0, still pending
    assert window.stats()["prefetch_hits"] == 1
    # c goes into a's slot, queued behind a's reader event: a's data is still there
    assert copies.pending() == 1
    assert all(torch.equal(x, y) for x, y in zip(got_a, a))
    _reader_event(copies, 0).complete()
    copies.run()
    assert copies.pending() == 0
    assert all(torch.equal(x, y) for x, y in zip(got_a, c))  # the slot now holds c
    window.use("c", c, upcoming=("d", d))  # a hit; d waits for b's readers (event 1)
    assert copies.pending() == 1
    assert all(torch.equal(x, y) for x, y in zip(got_b, b))
    # handing d out now would read a slot whose copy waits for b's readers: refused
    with pytest.raises(RuntimeError, match="would wait"):
        window.use("d", d)
    assert all(torch.equal(x, y) for x, y in zip(got_b, b))
    _reader_event(copies, 1).complete()
    got_d = window.use("d", d)
    assert all(torch.equal(x, y) for x, y in zip(got_d, d))
    # every copy into a slot that had readers waited for their event
    waited = [waits for kind, _, *rest in copies.log if kind == "copy" for waits in rest]
    assert [len(w) for w in waited] == [0, 0, 1, 1]


def test_a_window_of_one_slot_copies_each_block_after_the_previous_ones_readers():
    window, copies = _manual_window(slots=1)
    a, b = _bases(1.0), _bases(2.0)
    got_a = window.use("a", a, upcoming=("b", b))  # nothing to prefetch into: a is in use
    assert window.stats()["prefetches"] == 0 and copies.pending() == 0
    with pytest.raises(RuntimeError, match="would wait"):
        window.use("b", b)  # b's copy waits for a's readers
    assert all(torch.equal(x, y) for x, y in zip(got_a, a))
    _reader_event(copies, 0).complete()
    got_b = window.use("b", b)
    assert all(torch.equal(x, y) for x, y in zip(got_b, b))
    assert window.stats()["fills"] == 2


def test_new_host_tensors_are_copied_again_and_old_ones_are_never_handed_out():
    window = BasesWindow(HostCopies(), 2, BasesWindow.bytes_of(_bases(0.0)))
    a, b = _bases(1.0), _bases(2.0)
    window.use("a", a, upcoming=("b", b))
    window.use("b", b, upcoming=("a", a))
    assert window.use("a", a)[0][0, 0] == 1.0 and window.stats()["hits"] == 2
    a[0] = torch.full((4, 4), 7.0)  # an install replaces the tensor (same key, same shape)
    got = window.use("a", a)
    assert got[0][0, 0] == 7.0 and got[1][0, 0] == 2.0
    assert window.stats()["fills"] == 3
    with pytest.raises(ValueError, match="resize"):
        window.use("big", _bases(0.0, d=5))
    window.resize(BasesWindow.bytes_of(_bases(0.0, d=5)))
    assert window.use("big", _bases(3.0, d=5))[1][0, 0] == 4.0
    assert window.use("none", [None, None]) == [None, None]


def test_copies_wait_for_the_host_writes_before_them_and_the_host_waits_in_host_sync():
    """Note [Host writes]: ``to_host`` does not wait; later copies and ``host_sync`` do."""
    copies = HostCopies(auto_complete=False)
    src, dst = torch.full((3,), 5.0), torch.zeros(3)
    written = copies.to_host([dst], [src])
    assert not written.query()
    with pytest.raises(RuntimeError, match="never completes"):
        copies.host_sync()  # the host would read dst before its copy completed
    slot = torch.zeros(3)
    copies.copy([slot], [dst], [])  # a fill of the window from dst: queued behind the writes
    assert copies.pending() == 1 and torch.equal(slot, torch.zeros(3))
    written.complete()
    copies.run()
    copies.host_sync()
    assert torch.equal(slot, src) and copies.pending() == 0
    copies.copy([slot], [torch.ones(3)], [])  # once complete, nothing more waits for it
    assert copies.pending() == 0 and torch.equal(slot, torch.ones(3))


def test_the_stand_in_copies_to_host_land_only_when_waited_for():
    """Note [Stand-in host writes]: as a device-to-host copy behind a busy main stream, the
    stand-in's ``to_host`` has not written its destination for the host until the host waits
    for it (later copies on the "device" read what it writes); a copy between two host tensors
    runs at once and waits for nothing, as CUDA runs it."""
    copies = HostCopies()
    src, dst = torch.full((3,), 5.0), host_empty((3,), torch.float32, pinned=False)
    dst.fill_(-1.0)
    written = copies.to_host([dst], [src])
    src.fill_(6.0)  # a later kernel's write: not what the copy reads
    assert not written.query() and torch.equal(dst, torch.full((3,), -1.0))
    other = host_empty((3,), torch.float32, pinned=False)
    copies.copy([other], [dst], [])  # host to host: at once, from what dst holds now
    assert torch.equal(other, torch.full((3,), -1.0))
    slot = torch.zeros(3)
    copies.copy([slot], [dst], [])  # a window fill: on the "device", after the writes
    assert torch.equal(slot, torch.full((3,), 5.0))
    assert not written.query() and torch.equal(dst, torch.full((3,), -1.0))  # (host: not yet)
    dst2 = host_empty((3,), torch.float32, pinned=False)
    copies.to_host([dst2], [src])
    copies.host_sync()  # the host waits: both copies land, in order
    assert written.query() and torch.equal(dst, torch.full((3,), 5.0))
    assert torch.equal(dst2, torch.full((3,), 6.0))


@pytest.mark.parametrize("manual", [False, True], ids=["auto", "by_hand"])
def test_a_snapshot_of_a_host_basis_waits_for_the_copy_to_host_that_writes_it(manual):
    """Note [Host sources of a snapshot] (issue 50): a block's basis hosted by a ``to_host``
    still in flight, then snapshotted into a staging slot (a refresh requested in the step whose
    first read hosted its install): the slot holds the new basis, not what the reused host
    block held before."""
    copies = HostCopies(auto_complete=not manual)
    ring = StagingRing(slots=2, slot_bytes=4096)
    factor, new = torch.randn(4, 4), torch.full((4, 4), 3.0)
    basis = host_empty((4, 4), torch.float32, pinned=False, reuse=True)
    basis.fill_(-7.0)  # an older basis of another block, or uninitialised pages
    written = copies.to_host([basis], [new])
    if manual:  # the host would wait for a copy the stand-in cannot run by itself
        with pytest.raises(RuntimeError, match="never completes"):
            snapshot([factor, basis], ring, copies, timeout=0.0)
        assert ring.stats()["leased"] == 0
        written.complete()
    snap = snapshot([factor, basis], ring, copies, timeout=0.0)
    if manual:
        _reader_event(copies, 0).complete()
        copies.run()
    got = snap.wait()
    assert torch.equal(got[0], factor)
    assert torch.equal(got[1], new), "the snapshot read the basis before its copy to host landed"
    snap.release()


# ---- the runtime's window on the stand-in --------------------------------------------------------


@pytest.fixture
def discrete_gpu():
    """Make the runtime see a discrete GPU: bases in host memory behind a window (stand-in)."""
    with pretend_arch(Arch(cuda=True)):
        yield


def _train(name: str, config: RuntimeConfig, steps: int = STEPS):
    model = mlp_24_32_32_4()
    opt = OPTIMIZERS[name](model.parameters(), precondition_frequency=5, max_preconditioner_dim=16)
    gen = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(steps, 16, 24, generator=gen), torch.randn(steps, 16, 4, generator=gen)
    with Runtime(model, opt, config) as rt:
        for t in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xs[t]), ys[t]).backward()
            opt.step()
        report = rt.memory_report()
        report["stats"] = rt.stats()
        hosted = [
            is_host_tensor(q)
            for _, _, block, _ in opt.blocks()
            for q in block[opt.bases_field]
            if q is not None
        ]
    return [p.detach().clone() for p in model.parameters()], report, hosted


CONFIGS = {
    "staleness0": RuntimeConfig(staleness=0, workers=1),
    "fixed_delay": RuntimeConfig(staleness=3, fixed_delay=3, workers=1),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_training_through_the_window_is_bitwise_equal_to_training_without_it(name, config):
    reference, direct, _ = _train(name, CONFIGS[config])
    assert direct["placement"]["bases_access"] == "direct"
    with pretend_arch(Arch(cuda=True)):
        params, report, hosted = _train(name, CONFIGS[config])
    assert report["placement"]["bases_access"] == "window"
    window = report["placement"]["window"]
    assert window["slots"] == 2 and window["prefetch_hits"] > STEPS  # the window did the work
    assert hosted and all(hosted)  # the bases in use are Asteria host blocks
    for a, b in zip(params, reference):
        assert torch.equal(a, b)


@pytest.mark.parametrize("refresh", ["staggered", "continuous"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_staged_snapshots_of_host_bases_train_bitwise_like_bases_on_the_device(name, refresh):
    """Issue 50, through the runtime: with the device path's staged snapshots, a refresh
    requested in the step whose first read hosted the block's new bases stages them only once
    their copy to host memory landed (Note [Host sources of a snapshot]). The stand-in's copies
    to host land for the host only when it waits (Note [Stand-in host writes]): without the
    wait, the QR refreshes started from stale host blocks and diverged (or failed as
    non-finite)."""
    from asteria.runtime.testing import staged_snapshots

    def run(bases: str):
        config = RuntimeConfig(
            staleness=3, fixed_delay=3, workers=1, refresh=refresh, statistics_lane=False,
            placement={"bases": bases},
        )  # fmt: skip
        with pretend_arch(Arch(cuda=True)), staged_snapshots():
            return _train(name, config)

    reference, on_device, _ = run("device")
    params, report, hosted = run("host")
    assert on_device["placement"]["bases_access"] is None
    assert report["placement"]["bases_access"] == "window" and hosted and all(hosted)
    for a, b in zip(params, reference):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_a_window_of_one_block_still_trains_bitwise(name):
    reference, _, _ = _train(name, CONFIGS["fixed_delay"])
    with pretend_arch(Arch(cuda=True), window_blocks=1):
        params, report, _ = _train(name, CONFIGS["fixed_delay"])
    window = report["placement"]["window"]
    assert window["slots"] == 1 and window["prefetches"] == 0 and window["fills"] > STEPS
    assert report["device"]["bases"] == report["planned"]["device"]["bases"]
    for a, b in zip(params, reference):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_memory_report_counts_the_window_on_the_device_and_the_bases_in_host(name, discrete_gpu):
    model = mlp_24_32_32_4()
    opt = OPTIMIZERS[name](model.parameters(), precondition_frequency=5, max_preconditioner_dim=16)
    blocks = estimate_blocks(opt)
    with Runtime(model, opt, RuntimeConfig(staleness=0, workers=1)) as rt:
        for _ in range(12):
            opt.zero_grad()
            model(torch.randn(16, 24)).square().mean().backward()
            opt.step()
        report = rt.memory_report()
        slots = report["placement"]["window"]
        window = slots["slots"] * slots["slot_bytes"]  # the window's device buffers
        state = sum(
            q.nbytes
            for _, _, block, _ in opt.blocks()
            for q in block[opt.bases_field]
            if q is not None
        )
    planned = report["planned"]
    assert report["placement"]["tiers"]["bases"] == "host"
    assert report["device"]["bases"] == window == planned["device"]["bases"]
    assert window == 2 * max(b.bases for b in blocks) > 0
    assert report["host"]["bases"] == state == planned["host"]["bases"] > 0
    assert report["device"]["factors"] == planned["device"]["factors"]


def test_bases_that_outgrow_the_window_within_the_budget_grow_it_else_say_what_to_change(
    discrete_gpu,
):
    model = mlp_24_32_32_4()
    opt = SOAP(model.parameters(), precondition_frequency=5, max_preconditioner_dim=16)
    blocks = estimate_blocks(opt)
    must = sum(b.factors + b.moments for b in blocks) + 2 * max(b.bases for b in blocks)
    extra = torch.nn.Parameter(torch.randn(16, 16, dtype=torch.float64))  # fp64: larger bases

    def steps(rt, n):
        for _ in range(n):
            opt.zero_grad()
            (model(torch.randn(16, 24)).square().mean() + extra.sum() ** 2).backward()
            opt.step()

    with Runtime(model, opt, RuntimeConfig(staleness=0, workers=1, device_budget_bytes=must)) as rt:
        steps(rt, 2)
        opt.add_param_group({"params": [extra]})  # after attaching: the plan does not know it
        steps(rt, 1)  # its first step only initialises its bases
        with pytest.raises(ValueError, match=r"over device_budget_bytes=\d+\. Raise"):
            steps(rt, 1)
    model = mlp_24_32_32_4()
    opt = SOAP(model.parameters(), precondition_frequency=5, max_preconditioner_dim=16)
    with Runtime(model, opt, RuntimeConfig(staleness=0, workers=1)) as rt:
        steps(rt, 2)
        opt.add_param_group({"params": [extra]})
        steps(rt, 3)
        slot_bytes = rt.memory_report()["placement"]["window"]["slot_bytes"]
        assert slot_bytes == BasesWindow.bytes_of(opt.state[extra]["blocks"][0]["bases"])


def test_native_mode_hands_the_optimizer_its_own_bases():
    model = mlp_24_32_32_4()
    for cls in OPTIMIZERS.values():
        opt = cls(model.parameters(), precondition_frequency=1, max_preconditioner_dim=16)
        model(torch.randn(4, 24)).square().mean().backward()
        opt.step()
        opt.step()
        (pid, _), p, block, group = next(iter(opt.blocks()))
        update = Update(pid, p, p.grad, opt.state[p], opt.layout(p, group))
        groups = build([update], {"grad": [p.grad]}, opt.bases_field)
        (piece,) = opt.refresher.pieces(groups)
        assert piece.bases()[0][0] is block[opt.bases_field]


def _mlp(name: str):
    model = mlp_24_32_32_4()
    opt = OPTIMIZERS[name](model.parameters(), precondition_frequency=2, max_preconditioner_dim=16)
    return model, opt


def _steps(model, opt, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(8, 24)).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_dict_waits_for_the_copies_of_bases_to_host_memory(name, discrete_gpu, monkeypatch):
    """The host reads the bases in ``state_dict``: ``Runtime.sync`` waits for the window's
    copies back to host memory first (Note [Host writes])."""
    synced = []
    original = HostCopies.host_sync
    monkeypatch.setattr(HostCopies, "host_sync", lambda self: synced.append(1) or original(self))
    model, opt = _mlp(name)
    with Runtime(model, opt, RuntimeConfig(staleness=0, workers=1)):
        _steps(model, opt, 3)
        synced.clear()
        opt.state_dict()
        assert synced, "state_dict read host bases without waiting for their copies"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_installs_reuse_the_host_blocks_of_replaced_bases_and_close_frees_them(name, discrete_gpu):
    """Note [Reused host blocks]: each install replaces a block's host bases; from the second
    refresh on, the new ones take the blocks the old ones left (no fresh registration), and
    ``close()`` gives the cache back."""
    release_host_cache()
    before = host_memory_stats()
    model, opt = _mlp(name)
    with Runtime(model, opt, RuntimeConfig(staleness=0, workers=1)):
        _steps(model, opt, 12)
        during = host_memory_stats()
    reused = during["reused_blocks"] - before["reused_blocks"]
    fresh = during["allocated_blocks"] - before["allocated_blocks"]
    assert reused > fresh, f"{reused} reused, {fresh} fresh blocks"
    assert host_memory_stats()["cached_blocks"] == 0


def test_closing_one_window_keeps_the_cache_another_window_reuses(discrete_gpu):
    """The cache of reused host blocks is the process's: the first of two runtimes to close
    leaves it to the other (whose installs keep reusing it); the last one frees it."""
    release_host_cache()
    model_a, opt_a = _mlp("soap")
    model_b, opt_b = _mlp("soap")
    a = Runtime(model_a, opt_a, RuntimeConfig(staleness=0, workers=1))
    b = Runtime(model_b, opt_b, RuntimeConfig(staleness=0, workers=1))
    try:
        _steps(model_a, opt_a, 12)
        _steps(model_b, opt_b, 12)
        a.close()
        assert host_memory_stats()["cached_blocks"] > 0, "closing a emptied b's cache"
        reused = host_memory_stats()["reused_blocks"]
        _steps(model_b, opt_b, 10)
        assert host_memory_stats()["reused_blocks"] > reused
    finally:
        a.close()
        b.close()
    assert host_memory_stats()["cached_blocks"] == 0


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_failed_copy_to_host_leaves_the_blocks_bases_as_they_were(
    name, discrete_gpu, monkeypatch
):
    """All or nothing: a block takes its new host tensors only once their copies are issued, so
    a copy that raises (a CUDA error, an interrupt) leaves it reading its own bases."""
    model, opt = _mlp(name)
    with Runtime(model, opt, RuntimeConfig(staleness=0, workers=1)):
        _steps(model, opt, 4)
        fails = RuntimeError("copy to host failed")
        monkeypatch.setattr(HostCopies, "to_host", lambda self, d, s: (_ for _ in ()).throw(fails))
        for _, _, block, _ in opt.blocks():
            bases = block[opt.bases_field]
            if any(q is not None for q in bases):
                new = [None if q is None else q.clone() for q in bases]
                before = list(new)
                bases[:] = new
                with pytest.raises(RuntimeError, match="copy to host failed"):
                    opt._refresher._bases._host_bases_many([block])
                assert all(a is b for a, b in zip(bases, before))
                break
        else:
            pytest.fail("no block had bases")
        monkeypatch.undo()
