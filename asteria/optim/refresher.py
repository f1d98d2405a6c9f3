"""The seam between an optimizer's step and whoever computes its refreshes.

Owns: the refresh jobs (``RefreshJob``, one factor's refresh; its kinds are types, ``QRRefresh``
and ``RootRefresh``, each knowing how it computes, how it goes to a pool, what its result holds
and its checkpoint form), ``Update`` (a parameter's update of a step), the ``Refresher`` protocol
the step skeleton calls, ``Piece`` (blocks whose bases are handed out together),
``NativeRefresher`` (a due refresh computed and installed in the step), ``run_batched`` (Note
[Batched refreshes]) and ``RefreshFailedError``. ``asteria.Runtime`` is the other refresher; a
refresher is bound to its optimizer, so its methods do not take it.

Must not: hold any algorithm's math beyond running a job's matrix function, or import the
runtime.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import torch

from asteria.optim import groups as grouping
from asteria.optim import matrix_functions as mf
from asteria.optim.blocking import ParamLayout
from asteria.optim.groups import BlockGroup

__all__ = [
    "BlockKey",
    "JOB_KINDS",
    "NativeRefresher",
    "Piece",
    "QRRefresh",
    "RefreshFailedError",
    "RefreshJob",
    "Refresher",
    "RootRefresh",
    "Update",
    "run_batched",
]

#: A block's identity inside one optimizer: (index of its parameter in the flattened param
#: groups, the order ``state_dict`` uses; index of the block in the parameter's layout).
BlockKey = tuple[int, int]


class RefreshFailedError(RuntimeError):
    """A block's refresh failed ``max_consecutive_failures`` times in a row, or crashed."""


