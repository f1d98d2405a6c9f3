"""The seam between an optimizer's step and whoever computes its refreshes.

Owns: ``RefreshJob`` (one factor's refresh, described so that it can run here or on the worker
pool), ``Update`` (one parameter's update of a step), the ``Refresher`` protocol the optimizers
call during a step, and ``NativeRefresher``, the synchronous algorithm (a due refresh computed and
installed inside the step). ``asteria.Runtime`` is the other refresher.

Must not: hold any algorithm's math beyond running a job's matrix function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from asteria.optim import matrix_functions as mf
from asteria.optim.blocking import ParamLayout

if TYPE_CHECKING:
    from asteria.optim.base import KroneckerOptimizer

__all__ = ["BlockKey", "NativeRefresher", "RefreshJob", "Refresher", "Update"]

#: A block's identity inside one optimizer: (index of its parameter in the flattened param
#: groups, the order ``state_dict`` uses; index of the block in the parameter's layout).
BlockKey = tuple[int, int]


@dataclass
class RefreshJob:
    """One factor's refresh, described so that it can run here or on Asteria's worker pool.

    ``kind`` is ``"qr"`` (one warm-started power iteration + QR of ``factor @ basis``, columns
    sorted first when ``sort``) or ``"root"`` (``factor^{-1/root}`` with ``epsilon``). The result
    of :meth:`run` is ``(basis, permutation or None)`` for ``"qr"`` and a matrix for ``"root"``.
    """

    kind: str
    factor: torch.Tensor
    basis: torch.Tensor | None = None
    sort: bool = False
    root: float = 0.0
    epsilon: float = 0.0
    dtype: torch.dtype = torch.float32

    def run(self) -> Any:
        if self.kind == "qr":
            return mf.qr_refresh(self.factor, self.basis, sort=self.sort, dtype=self.dtype)
        if self.kind == "root":
            return mf.inverse_root(self.factor, self.root, self.epsilon, dtype=self.dtype)
        raise ValueError(f"unknown refresh kind {self.kind!r}")


class Update(NamedTuple):
    """One parameter's update of a step: ``p`` is what to update in place (the parameter's
    local tensor, or a working copy), ``grad`` its gradient in the state dtype."""

    pid: int
    p: torch.Tensor
    grad: torch.Tensor
    state: dict[str, Any]
    layout: ParamLayout


class Refresher(Protocol):
    """Decides when a block's refresh is computed and installed (see ``NativeRefresher``)."""

    def step_begin(self, opt: KroneckerOptimizer) -> None: ...

    def block_boundary(
        self,
        opt: KroneckerOptimizer,
        key: BlockKey,
        block: dict,
        group: dict,
        step: int,
        due: bool,
    ) -> None: ...

    def step_end(self, opt: KroneckerOptimizer) -> None: ...

    def accumulate(self, opt: KroneckerOptimizer, key: BlockKey, fn: Callable, *args: Any) -> None:
        """Run ``fn(*args)``, the block's statistics update of this step, now or later: nothing
        the step reads afterwards depends on it before ``block_begin``/a refresh of ``key``."""
        ...

    def block_begin(self, opt: KroneckerOptimizer, key: BlockKey, block: dict) -> None:
        """Called before an update reads state that ``accumulate`` writes (KL-Shampoo)."""
        ...

    def bases(self, opt: KroneckerOptimizer, key: BlockKey, block: dict) -> list:
        """The tensors to read as ``block``'s bases (``block[opt.bases_field]``) in the update
        that follows: the block's own, or device copies of them (Note [Bases window] in
        asteria/memory/window.py). Called right before the update's first read, once per block
        and step, in the order the step touches the blocks; what it returns is read by kernels
        issued before the next call (or ``step_end``) only, unless ``bases_stable``."""
        ...

    @property
    def bases_stable(self) -> bool:
        """Whether what ``bases`` returns stays valid until ``step_end`` (so an update may read
        several blocks' bases at once), not only until the next call."""
        ...

    def sync(self, opt: KroneckerOptimizer) -> None:
        """Finish every deferred statistics update (before ``state_dict`` and the like)."""
        ...

    @property
    def splits_updates(self) -> bool:
        """Whether ``beside`` has a thread to run part of the step's update on."""
        ...

    @property
    def lead(self) -> int:
        """How many steps before the step that uses it an optimizer whose update uses the
        refresh of its own step (``refresh_precedes_update``) requests a refresh: 0 in the
        synchronous algorithm (Note [Refresh lead] in asteria/runtime/runtime.py)."""
        ...

    def beside(
        self, opt: KroneckerOptimizer, fn: Callable[..., None], *args: Any
    ) -> Callable[[], None]:
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

    def __init__(self) -> None:
        #: Consecutive failed refreshes per block (blocks absent have none).
        self.failures: dict[BlockKey, int] = {}
        #: Failed refreshes since this refresher was attached.
        self.failed = 0
        self._error: BaseException | None = None

    def step_begin(self, opt: KroneckerOptimizer) -> None:
        pass

    def accumulate(self, opt, key, fn, *args) -> None:
        fn(*args)

    def block_begin(self, opt, key, block) -> None:
        pass

    def bases(self, opt, key, block) -> list:
        return block[opt.bases_field]

    bases_stable = True  # the blocks' own tensors

    def sync(self, opt) -> None:
        pass

    splits_updates = False  # everything in the step's own thread

    lead = 0  # a due refresh is computed in the step that uses it

    def beside(self, opt, fn, *args):
        raise RuntimeError("NativeRefresher runs the whole update in the step's thread")

    def block_boundary(self, opt, key, block, group, step, due) -> None:
        if not due:
            return
        jobs = opt.refresh_jobs(block, group)
        try:
            results = [None if j is None else j.run() for j in jobs]
        except mf.MatrixFunctionError as err:
            self._count_failure(opt, key, step, err)
            return  # Note [Refresh failures]: the previous bases or roots stay
        self.failures.pop(key, None)
        opt.install_refresh(block, results)

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

    def step_end(self, opt: KroneckerOptimizer) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error
