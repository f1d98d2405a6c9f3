"""Builds asteria._C, the C++ (and, with a CUDA torch and nvcc, CUDA) extension.

Always build without build isolation, against the torch already installed:

    pip install --no-build-isolation --no-deps -e .        # or: make build
    python setup.py build_ext --inplace                     # same extension, no install

Note [One source list]: every csrc/**/*.cpp is compiled, except that the CUDA build replaces each
CPU stand-in csrc/cuda/*_cpu.cpp by the csrc/cuda/*.cu files (and defines ASTERIA_WITH_CUDA).

CUDA is on when torch has CUDA (torch.version.cuda) and nvcc is found; ASTERIA_FORCE_CUDA=1 or
ASTERIA_NO_CUDA=1 override. TORCH_CUDA_ARCH_LIST is respected (set it: there may be no GPU to
query). MAX_JOBS caps parallel compile jobs. The build writes asteria/_build_info.py next to the
extension; asteria/_ext.py compares it with the running torch at import.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parent


def _check_torch() -> None:
    """Refuse a torch older than the supported range, unless ASTERIA_UNSUPPORTED_TORCH=1; warn for
    a newer torch or an untested Python (Note [Supported torch] in asteria/_supported.py, read
    without importing asteria)."""
    spec = importlib.util.spec_from_file_location(
        "_asteria_supported", ROOT / "asteria/_supported.py"
    )
    supported = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(supported)
    for warning in (
        supported.warning(torch.__version__),
        supported.python_warning(sys.version_info),
    ):
        if warning is not None:
            print(f"setup.py: WARNING: {warning}", file=sys.stderr)
    message = supported.refusal(torch.__version__)
    if message is None:
        return
    if os.environ.get(supported.OVERRIDE, "") in ("", "0"):
        sys.exit(f"setup.py: {message}")
    print(
        f"setup.py: WARNING, building anyway ({supported.OVERRIDE}=1): {message}", file=sys.stderr
    )


_check_torch()
# -g0 drops the debug info Python's own CFLAGS ask for: with torch's headers it nearly doubles the
# compile time of every file and makes a 19 MB library. ASTERIA_DEBUG=1 keeps it (and -O0).
DEBUG = os.environ.get("ASTERIA_DEBUG", "") not in ("", "0")
OPT_FLAGS = ["-O0", "-g"] if DEBUG else ["-O2", "-g0"]
CXX_FLAGS = OPT_FLAGS + ["-std=c++20", "-Wall", "-Wextra", "-Wno-unused-parameter"]
NVCC_FLAGS = (["-O0", "-g"] if DEBUG else ["-O2"]) + ["-std=c++20"]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def _toolkit_from_nvcc(nvcc: str) -> str | None:
    """The toolkit root nvcc reports (``#$ TOP=...`` in a dry run); wrappers hide it otherwise."""
    try:
        out = subprocess.run(
            [nvcc, "-dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.MULTILINE)
    return os.path.realpath(match.group(1).strip()) if match else None


def _has_cuda_headers(home: str | None) -> bool:
    return bool(home) and os.path.exists(os.path.join(home, "include", "cuda_runtime.h"))


def _cuda_home() -> str | None:
    """The CUDA toolkit root with nvcc and headers, or None. Points torch's builder at it."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or cpp_extension.CUDA_HOME
    nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    if not _has_cuda_headers(home):
        nvcc = nvcc if nvcc and os.path.exists(nvcc) else shutil.which("nvcc")
        home = _toolkit_from_nvcc(nvcc) if nvcc else None
    if not _has_cuda_headers(home) or not os.path.exists(os.path.join(home, "bin", "nvcc")):
        return None
    cpp_extension.CUDA_HOME = home  # read by torch's builder when it compiles and links
    os.environ["CUDA_HOME"] = home
    return home


def _nvcc_version(home: str) -> tuple[int, int] | None:
    """(major, minor) of ``home``'s nvcc (``release 13.0`` in ``nvcc --version``), or None."""
    try:
        out = subprocess.run(
            [os.path.join(home, "bin", "nvcc"), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"release (\d+)\.(\d+)", out.stdout + out.stderr)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _toolkit_fix(torch_cuda: str) -> str:
    major = torch_cuda.split(".")[0]
    return (
        f"install a CUDA {major}.x toolkit (nvcc and headers; e.g. the distribution's "
        f"cuda-toolkit-{major}-* package or `conda install -c nvidia cuda-nvcc "
        f"cuda-cudart-dev`), point CUDA_HOME at it and rebuild with ASTERIA_FORCE_CUDA=1: "
        "`ASTERIA_FORCE_CUDA=1 pip install --no-build-isolation --no-deps -e .` (docs/gpu.md). "
        "ASTERIA_NO_CUDA=1 builds the CPU-only extension on purpose"
    )


#: Why a torch with CUDA gets a CPU-only extension (None: CUDA is built, or torch has none);
#: recorded in asteria/_build_info.py, which ``python -m asteria.info`` and the runtime's attach
#: on CUDA parameters report (Note [CPU-only builds on CUDA machines]).
CUDA_MISSING: str | None = None


# Note [CPU-only builds on CUDA machines]: without nvcc the extension builds without CUDA, and
# everything the runtime does on a GPU (pinned registrations, fences on CUDA streams, device
# views) then fails, once at the first refresh request of every run. So a CUDA torch without a
# toolkit still builds (a CPU-only use of a CUDA wheel is common) but says so loudly, records
# why, and ``asteria.info`` and ``Runtime`` attach on CUDA parameters name what is missing and
# how to fix it. An nvcc whose CUDA major differs from torch's stops the build here with both
# versions named (torch's builder would refuse it later with less to go on).
def _use_cuda() -> bool:
    global CUDA_MISSING
    has_cuda_torch = bool(torch.version.cuda)
    if _env_flag("ASTERIA_NO_CUDA"):
        if _env_flag("ASTERIA_FORCE_CUDA"):
            sys.exit("setup.py: ASTERIA_FORCE_CUDA=1 and ASTERIA_NO_CUDA=1 contradict each other")
        if has_cuda_torch:
            CUDA_MISSING = "built with ASTERIA_NO_CUDA=1"
        return False
    home = _cuda_home() if has_cuda_torch else None
    if _env_flag("ASTERIA_FORCE_CUDA"):
        if not has_cuda_torch:
            sys.exit(f"setup.py: ASTERIA_FORCE_CUDA=1 but torch {torch.__version__} has no CUDA")
        if home is None:
            sys.exit(
                "setup.py: ASTERIA_FORCE_CUDA=1 but no CUDA toolkit (nvcc + headers) found; "
                + _toolkit_fix(torch.version.cuda)
            )
    if home is None:
        if has_cuda_torch:
            CUDA_MISSING = (
                f"torch {torch.__version__} has CUDA {torch.version.cuda}, but no CUDA toolkit "
                "was found at build (nvcc and cuda_runtime.h: CUDA_HOME/CUDA_PATH unset or "
                "incomplete, no nvcc on PATH)"
            )
            print(
                f"setup.py: WARNING: building asteria._C WITHOUT CUDA: {CUDA_MISSING}. The "
                "runtime will refuse CUDA parameters. To fix: " + _toolkit_fix(torch.version.cuda),
                file=sys.stderr,
            )
        return False
    nvcc = _nvcc_version(home)
    torch_major = int(torch.version.cuda.split(".")[0])
    if nvcc is not None and nvcc[0] != torch_major:
        sys.exit(
            f"setup.py: nvcc at {home} is CUDA {nvcc[0]}.{nvcc[1]}, but torch "
            f"{torch.__version__} was built with CUDA {torch.version.cuda}: their major versions "
            f"must match. Point CUDA_HOME at a CUDA {torch_major}.x toolkit, or install the "
            f"torch build for CUDA {nvcc[0]} (e.g. --index-url "
            f"https://download.pytorch.org/whl/cu{nvcc[0]}{nvcc[1]}), or build without CUDA "
            "(ASTERIA_NO_CUDA=1)"
        )
    return True


def _nvidia_include_dirs() -> list[str]:
    """Headers of the pip CUDA wheels (cusparse.h, cublas_v2.h, ...) that torch's CUDA headers
    include and a minimal system toolkit may lack."""
    site_packages = Path(torch.__file__).resolve().parent.parent
    return sorted(str(p) for p in site_packages.glob("nvidia/*/include") if p.is_dir())


def _sources(with_cuda: bool) -> list[str]:
    cpp = sorted(glob.glob("csrc/**/*.cpp", recursive=True, root_dir=ROOT))
    if not with_cuda:
        return cpp
    cu = sorted(glob.glob("csrc/cuda/*.cu", root_dir=ROOT))
    return [s for s in cpp if not re.fullmatch(r"csrc/cuda/.*_cpu\.cpp", s)] + cu


# Note [One libstdc++]: the extension shares the process's libstdc++ (torch's). The first H200
# build (2026-12-04: the image's toolchain, torch 2.11, Python 3.12) carried a static copy of it
# whose symbols it exported: the process resolved some of them to the shared libstdc++ and some to
# the copy, and every ``<<`` of a number into a stream in the extension (a cancelled job's message,
# a FutureTimeoutError's, a bad size's ValueError) segfaulted in num_put. So a -static-libstdc++
# in the link command is dropped (with a warning), and whatever a static archive brings in stays
# hidden inside the extension (--exclude-libs); tests/unit/test_extension.py checks the symbols.
LINK_ARGS = ["-Wl,--exclude-libs,ALL"]
STATIC_CXX_RUNTIME = ("-static-libstdc++",)


def _extension(with_cuda: bool):
    kwargs = {
        "name": "asteria._C",
        "sources": _sources(with_cuda),
        "include_dirs": [str(ROOT / "csrc")],
        "extra_link_args": LINK_ARGS,
    }
    if not with_cuda:
        return cpp_extension.CppExtension(extra_compile_args={"cxx": CXX_FLAGS}, **kwargs)
    kwargs["include_dirs"] += _nvidia_include_dirs()
    macro = ["-DASTERIA_WITH_CUDA"]
    return cpp_extension.CUDAExtension(
        extra_compile_args={"cxx": CXX_FLAGS + macro, "nvcc": NVCC_FLAGS + macro}, **kwargs
    )


def _build_info_text(ext, with_cuda: bool, link: list[str] | None = None) -> str:
    fields = {
        "TORCH_VERSION": torch.__version__,
        "CUDA": with_cuda,
        "CUDA_VERSION": torch.version.cuda if with_cuda else None,
        "CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST") if with_cuda else None,
        # why a torch with CUDA got a CPU-only build (Note [CPU-only builds on CUDA machines])
        "CUDA_MISSING": None if with_cuda else CUDA_MISSING,
        "CXX_FLAGS": ext.extra_compile_args["cxx"],
        "NVCC_FLAGS": ext.extra_compile_args.get("nvcc") if with_cuda else None,
        "SOURCES": ext.sources,
        # the shared-library link command (Note [One libstdc++] above)
        "LINK": link,
    }
    lines = [
        '"""How asteria._C was built. Written by setup.py; do not edit (gitignored)."""',
        "",
    ]
    lines += [f"{key} = {value!r}" for key, value in fields.items()]
    return "\n".join(lines) + "\n"


class BuildExtension(cpp_extension.BuildExtension):
    """torch's builder, plus asteria/_build_info.py written next to the built extension.

    Editable installs build in a fresh temporary directory by default; here they keep their object
    files under build/ instead, so ``pip install --no-build-isolation -e .`` recompiles only what
    changed (ninja tracks sources, headers and flags).
    """

    def finalize_options(self) -> None:
        super().finalize_options()
        if getattr(self, "editable_mode", False):
            self.build_temp = str(
                ROOT / "build" / f"temp-editable-{'cuda' if WITH_CUDA else 'cpu'}"
            )

    def build_extensions(self) -> None:
        for attr in ("linker_so", "linker_so_cxx"):  # Note [One libstdc++]
            cmd = getattr(self.compiler, attr, None)
            dropped = [a for a in cmd or [] if a in STATIC_CXX_RUNTIME]
            if dropped:
                print(f"setup.py: WARNING: dropped {' '.join(dropped)} from the link command "
                      "(Note [One libstdc++]: the extension must share torch's libstdc++)",
                      file=sys.stderr)  # fmt: skip
                setattr(self.compiler, attr, [a for a in cmd if a not in STATIC_CXX_RUNTIME])
        super().build_extensions()

    def run(self) -> None:
        super().run()
        for ext in self.extensions:
            target = Path(self.get_ext_fullpath(ext.name)).parent / "_build_info.py"
            target.parent.mkdir(parents=True, exist_ok=True)
            # setuptools links C++ with linker_so_cxx where it has one (>= 72), else linker_so
            cmd = getattr(self.compiler, "linker_so_cxx", None) or self.compiler.linker_so
            link = list(cmd or []) or None
            target.write_text(_build_info_text(ext, WITH_CUDA, link))


WITH_CUDA = _use_cuda()
print(
    f"setup.py: building asteria._C with{'' if WITH_CUDA else 'out'} CUDA against torch "
    f"{torch.__version__}" + (f" (CUDA_HOME={cpp_extension.CUDA_HOME})" if WITH_CUDA else ""),
    file=sys.stderr,
)

setup(
    ext_modules=[_extension(WITH_CUDA)],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
