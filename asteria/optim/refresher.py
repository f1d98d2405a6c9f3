"""The seam between an optimizer's step and whoever computes its refreshes.

Owns: the refresh jobs (``RefreshJob``: one factor's refresh, described so that it can run here
or on the worker pool; its kinds are types, ``QRRefresh`` and ``RootRefresh``, each of which
knows how it runs, how it is submitted to the pool, what its result holds and how it is
written in a checkpoint), ``Update`` (one parameter's update of a step), ``BlockEnd`` (what a
block hands its refresher at the end of its step), the ``Refresher`` protocol the optimizers
call during a step, ``NativeRefresher``, the synchronous algorithm (a due refresh computed
and installed inside the step), and ``run_batched`` (jobs of one kind and shape computed
together: Note [Batched refreshes]). ``asteria.Runtime`` is the other refresher. A refresher
is bound to its optimizer when it is made or attached, so its methods do not take the optimizer.

Must not: hold any algorithm's math beyond running a job's matrix function.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import torch

from asteria.optim import batched
from asteria.optim import matrix_functions as mf
from asteria.optim.blocking import ParamLayout

if TYPE_CHECKING:
    from asteria.optim.base import KroneckerOptimizer

__all__ = [
    "BlockEnd",
    "BlockKey",
    "JOB_KINDS",
    "NativeRefresher",
    "QRRefresh",
    "RefreshJob",
    "Refresher",
    "RootRefresh",
    "Update",
    "run_batched",
]

#: A block's identity inside one optimizer: (index of its parameter in the flattened param
#: groups, the order ``state_dict`` uses; index of the block in the parameter's layout).
BlockKey = tuple[int, int]


class RefreshJob:
    """One factor's refresh (``factor``, and the ``basis`` it starts from where it takes one),
    computed in ``dtype``, described so that it can run here (``run``) or on Asteria's worker
    pool (``submit``). A job without its tensors (``without_tensors``) still describes the
    refresh: what a pending refresh, a sync or a checkpoint keeps."""

    #: The kind's name in a checkpoint (``options``; ``JOB_KINDS`` maps it back).
    kind: ClassVar[str]
    factor: torch.Tensor | None
    basis: torch.Tensor | None
    dtype: torch.dtype

    def run(self) -> Any:
        """The refresh, computed here (asteria.optim.matrix_functions)."""
        raise NotImplementedError

    def submit(
        self,
        pool: Any,
        name: str,
        version: int,
        deadline: int,
        factor: torch.Tensor,
        basis: torch.Tensor | None,
    ) -> Any:
        """The refresh of ``factor`` (and ``basis``) on ``pool`` (``asteria._C.WorkerPool``,
        which copies them at submission): its future."""
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

    def without_tensors(self) -> RefreshJob:
        return replace(self, factor=None, basis=None)

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

    def run(self) -> Any:
        return mf.qr_refresh(self.factor, self.basis, sort=self.sort, dtype=self.dtype)

    def submit(self, pool, name, version, deadline, factor, basis):
        return pool.submit_qr_refresh(name, version, deadline, factor, basis, self.sort, self.dtype)

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

    def run(self) -> Any:
        epsilon = self.damping(self.factor)
        return mf.inverse_root(self.factor, self.root, epsilon, dtype=self.dtype)

    def submit(self, pool, name, version, deadline, factor, basis):
        return pool.submit_inverse_root(
            name, version, deadline, factor, self.root, self.damping(factor), self.dtype
        )

    def without_tensors(self) -> RefreshJob:
        return replace(self, factor=None)

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


class BlockEnd(NamedTuple):
    """What block ``key`` hands its refresher at the end of its step (``KroneckerOptimizer.
    _end_blocks``): its statistics update ``statistics(*args)`` (None: it has none), then its
    boundary at optimizer step ``step``, where a refresh is ``due``."""

    key: BlockKey
    block: dict[str, Any]
    step: int
    due: bool
    statistics: Callable[..., None] | None
    args: tuple


class Refresher(Protocol):
    """Decides when a block's refresh is computed and installed (see ``NativeRefresher``); bound
    to one optimizer (the one it was made for, or attached to)."""

    def step_begin(self) -> None: ...

    def block_boundary(
        self, key: BlockKey, block: dict, group: dict, step: int, due: bool
    ) -> None: ...

    def step_end(self) -> None: ...

    def accumulate(self, key: BlockKey, fn: Callable, *args: Any) -> None:
        """Run ``fn(*args)``, the block's statistics update of this step, now or later: nothing
        the step reads afterwards depends on it before ``block_begin``/a refresh of ``key``."""
        ...

    def block_begin(self, key: BlockKey, block: dict) -> None:
        """Called before an update reads state that ``accumulate`` writes (KL-Shampoo)."""
        ...

    def bases(self, key: BlockKey, block: dict) -> list:
        """The tensors to read as ``block``'s bases (``block[opt.bases_field]``) in the update
        that follows: the block's own, or device copies of them (Note [Bases window] in
        asteria/memory/window.py). Called right before the update's first read, once per block
        and step, in the order the step touches the blocks; what it returns is read by kernels
        issued before the next call (or ``step_end``) only, unless ``bases_stable``."""
        ...

    def bases_many(self, keys: Sequence[BlockKey], blocks: Sequence[dict]) -> list[list]:
        """The bases (SOAP/KL-Shampoo) or roots (Shampoo) of each block, what ``bases(key,
        block)`` returns, valid together until the next ``bases``/``bases_many`` call or
        ``step_end``. A batched update (Note [Batched steps] in batched.py) takes a shape
        group's bases with one call, in pieces of at most ``bases_room`` bytes."""
        ...

    @property
    def bases_room(self) -> int | None:
        """Bytes of bases one ``bases_many`` call can hand out at once; ``None``: unlimited,
        ``0``: one block a call."""
        ...

    @property
    def bases_stable(self) -> bool:
        """Whether what ``bases`` returns stays valid until ``step_end`` (so an update may read
        several blocks' bases at once), not only until the next call."""
        ...

    def sync(self) -> None:
        """Finish every deferred statistics update (before ``state_dict`` and the like)."""
        ...

    def state_replaced(self) -> None:
        """The optimizer's state was replaced (``load_state_dict``): forget what was kept for
        the old one (refreshes in flight, failure counts; Note [Transactional loads] in
        base.py)."""
        ...

    @property
    def splits_updates(self) -> bool:
        """Whether ``beside`` has a thread to run part of the step's update on."""
        ...

    @property
    def lead(self) -> int:
        """How many steps before the step that uses it an optimizer whose update uses the
        refresh of its own step (``refresh_precedes_update``) requests a refresh: 0 in the
        synchronous algorithm (Note [Refresh lead] in asteria/runtime/schedule.py)."""
        ...

    @property
    def first_lead(self) -> int:
        """``lead`` for a block's first refresh (no bases yet): 0 where the step that first uses
        it waits for it (Note [First roots] in asteria/runtime/schedule.py)."""
        ...

    def beside(self, fn: Callable[..., None], *args: Any) -> Callable[[], None]:
        """Start ``fn(*args)``, part of the step's update, on another thread, concurrently with
        the caller, and return the function that waits for it (and raises its error). Only
        called where ``splits_updates``. ``fn`` runs after everything the refresher queued
        before (installs, statistics)."""
        ...


