"""KL-Shampoo's batched step behind a device window (Note [Pieces of the window] in
asteria/runtime/window_bases.py): pieces of shape groups, each piece's bases valid only until
the next piece's are read, its statistics with its update (``update_statistics``).

Invariants, each over a space of settings drawn by hypothesis:
  * under a refresher whose handed-out bases are poisoned (NaN) at its next read or step end,
    with any bases room, the step in pieces gives bitwise the parameters and state of the
    per-block path: no update or statistics reads a piece's bases after the next piece took
    its own, and no piece hands out more than the room (but for one block over it);
  * through the runtime's window on its CPU stand-in (a pretended discrete GPU), over shapes,
    refresh frequency, staleness (fixed delays: reproducible), window slots and a device budget
    that cuts shape groups across pieces, training with the step in pieces is bitwise training
    with the per-block path under the same window;
  * a quiet step through the window dispatches as many ATen ops at 2, 4 and 8 layers of the
    same shapes (a window fill per piece, pieces per shape group).
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asteria.memory.accounting import estimate_blocks
from asteria.memory.tiers import Arch
from asteria.optim import KLShampoo
from asteria.optim import groups as grouping
from asteria.optim.refresher import NativeRefresher, Piece
from asteria.runtime import Runtime, RuntimeConfig
from asteria.runtime.testing import pretend_arch
from tests.unit.test_batched_steps import _Ops, _per_parameter, _run, _same, max_dim, shapes

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: The device memory a pretended GPU has free (the bases budget is a fraction of it: large
#: enough that only ``device_budget_bytes`` limits the window's slots), and the bases placed in
#: host memory behind the window (Note [Bases by budget] in asteria/memory/tiers.py).
FREE = 1 << 40
HOST = {"bases": "host"}
RUNTIME_SETTINGS = settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class _PoisonedWindow(NativeRefresher):
    """Native refreshes, the groups in pieces of at most ``room`` bytes of bases (``groups.pack``)
    whose bases are handed out as copies that are filled with NaN at the next piece's read and
    at the step's end (a window slot refilled); the keys of each read logged (``reads``)."""

    def __init__(self, opt, room: int) -> None:
        super().__init__(opt)
        self.room = room
        self._handed: list[torch.Tensor] = []
        self._last: Piece | None = None
        self.reads: list[tuple] = []  # keys per read

    def _poison(self) -> None:
        for q in self._handed:
            q.fill_(float("nan"))
        self._handed = []

    def pieces(self, groups, passes=1):
        field = self._field

        def nbytes(g):
            return sum(q.nbytes for b in g.blocks for q in b[field] if q is not None)

        cut = grouping.pack(groups, self.room, grouping.BATCH_ELEMENTS, nbytes)
        return [Piece(piece, self._read_poisoned) for piece in cut]

    def _read_poisoned(self, piece):
        if piece is self._last:  # (a second read of the last piece: its copies are valid)
            return self._copies
        self._poison()
        own = self._bases(piece)
        field = self._field
        if sum(len(g) for g in piece.groups) > 1:
            held = sum(
                q.nbytes for g in piece.groups for b in g.blocks for q in b[field] if q is not None
            )
            assert held <= self.room
        # clone keeps each basis's layout; None (no basis: SOAP's 1-D blocks) stays None
        out = [[[None if q is None else q.clone() for q in qs] for qs in g] for g in own]
        self._handed = [q for g in out for qs in g for q in qs if q is not None]
        self._last, self._copies = piece, out
        self.reads.append(tuple(k for g in piece.groups for k in g.keys))
        return out

    def end(self) -> None:
        self._poison()
        self._last = None
        super().end()


def _poisoned(room_share: float):
    """KLShampoo under ``_PoisonedWindow`` with a room of ``room_share`` of its bases."""

    class Poisoned(KLShampoo):
        def step(self, closure=None):
            if not isinstance(self._refresher, _PoisonedWindow):
                self._native = self._refresher = _PoisonedWindow(self, 0)
            total = sum(q.nbytes for _, _, b, _ in self.blocks() for q in b["bases"])
            self._refresher.room = int(room_share * total)
            return super().step(closure)

    return Poisoned


@SETTINGS
@given(shapes=shapes, max_dim=max_dim, data=st.data())
def test_pieces_under_poisoned_bases_are_bitwise_the_per_block_path(shapes, max_dim, data):
    options = dict(
        lr=1e-3,
        max_preconditioner_dim=max_dim,
        precondition_frequency=data.draw(st.sampled_from([1, 2, 3])),
        eps=data.draw(st.sampled_from([0.0, 1e-8, 0.1])),
        weight_decay=data.draw(st.sampled_from([0.0, 0.01])),
    )
    share = data.draw(st.sampled_from([0.0, 0.1, 0.3, 0.6, 1.0]))
    _same(
        _run(_per_parameter(KLShampoo), shapes, options, 6),
        _run(_poisoned(share), shapes, options, 6),
    )


