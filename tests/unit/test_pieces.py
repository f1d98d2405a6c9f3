"""Pieces cut on shape group boundaries (Note [Pieces by shape group] in asteria/optim/batched.py).

Invariants of ``batched.group_pieces`` over groups, element counts, bases bytes, element limits
and bases rooms drawn by hypothesis:
  * the pieces hold every item once, no piece is empty, and within a piece the groups and each
    group's items keep the order given (the pieces of a group too);
  * a piece of more than one item is within the element limit and the bases room;
  * a group that fits a piece (its elements within the limit, its bytes within the room) lies
    in one piece;
  * a group cut across pieces opens each of its pieces where its next item would overflow the
    one before (as ``pieces`` cuts items);
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

from asteria.optim import SOAP, KLShampoo, Shampoo, batched
from asteria.optim.refresher import NativeRefresher

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# an item: (group id, elements, bytes); a group: items of one id
item_sizes = st.tuples(st.integers(0, 40), st.integers(0, 40))
groups_of_sizes = st.lists(st.lists(item_sizes, min_size=1, max_size=6), max_size=8)


def _groups(sizes: list[list[tuple[int, int]]]) -> list[list[tuple[int, int, int, int]]]:
    """Items ``(group, index, elements, bytes)``, unique per position."""
    return [[(g, i, n, b) for i, (n, b) in enumerate(group)] for g, group in enumerate(sizes)]


def _elements(item) -> int:
    return item[2]


def _bytes(item) -> int:
    return item[3]


def _fits(items, limit: int, room: int | None) -> bool:
    return sum(map(_elements, items)) <= limit and (room is None or sum(map(_bytes, items)) <= room)


@SETTINGS
@given(
    sizes=groups_of_sizes,
    limit=st.integers(0, 120),
    room=st.one_of(st.none(), st.integers(0, 120)),
)
def test_pieces_keep_every_group_that_fits_whole_and_within_limits(sizes, limit, room):
    groups = _groups(sizes)
    got = batched.group_pieces(groups, _elements, _bytes, room, limit)
    assert sorted(x for piece in got for x in piece) == sorted(x for g in groups for x in g)
    where = {x: p for p, piece in enumerate(got) for x in piece}
    assert len(where) == sum(map(len, groups))  # each item once
    for piece in got:
        assert piece and piece == sorted(piece)  # (group, index): the order given
        if len(piece) > 1:
            assert _fits(piece, limit, room)
    cut = set()
    for group in groups:
        spans = sorted({where[x] for x in group})
        assert [where[x] for x in group] == sorted(where[x] for x in group)
        if _fits(group, limit, room):
            assert len(spans) == 1, (group, got)
            continue
        cut.update(group)
        for a, b in zip(spans, spans[1:]):  # each run opened by the item that overflowed
            head = min(x for x in got[b] if x in group)
            run = [x for x in got[a] if x in group]
            assert not _fits(run + [head], limit, room)
    for j, piece in enumerate(got):
        if not cut.intersection(piece):
            for before in got[:j]:
                assert not _fits(before + piece, limit, room), (before, piece)
    if groups and _fits([x for g in groups for x in g], limit, room):
        assert got == [[x for g in groups for x in g]]


@SETTINGS
@given(
    sizes=st.lists(item_sizes, max_size=12),
    limit=st.integers(0, 120),
    room=st.one_of(st.none(), st.integers(0, 120)),
)
def test_pieces_cut_items_in_order_where_the_next_would_overflow(sizes, limit, room):
    items = [(i, i, n, b) for i, (n, b) in enumerate(sizes)]
    got = batched.pieces(items, _elements, _bytes, room, limit)
    assert [x for piece in got for x in piece] == items
    for piece in got:
        assert piece and (len(piece) == 1 or _fits(piece, limit, room))
    for a, b in zip(got, got[1:]):
        assert not _fits(a + [b[0]], limit, room)


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
        self.bases_room = room


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
        opt._refresher = _Roomy(opt, _largest_group_bytes(opt))
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
