"""The base of Asteria's Kronecker-factored optimizers: their arguments and their one step.

Owns: what SOAP, KL-Shampoo and Shampoo share: the familiar arguments' validation, the step
skeleton (closure, parameters without gradients, fp32 state for low-precision parameters,
DTensors through their local shards: Note [Local shards] in tensors.py; then per parameter group
the optimizer's ``phases`` over its kernel, with the refresher: Note [One step]), per-parameter
layouts (``blocking.py``) and the attach point of a refresher. The step's checks are in
overflow.py, the state_dict and pickling in state_io.py.

Must not: hold any algorithm's math (the kernels and each subclass's file do) or know the
runtime. Subclasses say ``kernel``, ``phases``, ``_layout``, ``_state_template``,
``_init_param``, ``refresh_jobs`` and ``install_refresh``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import torch
from torch.optim import Optimizer

from asteria import _compat
from asteria.optim import groups as grouping
from asteria.optim.blocking import ParamLayout, warn_over_budget, without_factors
from asteria.optim.checks import check_lr, check_range, drop_duplicates, param_list
from asteria.optim.matrix_functions import MatrixFunctionError
from asteria.optim.overflow import GradientChecks
from asteria.optim.refresher import BlockKey, NativeRefresher, Refresher, RefreshJob, Update
from asteria.optim.state_format import state_init_probe
from asteria.optim.state_io import StateIO, blocks_of
from asteria.optim.tensors import (
    _ALIGNMENT,
    AUTOCAST_DEVICES,
    PLACEHOLDER_STEP,
    _is_placeholder,
    _promoted,
    local_tensor,
    no_autocast,
)

__all__ = ["KroneckerOptimizer", "ParamsT"]

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]

_new = tuple.__new__  # an ``Update`` without a Python call (Note [One step])


class KroneckerOptimizer(GradientChecks, StateIO, Optimizer):
    """Shared skeleton of the Kronecker-factored optimizers (see module docstring)."""

    #: The optimizer's math over shape groups (a module of asteria/optim/kernels/).
    kernel: ModuleType
    #: The order of a step's phases (Note [One step]): ``"statistics"`` (the factor statistics,
    #: through ``Refresher.accumulate``), ``"plan"`` (the refresh decisions, ``Refresher.plan``),
    #: ``"update"`` (the update in the refresher's pieces) or ``"update_statistics"`` (the
    #: update with each piece's statistics, which read its bases).
    phases: tuple[str, ...] = ("update", "statistics", "plan")
    #: Group options a subclass added after its first version: a loaded group without one takes
    #: the optimizer's default (a state_dict saved before it existed); every other option
    #: missing is refused (Note [Transactional loads]).
    options_added_later: tuple[str, ...] = ()
    #: The block-state field that holds the refresh results in use (bases or inverse roots).
    bases_field = "bases"
    #: Whether ``install_refresh`` reads the block's current bases (SOAP rotates its first
    #: moment by ``Q_old^T Q_new``); a runtime then hands it device copies of them.
    install_reads_bases = True
    #: Whether a block may carry factors on some dims and none on others (SOAP, the authors'
    #: rule); else a dim over the factor budget leaves the whole parameter without factors
    #: (Note [Factor budget] in blocking.py).
    factors_some_dims = False

    def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
        check_lr(defaults["lr"])  # first, as torch.optim does (Note [torch.optim conventions])
        params = param_list(type(self).__name__, params)
        #: per parameter (by identity): (layout key, layout), and a step's quicker key
        self._layouts: dict[int, tuple] = {}
        self._native = NativeRefresher(self)
        self._refresher: Refresher = self._native
        #: A block whose refresh fails this many times in a row raises ``RefreshFailedError`` at
        #: the end of the step (Note [Refresh failures] in refresher.py); ``RuntimeConfig`` has
        #: the runtime's own.
        self.max_consecutive_failures = 3
        #: Skip (and count) parameters whose gradient has NaN/Inf (Note [Non-finite gradients]).
        self.skip_nonfinite_grads = True
        #: How many (parameter, step) updates were skipped for a non-finite gradient.
        self.nonfinite_grads = 0
        #: Optional names of parameters by flattened index, used in messages (the runtime fills
        #: it from the model's ``named_parameters``); unnamed ones are ``param<index>``.
        self.param_names: dict[int, str] = {}
        self._nonfinite_warned = False
        self._overflow_warned = False
        self._budget_warned = False  # Note [Factor budget] in blocking.py
        #: Note [Refused steps] in overflow.py: per group (by identity) its options as last
        #: checked, and per parameter with state the keys its state was made for.
        self._checked_options: dict[int, tuple] = {}
        self._state_keys: dict[int, tuple] = {}
        #: Per parameter (by identity), an upper bound on the largest entry of the statistics
        #: it sums rather than averages, and (under ``("limit", id)``) the static part of its
        #: gradient limit (Note [Overflowing gradients]); filled when first needed.
        self._summed_bounds: dict[Any, Any] = {}
        #: A runtime's refreshes in flight from a loaded checkpoint, kept for the runtime that
        #: attaches next (Note [Runtime state in the optimizer's checkpoint]).
        self._resumed_refreshes: dict[str, Any] | None = None
        super().__init__(params, defaults)

    # -- who computes refreshes ------------------------------------------------------------------

    @property
    def refresher(self) -> Refresher:
        return self._refresher

    @property
    def refresh_precedes_update(self) -> bool:
        """Whether a step's refreshes are decided before its update reads the bases (Shampoo:
        the roots of step ``t`` precondition step ``t``), not after it (SOAP, KL-Shampoo: from
        step ``t + 1``). A refresh a runtime installs between two steps is then one step
        staler than one installed there for the others (Note [Staleness bound])."""
        phases = self.phases
        return phases.index("plan") < next(i for i, p in enumerate(phases) if "update" in p)

    def attach_refresher(self, refresher: Refresher) -> None:
        """Hand refreshes to ``refresher`` (Asteria's runtime); one at a time. Refreshes in
        flight that a ``load_state_dict`` brought along are handed to it (Note [Runtime state
        in the optimizer's checkpoint])."""
        if self._refresher is not self._native:
            raise ValueError(
                f"{type(self).__name__} is already orchestrated by {self._refresher!r}; "
                "close() that runtime before attaching another"
            )
        bound = refresher.optimizer
        if bound is not self:
            raise ValueError(
                f"{refresher!r} is bound to another optimizer ({type(bound).__name__} at "
                f"{id(bound):#x}); a refresher orchestrates the optimizer it was made for"
            )
        if refresher.closed:
            raise ValueError(f"{refresher!r} is closed; make a new one")
        resumed, self._resumed_refreshes = self._resumed_refreshes, None
        if resumed is not None:
            refresher.load_state_dict(resumed)  # raises before anything is attached
        self._refresher = refresher

    def detach_refresher(self) -> None:
        """Back to native mode: refreshes are computed in the step again."""
        self._native = NativeRefresher(self)
        self._refresher = self._native

    @property
    def orchestrated(self) -> bool:
        """Whether a refresher other than the native one is attached."""
        return self._refresher is not self._native

    def refresh_jobs(self, block: dict[str, Any], group: dict[str, Any]) -> list[RefreshJob | None]:
        """The refresh of every dim of ``block`` (``None`` where a dim has no factor)."""
        raise NotImplementedError

    def install_refresh(self, block: dict[str, Any], results: list[Any]) -> None:
        """Install the results of ``refresh_jobs(block, ...)``, carrying state over exactly."""
        raise NotImplementedError

    def install_refresh_many(self, blocks: list[dict[str, Any]], results: list[list]) -> None:
        """``install_refresh(blocks[i], results[i])`` of each block (an optimizer whose install
        computes may issue it per shape group: SOAP's Note [Batched installs])."""
        for block, result in zip(blocks, results):
            self.install_refresh(block, result)

    def refresh_due(self, step: int, group: dict[str, Any]) -> bool:
        """Whether the optimizer's own schedule refreshes a block at ``step``: every
        ``precondition_frequency`` steps (t > 0)."""
        return step > 0 and step % group["precondition_frequency"] == 0

    def refresh_urgent(self, block: dict[str, Any], step: int, group: dict[str, Any]) -> bool:
        """Whether ``block``'s refresh requested at ``step`` costs the most quality when late, so
        that a runtime waits for it at that step, as natively (Notes [Rank-deficient factors],
        [Young factors] in asteria/runtime/schedule.py); ``False``: any refresh may take the budget.
        It must depend only on the block's shapes, the group's hyperparameters and the refresh due
        at or after ``step``: the same over an interval and for a shape group, and once ``False``,
        ``False`` at every later step (a runtime asks it until then, once per shape group and
        interval)."""
        return False

    def install_cost(self, block: dict[str, Any]) -> float:
        """About how many flops ``install_refresh(block, ...)`` computes on the training's
        critical path; ``0`` where an install is a pointer swap. A runtime spreads costly
        installs over the steps its staleness budget allows (Note [Paced installs] in
        asteria/runtime/schedule.py)."""
        return 0.0

    def blocks(self) -> Iterable[tuple[BlockKey, torch.Tensor, dict[str, Any], dict[str, Any]]]:
        """Every initialised preconditioned block: ``(key, parameter, block state, group)``."""
        return blocks_of(self.param_groups, self.state)

    # -- torch.optim conventions ---------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its hyperparameters (given or inherited) are validated first. Its
        ``params`` are tensors or ``(name, tensor)`` pairs (``model.named_parameters()``), all
        of one kind: names go to the group's ``param_names``, as in ``torch.optim``, and to
        ``self.param_names`` for messages."""
        name = type(self).__name__
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise ValueError(f"a parameter group of {name} must be a dict with a 'params' key")
        ps = param_group["params"]
        _compat.check_params_not_a_set(name, ps, in_group=True)
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)  # a generator is read once
        for p in ps:
            named = isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
            if not isinstance(p[1] if named else p, torch.Tensor):
                raise TypeError(
                    f"params of {name} must be tensors or (name, tensor) pairs, "
                    f"got {type(p).__name__}"
                )
        super().add_param_group({**param_group, "params": ps})  # warns of duplicates
        drop_duplicates(self.param_groups[-1])
        try:
            self._check_group(self.param_groups[-1])
        except Exception:
            self.param_groups.pop()  # a refused group is not added
            raise
        first = sum(len(g["params"]) for g in self.param_groups[:-1])
        for i, param_name in enumerate(self.param_groups[-1].get("param_names", ()), first):
            self.param_names.setdefault(i, param_name)

    def _check_group(self, group: dict[str, Any]) -> None:
        name = type(self).__name__
        self._validate_group(group)
        for p in group["params"]:
            if p.layout != torch.strided:
                raise RuntimeError(
                    f"{name} does not support sparse parameters (got layout {p.layout})"
                )
            if p.is_complex():
                raise RuntimeError(
                    f"{type(self).__name__} does not support complex parameters "
                    f"(got one of shape {tuple(p.shape)})"
                )
            if not p.is_floating_point():
                raise RuntimeError(
                    f"{type(self).__name__} needs floating-point parameters, got {p.dtype}"
                )

    def _validate_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        if "eps" in group:  # Shampoo has Meta's grafting_epsilon instead
            check_range("eps", group["eps"], 0.0)
        check_range("weight_decay", group["weight_decay"], 0.0)
        check_range("precondition_frequency", group["precondition_frequency"], 1, integer=True)
        check_range("max_preconditioner_dim", group["max_preconditioner_dim"], 1, integer=True)
        if group["refresh_dtype"] not in (torch.float32, torch.float64):
            raise ValueError(
                "refresh_dtype must be torch.float32 or torch.float64, "
                f"got {group['refresh_dtype']}"
            )

    @torch.compiler.disable  # as torch.optim's own (Note [torch.compile])
    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim``'s ``zero_grad``; zeroing in place first lets deferred statistics
        updates, which read this step's gradients, finish."""
        if not set_to_none:
            self._refresher.sync()
        super().zero_grad(set_to_none=set_to_none)

    def state_template(
        self, p: torch.Tensor, group: dict[str, Any], device: torch.device | str | None = None
    ) -> dict[str, Any]:
        """The state ``p`` takes once initialised, less ``"step"``, in zeros on ``device``
        (default: its local shard's; ``"meta"`` allocates nothing): every key, shape, dtype and
        layout (``_state_template``). ``asteria.memory.accounting`` sizes state from it."""
        local = local_tensor(p)
        like = local if device is None else torch.empty_like(local, device=device)
        return self._state_template(like, group, self.layout(p, group))

    def _placeholder(
        self, p: torch.Tensor, group: dict[str, Any], device: torch.device | None = None
    ) -> dict[str, Any]:
        """A placeholder state of ``p`` (Note [State-initialisation probe]): the structure of
        its state once initialised, in zeros, on ``device`` (default: its local shard's)."""
        return {"step": PLACEHOLDER_STEP, **self.state_template(p, group, device)}

    # -- the step skeleton ---------------------------------------------------------------------

    @torch.compiler.disable  # runs eagerly inside a compiled function (Note [torch.compile])
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for device_type in AUTOCAST_DEVICES:  # Note [Autocast]: the closure alone runs under
            if torch.is_autocast_enabled(device_type):  # the caller's autocast
                with no_autocast():
                    return self._step(loss)
        return self._step(loss)

    def _step(self, loss: float | None) -> float | None:
        todo: list[tuple[int, dict[str, Any], torch.Tensor]] = []
        pid = -1
        for group in self.param_groups:
            for p in group["params"]:
                pid += 1
                g = p.grad
                if g is None or p.numel() == 0:
                    continue
                if g.is_sparse or g.is_complex():
                    self._check_grad_kind(g)
                todo.append((pid, group, p))
        # the states by parameter identity: a tensor's ``__hash__`` is a Python call, once per
        # parameter and lookup (no call per parameter: Note [Batched steps] in groups.py);
        # whether some parameter has state (placeholders and other entries do not count)
        by_id, has_state = {}, False
        for k, s in self.state.items():
            by_id[id(k)] = s
            if not has_state and isinstance(k, torch.Tensor) and s:
                has_state = s.get("step") != PLACEHOLDER_STEP
        options = self._check_before_step(todo, by_id)  # Note [Refused steps] in overflow.py
        if todo and not has_state and state_init_probe(self.param_groups, todo):
            for _, group, p in todo:
                if local_tensor(p).numel():
                    self.state[p] = self._placeholder(p, group)
            return loss
        if self.skip_nonfinite_grads:  # Notes [Non-finite gradients], [Overflowing gradients]
            verdicts, norms = self._gradient_verdicts(todo)
        else:
            verdicts, norms = [None] * len(todo), [0.0] * len(todo)
        self._refresher.begin()
        # Note [Working copies]: the update runs on a contiguous tensor in the state dtype, the
        # parameter itself when it is one, else a working copy written back after its update. A
        # copy in the parameter's own dtype (a transposed or strided view, channels-last) joins
        # the group's batch, so the parameter takes exactly the path of its contiguous twin; one
        # in another dtype (fp32 math for bf16/fp16 parameters, one rounding per step) runs
        # alone, so that only one such copy is alive at a time.
        batch: list[Update] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, copy) in the batch
        batch_group: dict[str, Any] | None = None
        layouts, states = self._layouts, self.state
        for (pid, group, p), verdict, norm in zip(todo, verdicts, norms):
            if verdict is not None:
                self._skip_nonfinite(pid, p, verdict, norm)
                continue
            # Note [Local shards]: a DTensor parameter (FSDP2 / HSDP) is optimized through its
            # local shard (plain tensors are their own); an empty shard has nothing to do.
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.numel() == 0:
                continue
            if group is not batch_group:
                self._flush_updates(batch_group, batch, copies)
                batch_group = group
            grad = p.grad
            sharded = hasattr(grad, "to_local")
            if sharded:
                grad = grad.to_local()
            dtype = _promoted(p.dtype)  # state_dtype(p)
            if grad.dtype != dtype or not grad.is_contiguous():
                # (``Tensor.to`` returns a non-contiguous gradient itself when the dtype
                # matches; its products would then be computed in another order than a copy's)
                grad = torch.empty(grad.shape, dtype=dtype, device=grad.device).copy_(grad)
            elif sharded and grad.data_ptr() % _ALIGNMENT:
                # FSDP2's gradient shards are views at arbitrary offsets of its reduce buffer,
                # and vectorized kernels may round differently on unaligned data: an aligned
                # copy keeps the arithmetic that of a fresh gradient (Note [Local shards]).
                grad = grad.clone()
            state = by_id.get(id(p))
            if state is None:
                state = states[p]  # (a new parameter's: made here)
            cached = layouts.get(id(p))
            quick = (local.shape, options[id(group)])
            layout = cached[2] if cached is not None and cached[1] == quick else None
            if layout is None:
                layout = self._layout_of(p, group, quick)
            work = local
            if local.dtype != grad.dtype or not local.is_contiguous():
                # (``Tensor.to`` returns a non-contiguous tensor itself when the dtype matches)
                work = torch.empty(local.shape, dtype=grad.dtype, device=local.device)
                work.copy_(local)
            if not state or state.get("step") == PLACEHOLDER_STEP:
                state.clear()
                if not self._first_step(pid, work, grad, group, state, layout):
                    if work is not local:
                        local.copy_(work)
                    continue
            update = _new(Update, (pid, work, grad, state, layout))
            if work is local or work.dtype == local.dtype:
                batch.append(update)
                if work is not local:
                    copies.append((local, work))
                continue
            self._flush_updates(group, [update], [(local, work)])
        self._flush_updates(batch_group, batch, copies)
        self._refresher.end()
        return loss

    def _run_group(self, hp: dict[str, Any], updates: list[Update]) -> None:
        """Note [One step]: one parameter group's updates, the kernel's phases in the order the
        optimizer declares, with the refresher."""
        k, r = self.kernel, self._refresher
        work = k.begin(hp, updates)
        for phase in self.phases:
            if phase == "statistics":
                if work.factored:
                    r.accumulate(grouping.keys_of(work.factored), k.statistics, work.factored, hp)
            elif phase == "plan":
                if work.factored:
                    r.plan(work.factored, hp)
            else:
                self._update(work, hp, phase == "update_statistics")
        k.end(work, hp)

    def _update(self, work: Any, hp: dict[str, Any], with_statistics: bool) -> None:
        """The update of ``work``'s groups a batch at a time (``groups.batches``) in the refresher's
        pieces: a batch of one piece in one call (``kernel.whole``, maybe split across threads),
        else each piece ``into``, the batch ``between``, and for a kernel that reads the bases twice
        each piece ``back`` in reverse and the batch ``after`` (Note [Two passes] in
        kernels/soap.py)."""
        k, r = self.kernel, self._refresher
        for batch in grouping.batches(work.groups):
            pieces = r.pieces(batch, k.passes)
            if len(pieces) == 1 and k.whole is not None:
                piece = pieces[0]
                bases = piece.bases()
                r.run(k.whole, piece.groups, bases, hp)
                if with_statistics:
                    keys = grouping.keys_of(piece.groups)
                    r.accumulate(keys, k.statistics, piece.groups, bases, hp)
                continue
            done = []
            for piece in pieces:
                bases = piece.bases()
                k.into(piece.groups, bases, hp)
                if with_statistics:
                    keys = grouping.keys_of(piece.groups)
                    r.accumulate(keys, k.statistics, piece.groups, bases, hp)
                done.extend(piece.groups)
            k.between(work, done, hp)
            if k.passes == 2:
                for piece in reversed(pieces):
                    k.back(piece.groups, piece.bases(), hp)
                k.after(work, done, hp)

    def _first_step(self, pid, p, grad, group, state, layout) -> bool:
        """``_init_param`` (whether the parameter also steps now); a matrix function that fails
        there (the first eigenbases) names the parameter (Note [Overflowing gradients]: a step's
        own gradients cannot make it fail)."""
        try:
            steps = self._init_param(pid, p, grad, group, state, layout)
            self._state_keys.pop(id(p), None)
        except MatrixFunctionError as err:
            state.clear()  # the parameter stays without state: its next step starts again
            name = self.param_names.get(pid, f"param{pid}")
            raise MatrixFunctionError(
                f"{type(self).__name__}: the first eigenbases of parameter '{name}' (index "
                f"{pid}, shape {tuple(p.shape)}) failed: {err}"
            ) from err
        return bool(steps)

    def _flush_updates(
        self,
        group: dict[str, Any] | None,
        batch: list[Update],
        copies: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """The batch's updates, then its working copies written back to their parameters
        (also when the update raised: what it applied reaches the parameter, as an in-place
        update's would)."""
        try:
            if batch:
                self._run_group(group, batch)
        finally:
            batch.clear()
            for local, work in copies:
                local.copy_(work)
            copies.clear()

    def layout(self, p: torch.Tensor, group: dict[str, Any]) -> ParamLayout:
        """The (cached) block layout of ``p`` under ``group``'s options: that of its local shard
        when ``p`` is a DTensor (Note [Local shards])."""
        return self._layout_of(p, group, None)

    def _layout_of(self, p: torch.Tensor, group: dict[str, Any], quick: Any) -> ParamLayout:
        local = local_tensor(p)
        key = self._layout_key(local, group)
        cached = self._layouts.get(id(p))
        if cached is None or cached[0] != key:
            layout = self._layout(local, group)
            if layout.over_budget and not self.factors_some_dims:
                layout = without_factors(layout)  # Note [Factor budget] in blocking.py
            cached = (key, quick, layout)
            if layout.over_budget and not self._budget_warned:
                self._budget_warned = True  # Note [Factor budget] in blocking.py: once
                flat = [q for g in self.param_groups for q in g["params"]]
                pid = next((i for i, q in enumerate(flat) if q is p), None)
                name = "?" if pid is None else self.param_names.get(pid, f"param{pid}")
                opt_name, some = type(self).__name__, self.factors_some_dims
                warn_over_budget(opt_name, name, local, layout, group, some)
        self._layouts[id(p)] = (key, quick, cached[2])
        return cached[2]

    def _layout_key(self, p: torch.Tensor, group: dict[str, Any]) -> tuple:
        return (tuple(p.shape), group["max_preconditioner_dim"])

    def is_refresh_step(self) -> bool:
        """Whether the next ``step()`` computes a preconditioner refresh for some block.

        Parameters without state yet (their first step initialises their factors with an
        eigendecomposition) count as refreshing.
        """
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state or _is_placeholder(state):
                    if p.requires_grad:
                        return True
                    continue
                factored = any(f is not None for b in state.get("blocks", ()) for f in b["factors"])
                if factored and self.refresh_due(state["step"] + 1, group):
                    return True
        return False

    # -- hooks for subclasses ------------------------------------------------------------------

    def _layout(self, p: torch.Tensor, group: dict[str, Any]) -> ParamLayout:
        raise NotImplementedError

    def _init_param(self, pid, p, grad, group, state, layout) -> bool | None:
        """A parameter's first step: its state; True where it also steps now (its update
        runs with the group's)."""
        raise NotImplementedError

    def _state_template(
        self, p: torch.Tensor, group: dict[str, Any], layout: ParamLayout
    ) -> dict[str, Any]:
        """The state ``_init_param`` gives ``p``, less ``"step"``, in zeros of ``state_dtype(p)`` on
        ``p``'s device: every key, shape, dtype and layout (bases column-major: ``basis_zeros``; a
        result that starts as None in its computed shape), for placeholders (Note
        [State-initialisation probe] in state_format.py) and loading (Note [Flat optimizer state]).
        """
        raise NotImplementedError


# Note [torch.compile]
# ~~~~~~~~~~~~~~~~~~~~
# A compiled model trains under these optimizers, with a runtime or not, with no graph break of
# Asteria's in its forward and backward (the module hooks are not traced: Note [Signals under
# torch.compile] in asteria/runtime/hooks.py). ``step()`` and ``zero_grad()`` are
# ``torch.compiler.disable``d: called from a compiled function each breaks the graph there and
# runs eagerly (traced, SOAP's first step broke it 20 times). docs/compile.md lists the breaks;
# tests/unit/test_compile.py counts them.

# Note [One step]
# ~~~~~~~~~~~~~~~
# One skeleton for every optimizer (``_step``, then ``_run_group`` per parameter group): the
# kernel's ``begin`` (per-parameter elementwise work; the blocks in shape groups), then the
# optimizer's ``phases`` in order, each one refresher call per group: ``accumulate`` (the
# statistics), ``plan`` (the refresh decisions), the update over the ``pieces`` the refresher
# hands out (through ``run``), then ``end``. SOAP updates, accumulates, plans (its refreshes of
# step t used from t + 1); Shampoo accumulates and plans first (roots of step t precondition step
# t); KL-Shampoo's statistics read the update's bases (``update_statistics``). The kernels take
# no refresher or optimizer, nothing per block crosses the seam, and the per-parameter work runs
# in this frame with no call per parameter (``Update`` via ``tuple.__new__``, cached layouts and
# checks): native host work grows with the shape groups (tests/unit/test_seam.py counts it).
