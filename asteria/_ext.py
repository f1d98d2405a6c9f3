"""Loads the C++ extension ``asteria._C`` and checks it was built against the running torch.

Owns: the import of ``asteria._C`` and the one clear error a user sees when the extension is
missing, stale, or built against another torch (instead of an opaque ``undefined symbol``).

Must not: import anything of asteria beyond ``asteria._build_info`` and ``asteria._C``; it runs
first, from ``asteria/__init__.py``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

__all__ = ["REBUILD_HINT", "ExtensionVersionError", "cuda_missing", "load_extension"]

REBUILD_HINT = (
    "rebuild it against the installed torch: `pip install --no-build-isolation --no-deps -e .` "
    "(or `make build`) in the asteria checkout"
)


class ExtensionVersionError(ImportError):
    """``asteria._C`` is missing or was built against another torch than the running one."""


def _base_version(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``: the extension's TORCH_VERSION macro has no local tag."""
    return version.split("+", 1)[0]


def _recorded_torch_version() -> str | None:
    try:
        build_info = importlib.import_module("asteria._build_info")
    except ImportError:
        return None
    return str(build_info.TORCH_VERSION)


def load_extension() -> ModuleType:
    """Import ``asteria._C``; raise ExtensionVersionError (an ImportError) when it is unusable."""
    running = torch.__version__
    built = _recorded_torch_version()
    if built is not None and built != running:
        raise ExtensionVersionError(
            f"asteria._C was built against torch {built}, but torch {running} is running; "
            + REBUILD_HINT
        )
    try:
        ext = importlib.import_module("asteria._C")
    except ImportError as e:
        raise ExtensionVersionError(
            f"asteria._C cannot be loaded (built against torch {built or 'unknown'}, running torch "
            f"{running}): {e}; {REBUILD_HINT}"
        ) from e
    compiled = str(ext.build_info()["torch_version"])
    if compiled != _base_version(running):
        raise ExtensionVersionError(
            f"asteria._C was compiled against torch {compiled}, but torch {running} is running; "
            + REBUILD_HINT
        )
    return ext


def cuda_missing(ext: ModuleType) -> str | None:
    """Why ``ext`` (``asteria._C``) has no CUDA and how to fix it; None for a CUDA build (Note
    [CPU-only builds on CUDA machines] in setup.py): what ``python -m asteria.info`` and the
    runtime's attach on CUDA parameters say."""
    if ext.cuda_enabled():
        return None
    try:
        reason = getattr(importlib.import_module("asteria._build_info"), "CUDA_MISSING", None)
    except ImportError:
        reason = None
    if torch.version.cuda:
        major = torch.version.cuda.split(".")[0]
        reason = (
            reason or f"asteria._C was built without CUDA (torch has CUDA {torch.version.cuda})"
        )
        fix = (
            f"install a CUDA {major}.x toolkit (nvcc and headers), point CUDA_HOME at it and "
            "rebuild: `ASTERIA_FORCE_CUDA=1 pip install --no-build-isolation --no-deps -e .` "
            "(docs/gpu.md)"
        )
        if "ASTERIA_NO_CUDA" in reason:
            fix = f"rebuild without ASTERIA_NO_CUDA, with a CUDA {major}.x toolkit: " + fix
    else:
        reason = f"asteria._C was built without CUDA: torch {torch.__version__} has no CUDA"
        fix = "install a torch with CUDA, then rebuild asteria._C against it with a CUDA toolkit"
    return f"{reason}. To use Asteria on a GPU, {fix}"
