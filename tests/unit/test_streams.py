"""``asteria.runtime.training_stream`` (Note [Stream priorities] in asteria/runtime/streams.py)
where no GPU is visible: it changes nothing and yields None, so that a training loop written
with it runs on the CPU as it is. The priorities on a GPU: tests/gpu/test_streams_gpu.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from asteria.optim import SOAP
from asteria.runtime import Runtime, RuntimeConfig, training_stream
from asteria.runtime.streams import stream_priorities
from tests.problems import mlp_24_32_32_4


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_without_a_gpu_the_training_stream_changes_nothing():
    assert stream_priorities() == {}
    for device in (None, "cpu", torch.device("cpu")):
        with training_stream(device) as stream:
            assert stream is None


def test_a_cpu_training_loop_inside_it_trains_as_without_it():
    def train(inside: bool):
        model = mlp_24_32_32_4()
        opt = SOAP(model.parameters(), precondition_frequency=2, max_preconditioner_dim=16)
        gen = torch.Generator().manual_seed(0)
        with Runtime(model, opt, RuntimeConfig(staleness=2, fixed_delay=2, workers=1)):
            with training_stream("cpu") if inside else contextlib.nullcontext():
                for _ in range(6):
                    opt.zero_grad()
                    model(torch.randn(8, 24, generator=gen)).square().mean().backward()
                    opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train(True), train(False)):
        assert torch.equal(a, b)