class RefreshJob:
    """One factor's refresh (``factor``, and the ``basis`` it starts from where it takes one),
    computed in ``dtype``: here (``run``, or ``compute`` on copies of its inputs) or on Asteria's
    worker pool (``submit``). A job made from a checkpoint's ``options`` has no tensors."""

    #: The kind's name in a checkpoint (``options``; ``JOB_KINDS`` maps it back).
    kind: ClassVar[str]
    factor: torch.Tensor | None
    basis: torch.Tensor | None
    dtype: torch.dtype

    def run(self) -> Any:
        """The refresh of the job's own tensors, computed here."""
        return self.compute(self.factor, self.basis)

    def compute(self, factor: torch.Tensor, basis: torch.Tensor | None) -> Any:
        """The refresh of ``factor`` and ``basis`` (the job's inputs or copies of them), computed
        here (asteria.optim.matrix_functions)."""
        raise NotImplementedError

    def submit(self, pool: Any, sub: Any) -> Any:
        """The refresh on ``pool`` (``asteria._C.WorkerPool``, which copies the inputs at
        submission) of ``sub``'s ``factor`` and ``basis`` (the job's inputs or their snapshot),
        named ``sub.name``, version ``sub.version``, deadline ``sub.deadline``: its future."""
        raise NotImplementedError

    @property
    def permutes(self) -> bool:
        """Whether the result carries a permutation (an int64 vector of the factor's dim)."""
        return False

    def parts(self, result: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``result`` (of ``run`` or the pool) as its matrix and permutation (or None)."""
        return result, None

    def from_parts(self, matrix: torch.Tensor, perm: torch.Tensor | None) -> Any:
        """The result made of ``parts``' two pieces (a result sent between ranks)."""
        return matrix

    def result_bytes(self) -> int:
        """Bytes of the result: the ``d x d`` matrix in ``dtype``, and the permutation."""
        d = int(self.factor.shape[0])
        item = torch.empty((), dtype=self.dtype, device="meta").element_size()
        return d * d * item + (8 * d if self.permutes else 0)

    def input_bytes(self) -> int:
        """Bytes of the job's inputs (its snapshot): the factor, and the basis it starts from."""
        return sum(t.nbytes for t in (self.factor, self.basis) if t is not None)

    def options(self) -> dict[str, Any]:
        """The job's options as plain values (a checkpoint's), ``kind`` first."""
        raise NotImplementedError

    @staticmethod
    def from_options(options: dict[str, Any]) -> RefreshJob:
        """The job (without tensors) of ``options``."""
        o = dict(options)
        return JOB_KINDS[o.pop("kind")].from_plain(o)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class QRRefresh(RefreshJob):
    """One warm-started power iteration + QR of ``factor @ basis``, columns sorted first when
    ``sort``; the result is ``(basis, permutation or None)``."""

    kind: ClassVar[str] = "qr"
    factor: torch.Tensor | None
    basis: torch.Tensor | None
    sort: bool = False
    dtype: torch.dtype = torch.float32

    def compute(self, factor, basis) -> Any:
        return mf.qr_refresh(factor, basis, sort=self.sort, dtype=self.dtype)

    def submit(self, pool, sub):
        return pool.submit_qr_refresh(
            sub.name, sub.version, sub.deadline, sub.factor, sub.basis, self.sort, self.dtype
        )

    @property
    def permutes(self) -> bool:
        return self.sort

    def parts(self, result):
        return result[0], result[1]

    def from_parts(self, matrix, perm):
        return matrix, perm

    def options(self) -> dict[str, Any]:
        # root and epsilon: the keys every format-1 checkpoint has
        return {"kind": self.kind, "sort": self.sort, "root": 0.0, "epsilon": 0.0,
                "dtype": _dtype_name(self.dtype)}  # fmt: skip

    @classmethod
    def from_plain(cls, o: dict[str, Any]) -> QRRefresh:
        return cls(None, None, sort=bool(o["sort"]), dtype=getattr(torch, o["dtype"]))


@dataclass
class RootRefresh(RefreshJob):
    """``factor^{-1/root}`` with ``max(epsilon, rel_epsilon * ||factor||_inf)`` added to its
    eigenvalues (Meta's ``rel_epsilon``: the infinity norm bounds the largest eigenvalue);
    the result is a matrix."""

    kind: ClassVar[str] = "root"
    basis: ClassVar[None] = None  # a root starts from the factor alone
    factor: torch.Tensor | None
    root: float = 0.0
    epsilon: float = 0.0
    dtype: torch.dtype = torch.float32
    rel_epsilon: float = 0.0

    def damping(self, factor: torch.Tensor) -> float:
        """The epsilon added to ``factor``'s eigenvalues: ``epsilon``, or the relative one where
        it is larger. Read from the factor the job computes from (the runtime's snapshot), so
        native and orchestrated roots of the same factor agree bit for bit."""
        if self.rel_epsilon == 0.0:
            return self.epsilon
        return self.damping_of(float(torch.linalg.matrix_norm(factor.double(), ord=float("inf"))))

    def damping_of(self, bound: float) -> float:
        """The epsilon for a factor whose infinity norm (in float64) is ``bound``."""
        return max(self.epsilon, self.rel_epsilon * bound)  # (a NaN bound: the factor's error)

    def compute(self, factor, basis=None) -> Any:
        return mf.inverse_root(factor, self.root, self.damping(factor), dtype=self.dtype)

    def submit(self, pool, sub):
        f = sub.factor
        damping = self.epsilon if self.rel_epsilon == 0.0 else self.damping(f)
        return pool.submit_inverse_root(
            sub.name, sub.version, sub.deadline, f, self.root, damping, self.dtype
        )

    def options(self) -> dict[str, Any]:
        o = {"kind": self.kind, "sort": False, "root": self.root, "epsilon": self.epsilon,
             "dtype": _dtype_name(self.dtype)}  # fmt: skip
        return o | ({"rel_epsilon": self.rel_epsilon} if self.rel_epsilon else {})

    @classmethod
    def from_plain(cls, o: dict[str, Any]) -> RootRefresh:
        return cls(None, root=float(o["root"]), epsilon=float(o["epsilon"]),
                   dtype=getattr(torch, o["dtype"]),
                   rel_epsilon=float(o.get("rel_epsilon", 0.0)))  # fmt: skip


#: Checkpoint names of the job kinds (``RefreshJob.from_options``).
JOB_KINDS: dict[str, Any] = {QRRefresh.kind: QRRefresh, RootRefresh.kind: RootRefresh}


class Update(NamedTuple):
    """One parameter's update of a step: ``p`` is what to update in place (the parameter's
    local tensor, or a working copy), ``grad`` its gradient in the state dtype."""

    pid: int
    p: torch.Tensor
    grad: torch.Tensor
    state: dict[str, Any]
    layout: ParamLayout


class Piece:
    """Shape groups (or runs of one) whose bases a refresher hands out together: ``groups``,
    and ``bases()``, per group and block the tensors to read as the block's bases (its
    ``bases_field``), valid until the next piece's ``bases()`` or the step's end."""

    __slots__ = ("groups", "_read")

    def __init__(self, groups: list[BlockGroup], read: Callable[[Piece], list]) -> None:
        self.groups = groups
        self._read = read

    def bases(self) -> list[list[list[torch.Tensor | None]]]:
        return self._read(self)


class Refresher(Protocol):
    """Who computes an optimizer's refreshes, and hands out its bases (see ``NativeRefresher``;
    docs/architecture.md draws a step through it). Bound to one optimizer."""

    @property
    def optimizer(self) -> Any:
        """The optimizer it is bound to."""
        ...

    @property
    def closed(self) -> bool:
        """Whether it was closed (a closed refresher is attached to nothing again)."""
        ...

    def begin(self) -> None:
        """A step begins, before it changes anything (a runtime raises a failure kept since the
        last step here)."""
        ...

    def accumulate(self, keys: Sequence[BlockKey], fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)``, the step's statistics of blocks ``keys``, now or later on another
        thread: the step reads what it writes only in a later step's ``pieces``, and a refresh
        of one of ``keys`` snapshots the factors only after it."""
        ...

    def plan(self, groups: Sequence[BlockGroup], hp: dict[str, Any]) -> None:
        """Every refresh decision of the blocks of ``groups`` (the factored ones of a parameter
        group ``hp``) at their step, carried out: the installs due, the requests, the due
        requests coalesced into the refresh in flight, the waits."""
        ...

    def pieces(self, groups: list[BlockGroup], passes: int = 1) -> list[Piece]:
        """``groups`` in the pieces whose bases the refresher hands out together, in the order
        the step reads them (``passes`` 2: the pieces in that order, then in reverse)."""
        ...

    def run(self, fn: Callable[..., None], groups: list[BlockGroup], bases: list, *args) -> None:
        """``fn(groups, bases, *args)``, part of the step's update: where a runtime has a thread
        beside this one, as two calls on halves of the blocks, one on each (Note [Split
        updates] in asteria/runtime/lane.py)."""
        ...

    def end(self) -> None:
        """The step ended: raise a refresh failure kept for it (Note [Refresh failures])."""
        ...

    def sync(self) -> None:
        """Finish every deferred statistics update (before ``state_dict`` and the like)."""
        ...

    def state_replaced(self) -> None:
        """The optimizer's state was replaced (``load_state_dict``): forget what was kept for
        the old one (refreshes in flight, failure counts; Note [Transactional loads] in
        state_io.py)."""
        ...

    def state_dict(self) -> dict[str, Any] | None:
        """The refreshes in flight, to save with the optimizer's state (None: none)."""
        ...

    def check_state_dict(self, saved: Any, groups: list[dict], state: dict) -> None:
        """Raise ``ValueError`` where ``load_state_dict(saved)`` after loading ``groups`` and
        ``state`` would be refused (checked before the optimizer's load changes anything)."""
        ...

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Take the refreshes in flight of a checkpoint (after the optimizer's own load)."""
        ...


class NativeRefresher:
    """The synchronous algorithm: a due refresh computed and installed in the step, at its ``plan``
    (after the update for SOAP and KL-Shampoo, before it for Shampoo).

    Note [Refresh failures]: a refresh that fails (``MatrixFunctionError``: failed in its dtype and
    in float64, or not finite) installs nothing: the block keeps all its previous bases or roots,
    and the failure is counted (``failures`` per block, consecutive; ``failed``); a success resets
    the block's count. At ``opt.max_consecutive_failures`` in a row the step still runs to its end
    and ``end`` raises ``RefreshFailedError``: no step is left half-applied. The runtime does the
    same with ``RuntimeConfig.max_consecutive_failures``."""

    closed = False

    def __init__(self, opt: Any) -> None:
        self._opt = weakref.ref(opt)  # the optimizer holds its refresher
        self._field = opt.bases_field
        #: Consecutive failed refreshes per block (blocks absent have none).
        self.failures: dict[BlockKey, int] = {}
        #: Failed refreshes since this refresher was attached.
        self.failed = 0
        self._error: BaseException | None = None

    @property
    def optimizer(self) -> Any:
        return self._opt()

    def begin(self) -> None:
        # a native step computes its own refreshes: a checkpoint's have no one to install
        self._opt()._resumed_refreshes = None

    def accumulate(self, keys, fn, *args) -> None:
        fn(*args)

    def plan(self, groups, hp) -> None:
        opt, due, asked = self._opt(), [], {}
        for g in groups:  # (the schedule asked once per step of the groups)
            now = asked.get(g.step)
            if now is None:
                now = asked[g.step] = opt.refresh_due(g.step, hp)
            if now:
                due.append(g)
        if due:
            self._refresh(opt, due, hp)

    def pieces(self, groups, passes=1) -> list[Piece]:
        return [Piece(groups, self._bases)]

    def _bases(self, piece: Piece) -> list:
        field = self._field
        return [[b[field] for b in g.blocks] for g in piece.groups]

    def run(self, fn, groups, bases, *args) -> None:
        fn(groups, bases, *args)

    def sync(self) -> None:
        pass

    def state_replaced(self) -> None:
        self.failures.clear()
        self._error = None

    def state_dict(self) -> None:
        return None

    def check_state_dict(self, saved, groups, state) -> None:
        pass

    def load_state_dict(self, saved) -> None:
        self._opt()._resumed_refreshes = saved  # for the runtime attached next

    def _refresh(self, opt: Any, due: list[BlockGroup], hp: dict[str, Any]) -> None:
        """The due blocks' refreshes, those of one kind and shape computed together, then
        installed in block order (Note [Batched refreshes])."""
        blocks = [b for g in due for b in g.blocks]
        jobs = [opt.refresh_jobs(b, hp) for b in blocks]
        flat = [j for block_jobs in jobs for j in block_jobs if j is not None]
        precomputed = {id(j): r for j, r in zip(flat, run_batched(flat)) if r is not None}
        keys = grouping.keys_of(due)
        done, installs = [], []
        for key, block, block_jobs in zip(keys, blocks, jobs):
            try:
                results = []
                for j in block_jobs:  # (a loop: no call per block but a job's own run)
                    r = None if j is None else precomputed.get(id(j))
                    results.append(j.run() if r is None and j is not None else r)
            except mf.MatrixFunctionError as err:
                self._count_failure(opt, key, due[0].step, err)
                continue  # Note [Refresh failures]: the previous bases or roots stay
            self.failures.pop(key, None)
            done.append(block)
            installs.append(results)
        opt.install_refresh_many(done, installs)

    def _count_failure(self, opt, key: BlockKey, step: int, err: BaseException) -> None:
        self.failed += 1
        n = self.failures.get(key, 0) + 1
        self.failures[key] = n
        if n >= opt.max_consecutive_failures and self._error is None:
            name = opt.param_names.get(key[0], f"param{key[0]}")
            error = RefreshFailedError(
                f"{type(opt).__name__}: the refresh of block '{name}[{key[1]}]' failed {n} times "
                f"in a row (step {step}); the step was applied with its previous version; "
                f"last error: {err}"
            )
            error.__cause__ = err
            self._error = error

    def end(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error


def run_batched(jobs: Sequence[RefreshJob]) -> list[Any | None]:
    """Each job's result (``job.run()``'s), computed with the jobs of its kind, shape and options
    (Note [Batched refreshes]) in pieces of at most ``groups.BATCH_ELEMENTS`` factor elements; None
    for a job to run alone (alone of its group, or whose batched result failed or is not finite)."""
    groups: dict[Any, list[int]] = {}
    for i, j in enumerate(jobs):
        f = j.factor
        if isinstance(j, QRRefresh):
            key = (QRRefresh, tuple(f.shape), f.dtype, f.device, j.sort, j.dtype)
        elif isinstance(j, RootRefresh):
            key = (RootRefresh, tuple(f.shape), f.dtype, f.device, j.root, j.dtype)
        else:
            continue
        groups.setdefault(key, []).append(i)
    out: list[Any | None] = [None] * len(jobs)
    for idx in groups.values():
        # pieces of at most BATCH_ELEMENTS factor elements: a batch's temporaries (a few
        # copies of its stack) are bounded by that, not by the model
        per = max(1, grouping.BATCH_ELEMENTS // max(jobs[idx[0]].factor.numel(), 1))
        for at in range(0, len(idx), per):
            piece = idx[at : at + per]
            if len(piece) < 2:
                continue
            for i, r in zip(piece, _run_group([jobs[i] for i in piece])):
                out[i] = r
    return out


def _run_group(group: list[Any]) -> list[Any | None]:
    first = group[0]
    factors = [j.factor for j in group]
    if isinstance(first, QRRefresh):
        bases = [j.basis for j in group]
        return mf.qr_refresh_many(factors, bases, sort=first.sort, dtype=first.dtype)
    return mf.inverse_root_many(factors, first.root, _dampings(group), dtype=first.dtype)


def _dampings(group: list[RootRefresh]) -> list[float]:
    """``job.damping(job.factor)`` of each job, the relative ones' norms in one op."""
    rel = [j.rel_epsilon for j in group]
    if rel.count(0.0) == len(rel):
        return [j.epsilon for j in group]
    stacked = torch.stack([j.factor for j in group]).double()
    bounds = torch.linalg.matrix_norm(stacked, ord=float("inf")).tolist()
    return [j.epsilon if j.rel_epsilon == 0.0 else j.damping_of(b) for j, b in zip(group, bounds)]


# Note [Batched refreshes]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# ``NativeRefresher.plan`` computes a parameter group's due refreshes together, where the
# optimizer's ``phases`` put it (``run_batched``: QR refreshes of one shape as one
# ``qr_refresh_many``, on the CPU one operator running the pool's ``qr_refresh`` per factor,
# Note [Refreshes one by one on the CPU] in csrc/core/aligned.cpp; roots of one shape as one
# ``inverse_root_many``, Note [Batched roots] in matrix_functions.py), then installs them in one
# ``install_refresh_many`` (SOAP's per shape group: Note [Batched installs] in soap.py): bitwise
# the per-block path on the CPU. A runtime's pool runs one job a core: its jobs stay per block.