class NativeRefresher:
    """The synchronous algorithm: a due refresh is computed and installed in the step itself.

    Note [Refresh failures]: a refresh that fails (``MatrixFunctionError``: the matrix function
    failed in its dtype and again in float64, or gave a non-finite result) installs nothing: the
    block keeps its previous bases or roots, all of them, and the failure is counted
    (``failures``: consecutive failures per block; ``failed``: all of them). A success resets the
    block's count. When a block reaches ``opt.max_consecutive_failures`` failures in a row, the
    step still runs to its end, every block updated with what it has, and ``step_end`` raises
    ``RefreshFailedError`` (``asteria.runtime``'s): no step is left half-applied. The runtime
    keeps, counts and raises after ``RuntimeConfig.max_consecutive_failures`` the same way.
    """

    def __init__(self, opt: KroneckerOptimizer) -> None:
        self._opt = weakref.ref(opt)  # the optimizer holds its refresher
        self._field = opt.bases_field
        #: Consecutive failed refreshes per block (blocks absent have none).
        self.failures: dict[BlockKey, int] = {}
        #: Failed refreshes since this refresher was attached.
        self.failed = 0
        self._error: BaseException | None = None
        #: Blocks whose refresh is due this step, not yet run: (key, block, group, step).
        self._due: list[tuple] = []

    def step_begin(self) -> None:
        pass

    def accumulate(self, key, fn, *args) -> None:
        fn(*args)

    def block_begin(self, key, block) -> None:
        pass

    def bases(self, key, block) -> list:
        self._run_due()
        return block[self._field]

    def bases_many(self, keys, blocks) -> list[list]:
        self._run_due()
        return [block[self._field] for block in blocks]

    bases_stable = True  # the blocks' own tensors
    bases_room = None

    def sync(self) -> None:
        pass

    def state_replaced(self) -> None:
        self.failures.clear()
        self._error = None
        self._due.clear()

    splits_updates = False  # everything in the step's own thread

    lead = 0  # a due refresh is computed in the step that uses it
    first_lead = 0

    def beside(self, fn, *args):
        raise RuntimeError("NativeRefresher runs the whole update in the step's thread")

    def block_boundary(self, key, block, group, step, due) -> None:
        if due:  # run before anything reads the bases again (Note [Batched refreshes])
            self._due.append((key, block, group, step))

    def _run_due(self) -> None:
        """The due refreshes, those of one kind and shape computed together, then installed
        in block order (Note [Batched refreshes])."""
        if not self._due:
            return
        due, self._due = self._due, []
        opt = self._opt()
        jobs = [opt.refresh_jobs(block, group) for _, block, group, _ in due]
        flat = [j for block_jobs in jobs for j in block_jobs if j is not None]
        precomputed = {id(j): r for j, r in zip(flat, run_batched(flat)) if r is not None}
        blocks, installs = [], []
        for (key, block, _, step), block_jobs in zip(due, jobs):
            try:
                results = [None if j is None else _result(j, precomputed) for j in block_jobs]
            except mf.MatrixFunctionError as err:
                self._count_failure(opt, key, step, err)
                continue  # Note [Refresh failures]: the previous bases or roots stay
            self.failures.pop(key, None)
            blocks.append(block)
            installs.append(results)
        opt.install_refresh_many(blocks, installs)

    def _count_failure(self, opt, key: BlockKey, step: int, err: BaseException) -> None:
        self.failed += 1
        n = self.failures.get(key, 0) + 1
        self.failures[key] = n
        limit = getattr(opt, "max_consecutive_failures", 3)
        if n >= limit and self._error is None:
            from asteria.runtime.registry import RefreshFailedError  # (asteria.runtime imports us)

            name = getattr(opt, "param_names", {}).get(key[0], f"param{key[0]}")
            error = RefreshFailedError(
                f"{type(opt).__name__}: the refresh of block '{name}[{key[1]}]' failed {n} times "
                f"in a row (step {step}); the step was applied with its previous version; "
                f"last error: {err}"
            )
            error.__cause__ = err
            self._error = error

    def step_end(self) -> None:
        self._run_due()
        error, self._error = self._error, None
        if error is not None:
            raise error


