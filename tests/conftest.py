"""Shared test configuration: import path, markers' skip helpers, the seeded test problem.

Markers (declared in pyproject.toml): ``slow`` (not in the default run), ``gpu`` (needs CUDA),
``distributed`` (spawns processes).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Small problems: one intra-op thread keeps timings and results stable on the 2-core machine.
torch.set_num_threads(1)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped where CUDA is not available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
