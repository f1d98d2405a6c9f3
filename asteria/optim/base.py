"""The base of Asteria's Kronecker-factored optimizers.

Owns: what SOAP, KL-Shampoo and Shampoo share: validation of the familiar arguments, the step
skeleton (closure, parameters without gradients, sparse/complex rejection, fp32 state for
low-precision parameters, skipping non-finite gradients, DTensor parameters through their local
shards: Note [Local shards] at ``local_tensor``), per-parameter layouts (``blocking.py``), the
Adam fallback for parameters that are not preconditioned, and an exact ``state_dict`` round trip
in a form that ``torch.distributed.checkpoint``'s state-dict API takes (Note [State-initialisation
probe] here; Notes [Flat optimizer state] and [Sharded state and torch's state-dict API] in
state_format.py). The refresher seam (``Refresher``, ``NativeRefresher``, ``RefreshJob``) is in
refresher.py and the input checks in checks.py; both are re-exported here.

Note [Non-finite gradients]: before any update, every gradient of the step is checked with one
fused reduction per gradient (its 2-norm; when that is not finite, its inf-norm, a max of absolute
values, so that large finite values cannot overflow into a false alarm) and one host sync per
device. A parameter whose gradient has a NaN or an Inf is skipped for that step as a whole: its
step count, factors, moments, pending refreshes and the parameter itself stay exactly as they were
(the algorithms' math runs per parameter, so a per-block skip would leave the parameter
half-updated). Other parameters update as usual, with arithmetic identical to a step without the
check. Skips are counted in ``nonfinite_grads`` (``Runtime.stats()["nonfinite_grads"]``) and the
first one warns (``RuntimeWarning`` naming the parameter). ``skip_nonfinite_grads = False`` turns
the check off.

Note [Overflowing gradients]: a gradient can be finite and still make the optimizer's statistics
inf (a gradient of 1e30 squares to 1e60, past float32's 3.4e38), and an inf factor or moment
then fails every refresh, or stops the parameter, far from the step that caused it. So the same
check skips, counts (``nonfinite_grads``) and warns about (once, with the parameter's name and the
2-norm) a gradient whose 2-norm is above the limit its update allows (``_gradient_limit``, from
the 2-norms the check computes anyway: no extra reduction or sync): every new statistic term is
at most ``gain * ||g||^2`` (an entry of ``G G^T`` or ``g^2``; KL-Shampoo's whitening by
``lambda^{-1/2} <= clamp`` along the other dims is its ``gain``), an average (EMA) of finite
terms stays finite, and a sum (Shampoo's factors at ``betas[1] == 1``, Adagrad grafting) needs
room for it: a host-side bound on its largest entry, taken from the state once and raised by
each accepted term. The limit keeps a margin of 4 below the dtype's largest value. Nothing
non-finite then reaches a matrix function from a step; one that still fails (a checkpoint's inf
factor) is a counted refresh failure, whose error names the parameter's block.
tests/unit/test_overflow.py has the cases of issue 22 (1e30 gradients, sums creeping up to
float32's limit) for every optimizer, natively and with a runtime.

Must not: hold any algorithm's math (that is each subclass's file) or know about the runtime that
may later take refreshes off the critical path. Subclasses implement ``_layout``, ``_init_param``
and ``_update_param`` (or ``_update_params``, a group's parameters at once); ``_refresh_due`` says
whether a step refreshes a block.
"""

from __future__ import annotations

import copy
import functools
import math
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch.optim import Optimizer

from asteria.optim import state_format
from asteria.optim.blocking import ParamLayout
from asteria.optim.checks import (
    OVERFLOW,
    check_betas,
    check_lr,
    check_range,
    check_shampoo_beta,
    gradient_verdicts,
)
from asteria.optim.matrix_functions import MatrixFunctionError
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

