"""torch.compile (issue 23, item 2; Note [torch.compile] in asteria/optim/base.py, Note [Signals
under torch.compile] in asteria/runtime/hooks.py, docs/compile.md).

A model compiled with ``torch.compile`` trains with a runtime attached and its module hooks
registered, with no graph break (counted with ``torch._dynamo.utils.counters``); a compiled
training step that calls ``opt.step()`` computes what the eager one does, bit for bit, and
breaks its graph only where docs/compile.md says: ``loss.backward()`` (torch's), ``opt.step()``
and ``opt.zero_grad()`` (run eagerly). The ``aot_eager`` backend traces forward and backward as
inductor would, without compiling kernels (no C++ compiler, seconds per test).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.runtime import Runtime, RuntimeConfig

OPTIMIZERS = {"soap": SOAP, "kl_shampoo": KLShampoo, "shampoo": Shampoo}
BACKEND = "aot_eager"
#: The graph breaks of a compiled training step (docs/compile.md): torch's ``Tensor.backward()``,
#: and the two ``torch.compiler.disable``d methods, entered and skipped.
EXPECTED_BREAKS = ("Tensor.backward()", "KroneckerOptimizer.step", "KroneckerOptimizer.zero_grad")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batches(n: int) -> list[torch.Tensor]:
    return [torch.randn(32, 8, generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _train_step(model, opt, x) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graph_breaks() -> dict[str, int]:
    return dict(counters["graph_break"])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_compiled_model_trains_with_a_runtime_without_graph_breaks(name, fresh_dynamo):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters(), lr=1e-2, precondition_frequency=2)
    with Runtime(model, opt, RuntimeConfig(staleness=2, workers=1)) as runtime:
        assert runtime.stats()["hooks"] > 0  # the module hooks are registered
        compiled = torch.compile(model, backend=BACKEND)
        losses = [_train_step(compiled, opt, x).item() for x in _batches(8)]
        stats = runtime.stats()
    assert _graph_breaks() == {}
    assert counters["stats"]["unique_graphs"] >= 1  # it did compile
    assert stats["steps"] == 8 and stats["installs"] > 0
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("mode", ["native", "runtime"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_compiled_training_step_matches_eager(name, mode, fresh_dynamo):
    config = RuntimeConfig(staleness=2, fixed_delay=1, workers=1)  # reproducible installs
    params = []
    for compiled in (False, True):
        model = _model()
        opt = OPTIMIZERS[name](model.parameters(), lr=1e-2, precondition_frequency=2)
        runtime = Runtime(model, opt, config) if mode == "runtime" else None
        step = torch.compile(_train_step, backend=BACKEND) if compiled else _train_step
        try:
            for x in _batches(6):
                step(model, opt, x)
        finally:
            if runtime is not None:
                runtime.close()
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params))
    breaks = _graph_breaks()
    assert breaks, "a compiled step breaks its graph at backward, step and zero_grad"
    for reason in breaks:
        assert any(cause in reason for cause in EXPECTED_BREAKS), reason
    for cause in EXPECTED_BREAKS:
        assert any(cause in reason for reason in breaks), cause
