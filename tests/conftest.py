"""Shared test configuration: import path, markers' skip helpers, the seeded test problem.

Markers (declared in pyproject.toml): ``slow`` (not in the default run), ``gpu`` (needs CUDA),
``distributed`` (spawns processes); ``no_gpu`` (declared below: runs only without CUDA).
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

# The one place that decides whether the CUDA tests run: a test (or a module, through
# ``pytestmark``) marked ``gpu`` is skipped where torch sees no CUDA device; one marked ``no_gpu``
# (it checks the behaviour without one) is skipped where torch sees one. On a CUDA machine with a
# CPU build of asteria._C the ``gpu`` tests run, and fail, saying to rebuild with CUDA.
CUDA_AVAILABLE = torch.cuda.is_available()
NEEDS_CUDA = "needs a CUDA device"
NEEDS_NO_CUDA = "checks the behaviour without a CUDA device"


def pytest_configure(config):
    config.addinivalue_line("markers", f"no_gpu: {NEEDS_NO_CUDA} (skipped with one)")


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests are skipped without CUDA, ``no_gpu`` tests with it."""
    unwanted = "no_gpu" if CUDA_AVAILABLE else "gpu"
    skip = pytest.mark.skip(reason=NEEDS_NO_CUDA if CUDA_AVAILABLE else NEEDS_CUDA)
    for item in items:
        if unwanted in item.keywords:
            item.add_marker(skip)
