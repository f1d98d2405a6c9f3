"""The machine and software a run or benchmark measured on, as one flat dict.

Owns: collecting versions, thread counts, CPU and accelerator names. Must not: change any setting
(threads are set by the caller before asking).
"""

from __future__ import annotations

import os
import platform
from importlib import metadata

import torch


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo where there is one, else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment(*packages: str) -> dict[str, object]:
    """Versions, threads and hardware; ``packages`` adds the versions of those distributions."""
    env: dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": f"{platform.system()} {platform.machine()}",
    }
    for name in packages:
        env[name] = package_version(name)
    return env
