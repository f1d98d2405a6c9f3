"""Dependencies that fit an optimizer library (issue 18, item 5; Note [The train extra] in
asteria/train/extra.py): the optimizers and the runtime run with the training job's packages
unimportable (blocked in a fresh process); the job says which extra to install when
one is missing; pyproject.toml's core dependencies hold none of them and requirements-test.txt
(what ``make demo`` and ``make test`` install) holds every package of the extra."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

from asteria.train.extra import EXTRA, EXTRA_MODULES

ROOT = Path(__file__).resolve().parents[2]
TRAINING_PACKAGES = ("numpy", "transformers", "matplotlib", "tqdm", "nvidia-ml-py")

# Run first in the child: the blocked modules are unimportable, as if not installed (``import``
# raises ModuleNotFoundError, ``importlib.util.find_spec`` returns None: what torch's own optional
# imports of numpy test for).
BLOCKER = textwrap.dedent(
    """
    import sys

    BLOCKED = set(sys.argv[1].split(","))
    for name in BLOCKED:
        sys.modules[name] = None
    sys.argv = sys.argv[1:]
    """
)

CORE = textwrap.dedent(
    """
    import torch
    torch.set_num_threads(1)
    import asteria
    from asteria.optim import SOAP, KLShampoo, Shampoo

    for cls in (SOAP, KLShampoo, Shampoo):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        opt = cls(model.parameters(), lr=1e-2, precondition_frequency=3)
        x = torch.randn(32, 8)
        with asteria.Runtime(model, opt, asteria.RuntimeConfig(staleness=2, workers=1)) as rt:
            for _ in range(10):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            assert rt.stats()["installs"] > 0, rt.stats()
    loaded = sorted(m for m, v in sys.modules.items() if m.split(".")[0] in BLOCKED and v)
    print("loaded:", loaded)
    """
)


def _child(tmp_path: Path, blocked: tuple[str, ...], code: str, *args: str):
    script = tmp_path / "child.py"
    script.write_text(BLOCKER + code)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(script), ",".join(blocked), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )


def test_the_optimizers_and_the_runtime_run_without_the_training_packages(tmp_path):
    blocked = ("numpy", "transformers", "matplotlib", "tqdm", "pynvml")
    proc = _child(tmp_path, blocked, CORE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded: []" in proc.stdout, proc.stdout


@pytest.mark.parametrize("absent", ["transformers", "matplotlib"])
def test_asteria_train_says_which_extra_to_install(tmp_path, absent):
    code = "import runpy\nrunpy.run_module('asteria.train', run_name='__main__')\n"
    proc = _child(tmp_path, (absent,), code, "--help")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert f"pip install 'asteria[{EXTRA}]'" in proc.stderr
    assert f"{absent} is not installed" in proc.stderr
    assert "Traceback" not in proc.stderr
    # the library's names say the same on first use
    code = "import asteria.train\nasteria.train.train\n"
    proc = _child(tmp_path, (absent,), code)
    assert proc.returncode == 1
    assert "MissingExtraError" in proc.stderr and f"asteria[{EXTRA}]" in proc.stderr


def test_the_job_runs_its_command_line_where_the_extra_is_installed(tmp_path):
    code = "import runpy\nrunpy.run_module('asteria.train', run_name='__main__')\n"
    proc = _child(tmp_path, ("pynvml",), code, "--help")  # NVML is optional
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--compare" in proc.stdout


def test_pyproject_keeps_the_training_packages_in_the_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}

    core = names(project["dependencies"])
    assert not core & set(TRAINING_PACKAGES), core
    assert "torch" not in core  # installed first, never by pip's resolver (see pyproject.toml)
    extra = names(project["optional-dependencies"][EXTRA])
    assert extra == set(TRAINING_PACKAGES)
    assert set(EXTRA_MODULES.values()) <= extra  # what the job checks for is in the extra
    assert project["scripts"]["asteria-train"] == "asteria.train.extra:main"


def test_requirements_test_installs_the_extra():
    """``make demo`` and ``make test`` install requirements-test.txt (then the package with
    ``--no-deps``), so it must hold every package of the extra."""
    lines = (ROOT / "requirements-test.txt").read_text().splitlines()
    pinned = {
        re.split(r"[<>=!~\[; ]", x, maxsplit=1)[0].lower() for x in lines if x and x[0] != "#"
    }
    missing = set(TRAINING_PACKAGES) - pinned
    assert not missing, missing
    makefile = (ROOT / "Makefile").read_text()
    assert "install -r requirements-test.txt" in makefile
    assert "--no-deps -e ." in makefile
