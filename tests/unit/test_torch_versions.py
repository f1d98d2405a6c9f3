"""The supported torch and Python versions (issues 23 and 40; Note [Supported torch] in
asteria/_supported.py): the range, setup.py's refusal of an older torch and warning for a newer
one, ``python -m asteria.info``'s line on it, the docs that state it. CI runs the whole suite
against two releases of the range (.ci/run: make test, make test-torch-cuda) and
``make test-torch TORCH=<release>`` against any other, where
``test_the_running_torch_is_supported`` checks each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asteria import _supported, info

ROOT = Path(__file__).resolve().parents[2]

releases = st.tuples(st.integers(1, 3), st.integers(0, 30))
suffixes = st.sampled_from(["", "+cpu", "+cu130", "+cu132", ".dev20260101", "a0+git1234", "rc1"])


def _version(release: tuple[int, int], patch: str = "0") -> str:
    return ".".join(map(str, release)) + "." + patch


def test_the_running_torch_is_supported():
    assert _supported.verdict(torch.__version__) == "inside"
    assert _supported.refusal(torch.__version__) is None
    assert _supported.warning(torch.__version__) is None
    assert _supported.python_warning(sys.version_info) is None


@pytest.mark.parametrize("version", [*_supported.TESTED, "2.11.0+cu130", "2.15.0+cu132"])
def test_the_tested_releases_are_in_the_range(version):
    assert _supported.verdict(version) == "inside"


def test_the_range_is_what_cuda_machines_have():
    """Issue 40: torch 2.11 to 2.15, CPython 3.11 and 3.12; the tested releases span it."""
    assert (_supported.TORCH_MIN, _supported.TORCH_MAX) == ((2, 11), (2, 15))
    assert (_supported.PYTHON_MIN, _supported.PYTHON_MAX) == ((3, 11), (3, 12))
    tested = sorted(_supported.release(v) for v in _supported.TESTED)
    assert tested[0] == _supported.TORCH_MIN and tested[-1] == _supported.TORCH_MAX


@given(release=releases, patch=st.integers(0, 9), suffix=suffixes)
def test_every_version_gets_one_verdict_and_its_message(release, patch, suffix):
    """Older: refused, with the range, the tested releases and the override; newer: a warning
    naming the range; inside: neither."""
    version = _version(release, f"{patch}{suffix}")
    verdict = _supported.verdict(version)
    expected = (
        "older"
        if release < _supported.TORCH_MIN
        else "newer"
        if release > _supported.TORCH_MAX
        else "inside"
    )
    assert verdict == expected
    refusal, warning = _supported.refusal(version), _supported.warning(version)
    assert (refusal is not None) == (verdict == "older")
    assert (warning is not None) == (verdict == "newer")
    for message in filter(None, (refusal, warning)):
        assert f"torch {version}" in message and _supported.supported_range() in message
        assert all(tested in message for tested in _supported.TESTED)
    if refusal is not None:
        assert _supported.OVERRIDE in refusal


@given(minor=st.integers(0, 20), micro=st.integers(0, 9))
def test_python_outside_the_tested_range_warns(minor, micro):
    inside = _supported.PYTHON_MIN <= (3, minor) <= _supported.PYTHON_MAX
    message = _supported.python_warning((3, minor, micro))
    assert (message is None) == inside
    if message is not None:
        assert f"Python 3.{minor}.{micro}" in message and _supported.python_range() in message


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


def test_setup_py_refuses_an_older_torch():
    version = _version((_supported.TORCH_MIN[0], _supported.TORCH_MIN[1] - 1))
    proc = _setup_py(version)
    assert proc.returncode == 1
    assert f"setup.py: Asteria supports {_supported.supported_range()}" in proc.stderr
    forced = _setup_py(version, **{_supported.OVERRIDE: "1"})
    assert forced.returncode == 0, forced.stderr
    assert "WARNING, building anyway" in forced.stderr
    assert forced.stdout.strip().splitlines()[-1] == "0.1.0"


def test_setup_py_builds_a_newer_torch_with_a_warning():
    version = _version((_supported.TORCH_MAX[0], _supported.TORCH_MAX[1] + 1))
    proc = _setup_py(version)
    assert proc.returncode == 0, proc.stderr
    assert f"setup.py: WARNING: torch {version} is newer" in proc.stderr
    assert _supported.supported_range() in proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "0.1.0"
    inside = _setup_py(_version(_supported.TORCH_MIN))
    assert inside.returncode == 0 and "WARNING" not in inside.stderr, inside.stderr


@pytest.mark.parametrize(
    ("version", "line"),
    [
        ("2.11.0+cu130", "yes"),
        ("2.16.0", "no: newer than the tested range"),
        ("2.10.1", "no: older than the range"),
    ],
)
def test_info_prints_the_range_and_whether_this_torch_is_in_it(monkeypatch, version, line):
    monkeypatch.setattr(torch, "__version__", version)
    report = info.format_report(info.collect())
    rows = dict(r.split("  ", 1) for r in report.splitlines())
    assert rows["supported"].strip() == (
        f"{_supported.supported_range()}, {_supported.python_range()}"
    )
    assert rows["this torch in the range"].strip().startswith(line)
    assert rows["this Python in the range"].strip() == "yes"
    assert ("outside the tested range" in rows["verdict"]) == (line != "yes")


def test_the_docs_state_the_range():
    python = ".".join(map(str, _supported.PYTHON_MIN))
    for doc in ("README.md", "docs/versions.md"):
        text = (ROOT / doc).read_text()
        assert _supported.supported_range() in text, doc
        assert _supported.python_range() in text, doc
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'requires-python = ">={python}"' in pyproject
