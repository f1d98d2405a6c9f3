"""Pieces cut on shape group boundaries (Note [Pieces by shape group] in asteria/optim/groups.py).

Invariants of ``groups.pack`` over shape groups (blocks, elements a block, bytes a block),
element limits and bases rooms drawn by hypothesis:
  * the pieces hold every block once, no piece is empty, and within a piece the groups and each
    group's blocks keep the order given (the runs of a group cut across pieces too);
  * a piece of more than one block is within the element limit and the bases room;
  * a group that fits a piece (its elements within the limit, its bytes within the room) lies
    in one piece;
  * a group cut across pieces opens each of its runs where its next block would overflow the
    one before;
  * no piece of whole groups fits together with a piece before it (first fit: it would have
    been placed there), so whole groups never take more pieces than they must pairwise;
  * where everything fits one piece, the one piece is the groups in their order.
And the optimizers' batched steps keep a shape group that fits in one piece: the stacks and
products of an ordinary SOAP, KL-Shampoo and Shampoo step under a refresher whose bases room
holds the largest group are those of one piece for the step.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.optim.groups import BATCH_ELEMENTS, BlockGroup, pack
from asteria.optim.refresher import NativeRefresher, Piece

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# a group: (blocks, elements a block, bytes a block)
group_sizes = st.tuples(st.integers(1, 6), st.integers(0, 40), st.integers(0, 40))


def _groups(sizes) -> list[BlockGroup]:
    """Fake groups whose keys are ``(group, block)`` and whose bytes a block are kept in
    ``scale``."""
    out = []
    for g, (n, numel, nbytes) in enumerate(sizes):
        group = BlockGroup(g, [(g, i) for i in range(n)], [{}] * n, 0, {}, numel, True)
        group.scale = nbytes
        out.append(group)
    return out


def _nbytes(g: BlockGroup) -> int:
    return g.scale * len(g)


def _fits(blocks: list[tuple], sizes, limit: int, room: int | None) -> bool:
    elements = sum(sizes[g][1] for g, _ in blocks)
    nbytes = sum(sizes[g][2] for g, _ in blocks)
    return elements <= limit and (room is None or nbytes <= room)


@SETTINGS
@given(
    sizes=st.lists(group_sizes, max_size=8),
    limit=st.integers(0, 120),
    room=st.one_of(st.none(), st.integers(0, 120)),
)
def test_pieces_keep_every_group_that_fits_whole_and_within_limits(sizes, limit, room):
    groups = _groups(sizes)
    got = [[k for g in piece for k in g.keys] for piece in pack(groups, room, limit, _nbytes)]
    every = [k for g in groups for k in g.keys]
    assert sorted(k for piece in got for k in piece) == sorted(every)
    where = {k: p for p, piece in enumerate(got) for k in piece}
    assert len(where) == len(every)  # each block once
    for piece in got:
        assert piece and piece == sorted(piece)  # (group, block): the order given
        if len(piece) > 1:
            assert _fits(piece, sizes, limit, room)
    cut = set()
    for group in groups:
        keys = group.keys
        spans = sorted({where[k] for k in keys})
        assert [where[k] for k in keys] == sorted(where[k] for k in keys)
        if _fits(keys, sizes, limit, room):
            assert len(spans) == 1, (keys, got)
            continue
        cut.update(keys)
        for a, b in zip(spans, spans[1:]):  # each run opened by the block that overflowed
            head = min(k for k in got[b] if k in keys)
            run = [k for k in got[a] if k in keys]
            assert not _fits(run + [head], sizes, limit, room)
    for j, piece in enumerate(got):
        if not cut.intersection(piece):
            for before in got[:j]:
                assert not _fits(before + piece, sizes, limit, room), (before, piece)
    if groups and _fits(every, sizes, limit, room):
        assert got == [every]


#: The ops that stack blocks or multiply them: what a shape group cut across two pieces repeats
#: (its stacks and ``bmm``s) or runs per block (``mm``: a cut-off block alone).
PRODUCTS = ("stack", "bmm", "mm")


class _Products(TorchDispatchMode):
    """The ``PRODUCTS`` ops dispatched, per name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in PRODUCTS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class _Roomy(NativeRefresher):
    """Native refreshes with a bases room of ``room`` bytes (pieces cut at it)."""

    def __init__(self, opt, room: int) -> None:
        super().__init__(opt)
        self.room = room

    def pieces(self, groups, passes=1):
        field = self._field

        def nbytes(g):
            return sum(q.nbytes for b in g.blocks for q in b[field] if q is not None)

        cut = pack(groups, self.room, BATCH_ELEMENTS, nbytes)
        return [Piece(piece, self._bases) for piece in cut]


def _largest_group_bytes(opt) -> int:
    """The bytes of the bases (roots) of the largest group of blocks of one shape."""
    groups: Counter = Counter()
    for _, p, block, _ in opt.blocks():
        groups[tuple(p.shape)] += sum(q.nbytes for q in block[opt.bases_field] if q is not None)
    return max(groups.values())


def _ordinary_step_products(cls, roomy: bool) -> Counter:
    """The products of an ordinary step of ``cls`` on two shape groups of three blocks each,
    interleaved in the parameters' order, under a bases room of the largest group's bytes
    (``roomy``) or none."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(24, 24), (48, 24)] * 3
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = cls(params, lr=1e-3, precondition_frequency=2)  # refreshes at step 2: roots too
    for step in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if step < 2:
            opt.step()
    if roomy:
        opt._native = opt._refresher = _Roomy(opt, _largest_group_bytes(opt))
    with _Products() as counter:
        opt.step()
    return counter.ops


@pytest.mark.parametrize("cls", [SOAP, KLShampoo, Shampoo])
def test_a_room_of_the_largest_group_cuts_no_group(cls):
    """A room of the largest shape group's bases (roots) holds either group but not both: each
    group in a piece of its own, never cut, so the step's stacks and products are those of one
    piece for the step (greedy packing cut SOAP's and KL-Shampoo's second group across two
    pieces: one of its blocks ran alone, with ``mm``s)."""
    assert _ordinary_step_products(cls, True) == _ordinary_step_products(cls, False)
