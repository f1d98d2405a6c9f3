"""The torch and Python versions Asteria supports, in one place.

Owns: the supported ranges and ``refusal(torch_version)``, the message that setup.py and
``asteria.info`` give for a torch outside them (Note [Supported torch]).

Must not: import torch or anything of asteria: setup.py reads this file before it builds.

Note [Supported torch]
~~~~~~~~~~~~~~~~~~~~~~
Asteria's C++ extension is built against one torch and loads only with it (asteria/_ext.py),
and its Python code follows torch's optimizer and compile internals closely enough (the step
hooks' wrapper, the state-dict hooks, ``torch.compiler.disable``, ``torch.testing``'s
``OptimizerInfo``) that only tested releases are supported: torch ``TORCH_MIN`` up to (not
including) ``TORCH_BELOW``, on CPython ``PYTHON_MIN`` or newer. CI builds and runs the test
suite against both ends that the CI machine can install (``TESTED``: the CPU 2.13.0 wheel in
.venv and the CUDA 2.14.1 wheel, on the CPU, in .venv-cuda; Makefile, .ci/run). setup.py refuses
any other torch with a message that says which versions work; ``ASTERIA_UNSUPPORTED_TORCH=1``
builds anyway, with a warning (how the lent H200 machine, which has torch 2.11, builds).
torch 2.15 is measured in docs/versions.md.
"""

from __future__ import annotations

__all__ = ["PYTHON_MIN", "TESTED", "TORCH_BELOW", "TORCH_MIN", "refusal", "supported_range"]

#: The oldest supported torch (major, minor).
TORCH_MIN = (2, 13)
#: The first unsupported torch release (major, minor): supported are those below it.
TORCH_BELOW = (2, 15)
#: The oldest supported CPython (torch 2.15 itself needs 3.11).
PYTHON_MIN = (3, 11)
#: The torch releases the test suite runs against in CI, and how.
TESTED = {
    "2.13.0": "CPU wheel (.venv): make test",
    "2.14.1": "CUDA 13.0 wheel, run on the CPU (.venv-cuda): make test-torch-cuda",
}

#: Set to 1 to build against a torch outside the range anyway.
OVERRIDE = "ASTERIA_UNSUPPORTED_TORCH"


def _release(version: str) -> tuple[int, int]:
    """``"2.14.1+cu130"`` -> ``(2, 14)``; ``"2.16.0.dev20260101"`` -> ``(2, 16)``."""
    major, minor = version.split("+", 1)[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def supported_range() -> str:
    """The range in words: ``"torch >= 2.13, < 2.15"``."""
    lo, hi = (".".join(map(str, v)) for v in (TORCH_MIN, TORCH_BELOW))
    return f"torch >= {lo}, < {hi}"


def refusal(torch_version: str) -> str | None:
    """None for a supported torch, else the message that says which versions work."""
    if TORCH_MIN <= _release(torch_version) < TORCH_BELOW:
        return None
    tested = ", ".join(TESTED)
    return (
        f"Asteria supports {supported_range()} (tested: {tested}); torch {torch_version} is "
        f"installed. Install a supported torch first (e.g. pip install torch=={list(TESTED)[-1]}) "
        f"and build again, or set {OVERRIDE}=1 to build against this one anyway, untested "
        "(docs/versions.md)."
    )