def _result(job: RefreshJob, precomputed: dict[int, Any]) -> Any:
    result = precomputed.get(id(job))
    return job.run() if result is None else result


def run_batched(jobs: Sequence[RefreshJob]) -> list[Any | None]:
    """Each job's result (what ``job.run()`` returns), computed together with the jobs of its
    kind, shape and options (Note [Batched refreshes]): ``QRRefresh`` jobs as one
    ``qr_refresh_many``, ``RootRefresh`` jobs as one ``inverse_root_many`` (each with its own
    ``damping``), in pieces of at most ``batched.BATCH_ELEMENTS`` factor elements. ``None``
    for a job to run alone (``job.run()``, which raises its error): alone of its group, or
    whose batched result failed or was not finite."""
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
        numel = jobs[idx[0]].factor.numel()
        limit = batched.BATCH_ELEMENTS
        for piece in batched.pieces(idx, lambda _, n=numel: n, lambda _: 0, None, limit):
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
    if all(j.rel_epsilon == 0.0 for j in group):
        return [j.epsilon for j in group]
    stacked = torch.stack([j.factor for j in group]).double()
    bounds = torch.linalg.matrix_norm(stacked, ord=float("inf")).tolist()
    return [j.epsilon if j.rel_epsilon == 0.0 else j.damping_of(b) for j, b in zip(group, bounds)]


# Note [Batched refreshes]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Natively a due refresh is computed in the step, from the factors the step's statistics
# updated. ``NativeRefresher`` keeps the due blocks of a step and runs them together before the
# bases are read again (the next ``bases``/``bases_many`` call: Shampoo's roots of step t
# precondition step t) or at ``step_end``, whichever comes first: QR refreshes of one shape
# (SOAP, KL-Shampoo) as one ``qr_refresh_many`` (on a GPU one batched power iteration, sort
# and ``geqrf``/``orgqr``; on the CPU one operator that runs the pool's ``qr_refresh`` on each
# factor, unstacked: Note [Refreshes one by one on the CPU] in csrc/core/aligned.cpp),
# Shampoo's roots of one shape and root as one ``inverse_root_many`` (one batched ``eigh``,
# Meta's shifts and the
# round-off floor per matrix: Note [Batched roots] in matrix_functions.py; bitwise each
# ``inverse_root`` on the CPU) (``run_batched``, which a device-stream executor can call on its
# queue as well), then the installs, in one ``install_refresh_many`` (SOAP's per shape group:
# Note [Batched installs] in soap.py; bitwise each block's ``install_refresh`` on the CPU).
# Nothing reads a block's bases, moments or factors between its boundary and that point. A
# runtime's pool runs one job a core: its jobs stay per block.
