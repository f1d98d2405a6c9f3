"""The base of Asteria's Kronecker-factored optimizers.

Owns: what SOAP, KL-Shampoo and Shampoo share: validation of the familiar arguments, the step
skeleton (closure, parameters without gradients, sparse/complex rejection, fp32 state for
low-precision parameters, skipping non-finite gradients, DTensor parameters through their local
shards: Note [Local shards] in tensors.py), per-parameter layouts (``blocking.py``), the
Adam fallback for parameters that are not preconditioned, and an exact ``state_dict`` round trip
in a form that ``torch.distributed.checkpoint``'s state-dict API takes (Note [State-initialisation
probe] here; Notes [Flat optimizer state] and [Sharded state and torch's state-dict API] in
state_format.py). The refresher seam (``Refresher``, ``NativeRefresher``, ``RefreshJob``) is in
refresher.py and the input checks in checks.py; both are re-exported here.

The gradient checks before any update (Notes [Non-finite gradients] and [Overflowing
gradients]) are in overflow.py, and the state_dict, load_state_dict and pickling in state_io.py.

Must not: hold any algorithm's math (that is each subclass's file) or know about the runtime that
may later take refreshes off the critical path. Subclasses implement ``_layout``, ``_init_param``
and ``_update_param`` (or ``_update_params``, a group's parameters at once); ``_refresh_due`` says
whether a step refreshes a block.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch.optim import Optimizer

from asteria import _compat
from asteria.optim.blocking import (
    FACTOR_BUDGET_DIM,
    FACTOR_BUDGET_RATIO,
    FactorBudgetWarning,
    ParamLayout,
    without_factors,
)
from asteria.optim.checks import (
    check_betas,
    check_lr,
    check_range,
    check_shampoo_beta,
    gradient_verdicts,
)
from asteria.optim.matrix_functions import MatrixFunctionError
from asteria.optim.overflow import GradientChecks
from asteria.optim.refresher import (
    BlockEnd,
    BlockKey,
    NativeRefresher,
    QRRefresh,
    Refresher,
    RefreshJob,
    RootRefresh,
    Update,
)
from asteria.optim.state_io import RUNTIME_STATE_KEY, StateIO, _blocks_of
from asteria.optim.tensors import (
    PLACEHOLDER_STEP,
    _halves,
    _is_placeholder,
    basis_zeros,
    block_views,
    local_tensor,
    no_autocast,
    state_dtype,
)

__all__ = [
    "BlockEnd",
    "BlockKey",
    "KroneckerOptimizer",
    "NativeRefresher",
    "PLACEHOLDER_STEP",
    "RUNTIME_STATE_KEY",
    "ParamsT",
    "QRRefresh",
    "RefreshJob",
    "RootRefresh",
    "Refresher",
    "Update",
    "adamw_update",
    "basis_zeros",
    "block_views",
    "check_betas",
    "check_range",
    "check_shampoo_beta",
    "local_tensor",
    "shampoo_beta",
    "state_dtype",
]

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]
T = TypeVar("T")


def shampoo_beta(group: dict[str, Any]) -> float:
    """The group's factor EMA coefficient: ``shampoo_beta``, or ``betas[1]`` when unset/negative."""
    sb = group["shampoo_beta"]
    return group["betas"][1] if sb is None or sb < 0 else sb


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step with exactly ``torch.optim.AdamW``'s operations (single-tensor path).

    ``state`` holds ``exp_avg``, ``exp_avg_sq`` and the int ``step``; ``param`` is the working
    copy the optimizer updates (in the state dtype).
    """
    beta1, beta2 = betas
    state["step"] += 1
    step = state["step"]
    param.mul_(1 - lr * weight_decay)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


class KroneckerOptimizer(GradientChecks, StateIO, Optimizer):
    """Shared skeleton of the Kronecker-factored optimizers (see module docstring)."""

    #: Hyperparameters every group must carry and that ``_validate_group`` checks.
    _common_keys = ("lr", "betas", "eps", "weight_decay", "precondition_frequency")
    #: Group options a subclass added after its first version: a loaded group without one takes
    #: the optimizer's default (a state_dict saved before it existed); every other option
    #: missing is refused (Note [Transactional loads]).
    options_added_later: tuple[str, ...] = ()
    #: The block-state field that holds the refresh results in use (bases or inverse roots).
    bases_field = "bases"
    #: Whether the update reads a block's bases only through ``Refresher.bases`` (then a
    #: runtime may keep them in host memory and hand out device copies: the bases window).
    reads_bases_through_refresher = False
    #: Whether ``install_refresh`` reads the block's current bases (SOAP rotates its first
    #: moment by ``Q_old^T Q_new``); a runtime then hands it device copies of them.
    install_reads_bases = True
    #: Whether the native step computes a due refresh before its update reads the bases
    #: (Shampoo: the roots of step ``t`` precondition step ``t``) rather than after it (SOAP,
    #: KL-Shampoo: from step ``t + 1``). A refresh a runtime installs between two steps is then
    #: one step staler than one installed there for the others (Note [Staleness bound]).
    refresh_precedes_update = False
    #: Whether a block may carry factors on some dims and none on others (SOAP, the authors'
    #: rule); else a dim over the factor budget leaves the whole parameter without factors
    #: (Note [Factor budget] in blocking.py).
    factors_some_dims = False

    def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
        check_lr(defaults["lr"])  # first, as torch.optim does (Note [torch.optim conventions])
        params = _param_list(type(self).__name__, params)
        self._layouts: dict[int, tuple[tuple, ParamLayout]] = {}
        self._refresher: Refresher = NativeRefresher(self)
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
        #: Note [Refused steps]: per group (by identity) its options as last checked, and per
        #: parameter with state the layout key and state dtype that state was made for.
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

    def attach_refresher(self, refresher: Refresher) -> None:
        """Hand refreshes to ``refresher`` (Asteria's runtime); one at a time. Refreshes in
        flight that a ``load_state_dict`` brought along are handed to it (Note [Runtime state
        in the optimizer's checkpoint])."""
        if not isinstance(self._refresher, NativeRefresher):
            raise ValueError(
                f"{type(self).__name__} is already orchestrated by {self._refresher!r}; "
                "close() that runtime before attaching another"
            )
        bound = getattr(refresher, "optimizer", self)
        if bound is not self:
            raise ValueError(
                f"{refresher!r} is bound to another optimizer ({type(bound).__name__} at "
                f"{id(bound):#x}); a refresher orchestrates the optimizer it was made for"
            )
        if getattr(refresher, "closed", False):
            raise ValueError(f"{refresher!r} is closed; make a new one")
        resumed, self._resumed_refreshes = self._resumed_refreshes, None
        if resumed is not None:
            refresher.load_state_dict(resumed)  # raises before anything is attached
        self._refresher = refresher

    def detach_refresher(self) -> None:
        """Back to native mode: refreshes are computed in the step again."""
        self._refresher = NativeRefresher(self)

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

    def refresh_urgent(self, block: dict[str, Any], step: int, group: dict[str, Any]) -> bool:
        """Whether ``block``'s refresh requested at ``step`` costs the most quality when it
        arrives late, so that a runtime waits for it at that step, as natively (Notes
        [Rank-deficient factors] and [Young factors] in asteria/runtime/schedule.py).
        ``False``: any refresh may take the runtime's staleness budget. The answer must depend
        only on the block's shapes, the group's hyperparameters and the refresh due at or after
        ``step`` (a multiple of the frequency): it is the same over a refresh interval, so that
        a request made ahead and one made at its step never both pass a due step by, and a
        runtime asks it once per block and interval."""
        return False

    def install_cost(self, block: dict[str, Any]) -> float:
        """About how many flops ``install_refresh(block, ...)`` computes on the training's
        critical path; ``0`` where an install is a pointer swap. A runtime spreads costly
        installs over the steps its staleness budget allows (Note [Paced installs] in
        asteria/runtime/schedule.py)."""
        return 0.0

    def blocks(self) -> Iterable[tuple[BlockKey, torch.Tensor, dict[str, Any], dict[str, Any]]]:
        """Every initialised preconditioned block: ``(key, parameter, block state, group)``."""
        return _blocks_of(self.param_groups, self.state)

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
        _drop_duplicates(self.param_groups[-1])
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
        with no_autocast():  # Note [Autocast]: the closure alone runs under the caller's
            return self._step(loss)

    def _step(self, loss: float | None) -> float | None:
        todo: list[tuple[int, dict[str, Any], torch.Tensor]] = []
        pid = -1
        for group in self.param_groups:
            for p in group["params"]:
                pid += 1
                if p.grad is None or p.numel() == 0:
                    continue
                self._check_grad_kind(p.grad)
                todo.append((pid, group, p))
        self._check_before_step(todo)  # Note [Refused steps]
        if todo and not self._has_state() and _state_init_probe(self.param_groups, todo):
            for _, group, p in todo:
                if local_tensor(p).numel():
                    self.state[p] = self._placeholder(p, group)
            return loss
        if self.skip_nonfinite_grads:  # Notes [Non-finite gradients], [Overflowing gradients]
            limits = [self._gradient_limit(p, group) for _, group, p in todo]
            verdicts, norms = gradient_verdicts([p.grad for _, _, p in todo], limits)
        else:
            verdicts, norms = [None] * len(todo), [0.0] * len(todo)
        if self._resumed_refreshes is not None and isinstance(self._refresher, NativeRefresher):
            # a native step computes its own refreshes: the saved ones have no one to install
            self._resumed_refreshes = None
        self._refresher.step_begin()
        # Updates of one group run together (``_update_params``: SOAP fuses its elementwise
        # math across blocks). Note [Working copies]: the update runs on a contiguous tensor in
        # the state dtype, the parameter itself when it is one, else a working copy written
        # back after its update. A copy in the parameter's own dtype (a transposed or strided
        # view, channels-last) joins the group's batch, so the parameter takes exactly the path
        # of its contiguous twin; one in another dtype (fp32 math for bf16/fp16 parameters, one
        # rounding per step) runs alone, so that only one such copy is alive at a time.
        batch: list[Update] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, copy) in the batch
        batch_group: dict[str, Any] | None = None
        for (pid, group, p), verdict, norm in zip(todo, verdicts, norms):
            if verdict is not None:
                self._skip_nonfinite(pid, p, verdict, norm)
                continue
            self._statistics_added(p, group, norm)
            # Note [Local shards]: a DTensor parameter (FSDP2 / HSDP) is optimized through its
            # local shard (plain tensors are their own); an empty shard has nothing to do.
            local = local_tensor(p)
            if local.numel() == 0:
                continue
            if group is not batch_group:
                self._flush_updates(batch_group, batch, copies)
                batch_group = group
            grad = self._checked_grad(p)
            state = self.state[p]
            layout = self.layout(p, group)
            work = local
            if local.dtype != grad.dtype or not local.is_contiguous():
                # (``Tensor.to`` returns a non-contiguous tensor itself when the dtype matches)
                work = torch.empty(local.shape, dtype=grad.dtype, device=local.device)
                work.copy_(local)
            if not state or _is_placeholder(state):
                state.clear()
                self._first_step(pid, work, grad, group, state, layout)
            elif work is local or work.dtype == local.dtype:
                batch.append(Update(pid, work, grad, state, layout))
                if work is not local:
                    copies.append((local, work))
                continue
            else:
                self._update_params(group, [Update(pid, work, grad, state, layout)])
            if work is not local:
                local.copy_(work)
        self._flush_updates(batch_group, batch, copies)
        self._refresher.step_end()
        return loss

    def _check_before_step(self, todo: list[tuple[int, dict[str, Any], torch.Tensor]]) -> None:
        """Note [Refused steps]: what a step would fail on midway, refused before it changes
        anything: a group's options edited since they were last checked (``param_groups[i]
        ["lr"] = -1``: the constructor's checks, ``_validate_group``), and a parameter whose
        shape, dtype or blocking options changed under its state (``p.data = ...`` of another
        shape, ``max_preconditioner_dim`` edited after the first step)."""
        name = type(self).__name__
        for group in {id(g): g for _, g, _ in todo}.values():  # once per group and step
            options = _options_of(group)
            if self._checked_options.get(id(group)) != options:
                try:
                    self._validate_group(group)
                except (ValueError, TypeError, KeyError) as err:
                    index = next(i for i, g in enumerate(self.param_groups) if g is group)
                    raise ValueError(
                        f"{name}.step: param_groups[{index}] was changed to a value the "
                        f"optimizer does not take: {err}; nothing was updated"
                    ) from None
                self._checked_options[id(group)] = options
        for pid, group, p in todo:
            state = self.state.get(p)
            if not state or _is_placeholder(state):
                continue
            now = (self._layout_key(local_tensor(p), group), state_dtype(p))
            seen = self._state_keys.setdefault(id(p), now)
            if seen != now:
                what = self.param_names.get(pid, f"param{pid}")
                raise ValueError(
                    f"{name}.step: parameter '{what}' (index {pid}) has state for shape, "
                    f"blocking options and state dtype {seen}, but is now {now}: its state does "
                    "not fit it. Nothing was updated; to change a parameter's shape, dtype or "
                    "blocking after its first step, make a new optimizer (or clear its state: "
                    "del opt.state[p])"
                )

    def _first_step(self, pid, p, grad, group, state, layout) -> None:
        """``_init_param``; a matrix function that fails there (the first eigenbases) names the
        parameter (Note [Overflowing gradients]: a step's own gradients cannot make it fail)."""
        try:
            self._init_param(pid, p, grad, group, state, layout)
            self._state_keys[id(p)] = (self._layout_key(p, group), state_dtype(p))
        except MatrixFunctionError as err:
            state.clear()  # the parameter stays without state: its next step starts again
            name = self.param_names.get(pid, f"param{pid}")
            raise MatrixFunctionError(
                f"{type(self).__name__}: the first eigenbases of parameter '{name}' (index "
                f"{pid}, shape {tuple(p.shape)}) failed: {err}"
            ) from err

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
                self._update_params(group, batch)
        finally:
            batch.clear()
            for local, work in copies:
                local.copy_(work)
            copies.clear()

    def _has_state(self) -> bool:
        """Whether some parameter has state (placeholders, and entries of ``state`` that are
        not a parameter's, do not count)."""
        return any(
            s and not _is_placeholder(s)
            for k, s in self.state.items()
            if isinstance(k, torch.Tensor)
        )

    def layout(self, p: torch.Tensor, group: dict[str, Any]) -> ParamLayout:
        """The (cached) block layout of ``p`` under ``group``'s options: that of its local shard
        when ``p`` is a DTensor (Note [Local shards])."""
        local = local_tensor(p)
        key = self._layout_key(local, group)
        cached = self._layouts.get(id(p))
        if cached is None or cached[0] != key:
            layout = self._layout(local, group)
            if layout.over_budget and not self.factors_some_dims:
                layout = without_factors(layout)  # Note [Factor budget] in blocking.py
            cached = (key, layout)
            self._layouts[id(p)] = cached
            if cached[1].over_budget and not self._budget_warned:
                self._warn_over_budget(p, local, cached[1], group)
        return cached[1]

    def _warn_over_budget(
        self, p: torch.Tensor, local: torch.Tensor, layout: ParamLayout, group: dict[str, Any]
    ) -> None:
        """Note [Factor budget] in blocking.py: once per optimizer, the first parameter a dim of
        which is left without a factor."""
        self._budget_warned = True
        flat = [q for g in self.param_groups for q in g["params"]]
        pid = next((i for i, q in enumerate(flat) if q is p), None)
        name = "?" if pid is None else self.param_names.get(pid, f"param{pid}")
        dims = ", ".join(
            f"dim {i} ({layout.view_shape[i]}: a factor of up to "
            f"{min(layout.view_shape[i], group['max_preconditioner_dim'])} wide)"
            for i in layout.over_budget
        )
        where = (
            f"along {dims}"
            if self.factors_some_dims
            else f"(every dim: {type(self).__name__} factors all dims of a block or none) for "
            f"{dims}"
        )
        warnings.warn(
            f"{type(self).__name__}: parameter '{name}' of shape {tuple(local.shape)} (viewed as "
            f"{layout.view_shape}) is left unpreconditioned {where}, as the SOAP authors "
            f"leave a dim above max_precond_dim: the factor would be wider than "
            f"{FACTOR_BUDGET_DIM} and hold more than {FACTOR_BUDGET_RATIO} times the elements of "
            "the block it preconditions (Note [Factor budget] in asteria/optim/blocking.py: "
            "about 90 s a refresh and 400 MB at 10000 wide on a CPU). To precondition it, "
            "reshape the parameter so that no dim is much longer than the others. Shown once "
            "per optimizer.",
            FactorBudgetWarning,
            stacklevel=4,
        )

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
                if self._refresh_due(state, group, next_step=True):
                    return True
        return False

    # -- hooks for subclasses ------------------------------------------------------------------

    def _layout(self, p: torch.Tensor, group: dict[str, Any]) -> ParamLayout:
        raise NotImplementedError

    def _init_param(self, pid, p, grad, group, state, layout) -> None:
        raise NotImplementedError

    def _state_template(
        self, p: torch.Tensor, group: dict[str, Any], layout: ParamLayout
    ) -> dict[str, Any]:
        """The state ``_init_param`` gives ``p`` and keeps from then on, less ``"step"``, in
        zeros of ``state_dtype(p)`` on ``p``'s device: every key, shape, dtype and layout (bases
        column-major, as the refreshes return them: ``basis_zeros``), and a refresh result that
        starts as None (Shampoo's roots) in the shape it takes once computed. Placeholders
        (Note [State-initialisation probe]) and loading (Note [Flat optimizer state]) use it."""
        raise NotImplementedError

    def _update_param(self, pid, p, grad, group, state, layout) -> None:
        raise NotImplementedError

    def _run_split(
        self, fn: Callable[..., None], items: list[T], cost: Callable[[T], float], *args: Any
    ) -> None:
        """``fn(items, *args)``; where the refresher has a thread beside this one, as two calls
        on halves of ``items`` of about equal ``cost``, one on each thread (Note [Split
        updates] in asteria/runtime/lane.py)."""
        if len(items) < 2 or not self._refresher.splits_updates:
            fn(items, *args)
            return
        mine, theirs = _halves(items, [cost(x) for x in items])
        wait = self._refresher.beside(fn, theirs, *args)
        try:
            fn(mine, *args)
        finally:
            wait()  # also when this half raised: the other half must not outlive the step

    def _end_blocks(self, group: dict[str, Any], ends: Iterable[BlockEnd]) -> None:
        """The end of each block's step, in order: its statistics update handed to the
        refresher (``accumulate``: now, or on its lane), then the refresher's decision at the
        block's boundary (``block_boundary``: install, request). Every optimizer ends its blocks
        here; ``ends`` may be a generator that updates each block as it yields its end, so that
        a block ends before the next one is updated."""
        refresher = self._refresher
        for end in ends:
            if end.statistics is not None:
                refresher.accumulate(end.key, end.statistics, *end.args)
            refresher.block_boundary(end.key, end.block, group, end.step, end.due)

    def _update_params(self, group: dict[str, Any], updates: list[Update]) -> None:
        """Update the parameters of one group; ``_update_param`` on each, unless overridden."""
        for u in updates:
            self._update_param(u.pid, u.p, u.grad, group, u.state, u.layout)

    def _refresh_due(self, state: dict[str, Any], group: dict[str, Any], next_step: bool) -> bool:
        """Preconditioned parameters refresh every ``precondition_frequency`` steps (t > 0)."""
        if "blocks" not in state:
            return False
        t = state["step"] + (1 if next_step else 0)
        return t > 0 and t % group["precondition_frequency"] == 0


# Note [torch.compile]
# ~~~~~~~~~~~~~~~~~~~~
# A model compiled with ``torch.compile`` trains under these optimizers, with a runtime attached
# or not, and its compiled forward and backward have no graph break of Asteria's: the runtime's
# module hooks are not traced (Note [Signals under torch.compile] in asteria/runtime/hooks.py).
# ``step()`` and ``zero_grad()`` are ``torch.compiler.disable``d: called from a compiled
# function, each breaks the graph there and runs eagerly, as it would outside (the step holds
# host-side decisions, C++ worker calls and LAPACK refreshes that dynamo cannot trace: traced,
# the first step of SOAP broke the graph 20 times). torch.optim's own ``zero_grad`` is disabled
# the same way. docs/compile.md lists the graph breaks of a compiled training step;
# tests/unit/test_compile.py counts them.

# Note [torch.optim conventions]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# SOAP, KL-Shampoo and Shampoo keep every generic convention of ``torch.optim.Optimizer`` that
# torch's own optimizer tests check (test/test_optim.py, TestOptimRenewed), and the project's
# conformance suite checks the same on an ``OptimizerInfo`` per optimizer
# (tests/unit/test_torch_conformance.py), natively and with a runtime attached:
#   * params: tensors, parameter groups, or ``(name, tensor)`` pairs (``named_parameters()``),
#     whose names go to the group's ``param_names`` and so into the ``state_dict``; what is not
#     an ordered iterable of those is a ``TypeError`` in torch's words (a single tensor
#     included), duplicates warn (and are kept once: Note [Duplicate
#     parameters]) and a parameter in two groups is a ``ValueError``, as in torch;
#     an empty list is one empty group that steps as a no-op (torch raises).
#   * ``lr`` may be a 1-element floating-point tensor (checked before the parameters, as torch
#     does, "Tensor lr must be 1-element"); schedulers fill it in place.
#   * ``state_dict``: pre-hooks, then the dict, then post-hooks, whose result is what is
#     returned; entries of ``state`` that are not a parameter's (a hook's) are kept as they
#     are. ``load_state_dict``: pre-hooks on a shallow copy of what is given (a result
#     replaces it), the groups (saved options; live ``param_names`` where the saved have none)
#     and the state restored, then post-hooks. Saving is deterministic, loads into equal but
#     not identical parameters, and survives ``torch.save`` / ``torch.load(weights_only=True)``.
#   * ``copy.deepcopy`` and pickling keep every attribute but the hooks (as torch), the
#     refresher (a copy steps natively; a runtime's refreshes in flight go along as a loaded
#     checkpoint's would) and the layout cache (keyed by parameter identity, rebuilt).
#   * Step pre/post hooks, global and per optimizer, run in torch's order (torch's own wrapper of
#     ``step``).
# Not offered: foreach, fused, capturable and differentiable (implementation flags of torch's
# element-wise optimizers; a constructor given one raises TypeError), maximize, complex and
# sparse parameters or gradients (a RuntimeError that names them).


def _param_list(name: str, params: Any) -> list:
    """``params`` as a list; an empty one becomes one empty group (an optimizer with nothing to
    do steps as a no-op, where ``torch.optim`` raises). What is not an ordered iterable is a
    ``TypeError`` in torch's words (Note [torch.optim conventions])."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, "
            f"but got {torch.typename(params)} ({name}: a single tensor goes in a list)"
        )
    _compat.check_params_not_a_set(name, params)  # torch 2.15 warns: Note [Per-release differences]
    try:
        params = list(params)
    except TypeError:
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, "
            f"but got {type(params).__name__} ({name})"
        ) from None
    return params if params else [{"params": []}]


def _options_of(group: dict[str, Any]) -> tuple:
    """A group's options as ``_check_before_step`` compares them (a tensor by identity: a
    scheduler fills a tensor ``lr`` in place, and reading it would wait for its device)."""
    return tuple(
        (k, id(v) if isinstance(v, torch.Tensor) else v)
        for k, v in group.items()
        if k not in ("params", "param_names")
    )


# Note [Refused steps]
# ~~~~~~~~~~~~~~~~~~~~
# A ``step()`` either runs to its end or raises before it changes anything (parameters,
# ``opt.state``, a runtime's versions and refreshes in flight), for every input a caller can
# hand it: a sparse or complex gradient (``_check_grad_kind``, in the first pass over the
# parameters), a group option edited after construction to a value the constructor refuses
# (``param_groups[0]["lr"] = -1``, ``"x"``, NaN, ``betas`` out of range, a frequency of 0 or 1.5,
# a ``refresh_dtype`` of float16: each ran, silently wrong, or failed midway with a parameter
# updated), and a parameter whose shape, dtype or blocking options no longer fit its state
# (``p.data = torch.randn(5, 3)`` over a (4, 3) state, ``max_preconditioner_dim`` edited after
# the first step: failed midway). ``_check_before_step`` checks them all first, with the
# constructor's own checks, once per change of a group's options (a dict compare per group and
# step otherwise). A non-finite gradient is not refused: its parameter skips the step (Note
# [Non-finite gradients]). tests/unit/test_refusals.py draws the bad inputs with hypothesis and
# compares a deep snapshot of everything observable before and after the refused step.


def _drop_duplicates(group: dict[str, Any]) -> None:
    """A parameter listed twice in ``group`` kept once, at its first place (and its name).

    Note [Duplicate parameters]: ``torch.optim`` warns of a parameter group with duplicate
    parameters and carries on, stepping the parameter once per listing on one state. For a
    Kronecker-factored optimizer that would add its statistics twice a step, and under a
    runtime give one block two keys (the registry's bookkeeping of one block, twice: an
    internal AssertionError). So, after torch's warning, the group keeps the first listing only:
    the parameter trains as if listed once, natively and under a runtime alike
    (tests/unit/test_layouts.py). ``state_dict`` then has one entry per distinct parameter."""
    params = group["params"]
    seen: set[int] = set()
    keep = [i for i, p in enumerate(params) if not (id(p) in seen or seen.add(id(p)))]
    if len(keep) == len(params):
        return
    group["params"] = [params[i] for i in keep]
    if "param_names" in group:
        group["param_names"] = [group["param_names"][i] for i in keep]


def _state_init_probe(groups: list[dict[str, Any]], todo: list[tuple]) -> bool:
    """Whether this first step is ``torch.distributed.checkpoint.state_dict``'s probe, which
    makes placeholders instead of a step.

    Note [State-initialisation probe]: ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``
    (and the trainers built on them: torchtitan, OLMo-core) make an optimizer with no state create
    it, by calling ``step()`` with every gradient zero and every ``lr`` 0, and then rely on its
    structure: DCP loads a checkpoint into the tensors of that state (in place: their shapes,
    dtypes and layouts), and a flattened state is unflattened by the keys of the live state. For
    Adam the step is harmless; for SOAP and KL-Shampoo the first step initialises the eigenbases
    from the first gradient (the authors' rule), so zeros would leave bases of zero statistics and
    shift every later step by one. A first step (no state yet) whose gradients are all exactly
    zero with every ``lr`` 0 (a real first step never has both) therefore makes *placeholders*:
    each parameter's state as ``_state_template`` describes it, in zeros, with ``"step"`` set to
    ``PLACEHOLDER_STEP``. A placeholder counts as no state: the next real step initialises the
    parameter as a first step does, ``blocks()`` and ``is_refresh_step()`` pass over it, and
    loading a checkpoint replaces it. A checkpoint taken before the first step holds placeholders,
    which load back as placeholders.
    """
    if any(float(g["lr"]) != 0.0 for g in groups):
        return False
    return all(not bool(local_tensor(p.grad).any()) for _, _, p in todo)