class _OneBlockGroups:
    """A kernel whose groups are single blocks: the per-block ops, through any refresher."""

    def __init__(self, kernel) -> None:
        self._kernel = kernel

    def __getattr__(self, name):
        return getattr(self._kernel, name)

    def begin(self, hp, updates):
        work = self._kernel.begin(hp, updates)
        one = {id(g): [g.take([i]) for i in range(len(g))] for g in work.factored + work.groups}
        return work._replace(
            groups=[x for g in work.groups for x in one[id(g)]],
            factored=[x for g in work.factored for x in one[id(g)]],
        )


class _PerBlockKL(KLShampoo):
    """KLShampoo's per-block path (each block's bases read and updated alone)."""

    kernel = _OneBlockGroups(KLShampoo.kernel)


class _Net(torch.nn.Module):
    """``depth`` tanh layers of width ``width`` between an input of ``inputs`` and 4 outputs."""

    def __init__(self, inputs: int, width: int, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        dims = [inputs] + [width] * depth + [4]
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


def _train_window(cls, net: dict, options: dict, config: dict, slots: int, cut: float):
    """Parameters and state after training ``cls`` through a window of ``slots`` slots whose
    device budget leaves ``cut`` of the widest group's bases between the largest block's and
    the widest group's (0: a block's; 1: the whole group) per slot."""
    model = _Net(**net)
    opt = cls(model.parameters(), **options)
    blocks = estimate_blocks(opt)
    largest = max(b.bases for b in blocks)
    groups: dict = {}
    for b in blocks:
        groups[b.group] = groups.get(b.group, 0) + b.bases
    slot = largest + int(cut * (max(groups.values()) - largest))
    budget = sum(b.factors + b.moments for b in blocks) + slots * slot
    gen = torch.Generator().manual_seed(1)
    steps = 10
    xs, ys = (
        torch.randn(steps, 8, net["inputs"], generator=gen),
        torch.randn(steps, 8, 4, generator=gen),
    )
    with pretend_arch(Arch(cuda=True), window_blocks=slots, device_free_bytes=FREE):
        rc = RuntimeConfig(workers=1, device_budget_bytes=budget, placement=HOST, **config)
        with Runtime(model, opt, rc) as rt:
            for t in range(steps):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(xs[t]), ys[t]).backward()
                opt.step()
            report = rt.memory_report()
    assert report["placement"]["bases_access"] == "window"
    assert report["placement"]["window"]["slot_bytes"] == slot
    tensors = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        tensors += _state_tensors(opt.state[p])
    return tensors


def _state_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value.detach().to("cpu").clone()]
    if isinstance(value, dict):
        return [t for k in sorted(value) for t in _state_tensors(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _state_tensors(v)]
    return []


CONFIGS = [
    dict(staleness=0),
    dict(staleness=2, fixed_delay=1),
    dict(staleness=3, fixed_delay=3),
]


#: The space of the window tests through the runtime: the net, blocking, refresh frequency,
#: staleness, slots of the ring and the share of a shape group a slot holds (``_train_window``).
WINDOW_SPACE = dict(
    net=st.fixed_dictionaries(
        dict(
            inputs=st.sampled_from([8, 20, 24]),
            width=st.sampled_from([20, 24, 33]),
            depth=st.integers(2, 4),
        )
    ),
    max_dim=st.sampled_from([16, 24, 64]),
    freq=st.sampled_from([1, 2, 3]),
    config=st.sampled_from(CONFIGS),
    slots=st.sampled_from([1, 2]),
    cut=st.sampled_from([0.0, 0.4, 1.0]),
)


@RUNTIME_SETTINGS
@given(**WINDOW_SPACE)
def test_pieces_through_the_window_are_bitwise_the_per_block_path(
    net, max_dim, freq, config, slots, cut
):
    options = dict(lr=3e-3, precondition_frequency=freq, max_preconditioner_dim=max_dim)
    want = _train_window(_PerBlockKL, net, options, config, slots, cut)
    got = _train_window(KLShampoo, net, options, config, slots, cut)
    _same(got, want)


def _quiet_step_ops(layers: int) -> int:
    """Ops of a quiet step (no refresh due) of KL-Shampoo through the window on ``layers``
    layers of one width."""
    model = _Net(inputs=24, width=24, depth=layers)
    opt = KLShampoo(model.parameters(), lr=1e-3, precondition_frequency=100)
    x = torch.randn(8, 24)
    with pretend_arch(Arch(cuda=True), device_free_bytes=FREE):
        with Runtime(model, opt, RuntimeConfig(workers=1, staleness=0, placement=HOST)):
            for step in range(4):
                opt.zero_grad()
                model(x).square().mean().backward()
                if step < 3:
                    opt.step()
            with _Ops() as counter:
                opt.step()
    return counter.ops


def test_quiet_window_step_ops_do_not_grow_with_the_layers():
    counts = {layers: _quiet_step_ops(layers) for layers in (2, 4, 8)}
    assert len(set(counts.values())) == 1, counts
