"""The optimizers' math over shape groups: one module per algorithm.

Owns: what a step computes, as functions over a step's ``BlockGroup``s (groups.py) and a
parameter group's hyperparameters ``hp``: ``begin`` (the per-parameter work before the seam,
and the step's groups), ``statistics``, and the update in pieces (``whole`` for a piece that is
the whole batch, else ``into`` per piece, ``between`` over the batch, ``back`` per piece again
where ``passes`` is 2, ``after``), then ``end``. The step skeleton (base.py) calls them in the
order the optimizer's ``phases`` declare, with the bases a refresher hands out.

Must not: take a refresher or an optimizer, or say where the bases come from.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from asteria.optim.groups import BlockGroup, build

__all__ = ["Kernel", "Work", "shampoo_beta"]


class Work(NamedTuple):
    """A parameter group's step as ``begin`` makes it: ``groups`` (the blocks the update reads
    bases for), ``factored`` (the blocks with factors: statistics and refreshes), ``updates``
    (the parameters' ``Update``s) and ``extra`` (the kernel's own)."""

    groups: list[BlockGroup]
    factored: list[BlockGroup]
    updates: list[Any]
    extra: Any = None


def shampoo_beta(hp: dict[str, Any]) -> float:
    """The group's factor EMA coefficient: ``shampoo_beta``, or ``betas[1]`` when unset/negative."""
    sb = hp["shampoo_beta"]
    return hp["betas"][1] if sb is None or sb < 0 else sb


class Kernel:
    """A kernel of one's own (docs/extending.md): the defaults of one that reads the bases once
    (``passes`` 1) and updates a piece whole (``whole``, also ``into`` where the bases come in
    several pieces); ``begin`` counts every parameter's step and puts its blocks in shape groups
    with views of the gradient (``"grad"``) and of the parameter (``"weight"``)."""

    passes = 1
    bases_field = "bases"

    def begin(self, hp: dict[str, Any], updates: list[Any]) -> Work:
        for u in updates:
            u.state["step"] += 1
        views = {"grad": [u.grad for u in updates], "weight": [u.p for u in updates]}
        groups = build(updates, views, self.bases_field)
        return Work(groups, [g for g in groups if g.factored], updates)

    def statistics(self, groups: list[BlockGroup], hp: dict[str, Any]) -> None:
        """The factor statistics of the step's factored groups."""

    def whole(self, groups: list[BlockGroup], bases: list, hp: dict[str, Any]) -> None:
        """The update of a piece's groups with their ``bases`` (per group and block)."""
        raise NotImplementedError

    def into(self, groups: list[BlockGroup], bases: list, hp: dict[str, Any]) -> None:
        self.whole(groups, bases, hp)

    def between(self, work: Work, groups: list[BlockGroup], hp: dict[str, Any]) -> None:
        pass

    def end(self, work: Work, hp: dict[str, Any]) -> None:
        pass
