"""examples/: Asteria's optimizers inside the Hugging Face Trainer and OLMo-core's trainer,
through ``asteria.integrations.hf`` and ``asteria.integrations.olmo_core``, end to end."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import pytest
import torch

needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="the HF Trainer needs accelerate"
)
# ai2-olmo-core 3.0.0 (the newest) requires torch < 2.14: not installed beside a newer torch
needs_olmo_core = pytest.mark.skipif(
    importlib.util.find_spec("olmo_core") is None, reason="needs ai2-olmo-core (torch < 2.14)"
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


OLMO_STEPS = 20
#: Where the interrupted runs stop: SOAP's refreshes requested at trainer step 11 (its optimizer
#: step 10; the first step only initialises) install at step 13 (``fixed_delay=2``), so they are
#: in flight when the checkpoint of step 12 is written.
OLMO_STOP = 12


@pytest.fixture(scope="module")
def olmo_core_runs(tmp_path_factory) -> dict[str, tuple[list[float], Any]]:
    """examples/olmo_core_optim.py's run() with SOAP in both modes (Asteria mode with
    ``fixed_delay=2``, which makes it deterministic): 20 steps straight ("native", "asteria"),
    and stopped at step 12 then resumed from OLMo-core's checkpoint by a fresh trainer in the same
    work dir ("<mode>/first", "<mode>/resumed")."""
    from examples.olmo_core_optim import run

    runs = {}
    for mode in ("native", "asteria"):
        straight, interrupted = (str(tmp_path_factory.mktemp(mode)) for _ in range(2))
        runs[mode] = run("soap", mode, OLMO_STEPS, work_dir=straight, fixed_delay=2)
        runs[f"{mode}/first"] = run(
            "soap", mode, OLMO_STEPS, work_dir=interrupted, stop_at=OLMO_STOP, fixed_delay=2
        )
        runs[f"{mode}/resumed"] = run("soap", mode, OLMO_STEPS, work_dir=interrupted, fixed_delay=2)
    return runs


@needs_olmo_core
@pytest.mark.parametrize("mode", ["native", "asteria"])
def test_olmo_core_trainer_trains_with_soap(mode: str, olmo_core_runs) -> None:
    from asteria.optim import SOAP

    losses, trainer = olmo_core_runs[mode]
    assert len(losses) == OLMO_STEPS and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0  # from ln(257) = 5.55
    opt, params = trainer.train_module.optim, list(trainer.train_module.model.parameters())
    assert type(opt) is SOAP and len(opt.state) == len(params)
    # One step per trainer step (the first only sets up the eigenbases): OLMo-core's dry-run
    # batch before training runs a backward but no optimizer step.
    assert all(opt.state[p]["step"] == OLMO_STEPS - 1 for p in params)
    if mode == "asteria":
        callback = trainer.callbacks["asteria"]
        assert callback.runtime is None  # attached in pre_train, detached in post_train
        assert callback.stats["steps"] == OLMO_STEPS and callback.stats["installs"] > 0


@needs_olmo_core
def test_olmo_core_asteria_mode_matches_native_before_the_first_refresh(olmo_core_runs) -> None:
    from asteria.integrations.olmo_core import AsteriaSOAPConfig

    # Same seed and data order; the modes differ only in when a refresh is installed.
    first = AsteriaSOAPConfig.precondition_frequency
    native, asteria = olmo_core_runs["native"][0], olmo_core_runs["asteria"][0]
    assert asteria[:first] == pytest.approx(native[:first], rel=1e-5)


@needs_olmo_core
@pytest.mark.parametrize("mode", ["native", "asteria"])
def test_olmo_core_checkpoint_resumes_bit_for_bit(mode: str, olmo_core_runs) -> None:
    """OLMo-core's own checkpointing (torch's state-dict API, flattened and offloaded to the CPU,
    through DCP): a fresh trainer resumed from the checkpoint of step 12 logs the losses of the
    uninterrupted run exactly; in Asteria mode with the refreshes that were in flight."""
    straight = olmo_core_runs[mode][0]
    first, trainer = olmo_core_runs[f"{mode}/first"]
    resumed, resumed_trainer = olmo_core_runs[f"{mode}/resumed"]
    assert first == straight[:OLMO_STOP]
    assert len(resumed) == OLMO_STEPS - OLMO_STOP and resumed == straight[OLMO_STOP:]
    opt = resumed_trainer.train_module.optim
    params = resumed_trainer.train_module.model.parameters()
    assert all(opt.state[p]["step"] == OLMO_STEPS - 1 for p in params)
    if mode == "asteria":  # stats() of the interrupted run at its end: at the checkpoint
        assert trainer.callbacks["asteria"].stats["jobs"]["in_flight"] > 0


@needs_olmo_core
def test_olmo_core_optim_configs_build_asteria_optimizers() -> None:
    from olmo_core.optim import OptimGroupOverride

    from asteria.integrations.olmo_core import (
        AsteriaKLShampooConfig,
        AsteriaRuntimeCallback,
        AsteriaShampooConfig,
        AsteriaSOAPConfig,
    )
    from asteria.optim import SOAP, KLShampoo, Shampoo

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
