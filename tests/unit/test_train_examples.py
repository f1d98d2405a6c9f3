"""examples/: Asteria's optimizers inside the Hugging Face Trainer and OLMo-core's OptimConfig."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="the HF Trainer needs accelerate"
)


@needs_accelerate
@pytest.mark.parametrize("mode", ["native", "asteria"])
def test_hf_trainer_trains_with_soap(mode: str, tmp_path) -> None:
    from examples.hf_trainer import run

    losses, callback = run("soap", mode, steps=12, output_dir=str(tmp_path))
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5  # from ln(257) = 5.55
    if mode == "asteria":
        assert callback.runtime is None and callback.stats["steps"] == 12  # attached, detached


def test_olmo_core_optim_configs_build_asteria_optimizers() -> None:
    pytest.importorskip("olmo_core", reason="ai2-olmo-core is not installed")
    from olmo_core.optim import OptimGroupOverride

    from asteria.optim import SOAP, KLShampoo, Shampoo
    from examples.olmo_core_optim import (
        AsteriaKLShampooConfig,
        AsteriaRuntimeCallback,
        AsteriaShampooConfig,
        AsteriaSOAPConfig,
    )

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    no_decay = [OptimGroupOverride(params=["*.bias"], opts={"weight_decay": 0.0})]
    for config, cls in [
        (AsteriaSOAPConfig, SOAP),
        (AsteriaKLShampooConfig, KLShampoo),
        (AsteriaShampooConfig, Shampoo),
    ]:
        opt = config(group_overrides=no_decay).build(model)
        assert type(opt) is cls and len(opt.param_groups) == 2
        assert opt.param_groups[0]["weight_decay"] == 0.0
        assert opt.param_groups[1]["initial_lr"] == config.lr
    callback = AsteriaRuntimeCallback(staleness=1, workers=1)
    callback.attach(model, opt)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    for _ in range(12):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert callback.runtime.stats()["installs"] > 0
    callback.detach()
    assert callback.runtime is None
