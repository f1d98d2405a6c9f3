"""The import of a framework an integration needs, with a message that says how to get it.

Owns: ``require``. Must not: import anything at its own import.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, integration: str, install: str) -> ModuleType:
    """``import module``, or an ImportError that names the integration and the install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{integration} needs {module.split('.')[0]}, which is not installed "
            f"(pip install {install}): {e}"
        ) from e
