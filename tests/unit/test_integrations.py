"""asteria.integrations (issue 23, item 5): part of the package, importing its framework only
when used, with a clear error where the framework is missing; what the HF Trainer is handed.
The end-to-end runs inside the HF Trainer and OLMo-core's trainer are in
tests/unit/test_train_examples.py (examples/ import these modules)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import asteria
from asteria.optim.refresher import NativeRefresher

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FRAMEWORKS = ("transformers", "accelerate", "olmo_core")


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )


def test_importing_asteria_imports_no_framework():
    proc = _python(
        f"""
        import sys
        import asteria, asteria.integrations, asteria.optim, asteria.runtime
        print([m for m in {FRAMEWORKS!r} if m in sys.modules])
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "module,framework,install",
    [
        ("hf", "transformers", "transformers accelerate"),
        ("olmo_core", "olmo_core", "ai2-olmo-core"),
    ],
)
def test_a_missing_framework_says_what_to_install(module, framework, install):
    proc = _python(
        f"""
        import sys
        sys.modules[{framework!r}] = None  # as if it were not installed
        try:
            import asteria.integrations.{module}
        except ImportError as e:
            print(e)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert f"asteria.integrations.{module} needs {framework}" in proc.stdout
    assert f"pip install {install}" in proc.stdout


needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers"
)


@needs_transformers
def test_trainer_kwargs_hand_the_trainer_an_asteria_optimizer_and_runtime():
    from asteria.integrations.hf import AsteriaRuntimeCallback, trainer_kwargs

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].bias.requires_grad_(False)
    kwargs = trainer_kwargs(model, "kl-shampoo", lr=1e-3)
    opt, sched = kwargs["optimizers"]
    assert type(opt) is asteria.optim.KLShampoo and sched is None
    assert opt.param_groups[0]["lr"] == 1e-3
    assert opt.param_groups[0]["param_names"] == ["0.weight", "0.bias", "1.weight"]
    (callback,) = kwargs["callbacks"]
    assert isinstance(callback, AsteriaRuntimeCallback) and callback.config is None

    config = asteria.RuntimeConfig(staleness=1, workers=1)
    kwargs = trainer_kwargs(
        model,
        asteria.optim.Shampoo,
        runtime=config,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5),
    )
    opt, sched = kwargs["optimizers"]
    assert type(opt) is asteria.optim.Shampoo and sched.optimizer is opt
    assert kwargs["callbacks"][0].config is config
    assert "callbacks" not in trainer_kwargs(model, "soap", runtime=False)
    with pytest.raises(ValueError, match="optimizer must be one of soap, kl-shampoo, shampoo"):
        trainer_kwargs(model, "adamw")
    with pytest.raises(ValueError, match="runtime must be True, False or a RuntimeConfig"):
        trainer_kwargs(model, runtime="yes")


@needs_transformers
def test_runtime_callback_attaches_and_closes():
    from asteria.integrations.hf import AsteriaRuntimeCallback

    model = torch.nn.Linear(4, 3)
    opt = asteria.optim.SOAP(model.parameters(), precondition_frequency=2)
    callback = AsteriaRuntimeCallback(asteria.RuntimeConfig(staleness=1, workers=1))
    wrapped = type("AcceleratedOptimizer", (), {"optimizer": opt})()  # Accelerate's wrapper
    callback.on_train_begin(None, None, None, model=model, optimizer=wrapped)
    assert opt.refresher is callback.runtime
    for _ in range(4):
        model(torch.randn(8, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    callback.on_train_end(None, None, None)
    assert callback.runtime is None and callback.stats["steps"] == 4
    assert isinstance(opt.refresher, NativeRefresher) and callback.stats["installs"] > 0
    with pytest.raises(ValueError, match="needs the Trainer's optimizer to be an Asteria"):
        callback.on_train_begin(
            None, None, None, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
        )
