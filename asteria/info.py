"""``python -m asteria.info``: how the extension was built, what it found, and whether that fits,
and what the public low-level API can do here.

Owns: the build report (xformers' ``python -m xformers.info`` idea): the supported range and the
running torch and Python (asteria/_supported.py), the build record (``asteria/_build_info.py``),
``asteria._C.build_info()``, torch's config and ``asteria.lowlevel.capabilities()``;
``--spill-dir DIR`` probes O_DIRECT there. Must not: change any state or build anything (the
probe's scratch file is deleted before it returns).
"""

from __future__ import annotations

import argparse
import importlib
import platform
import re
import sys
from typing import Any

import torch

import asteria
from asteria import _C, _supported
from asteria._ext import cuda_missing
from asteria.lowlevel import capabilities


def _recorded_build() -> dict[str, Any]:
    try:
        module = importlib.import_module("asteria._build_info")
    except ImportError:
        return {}
    return {key: value for key, value in vars(module).items() if key.isupper()}


def _torch_lapack() -> str:
    """torch's LAPACK as its build config names it (``LAPACK_INFO=mkl`` -> ``mkl``)."""
    match = re.search(r"LAPACK_INFO=([^,\s]+)", torch.__config__.show())
    return match.group(1) if match else "unknown"


def collect(spill_dir: str | None = None) -> dict[str, Any]:
    """Everything the report prints, as a dict (also handy in bug reports and tests)."""
    ext = _C.build_info()
    recorded = _recorded_build()
    return {
        "asteria_version": asteria.__version__,
        "python": platform.python_version(),
        "torch_built_against": recorded.get("TORCH_VERSION", ext["torch_version"]),
        "torch_running": torch.__version__,
        "cuda_extension": bool(ext["cuda"]),
        "cuda_version": ext["cuda_version"] or None,
        "cuda_arch_list": recorded.get("CUDA_ARCH_LIST"),
        "cuda_available": torch.cuda.is_available(),
        # what a CPU-only build with a CUDA torch lacks, and how to fix it
        "cuda_missing": cuda_missing(_C) if torch.version.cuda else None,
        "lapack_backend": ext["lapack_backend"] or _torch_lapack(),
        "eigh_path": ext["eigh_path"],
        "per_worker_lapack_threads": bool(ext["thread_local_mkl"] or ext["thread_local_openmp"]),
        "default_workers": int(ext["default_workers"]),
        "cxx_flags": recorded.get("CXX_FLAGS"),
        "link": recorded.get("LINK"),
        "capabilities": capabilities(spill_dir).as_dict(),
        "supported_range": f"{_supported.supported_range()}, {_supported.python_range()}",
        "torch_in_range": _supported.verdict(torch.__version__),
        "python_in_range": _supported.python_warning(sys.version_info) is None,
    }


_IN_RANGE = {
    "inside": "yes",
    "newer": "no: newer than the tested range (should work, untested)",
    "older": "no: older than the range (unsupported)",
}


def verdict(info: dict[str, Any]) -> str:
    """One line: is this build usable as it stands, and if not, what to do (a build against another
    torch never gets here: ``import asteria`` refused it)."""
    if info["torch_in_range"] != "inside" or not info["python_in_range"]:
        return f"OK, outside the tested range ({info['supported_range']}): docs/versions.md"
    if info.get("cuda_missing") and not info["cuda_extension"]:
        where = "a CUDA machine" if info["cuda_available"] else "a torch with CUDA"
        return (
            f"CPU ONLY: CUDA off (a CPU-only build on {where}: a Runtime refuses CUDA "
            f"parameters): {info['cuda_missing']}"
        )
    if info["cuda_extension"]:
        return "OK: CUDA build"
    return "OK: CPU build (CUDA off)"


def format_report(info: dict[str, Any]) -> str:
    cuda = "off"
    if info["cuda_extension"]:
        cuda = f"on (CUDA {info['cuda_version']}, arch list {info['cuda_arch_list'] or 'default'})"
    rows = [
        ("asteria", info["asteria_version"]),
        ("python", info["python"]),
        ("torch (built against)", info["torch_built_against"]),
        ("torch (running)", info["torch_running"]),
        ("supported", info["supported_range"]),
        ("this torch in the range", _IN_RANGE[info["torch_in_range"]]),
        ("this Python in the range", "yes" if info["python_in_range"] else "no (untested)"),
        ("CUDA extension", cuda),
        *([("CUDA missing", info["cuda_missing"])] if info.get("cuda_missing") else []),
        ("CUDA device available", "yes" if info["cuda_available"] else "no"),
        ("LAPACK backend", f"{info['lapack_backend']} (eigh path: {info['eigh_path']})"),
        ("per-worker LAPACK threads", "yes" if info["per_worker_lapack_threads"] else "no"),
        ("default worker count", str(info["default_workers"])),
        ("C++ flags", " ".join(info["cxx_flags"] or []) or "unknown"),
        ("link command", " ".join(info.get("link") or []) or "unknown"),
    ]
    rows += _capability_rows(info["capabilities"])
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines.append(f"{'verdict':<{width}}  {verdict(info)}")
    return "\n".join(lines)


def _yes(flag: bool | None) -> str:
    return "not probed" if flag is None else ("yes" if flag else "no")


def _capability_rows(caps: dict[str, Any]) -> list[tuple[str, str]]:
    """What ``asteria.lowlevel`` can do on this build (docs/api.md, Capabilities)."""
    gpu = caps["cuda_build"] and caps["cuda_device"]
    gpu_only = "" if gpu else " (needs a CUDA build and a GPU)"
    o_direct = _yes(caps["o_direct"])
    if caps["o_direct"] is not None:
        o_direct += f" in {caps['spill_dir']}: {caps['o_direct_reason']}"
    return [
        ("api: CUDA", _yes(gpu)),
        ("api: pinned host memory", _yes(caps["pinned_memory"]) + gpu_only),
        ("api: mapped memory (device_view)", _yes(caps["mapped_memory"]) + gpu_only),
        ("api: CUDA copy stream", _yes(caps["cuda_copy_stream"]) + gpu_only),
        ("api: O_DIRECT spill store", o_direct),
        ("api: LAPACK path", f"{caps['lapack_backend']}, eigh via {caps['eigh_path']}"),
        ("api: torch.ops", ", ".join(caps["custom_ops"]) or "none"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asteria.info", description=__doc__)
    parser.add_argument(
        "--spill-dir", help="where to probe O_DIRECT (default: the temporary directory)"
    )
    args = parser.parse_args(argv)
    print(format_report(collect(args.spill_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
