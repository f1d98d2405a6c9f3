"""The training job's own packages: the ``asteria[train]`` extra.

Owns: which modules the main job needs beyond torch (``EXTRA_MODULES``, by import name), the
check naming the missing ones and the command that installs them (``require``), and the console
entry point ``asteria-train`` / ``python -m asteria.train`` (``main``), which checks first.

Must not: import any of those packages (it runs where they are missing) or anything of the job.

Note [The train extra]: the optimizers and the runtime need torch alone; the main job (an OLMo-2
model from ``transformers``, numpy corpora, matplotlib plots, tqdm, NVML energy) takes its
packages from ``pip install 'asteria[train]'`` (``nvidia-ml-py`` optional: without it energy is
reported as not measured). requirements-test.txt holds them too
(tests/unit/test_dependencies.py).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

__all__ = ["EXTRA", "EXTRA_MODULES", "MissingExtraError", "main", "missing", "require"]

#: The extra that holds the main job's packages.
EXTRA = "train"
#: Module name -> the package of the extra that provides it (those the job cannot run without).
EXTRA_MODULES = {
    "numpy": "numpy",
    "transformers": "transformers",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
}
INSTALL = f"pip install 'asteria[{EXTRA}]'"


class MissingExtraError(ImportError):
    """The main job's packages are not installed; the message says how to install them."""


def missing() -> list[str]:
    """The packages of ``EXTRA_MODULES`` that cannot be imported here, in its order."""
    return [pkg for mod, pkg in EXTRA_MODULES.items() if not _importable(mod)]


def _importable(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require() -> None:
    """Raise ``MissingExtraError`` naming the missing packages and the extra to install."""
    absent = missing()
    if absent:
        raise MissingExtraError(
            f"asteria.train (asteria-train) needs the '{EXTRA}' extra, and {', '.join(absent)} "
            f"{'is' if len(absent) == 1 else 'are'} not installed: {INSTALL} (from a checkout: "
            f"pip install --no-build-isolation -e '.[{EXTRA}]'). The optimizers and the runtime "
            "need torch alone."
        )


def main(argv: Sequence[str] | None = None) -> int:
    """``asteria-train``: the job's command line, or the install hint (exit 1) without its
    packages."""
    try:
        require()
    except MissingExtraError as err:
        print(f"asteria-train: {err}", file=sys.stderr)
        return 1
    from asteria.train.cli import main as cli_main

    return cli_main(argv)
