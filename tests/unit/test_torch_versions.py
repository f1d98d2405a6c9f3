"""The supported torch and Python versions (issue 23, item 3; Note [Supported torch] in
asteria/_supported.py): the range, setup.py's refusal of a torch outside it, the docs that state
it. CI runs the whole suite against both ends of the range (.ci/run: make test, make
test-torch-cuda), where ``test_the_running_torch_is_supported`` checks each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asteria import _supported

ROOT = Path(__file__).resolve().parents[2]


def _version(release: tuple[int, int], patch: str = "0") -> str:
    return ".".join(map(str, release)) + "." + patch


def test_the_running_torch_is_supported():
    assert _supported.refusal(torch.__version__) is None
    assert sys.version_info[:2] >= _supported.PYTHON_MIN


@pytest.mark.parametrize("version", [*_supported.TESTED, "2.13.0+cpu", "2.14.1+cu130"])
def test_the_tested_releases_are_in_the_range(version):
    assert _supported.refusal(version) is None


def test_torch_outside_the_range_is_refused_with_the_range():
    lo, hi = _supported.TORCH_MIN, _supported.TORCH_BELOW
    below = _version((lo[0], lo[1] - 1), "1")
    for version in (below, _version(hi), _version(hi, "0.dev20260101"), "3.0.0", "1.13.1"):
        message = _supported.refusal(version)
        assert message is not None and f"torch {version} is installed" in message
        assert _supported.supported_range() in message and _supported.OVERRIDE in message


def _setup_py(fake_version: str, **env: str) -> subprocess.CompletedProcess:
    """setup.py --version with torch pretending to be ``fake_version`` (nothing is built)."""
    code = (
        "import runpy, sys, torch; "
        f"torch.__version__ = {fake_version!r}; sys.argv = ['setup.py', '--version']; "
        "runpy.run_path('setup.py', run_name='__main__')"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if k != _supported.OVERRIDE}, **env},
    )


def test_setup_py_refuses_an_unsupported_torch():
    version = _version((_supported.TORCH_MIN[0], _supported.TORCH_MIN[1] - 1))
    proc = _setup_py(version)
    assert proc.returncode == 1
    assert f"setup.py: Asteria supports {_supported.supported_range()}" in proc.stderr
    forced = _setup_py(version, **{_supported.OVERRIDE: "1"})
    assert forced.returncode == 0, forced.stderr
    assert "WARNING, building anyway" in forced.stderr
    assert forced.stdout.strip().splitlines()[-1] == "0.1.0"


def test_the_docs_state_the_range():
    python = ".".join(map(str, _supported.PYTHON_MIN))
    for doc in ("README.md", "docs/versions.md"):
        text = (ROOT / doc).read_text()
        assert _supported.supported_range() in text, doc
        assert f"Python >= {python}" in text, doc
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'requires-python = ">={python}"' in pyproject
