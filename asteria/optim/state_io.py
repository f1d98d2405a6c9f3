"""The state of a Kronecker-factored optimizer in and out: ``state_dict``, a transactional
``load_state_dict``, copies and pickles, with a runtime's refreshes in flight carried along.

Owns: ``StateIO``, the part of ``KroneckerOptimizer`` (base.py) that saves, checks and loads its
state (the flat form is state_format.py's), and what a copy or a pickle keeps.
Must not: step, or reach into a refresher beyond its ``Refresher`` methods (``state_dict``,
``check_state_dict``, ``load_state_dict``, ``state_replaced``, ``sync``).
"""

from __future__ import annotations

import copy
import sys
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from asteria.optim import state_format
from asteria.optim.refresher import NativeRefresher
from asteria.optim.tensors import _is_placeholder, _to_device, local_tensor

# Note [Transactional loads]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``load_state_dict`` loads the whole state_dict or raises a ``ValueError`` naming the first
# entry that does not fit, and leaves the optimizer (and an attached runtime) as it was: all is
# checked before anything changes (``_loaded_state``): the dict's form, the numbers of groups and
# parameters, every option (missing: another class's state_dict, unless added later,
# ``options_added_later``) by the constructor's checks, ``param_names``, every parameter's state
# against its ``_state_template`` (keys, shapes, dtypes, an integer ``step``: state_format.py),
# and with a runtime, that the options keep its blocks and its ``"asteria_runtime"`` part
# (``Runtime.check_state_dict``). Only then are groups and state replaced and the refresher told
# (``state_replaced``: a runtime drops its refreshes in flight and takes each block's version
# from the loaded state). tests/unit/test_transactional_loads.py draws corruptions with
# hypothesis and compares the whole state before and after each refused load.


# Note [Runtime state in the optimizer's checkpoint]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Frameworks (HF Trainer, Lightning, torchtitan) save ``optimizer.state_dict()`` and know nothing
# of a runtime. So with refreshes in flight it carries the runtime's part under
# ``"asteria_runtime"`` (Note [Checkpoints with work in flight] in asteria/runtime/state.py);
# ``load_state_dict`` hands it to the runtime attached then, or keeps it for the next one
# (``attach_refresher``): save both, load both in a fresh process, attach, and a ``fixed_delay``
# run resumes bit for bit (tests/unit/test_checkpoint.py). A native step before any runtime
# attaches drops it. DCP's state-dict API keeps only ``state`` and ``param_groups``.


#: The key of a runtime's refreshes in flight in ``KroneckerOptimizer.state_dict()``.
RUNTIME_STATE_KEY = "asteria_runtime"


#: What ``__getstate__`` leaves out: torch's hooks (as torch does), the refresher, the layouts.
_NOT_COPIED = frozenset(
    {
        "_refresher",
        "_native",
        "_layouts",
        "_summed_bounds",
        "_checked_options",
        "_state_keys",
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
    "_budget_warned": False,
    "_resumed_refreshes": None,
}


def blocks_of(groups: list[dict[str, Any]], states: dict) -> Iterable[tuple]:
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
    """The refresher's refreshes in flight, or None when it has none."""
    state = refresher.state_dict()
    return state if state and state.get("pending") else None


class StateIO:
    """``state_dict``, ``load_state_dict`` and pickling of ``KroneckerOptimizer`` (a mixin of
    it, before ``torch.optim.Optimizer``; the checks it runs on loaded groups and states are the
    optimizer's own: ``_validate_group``, ``_state_template``)."""

    def __getstate__(self) -> dict[str, Any]:
        """What a copy or a pickle keeps (Note [torch.optim conventions]): the groups, state,
        defaults and every other attribute, after deferred statistics ran, with a runtime's
        refreshes in flight as a loaded checkpoint's; not the hooks (as torch), the refresher or the
        layouts."""
        self._refresher.sync()
        state = {k: v for k, v in self.__dict__.items() if k not in _NOT_COPIED}
        in_flight = _refresher_state(self._refresher)
        if in_flight is not None:
            state["_resumed_refreshes"] = in_flight
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
        self._checked_options, self._state_keys = {}, {}  # by identity: made again
        self._native = NativeRefresher(self)
        self._refresher = self._native

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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict``, keeping every state tensor's saved dtype and layout.

        Takes the flat form :meth:`state_dict` writes, torch's unflattened one and earlier versions'
        nested form (Note [Flat optimizer state]). Unlike ``torch.optim`` it does not cast state to
        the parameter's dtype (fp32 state for bf16 parameters stays); the rest is torch's (Note
        [torch.optim conventions]): hooks, saved options, live ``param_names`` where the saved have
        none, entries not a parameter's kept as they are."""
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
        self._refresher.check_state_dict(in_flight, groups, state)  # against what is loaded
        self.param_groups, self.state = groups, state
        self._layouts.clear()  # layouts under the saved options were cached on the way
        self._state_keys.clear()  # the loaded state was checked against the parameters
        self._summed_bounds.clear()  # taken from the loaded state when next needed
        first = 0
        for group in self.param_groups:  # the loaded names, in messages too
            for i, param_name in enumerate(group.get("param_names", ()), first):
                self.param_names[i] = param_name
            first += len(group["params"])
        # what was in flight for the state just replaced no longer fits it
        self._refresher.state_replaced()
        self._resumed_refreshes = None
        if in_flight is not None:  # native mode keeps it for the runtime attached next
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

    def check_layouts_kept(self, groups: list[dict[str, Any]]) -> None:
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
