"""Optimizer table for `asteria.train`: name -> constructor and learning rates that work.

Owns: the names the CLI accepts, each optimizer's hyperparameters for the demo, its learning-rate
schedule, and the documented default learning rates. Must not: implement optimizer math (that
lives in `asteria.optim` and `torch.optim`). Every parameter goes to one group, and the
second-order optimizers handle 1-D parameters (norm weights) with their Adam path and
precondition the embedding and head matrices like any other; the one exception is ``muon``
(Note [Muon as people use it]), which splits the model's hidden matrices from the rest.

Learning rates: bench/time_to_target.py's tuning (issue 24; issue 49 for ``muon`` and SOAP at
frequency 1), every optimizer at the four rates of its grid, seed 0, the lowest final validation
loss chosen per preset (``nano``, ``tiny``; other presets take ``tiny``'s, untuned: pass
``--lr``). The grids, losses and caveats: docs/benchmarks.md, "The demo's learning rates".
KL-Shampoo uses shampoo_beta 0.9, not the authors' 0.98 (``_kl_shampoo``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

Params = Iterable[torch.nn.Parameter]


def _adamw(params: Params, lr: float) -> Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def _soap(params: Params, lr: float) -> Optimizer:
    from asteria.optim import SOAP

    return SOAP(params, lr=lr, betas=(0.95, 0.95), weight_decay=0.01, precondition_frequency=10)


def _kl_shampoo(params: Params, lr: float) -> Optimizer:
    from asteria.optim import KLShampoo

    # shampoo_beta 0.9, not the authors' 0.98: the eigenvalue estimates start at init_factor (0.1,
    # far above a small LM's gradient scale) and at 0.98 take hundreds of steps to settle.
    return KLShampoo(
        params,
        lr=lr,
        betas=(0.9, 0.98),
        shampoo_beta=0.9,
        weight_decay=0.01,
        precondition_frequency=10,
    )


def _soap_f1(params: Params, lr: float) -> Optimizer:
    from asteria.optim import SOAP

    # the quality reference: a refresh at every step, as NVIDIA's Emerging-Optimizers SOAP and
    # the step-count record of modded-nanogpt's optimization track run it
    return SOAP(params, lr=lr, betas=(0.95, 0.95), weight_decay=0.01, precondition_frequency=1)


def _shampoo(params: Params, lr: float) -> Optimizer:
    from asteria.optim import Shampoo

    return Shampoo(params, lr=lr, betas=(0.9, 1.0), precondition_frequency=10, grafting="adam")


# Note [Muon as people use it]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``muon`` is torch.optim.Muon (torch >= 2.9) as its documentation and published trainings use
# it: Muon on the hidden 2-D matrices only (``hidden_matrices``; a bare list of parameters: every
# 2-D one), AdamW (the ``adamw`` entry's settings) on embeddings, norms, biases and the output
# layer; torch's defaults (momentum 0.95, Nesterov, 5 Newton-Schulz steps, weight decay 0.1)
# with ``adjust_lr_fn="match_rms_adamw"`` (Moonshot, arXiv 2502.16982), so one tuned rate drives
# both parts; Keller Jordan's schedule (no warmup, the peak for 60 % of the steps, then a linear
# cooldown to 10 %: ``"stable-cooldown"``). Refused under FSDP/HSDP (Newton-Schulz on a shard is
# not Muon). One deviation, on a CPU only: a CPU without bfloat16 matrix units multiplies it 15
# to 40 times slower than float32 (torch's Muon: 11-20 s a step on ``tiny``), so the iteration
# runs in float32 there (``CPUMuon``: torch's update line for line; tests/unit/test_train.py
# checks it is torch.optim.Muon bit for bit in bfloat16).

MUON_MOMENTUM = 0.95
MUON_WEIGHT_DECAY = 0.1  # torch.optim.Muon's default (Moonshot's value)
MUON_COOLDOWN_FRAC = 0.4  # modded-nanogpt's cooldown_frac


class CPUMuon(torch.optim.Muon):
    """``torch.optim.Muon`` with its Newton-Schulz iteration in ``ns_dtype`` (default: bfloat16,
    torch's, on a GPU; float32 on a CPU; Note [Muon as people use it]). Everything else is
    torch's: its parameters, state, hyperparameters, and the update of ``_single_tensor_muon``
    line for line."""

    def __init__(self, params, *, ns_dtype: torch.dtype | None = None, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
            for param, grad, buf in zip(params, grads, bufs):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                dtype = self.ns_dtype or (torch.float32 if grad.device.type == "cpu" else None)
                if dtype in (None, torch.bfloat16):
                    update = _zeropower_via_newtonschulz(
                        update, group["ns_coefficients"], group["ns_steps"], group["eps"]
                    )
                else:
                    update = _newton_schulz(
                        update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype
                    )
                adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], param.shape)
                param.mul_(1 - lr * wd)
                param.add_(update, alpha=-adjusted_lr)
        return loss


def _newton_schulz(
    grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype
) -> torch.Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz in ``dtype`` instead of bfloat16."""
    a, b, c = coefficients
    x = grad.to(dtype)
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x


class MuonWithAdamW(Optimizer):
    """``torch.optim.Muon`` on the hidden matrices and ``torch.optim.AdamW`` on the rest, stepped as
    one ``Optimizer`` (one scheduler, ``zero_grad`` and ``state_dict``: Note [Muon as people use
    it]). The two do all the math; this class shares their param groups (``"muon": True/False``) and
    state. ``adamw`` is None where every parameter is a hidden matrix."""

    def __init__(self, hidden: list[torch.nn.Parameter], rest: list[torch.nn.Parameter], lr: float):
        if not hidden:
            raise ValueError("muon: no hidden 2-D matrix to optimize (Muon takes 2-D parameters)")
        self.muon = CPUMuon(
            hidden,
            lr=lr,
            momentum=MUON_MOMENTUM,
            weight_decay=MUON_WEIGHT_DECAY,
            adjust_lr_fn="match_rms_adamw",
        )
        self.adamw = _adamw(rest, lr) if rest else None
        groups = list(self.muon.param_groups)
        for g in groups:
            g["muon"] = True
        if self.adamw is not None:
            for g in self.adamw.param_groups:
                g["muon"] = False
            groups += self.adamw.param_groups
        super().__init__(groups, {"lr": lr})  # the same group dicts: one schedule sets both
        self._link()

    def _link(self) -> None:
        self.muon.param_groups = [g for g in self.param_groups if g["muon"]]
        self.muon.state = self.state
        if self.adamw is not None:
            self.adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
            self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        if self.adamw is not None:
            self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        super().load_state_dict(state_dict)  # new group dicts and state: hand them on
        self._link()


def hidden_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The hidden 2-D matrices of ``model``: every 2-D parameter but the input embedding and the
    output layer (Note [Muon as people use it])."""
    outer = set()
    for get in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, get, lambda: None)()
        if module is not None and getattr(module, "weight", None) is not None:
            outer.add(id(module.weight))
    return [p for p in model.parameters() if p.ndim == 2 and id(p) not in outer]


def _muon(params: Params, lr: float, hidden: Iterable[torch.nn.Parameter] | None = None):
    params = list(params)
    if hidden is None:  # torch's docstring example: every 2-D parameter to Muon
        hidden_ids = {id(p) for p in params if p.ndim == 2}
    else:
        hidden_ids = {id(p) for p in hidden}
    return MuonWithAdamW(
        [p for p in params if id(p) in hidden_ids],
        [p for p in params if id(p) not in hidden_ids],
        lr,
    )


TUNED_PRESET = "tiny"  # whose rates the untuned presets use
# bench/time_to_target.py's tuning of the two issue-49 references (see the module doc)
MUON_LRS = {"nano": 5e-3, "tiny": 4e-3}
SOAP_F1_LRS = {"nano": 2e-2, "tiny": 1.2e-2}


SCHEDULES = ("warmup-cosine", "stable-cooldown")


@dataclass(frozen=True)
class OptimizerSpec:
    """One trainable optimizer: its CLI name, tuned learning rates per preset, constructor, and
    learning-rate schedule (``loop.lr_factor``: ``"warmup-cosine"``, or ``"stable-cooldown"``
    for Muon, Note [Muon as people use it])."""

    name: str
    lrs: dict[str, float]
    summary: str
    factory: Callable[..., Optimizer]
    schedule: str = "warmup-cosine"
    needs_hidden: bool = False  # the factory takes ``hidden=`` (the model's hidden matrices)

    def lr_for(self, model: str) -> float:
        """The documented learning rate on preset ``model`` (``tiny``'s where not tuned)."""
        return self.lrs.get(model, self.lrs[TUNED_PRESET])


OPTIMIZERS: dict[str, OptimizerSpec] = {
    s.name: s
    for s in (
        OptimizerSpec(
            "adamw", {"nano": 3e-3, "tiny": 1e-3}, "torch.optim.AdamW, betas (0.9, 0.95)", _adamw
        ),
        OptimizerSpec(
            "soap", {"nano": 2e-2, "tiny": 6e-3}, "asteria.optim.SOAP, refresh every 10", _soap
        ),
        OptimizerSpec(
            "kl-shampoo",
            {"nano": 1e-2, "tiny": 5e-3},
            "asteria.optim.KLShampoo, refresh every 10",
            _kl_shampoo,
        ),
        OptimizerSpec(
            "shampoo",
            {"nano": 3e-3, "tiny": 1.5e-3},
            "asteria.optim.Shampoo, Adam grafting",
            _shampoo,
        ),
        OptimizerSpec(
            "muon",
            MUON_LRS,
            "torch.optim.Muon on hidden matrices + AdamW on the rest",
            _muon,
            schedule="stable-cooldown",
            needs_hidden=True,
        ),
        OptimizerSpec(
            "soap-f1",
            SOAP_F1_LRS,
            "asteria.optim.SOAP, refresh every step (the quality reference)",
            _soap_f1,
        ),
    )
}


def get_spec(name: str) -> OptimizerSpec:
    """The optimizer called ``name``; ``ValueError`` listing the known ones otherwise."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(
            f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}"
        ) from None


# native: the optimizer alone; asteria: under asteria.Runtime (its configuration as given);
# continuous: under the runtime with RuntimeConfig(refresh="continuous")
MODES = ("native", "asteria", "continuous")
RUNTIME_MODES = frozenset({"asteria", "continuous"})
FIRST_ORDER = frozenset({"adamw", "muon"})  # no refreshes: only the native mode exists


@dataclass(frozen=True)
class RunSpec:
    """One run of a comparison: optimizer ``name`` in ``mode``; ``label`` names it everywhere
    (``adamw``, ``soap:native``, ``soap:asteria``)."""

    name: str
    mode: str = "native"

    @property
    def label(self) -> str:
        return self.name if self.name in FIRST_ORDER else f"{self.name}:{self.mode}"


def parse_run(text: str, default_mode: str = "native") -> RunSpec:
    """``"soap"``, ``"soap:asteria"`` or ``"adamw"`` -> a checked `RunSpec`."""
    name, _, mode = text.strip().partition(":")
    get_spec(name)
    if default_mode not in MODES:
        raise ValueError(f"unknown mode {default_mode!r}; choose from {', '.join(MODES)}")
    mode = mode.strip() or default_mode
    if mode not in MODES:
        raise ValueError(
            f"unknown mode {mode!r} in {text.strip()!r}; choose from {', '.join(MODES)}"
        )
    if name in FIRST_ORDER:
        if ":" in text and mode != "native":
            raise ValueError(
                f"{name} has no preconditioner refreshes to orchestrate: only {name} (native) "
                "exists; the asteria and continuous modes are for soap, soap-f1, kl-shampoo and "
                "shampoo"
            )
        mode = "native"
    return RunSpec(name, mode)


def parse_runs(text: str, default_mode: str = "native") -> list[RunSpec]:
    """``"adamw,soap:native,soap:asteria"`` -> run specs in order, each checked, no repeats.

    A name without ``:mode`` takes ``default_mode`` (AdamW is always native).
    """
    parts = [n for n in text.split(",") if n.strip()]
    if not parts:
        raise ValueError(
            f"no optimizer names in {text!r}; choose from {', '.join(OPTIMIZERS)} "
            f"(second-order ones as name:native, name:asteria or name:continuous)"
        )
    runs = [parse_run(part, default_mode) for part in parts]
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"optimizer runs repeat in {text!r}: {', '.join(labels)}")
    return runs


def parse_names(text: str) -> list[str]:
    """``"adamw,soap"`` -> ``["adamw", "soap"]``, each checked, no duplicates (names only)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"no optimizer names in {text!r}; choose from {', '.join(OPTIMIZERS)}")
    for name in names:
        get_spec(name)
    if len(set(names)) != len(names):
        raise ValueError(f"optimizer names repeat in {text!r}")
    return names


def build_optimizer(
    name: str,
    params: Params,
    lr: float | None = None,
    *,
    model: str = TUNED_PRESET,
    hidden: Iterable[torch.nn.Parameter] | None = None,
) -> Optimizer:
    """Construct optimizer ``name`` over ``params`` (one group; ``muon``: its two parts) at ``lr``
    or its rate for preset ``model``. ``hidden``: the model's hidden matrices (``muon`` alone
    reads them, ``hidden_matrices``)."""
    spec = get_spec(name)
    if lr is not None and not lr > 0.0:
        raise ValueError(f"lr must be > 0, got {lr}")
    rate = spec.lr_for(model) if lr is None else lr
    if spec.needs_hidden:
        return spec.factory(params, rate, hidden=hidden)
    return spec.factory(params, rate)
