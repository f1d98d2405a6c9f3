"""SOAP's step in two passes over the pieces the window hands out (Note [Two passes] in
asteria/optim/kernels/soap.py), and the order and prefetch of the window's pieces (Note [Pieces
of the window] in asteria/runtime/window_bases.py).

Invariants, each over a space of settings drawn by hypothesis:
  * under a refresher whose handed-out bases are poisoned (NaN) at its next read or step end,
    with any bases room, SOAP's parameters and state are
    bitwise those of its step in one piece (native): no product reads a piece's bases after
    the next piece took its own, and the elementwise ops run once a batch; a batch read in
    several pieces reads them in order, then in the reverse order but the last (still valid);
  * through the runtime's window on its CPU stand-in (a pretended discrete GPU), over shapes,
    refresh frequency, staleness (fixed delays: reproducible), slots and a device budget that
    cuts the step into pieces, training is bitwise training with the bases on the device;
  * a quiet step through a window of ``k`` slots that reads ``n > k`` pieces fills ``2 (n -
    k)`` slots (SOAP) or ``n - k`` (Shampoo and KL-Shampoo: the pieces the ring holds first),
    and dispatches native's ATen ops plus those fills, at 1, 2 and 4 times the layers.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asteria.memory.accounting import estimate_blocks
from asteria.memory.tiers import Arch
from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.runtime import Runtime, RuntimeConfig
from asteria.runtime.testing import pretend_arch
from tests.unit.test_batched_steps import _Ops, _run, _same, max_dim, shapes
from tests.unit.test_kl_window import FREE, WINDOW_SPACE, _PoisonedWindow, _state_tensors

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RUNTIME_SETTINGS = settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _poisoned(room_share: float, log: list):
    """SOAP under ``_PoisonedWindow`` with a room of ``room_share`` of its bases; each step's
    reads are appended to ``log``."""

    class Poisoned(SOAP):
        def step(self, closure=None):
            if not isinstance(self._refresher, _PoisonedWindow):
                self._native = self._refresher = _PoisonedWindow(self, 0)
            total = sum(
                q.nbytes for _, _, b, _ in self.blocks() for q in b["bases"] if q is not None
            )
            self._refresher.room = int(room_share * total)
            self._refresher.reads = []
            out = super().step(closure)
            log.append(self._refresher.reads)
            return out

    return Poisoned


def _passes(reads: list[tuple]) -> bool:
    """Whether a step's reads are pieces in order then back in the reverse order but the last
    (P0 P1 P2 P1 P0), or one read."""
    half = reads[: (len(reads) + 1) // 2]
    return reads == half + half[-2::-1]


@SETTINGS
@given(shapes=shapes, max_dim=max_dim, data=st.data())
def test_two_passes_under_poisoned_bases_are_bitwise_one_piece(shapes, max_dim, data):
    options = dict(
        lr=3e-3,
        max_preconditioner_dim=max_dim,
        precondition_frequency=data.draw(st.sampled_from([1, 2, 3])),
        normalize_grads=data.draw(st.booleans()),
        precondition_1d=data.draw(st.booleans()),
        correct_bias=data.draw(st.booleans()),
        eps=data.draw(st.sampled_from([1e-8, 0.1])),
        weight_decay=data.draw(st.sampled_from([0.0, 0.01])),
    )
    share = data.draw(st.sampled_from([0.0, 0.1, 0.3, 0.6, 1.0]))
    log: list = []
    _same(_run(SOAP, shapes, options, 6), _run(_poisoned(share, log), shapes, options, 6))
    assert all(_passes(reads) for reads in log), log


def _net(inputs: int, width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    dims = [inputs] + [width] * depth + [4]
    layers = [torch.nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])]
    return torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())][:-1])


def _train(cls, net: dict, options: dict, config: dict, window: tuple[int, float] | None):
    """Parameters and state after training ``cls`` 10 steps on the CPU stand-in of a discrete
    GPU, with the bases behind a window of ``window = (slots, cut)`` (each slot the largest
    block's bases plus ``cut`` of the rest of the widest shape group's), or on the device."""
    model = _net(**net)
    opt = cls(model.parameters(), **options)
    extra: dict = dict(placement={"bases": "device"})
    slots = 2
    if window is not None:
        slots, cut = window
        blocks = estimate_blocks(opt)
        largest = max(b.bases for b in blocks)
        groups: dict = {}
        for b in blocks:
            groups[b.group] = groups.get(b.group, 0) + b.bases
        slot = largest + int(cut * (max(groups.values()) - largest))
        budget = sum(b.factors + b.moments for b in blocks) + slots * slot
        extra = dict(placement={"bases": "host"}, device_budget_bytes=budget)
    gen = torch.Generator().manual_seed(1)
    steps = 10
    xs = torch.randn(steps, 8, net["inputs"], generator=gen)
    ys = torch.randn(steps, 8, 4, generator=gen)
    with pretend_arch(Arch(cuda=True), window_blocks=slots, device_free_bytes=FREE):
        with Runtime(model, opt, RuntimeConfig(workers=1, **config, **extra)) as rt:
            for t in range(steps):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(xs[t]), ys[t]).backward()
                opt.step()
            access = rt.memory_report()["placement"]["bases_access"]
    assert access == (None if window is None else "window")  # (None: on the device)
    tensors = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        tensors += _state_tensors(opt.state[p])
    return tensors


@RUNTIME_SETTINGS
@given(**WINDOW_SPACE, normalize=st.booleans(), cls=st.sampled_from([SOAP, Shampoo]))
def test_pieces_through_the_window_are_bitwise_device_bases(
    net, max_dim, freq, config, slots, cut, normalize, cls
):
    """SOAP in two passes, Shampoo in one (Note [Pieces of the window])."""
    options = dict(lr=3e-3, precondition_frequency=freq, max_preconditioner_dim=max_dim)
    if cls is SOAP:
        options["normalize_grads"] = normalize
    want = _train(cls, net, options, config, None)
    got = _train(cls, net, options, config, (slots, cut))
    _same(got, want)


def _quiet_step(cls, layers: int, window: bool) -> tuple[int, int]:
    """ATen ops and window fills of a quiet step of ``cls`` (no refresh due; Shampoo's roots
    computed at step 3) on ``layers`` times three weights of as many shape groups, whose bases
    a ring of two slots of the largest cannot hold."""
    torch.manual_seed(0)
    if cls is not Shampoo:  # bases of 2,560, 4,608 and 2,368 bytes a block
        dims, freq = [(24, 8), (24, 24), (4, 24)], 100
    else:  # one root over each flattened weight: 160^2, 192^2 and 240^2 floats
        dims, freq = [(20, 8), (24, 8), (24, 10)], 3
    mods = [torch.nn.Linear(i, o, bias=False) for _ in range(layers) for o, i in dims]
    model = torch.nn.Sequential(*mods)
    opt = cls(model.parameters(), lr=1e-3, precondition_frequency=freq)
    x = torch.randn(8, 24)

    def loss() -> torch.Tensor:
        return sum(torch.tanh(m(x[:, : m.in_features])).square().mean() for m in mods)

    placement = {"bases": "host" if window else "device"}
    with pretend_arch(Arch(cuda=True), device_free_bytes=FREE):
        rc = RuntimeConfig(
            workers=1, staleness=0, placement=placement, statistics_lane=False, refresh="interval"
        )
        with Runtime(model, opt, rc) as rt:  # (no lane: its ops are another thread's)
            for _ in range(7 if cls is Shampoo else 4):
                opt.zero_grad()
                loss().backward()
                opt.step()
            opt.zero_grad()
            loss().backward()
            before = (rt.memory_report()["placement"]["window"] or {}).get("fills", 0)
            with _Ops() as counter:
                opt.step()
            after = (rt.memory_report()["placement"]["window"] or {}).get("fills", 0)
    return counter.ops, after - before


@pytest.mark.parametrize("cls", [SOAP, Shampoo, KLShampoo])
def test_a_quiet_step_over_more_pieces_than_slots_fills_only_their_excess(cls):
    """SOAP's two passes fill ``2 (n - k)`` slots; Shampoo's and KL-Shampoo's one pass, the
    pieces the ring holds first, ``n - k``."""
    for layers in (1, 2, 4):
        native, none = _quiet_step(cls, layers, window=False)
        ops, fills = _quiet_step(cls, layers, window=True)
        assert none == 0
        assert fills == (2 if cls is SOAP else 1) * (3 - 2), (layers, fills)
        assert ops == native + fills, (layers, ops, native)
