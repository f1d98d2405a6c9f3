"""A CUDA torch without a usable CUDA toolkit (Note [CPU-only builds on CUDA machines] in
setup.py, issue 50): setup.py builds the CPU-only extension but says so and records why, stops
with both versions named where nvcc's CUDA major differs from torch's, and ``python -m
asteria.info`` and the runtime's attach on CUDA parameters name what is missing and the fix.
setup.py runs as ``setup.py --version`` (nothing is built) with torch pretending to have CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import asteria.info
from asteria import _C
from asteria._ext import cuda_missing
from asteria.lowlevel.capabilities import CudaUnavailableError
from asteria.runtime.parts import check_cuda_build

ROOT = Path(__file__).resolve().parents[2]
CPU_BUILD = not _C.cuda_enabled()


def _toolkit(tmp_path: Path, release: str) -> Path:
    """A fake CUDA toolkit: headers, and an nvcc that reports ``release``."""
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime.h").write_text("")
    (tmp_path / "bin").mkdir()
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\n"
        f'echo "Cuda compilation tools, release {release}, V{release}.1"\n'
    )  # fmt: skip
    nvcc.chmod(0o755)
    return tmp_path


def _setup_py(torch_cuda: str, **env: str) -> subprocess.CompletedProcess:
    code = (
        "import runpy, sys, torch; import torch.utils.cpp_extension as ce; "
        f"torch.version.cuda = {torch_cuda!r}; ce.CUDA_HOME = None; "
        "sys.argv = ['setup.py', '--version']; runpy.run_path('setup.py', run_name='__main__')"
    )
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CUDA_HOME", "CUDA_PATH", "ASTERIA_FORCE_CUDA", "ASTERIA_NO_CUDA")
    }
    base["PATH"] = os.pathsep.join(
        [str(Path(sys.executable).parent), "/usr/bin", "/bin"]
    )  # (no nvcc of this machine's)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**base, **env},
    )


@pytest.mark.skipif(
    any(Path(d, "nvcc").exists() for d in ("/usr/bin", "/bin")), reason="an nvcc on /usr/bin"
)
def test_a_cuda_torch_without_a_toolkit_builds_cpu_only_and_says_what_to_do():
    proc = _setup_py("13.0")
    assert proc.returncode == 0, proc.stderr
    assert "WARNING: building asteria._C WITHOUT CUDA" in proc.stderr
    assert "has CUDA 13.0, but no CUDA toolkit" in proc.stderr
    assert "CUDA 13.x toolkit" in proc.stderr and "ASTERIA_FORCE_CUDA=1" in proc.stderr
    forced = _setup_py("13.0", ASTERIA_FORCE_CUDA="1")
    assert forced.returncode == 1 and "CUDA 13.x toolkit" in forced.stderr
    quiet = _setup_py("13.0", ASTERIA_NO_CUDA="1")  # a CPU-only build on purpose
    assert quiet.returncode == 0 and "WARNING" not in quiet.stderr, quiet.stderr


def test_an_nvcc_of_another_cuda_major_stops_the_build_naming_both(tmp_path):
    home = _toolkit(tmp_path, "12.8")
    proc = _setup_py("13.0", CUDA_HOME=str(home))
    assert proc.returncode == 1
    assert f"nvcc at {home} is CUDA 12.8" in proc.stderr
    assert "built with CUDA 13.0" in proc.stderr and "CUDA 13.x toolkit" in proc.stderr


def test_an_nvcc_of_the_same_cuda_major_builds_with_cuda(tmp_path):
    home = _toolkit(tmp_path, "13.1")  # a minor mismatch only warns (torch's builder)
    proc = _setup_py("13.0", CUDA_HOME=str(home))
    assert proc.returncode == 0, proc.stderr
    assert f"building asteria._C with CUDA against torch {torch.__version__}" in proc.stderr


@pytest.mark.skipif(not CPU_BUILD, reason="needs a CPU-only build of asteria._C")
def test_info_and_attach_name_what_a_cpu_only_build_with_a_cuda_torch_lacks(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    missing = cuda_missing(_C)
    assert missing is not None and "CUDA 13.x toolkit" in missing
    assert "ASTERIA_FORCE_CUDA=1 pip install" in missing
    info = asteria.info.collect()
    assert info["cuda_missing"] == missing
    assert asteria.info.verdict(info).startswith("CPU ONLY: CUDA off")
    report = asteria.info.format_report(info)
    assert missing in report
    cuda_row = next(line for line in report.splitlines() if line.startswith("CUDA extension"))
    assert cuda_row.split()[-1] == "off"  # (tests/unit/test_extension.py reads this row)
    with pytest.raises(CudaUnavailableError, match="the parameters are on CUDA, but") as err:
        check_cuda_build([torch.device("cpu"), torch.device("cuda", 0)])
    assert "CUDA 13.x toolkit" in str(err.value)
    check_cuda_build([torch.device("cpu")])  # CPU parameters: nothing to refuse


@pytest.mark.skipif(not CPU_BUILD, reason="needs a CPU-only build of asteria._C")
def test_a_cpu_torch_gets_no_toolkit_advice():
    if torch.version.cuda:
        pytest.skip("torch has CUDA")
    assert "has no CUDA" in cuda_missing(_C)
    assert asteria.info.collect()["cuda_missing"] is None


@pytest.mark.skipif(not CPU_BUILD, reason="needs a CPU-only build of asteria._C")
def test_a_cpu_only_build_on_purpose_says_to_rebuild_without_asteria_no_cuda(monkeypatch):
    import types

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    fake = types.SimpleNamespace(CUDA_MISSING="built with ASTERIA_NO_CUDA=1")
    monkeypatch.setitem(sys.modules, "asteria._build_info", fake)
    missing = cuda_missing(_C)
    assert missing.startswith("built with ASTERIA_NO_CUDA=1")
    assert "rebuild without ASTERIA_NO_CUDA, with a CUDA 13.x toolkit" in missing