__all__ = [
    "BlockEnd",
    "BlockKey",
    "KroneckerOptimizer",
    "NativeRefresher",
    "PLACEHOLDER_STEP",
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


def state_dtype(param: torch.Tensor) -> torch.dtype:
    """Optimizer state is at least fp32: bf16/fp16 parameters get fp32 state."""
    return torch.promote_types(param.dtype, torch.float32)


class KroneckerOptimizer(Optimizer):
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

    def __getstate__(self) -> dict[str, Any]:
        """What a copy or a pickle keeps (Note [torch.optim conventions]): the groups, the
        state, the defaults and every other attribute (``skip_nonfinite_grads``,
        ``nonfinite_grads``, ``param_names``, ...), after any deferred statistics update has
        run; a runtime's refreshes in flight go along as a loaded checkpoint's would, for the
        runtime the copy attaches. Not kept, as in torch: the hooks; not kept either: the
        refresher (a copy steps natively) and the layouts (cached by parameter identity)."""
        self._refresher.sync()
        state = {k: v for k, v in self.__dict__.items() if k not in _NOT_COPIED}
        if not isinstance(self._refresher, NativeRefresher):
            state["_resumed_refreshes"] = _refresher_state(self._refresher)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        had_differentiable = "differentiable" in state.get("defaults", {})
        super().__setstate__(state)  # torch's: empty hooks, the step's profiling wrapper
        if not had_differentiable:
            self.defaults.pop("differentiable", None)  # torch's default of an option not ours
        for name, value in _ATTRIBUTE_DEFAULTS.items():  # pickled by an earlier version
            if name not in self.__dict__:
                setattr(self, name, copy.copy(value))
        self._layouts = {}
        self._summed_bounds = {}
        self._refresher = NativeRefresher(self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its hyperparameters (given or inherited) are validated first. Its
        ``params`` are tensors or ``(name, tensor)`` pairs (``model.named_parameters()``), all
        of one kind: names go to the group's ``param_names``, as in ``torch.optim``, and to
        ``self.param_names`` for messages."""
        name = type(self).__name__
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise ValueError(f"a parameter group of {name} must be a dict with a 'params' key")
        ps = param_group["params"]
        if isinstance(ps, set):
            raise TypeError(f"params of {name} must be an ordered collection (a list), not a set")
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)  # a generator is read once
        for p in ps:
            named = isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
            if not isinstance(p[1] if named else p, torch.Tensor):
                raise TypeError(
                    f"params of {name} must be tensors or (name, tensor) pairs, "
                    f"got {type(p).__name__}"
                )
        super().add_param_group({**param_group, "params": ps})
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

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim``'s ``state_dict``, after any deferred statistics update has run, in the
        flat form of Note [Flat optimizer state] (state_format.py): each parameter's state is one
        dict of dotted keys (``"blocks.0.bases.1"``) to tensors and numbers, and
        ``refresh_dtype`` is a name. The hooks run as torch runs them (Note [torch.optim
        conventions]): the pre-hooks first, the post-hooks last, on the whole dict."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._refresher.sync()
        state_format.refuse_sharded_state_dict_api(self, sys._getframe(1))
        # Parameters are saved by their position in the groups, a repeated one by its first.
        index: dict[int, int] = {}
        groups = []
        position = 0
        for group in self.param_groups:
            for p in group["params"]:
                index.setdefault(id(p), position)
                position += 1
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index[id(p)] for p in group["params"]]
            groups.append(state_format.portable_group(packed))
        state: dict[Any, Any] = {}
        for key, value in self.state.items():
            if isinstance(key, torch.Tensor):
                state[index[id(key)]] = state_format.flat_state(value, self.bases_field)
            else:  # what a hook or a caller keeps beside the parameters' state, as it is
                state[key] = value
        out: dict[str, Any] = {"state": state, "param_groups": groups}
        # Note [Runtime state in the optimizer's checkpoint]
        in_flight = _refresher_state(self._refresher)
        if in_flight is not None:
            out[RUNTIME_STATE_KEY] = in_flight
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, out)
            if result is not None:
                out = result
        return out

    @torch.compiler.disable  # as torch.optim's own (Note [torch.compile])
    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim``'s ``zero_grad``; zeroing in place first lets deferred statistics
        updates, which read this step's gradients, finish."""
        if not set_to_none:
            self._refresher.sync()
        super().zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict``, keeping every state tensor's saved dtype and layout.

        Takes the flat form :meth:`state_dict` writes, the same nested in dicts (as
        ``set_optimizer_state_dict`` unflattens it), and the nested form (lists of blocks) of
        earlier versions (Note [Flat optimizer state] in state_format.py).
        ``torch.optim.Optimizer.load_state_dict`` would cast floating-point state to the
        parameter's dtype; Asteria keeps fp32 state for bf16/fp16 parameters, so the saved
        tensors are restored as they are (copies, moved to the parameter's device). Everything
        else is torch's (Note [torch.optim conventions]): the pre-hooks see the dict as given
        and may return another, the groups take the saved options (and ``param_names``, kept
        from the live groups where the saved ones have none), entries of ``state`` that are not
        a parameter's are kept as they are, and the post-hooks run once all is restored.
        """
        if not isinstance(state_dict, dict):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict takes a dict (an optimizer's "
                f"state_dict()), got {type(state_dict).__name__}"
            )
        state_dict = state_dict.copy()  # shallow, as torch: a pre-hook may replace entries
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._refresher.sync()
        state_format.refuse_sharded_state_dict_api(self, sys._getframe(1))
        # Note [Transactional loads]: everything is checked before anything changes
        groups, state = self._loaded_state(state_dict)
        in_flight = state_dict.get(RUNTIME_STATE_KEY)
        native = isinstance(self._refresher, NativeRefresher)
        if not native:
            self._check_layouts_kept(groups)
            if in_flight is not None:  # checked against the state about to be loaded
                blocks = {k: (b, state[p]["step"]) for k, p, b, _ in _blocks_of(groups, state)}
                self._refresher.check_state_dict(in_flight, blocks)
        self.param_groups, self.state = groups, state
        self._layouts.clear()  # layouts under the saved options were cached on the way
        self._summed_bounds.clear()  # taken from the loaded state when next needed
        first = 0
        for group in self.param_groups:  # the loaded names, in messages too
            for i, param_name in enumerate(group.get("param_names", ()), first):
                self.param_names[i] = param_name
            first += len(group["params"])
        # what was in flight for the state just replaced no longer fits it
        self._refresher.state_replaced()
        self._resumed_refreshes = None
        if in_flight is not None:
            if native:
                self._resumed_refreshes = in_flight  # for the runtime attached next
            else:
                self._refresher.load_state_dict(in_flight)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _loaded_state(self, state_dict: dict[str, Any]) -> tuple[list[dict], dict]:
        """The param groups and state ``load_state_dict`` installs, made without changing
        anything: a ``ValueError`` names the first entry that does not fit (Note
        [Transactional loads])."""
        where = f"{type(self).__name__}.load_state_dict"
        for part, kind in (("param_groups", list), ("state", dict)):
            if not isinstance(state_dict.get(part), kind):
                got = type(state_dict.get(part)).__name__ if part in state_dict else "nothing"
                raise ValueError(
                    f"{where}: the state_dict's {part!r} must be a {kind.__name__}, got {got} "
                    "(load what an optimizer's state_dict() returned)"
                )
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        for i, g in enumerate(saved_groups):
            if not isinstance(g, dict) or not isinstance(g.get("params"), (list, tuple)):
                raise ValueError(f"{where}: param_groups[{i}] must be a dict with a 'params' list")
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of "
                "optimizer's group"
            )
        groups = []
        for i, (live, group) in enumerate(zip(self.param_groups, saved_groups)):
            group = {**state_format.group_from_portable(group), "params": live["params"]}
            if "param_names" in live and "param_names" not in group:
                group["param_names"] = live["param_names"]
            self._check_loaded_group(i, group, where)
            groups.append(group)
        saved = copy.deepcopy(state_dict["state"])
        # The saved groups' "params" lists name the parameters, in order: positions as this
        # class saves them, or other keys (torch.distributed.checkpoint.state_dict's parameter
        # names), mapped by position as torch.optim does.
        owners = [(p, g) for g in groups for p in g["params"]]
        keys = [k for g in saved_groups for k in g["params"]]
        owner_of = dict(zip(keys, owners))
        state: defaultdict[Any, Any] = defaultdict(dict)
        for key, value in saved.items():
            if key not in owner_of:
                state[key] = value  # not a parameter's: kept as it is, as torch does
                continue
            param, group = owner_of[key]
            if not isinstance(value, dict):
                raise ValueError(
                    f"{where}: the state of parameter {key!r} is {type(value).__name__}, "
                    "a dict is needed"
                )
            if not value:
                state[param] = {}
                continue
            if not any(isinstance(v, list) for v in value.values()):  # not the nested form
                value = self._unflatten_state(key, value, param, group)
            else:
                value = self._checked_nested(key, value, param, group)
            state[param] = _to_device(value, param.device)
        return groups, state

    def _check_loaded_group(self, i: int, group: dict[str, Any], where: str) -> None:
        """A loaded group carries every option of this class, each valid (the checks of the
        constructor's arguments), and ``param_names`` that fit its parameters."""
        name = type(self).__name__
        for key in self.options_added_later:  # a state_dict saved before they existed
            if key not in group and key in self.defaults:
                group[key] = self.defaults[key]
        missing = [k for k in self.defaults if k not in group]
        if missing:
            raise ValueError(
                f"{where}: param_groups[{i}] has no {missing}, which every {name} group "
                "carries: load a state_dict of the same optimizer class"
            )
        try:
            self._validate_group(group)
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"{where}: param_groups[{i}]: {err}") from None
        names = group.get("param_names")
        if names is not None and (
            not isinstance(names, (list, tuple))
            or len(names) != len(group["params"])
            or not all(isinstance(n, str) for n in names)
        ):
            raise ValueError(
                f"{where}: param_groups[{i}]['param_names'] must be {len(group['params'])} "
                f"strings, one per parameter, got {names!r}"
            )

    def _check_layouts_kept(self, groups: list[dict[str, Any]]) -> None:
        """With a runtime attached, a load must keep every parameter's blocks (the runtime's
        placement, registry and bases were made for them at attach time)."""
        for live, group in zip(self.param_groups, groups):
            for p in live["params"]:
                local = local_tensor(p)
                if self._layout_key(local, live) != self._layout_key(local, group):
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: the state_dict's options "
                        "change how parameters are split into blocks, which a runtime "
                        f"attached ({self._refresher!r}) planned for: close() it first, load, "
                        "and attach a new one"
                    )

    def _checked_nested(
        self, key: Any, value: dict[str, Any], param: torch.Tensor, group: dict[str, Any]
    ) -> dict[str, Any]:
        """The nested form of earlier versions, checked against the placeholder's structure."""
        where = f"{type(self).__name__}.load_state_dict: the state of parameter {key!r}"
        template = self._placeholder(param, group, device=torch.device("meta"))
        value = dict(value)
        value["step"] = state_format.checked_step(value.get("step"), where)
        template.pop("step")
        state_format.check_nested(template, {k: v for k, v in value.items() if k != "step"},
                                  "", where, self.bases_field)  # fmt: skip
        return value

    def _unflatten_state(
        self, key: Any, flat: dict[str, Any], param: torch.Tensor, group: dict[str, Any]
    ) -> dict[str, Any]:
        """The live state of ``param`` from its flat form (Note [Flat optimizer state]), shaped
        by the placeholder of ``param`` under ``group`` (its structure only: meta tensors)."""
        flat = state_format.dotted(flat)
        where = f"{type(self).__name__}.load_state_dict: the state of parameter {key!r}"
        template = self._placeholder(param, group, device=torch.device("meta"))
        state = state_format.fill(template, flat, "", where)
        state["step"] = state_format.checked_step(state["step"], where)
        if flat:
            raise ValueError(
                f"{where} has entries {sorted(flat)} that this optimizer does not keep for it: "
                "load a state_dict of the same optimizer class and options"
            )
        if not _is_placeholder(state):
            for block in state.get("blocks", ()):
                results = block[self.bases_field]
                for i, q in enumerate(results):
                    if q is not None and not bool(q.any()):
                        results[i] = None  # zeros stand for a refresh not computed yet
        return state

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
        todo: list[tuple[int, dict[str, Any], torch.Tensor]] = []
        pid = -1
        for group in self.param_groups:
            for p in group["params"]:
                pid += 1
                if p.grad is None or p.numel() == 0:
                    continue
                self._check_grad_kind(p.grad)
                todo.append((pid, group, p))
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
        # math across blocks); a parameter updated through a working copy runs alone, so that
        # only one such copy is alive at a time.
        batch: list[Update] = []
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
                self._flush_updates(batch_group, batch)
                batch_group = group
            grad = self._checked_grad(p)
            state = self.state[p]
            layout = self.layout(p, group)
            # The update runs on a contiguous tensor in the state dtype: the parameter itself
            # when it already is one, otherwise a working copy written back afterwards (fp32
            # math for bf16/fp16 parameters, one rounding per step).
            work = local
            if local.dtype != grad.dtype or not local.is_contiguous():
                work = local.detach().to(dtype=grad.dtype, memory_format=torch.contiguous_format)
            if not state or _is_placeholder(state):
                state.clear()
                self._first_step(pid, work, grad, group, state, layout)
            elif work is local:
                batch.append(Update(pid, work, grad, state, layout))
                continue
            else:
                self._update_params(group, [Update(pid, work, grad, state, layout)])
            if work is not local:
                local.copy_(work)
        self._flush_updates(batch_group, batch)
        self._refresher.step_end()
        return loss

    def _first_step(self, pid, p, grad, group, state, layout) -> None:
        """``_init_param``; a matrix function that fails there (the first eigenbases) names the
        parameter (Note [Overflowing gradients]: a step's own gradients cannot make it fail)."""
        try:
            self._init_param(pid, p, grad, group, state, layout)
        except MatrixFunctionError as err:
            state.clear()  # the parameter stays without state: its next step starts again
            name = self.param_names.get(pid, f"param{pid}")
            raise MatrixFunctionError(
                f"{type(self).__name__}: the first eigenbases of parameter '{name}' (index "
                f"{pid}, shape {tuple(p.shape)}) failed: {err}"
            ) from err

    def _flush_updates(self, group: dict[str, Any] | None, batch: list[Update]) -> None:
        if batch:
            self._update_params(group, batch)
            batch.clear()

    def _has_state(self) -> bool:
        """Whether some parameter has state (placeholders, and entries of ``state`` that are
        not a parameter's, do not count)."""
        return any(
            s and not _is_placeholder(s)
            for k, s in self.state.items()
            if isinstance(k, torch.Tensor)
        )

    def _check_grad_kind(self, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        if grad.is_complex():
            raise RuntimeError(f"{type(self).__name__} does not support complex gradients")

    def _skip_nonfinite(self, pid: int, p: torch.Tensor, verdict: str, norm: float) -> None:
        """Count a skipped update (Notes [Non-finite gradients], [Overflowing gradients]); the
        first of each kind warns."""
        self.nonfinite_grads += 1
        overflow = verdict == OVERFLOW
        if self._overflow_warned if overflow else self._nonfinite_warned:
            return
        name = self.param_names.get(pid, f"param{pid}")
        if overflow:
            self._overflow_warned = True
            what = (
                f"is finite but so large (2-norm up to {norm:.3g}) that its update would "
                f"overflow the optimizer's factors or moments ({state_dtype(p)})"
            )
        else:
            self._nonfinite_warned = True
            what = "has NaN or Inf values"
        warnings.warn(
            f"{type(self).__name__}: the gradient of parameter '{name}' (index {pid}, shape "
            f"{tuple(p.shape)}) {what}; its update is skipped for this step "
            "(factors, moments and the parameter are left unchanged). Later skips are counted "
            "in optimizer.nonfinite_grads without a warning.",
            RuntimeWarning,
            stacklevel=4,
        )

    def _gradient_limit(self, p: torch.Tensor, group: dict[str, Any]) -> float:
        """The largest gradient 2-norm whose update keeps every statistic of ``p`` finite
        (Note [Overflowing gradients]): averages (EMAs) stay finite while each new term does,
        and a term is at most ``gain * ||g||^2``; statistics that are sums need room for it."""
        key = (p.dtype, p.shape, self._gain_options(group))
        cached = self._summed_bounds.get(("limit", id(p)))
        if cached is None or cached[0] != key:  # computed once per parameter and options
            big = _float_max(state_dtype(p)) / _OVERFLOW_MARGIN
            cached = (key, big, self._statistics_gain(p, group))
            self._summed_bounds[("limit", id(p))] = cached
        _, big, gain = cached
        if self._sums_statistics(group):
            summed = self._summed_bound(p, group)
            if math.isfinite(summed):  # (a loaded non-finite sum fails its refreshes instead)
                big -= summed
        return math.sqrt(max(big, 0.0) / gain)

    def _gain_options(self, group: dict[str, Any]) -> Any:
        """The group options ``_statistics_gain`` depends on (with the parameter's shape)."""
        return None

    def _statistics_gain(self, p: torch.Tensor, group: dict[str, Any]) -> float:
        """How much larger than ``||g||^2`` a statistic's new term may be (KL-Shampoo whitens the
        gradient before its factors see it); 1 where each term is a product of two gradients."""
        return 1.0

    def _sums_statistics(self, group: dict[str, Any]) -> bool:
        """Whether some statistic of ``group``'s parameters is a sum over steps (Shampoo's
        factors with ``betas[1] == 1``, Adagrad grafting), not an average."""
        return False

    def _largest_summed(self, p: torch.Tensor, state: dict[str, Any], group: dict) -> float:
        """The largest entry of ``p``'s summed statistics in ``state`` (a host sync)."""
        return 0.0

    def _summed_bound(self, p: torch.Tensor, group: dict[str, Any]) -> float:
        bound = self._summed_bounds.get(id(p))
        if bound is None:
            state = self.state.get(p)
            fresh = not state or _is_placeholder(state)
            bound = 0.0 if fresh else self._largest_summed(p, state, group)
            self._summed_bounds[id(p)] = bound
        return bound

    def _statistics_added(self, p: torch.Tensor, group: dict[str, Any], norm: float) -> None:
        """A step of ``p`` with a gradient of 2-norm ``norm`` adds at most ``gain * norm^2`` to
        each entry of its summed statistics."""
        if self.skip_nonfinite_grads and self._sums_statistics(group):
            bound = self._summed_bound(p, group)
            cached = self._summed_bounds.get(("limit", id(p)))
            gain = cached[2] if cached is not None else self._statistics_gain(p, group)
            self._summed_bounds[id(p)] = bound + gain * norm * norm

    def _checked_grad(self, p: torch.Tensor) -> torch.Tensor:
        sharded = hasattr(p.grad, "to_local")
        grad = local_tensor(p.grad)
        self._check_grad_kind(grad)
        dtype = state_dtype(p)
        if grad.dtype != dtype or not grad.is_contiguous():
            grad = grad.to(dtype=dtype, memory_format=torch.contiguous_format)
        elif sharded and grad.data_ptr() % _ALIGNMENT:
            # FSDP2's gradient shards are views at arbitrary offsets of its reduce buffer, and
            # vectorized kernels may round differently on unaligned data: an aligned copy keeps
            # the arithmetic that of a freshly allocated gradient (Note [Local shards]).
            grad = grad.clone()
        return grad

    def layout(self, p: torch.Tensor, group: dict[str, Any]) -> ParamLayout:
        """The (cached) block layout of ``p`` under ``group``'s options: that of its local shard
        when ``p`` is a DTensor (Note [Local shards])."""
        local = local_tensor(p)
        key = self._layout_key(local, group)
        cached = self._layouts.get(id(p))
        if cached is None or cached[0] != key:
            cached = (key, self._layout(local, group))
            self._layouts[id(p)] = cached
        return cached[1]

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


#: Statistics are kept this far below the dtype's largest value: their EMAs and sums add two
#: terms that are each below it (Note [Overflowing gradients]).
_OVERFLOW_MARGIN = 4.0


@functools.cache
def _float_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


#: The key of a runtime's refreshes in flight in ``KroneckerOptimizer.state_dict()``.
RUNTIME_STATE_KEY = "asteria_runtime"

#: What ``__getstate__`` leaves out: torch's hooks (as torch does), the refresher, the layouts.
_NOT_COPIED = frozenset(
    {
        "_refresher",
        "_layouts",
        "_summed_bounds",
        "_optimizer_step_pre_hooks",
        "_optimizer_step_post_hooks",
        "_optimizer_state_dict_pre_hooks",
        "_optimizer_state_dict_post_hooks",
        "_optimizer_load_state_dict_pre_hooks",
        "_optimizer_load_state_dict_post_hooks",
    }
)

#: Attributes an optimizer pickled before they existed takes on unpickling (their defaults in
#: ``KroneckerOptimizer.__init__``).
_ATTRIBUTE_DEFAULTS: dict[str, Any] = {
    "max_consecutive_failures": 3,
    "skip_nonfinite_grads": True,
    "nonfinite_grads": 0,
    "param_names": {},
    "_nonfinite_warned": False,
    "_overflow_warned": False,
    "_resumed_refreshes": None,
}

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
#     included), duplicates warn and a parameter in two groups is a ``ValueError``, as in torch;
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

# Note [Transactional loads]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``load_state_dict`` either loads the whole state_dict or raises a ``ValueError`` that names the
# first entry that does not fit and what was expected, and leaves the optimizer (and a runtime
# attached to it) exactly as it was. Everything is checked before anything changes
# (``_loaded_state``): the dict's form; the number of groups and of parameters; every group
# option this class keeps (a missing one means another optimizer class's state_dict, unless
# the class added it later, ``options_added_later``: an older state_dict takes its default) and its
# type and range (the constructor's own checks, ``_validate_group``); ``param_names``; every
# parameter's state against its ``_state_template`` under the loaded options: each key, tensor
# shape, floating-point dtype, an integer ``step``, and nothing more (state_format.py); with a
# runtime attached, that the options keep every parameter's blocks (the runtime planned for
# them) and the ``"asteria_runtime"`` part against the state about to be loaded
# (``Runtime.check_state_dict``: blocks, steps, result shapes, and that each refresh can be
# installed within the budget: Note [Checkpoints with work in flight] in
# asteria/runtime/state.py). Only then are the groups and the state replaced, and the refresher
# told (``state_replaced``): a runtime drops its refreshes in flight, which were requested from
# the old state (a loaded ``"asteria_runtime"`` part puts its own back), and takes each block's
# version from the loaded state, so the staleness contract holds across the load.
# ``Runtime.load_state_dict`` is transactional the same way. tests/unit/test_transactional_loads.py
# draws corruptions of a state_dict (another class, other shapes, missing and extra keys, wrong
# types, ranges and dtypes, truncated tensors) with hypothesis, for every optimizer with and
# without a runtime, and compares the whole state before and after each refused load.

# Note [Runtime state in the optimizer's checkpoint]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Frameworks (the HF Trainer, Lightning, torchtitan) save ``model.state_dict()`` and
# ``optimizer.state_dict()`` and know nothing of a runtime. So, with a runtime attached and
# refreshes in flight, ``optimizer.state_dict()`` carries the runtime's part under
# ``"asteria_runtime"`` (``Runtime.state_dict()``: each refresh finished first, with its request
# step and results; Note [Checkpoints with work in flight] in asteria/runtime/state.py).
# ``load_state_dict`` hands it to the runtime attached at the time, or keeps it for the runtime
# attached next (``attach_refresher``), which installs each refresh at the step it would have
# been installed at: the plain torch pattern (save both, load both in a fresh process, attach a
# runtime) resumes a ``fixed_delay`` run bit for bit (tests/unit/test_checkpoint.py). A native
# step before any runtime attaches drops it (native mode computes its own refreshes). Nothing
# is added when no refresh is in flight, and ``torch.distributed.checkpoint``'s state-dict API
# keeps only ``state`` and ``param_groups`` (use asteria.checkpoint there).


def _blocks_of(groups: list[dict[str, Any]], states: dict) -> Iterable[tuple]:
    """``KroneckerOptimizer.blocks`` of ``groups`` and ``states`` (the live ones, or those a
    load is about to install): ``(key, parameter, block state, group)``; the block's step is
    its parameter state's ``"step"``."""
    pid = 0
    for group in groups:
        for p in group["params"]:
            state = states.get(p)
            if state and "blocks" in state and not _is_placeholder(state):
                for bi, block in enumerate(state["blocks"]):
                    yield (pid, bi), p, block, group
            pid += 1


def _refresher_state(refresher: Any) -> dict[str, Any] | None:
    """The refresher's refreshes in flight, or None when it has none (or is native)."""
    if isinstance(refresher, NativeRefresher):
        return None
    state = refresher.state_dict()
    return state if state.get("pending") else None


def _param_list(name: str, params: Any) -> list:
    """``params`` as a list; an empty one becomes one empty group (an optimizer with nothing to
    do steps as a no-op, where ``torch.optim`` raises). What is not an ordered iterable is a
    ``TypeError`` in torch's words (Note [torch.optim conventions])."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, "
            f"but got {torch.typename(params)} ({name}: a single tensor goes in a list)"
        )
    if isinstance(params, set):
        raise TypeError(f"params of {name} must be an ordered collection (a list), not a set")
    try:
        params = list(params)
    except TypeError:
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, "
            f"but got {type(params).__name__} ({name})"
        ) from None
    return params if params else [{"params": []}]


#: Bytes: gradient shards not aligned to this are copied before use (``_checked_grad``).
_ALIGNMENT = 64


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (an FSDP2 / HSDP parameter or gradient), else ``t`` itself.

    Note [Local shards]: Asteria's optimizers work on local shards. Under ``no_grad`` (the step)
    ``DTensor.to_local()`` is the shard's own storage, so in-place updates reach the parameter.
    Blocks, factors, moments and refresh results are those of the local shard (its layout is the
    layout of the local shape); state holds plain tensors, and a ``state_dict`` loads back on the
    same sharding.
    """
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


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


#: The ``"step"`` of a placeholder state (Note [State-initialisation probe]); real steps are >= 0.
PLACEHOLDER_STEP = -1


def _is_placeholder(state: dict[str, Any]) -> bool:
    return state.get("step") == PLACEHOLDER_STEP


def basis_zeros(d: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """A ``d x d`` zero matrix in column-major order, the layout of the bases the refreshes
    return (Note [QR layout] in matrix_functions.py): a placeholder's basis."""
    return torch.zeros(d, d, dtype=dtype, device=device).T


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device=device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    return value


def block_views(t: torch.Tensor, layout: ParamLayout) -> list[torch.Tensor]:
    """Views of ``t`` (viewed with the layout's shape) for every block, in layout order."""
    v = layout.view(t)
    return [v[b.index] for b in layout.blocks]


def _halves(items: list[T], costs: list[float]) -> tuple[list[T], list[T]]:
    """``items`` in two parts of about equal cost (largest first, each to the cheaper part so
    far), each in its original order."""
    side, load = [0] * len(items), [0.0, 0.0]
    for i in sorted(range(len(items)), key=lambda i: -costs[i]):
        side[i] = 0 if load[0] <= load[1] else 1
        load[side[i]] += costs[i]
    return (
        [x for x, s in zip(items, side) if s == 0],
        [x for x, s in zip(items, side) if s == 1],
    )


def zeros_like_blocks(layout: ParamLayout, dtype: torch.dtype, device) -> list[torch.Tensor]:
    return [torch.zeros(b.shape, dtype=dtype, device=device) for b in layout.blocks]
