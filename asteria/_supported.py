"""The torch and Python versions Asteria supports, in one place.

Owns: the supported ranges, ``verdict(torch_version)`` (inside, newer, older) and the messages
that setup.py, ``import asteria`` and ``asteria.info`` give outside them (Note [Supported
torch]); what differs inside the range is asteria/_compat.py's.

Must not: import torch or anything of asteria: setup.py reads this file before it builds.

Note [Supported torch]
~~~~~~~~~~~~~~~~~~~~~~
The extension loads only with the torch it was built against (asteria/_ext.py), and the Python
code follows torch's optimizer and compile internals closely (step hooks, state-dict hooks,
``torch.compiler.disable``, ``OptimizerInfo``), so a release is supported once the suite passed
on it: torch ``TORCH_MIN`` through ``TORCH_MAX`` on CPython ``PYTHON_MIN`` through
``PYTHON_MAX``. ``TESTED`` says how (CI at both ends its machine installs, ``make test-torch
TORCH=<release>``, docs/versions.md for runs by hand). An older torch is refused before the
build (``ASTERIA_UNSUPPORTED_TORCH=1`` builds anyway, warning); a newer torch or Python builds and
runs with a warning naming the tested range.
"""

from __future__ import annotations

__all__ = [
    "OVERRIDE",
    "PYTHON_MAX",
    "PYTHON_MIN",
    "TESTED",
    "TORCH_MAX",
    "TORCH_MIN",
    "python_warning",
    "refusal",
    "release",
    "supported_range",
    "verdict",
    "warning",
]

#: The oldest supported torch (major, minor).
TORCH_MIN = (2, 11)
#: The newest supported torch (major, minor): newer ones build with a warning.
TORCH_MAX = (2, 15)
#: The oldest supported CPython (torch 2.15 itself needs 3.11).
PYTHON_MIN = (3, 11)
#: The newest tested CPython.
PYTHON_MAX = (3, 12)
#: The torch releases the whole suite has passed on, and how it runs there.
TESTED = {
    "2.11.0": "CUDA 13.0 wheel, run on the CPU: make test-torch TORCH=2.11.0 (docs/versions.md)",
    "2.13.0": "CPU wheel (.venv): make test (CI)",
    "2.14.1": "CUDA 13.0 wheel, run on the CPU (.venv-cuda): make test-torch-cuda (CI)",
    "2.15.0": "CUDA 13.2 wheel, run on the CPU: make test-torch TORCH=2.15.0 (docs/versions.md)",
}

#: Set to 1 to build against a torch older than the range anyway.
OVERRIDE = "ASTERIA_UNSUPPORTED_TORCH"


def release(version: str) -> tuple[int, int]:
    """``"2.14.1+cu130"`` -> ``(2, 14)``; ``"2.16.0.dev20260101"`` -> ``(2, 16)``."""
    major, minor = version.split("+", 1)[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def supported_range() -> str:
    """The range in words: ``"torch 2.11 to 2.15"``."""
    return f"torch {_dotted(TORCH_MIN)} to {_dotted(TORCH_MAX)}"


def python_range() -> str:
    """``"Python 3.11 to 3.12"``."""
    return f"Python {_dotted(PYTHON_MIN)} to {_dotted(PYTHON_MAX)}"


def verdict(torch_version: str) -> str:
    """``"inside"``, ``"newer"`` (than the range) or ``"older"``."""
    r = release(torch_version)
    if r < TORCH_MIN:
        return "older"
    return "newer" if r > TORCH_MAX else "inside"


def _tested() -> str:
    return ", ".join(TESTED)


def refusal(torch_version: str) -> str | None:
    """The message for a torch older than the range (which setup.py refuses), else None."""
    if verdict(torch_version) != "older":
        return None
    return (
        f"Asteria supports {supported_range()} (tested: {_tested()}); torch {torch_version} is "
        f"installed. Install a supported torch first (e.g. pip install torch=={list(TESTED)[-1]}) "
        f"and build again, or set {OVERRIDE}=1 to build against this one anyway, untested "
        "(docs/versions.md)."
    )


def warning(torch_version: str) -> str | None:
    """The warning for a torch newer than the range (which builds and runs), else None."""
    if verdict(torch_version) != "newer":
        return None
    return (
        f"torch {torch_version} is newer than the releases Asteria is tested on "
        f"({supported_range()}; tested: {_tested()}): it should work, but the test suite has not "
        "run on it (make test-torch TORCH=<release> runs it; docs/versions.md)."
    )


def python_warning(python_version: tuple[int, ...]) -> str | None:
    """The warning for a CPython outside :func:`python_range`, else None (setup.py, asteria.info;
    pyproject.toml's requires-python refuses an older one before either)."""
    if PYTHON_MIN <= tuple(python_version[:2]) <= PYTHON_MAX:
        return None
    return (
        f"Python {_dotted(tuple(python_version[:3]))} is outside the tested {python_range()} "
        "(docs/versions.md)."
    )
