"""Every code block of README.md and docs/*.md runs, or is marked a fragment (issue 23, item 6).

A block is a fragment when the line before its opening fence is ``<!-- fragment: why -->``
(invisible where the Markdown is rendered; the reason is required): shell commands, a diagram,
code that needs a GPU, a process group or the reader's own model. Every other block must be
Python, and the Python blocks of one file run in order in one namespace (a later block may use
what an earlier one defined), in a fresh process, in a temporary directory, with one intra-op
thread; a traceback names the file and the line of the block.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")
FRAGMENT = re.compile(r"^<!-- fragment: (\S.*\S) -->$")

RUNNER = textwrap.dedent(
    """
    import json, sys
    import torch
    torch.set_num_threads(1)
    namespace = {"__name__": "__main__"}
    for name, code in json.load(open(sys.argv[1])):
        exec(compile(code, name, "exec"), namespace)
    """
)


@dataclass
class Block:
    lang: str
    line: int  # of the opening fence, 1-based
    code: str
    fragment: str | None  # the reason, for a fragment


def blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = FRAGMENT.match(lines[i - 1]) if i else None
        code = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(match.group(1), i + 1, code, marker.group(1) if marker else None))
        i = end + 1
    return found


def test_the_docs_have_blocks_to_run():
    runnable = [b for p in DOCS for b in blocks(p) if b.fragment is None]
    assert len(runnable) >= 6, "README.md's and docs/'s examples are found"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_runs_or_is_a_fragment(path, tmp_path):
    name = str(path.relative_to(ROOT))
    runnable = []
    for block in blocks(path):
        if block.fragment is not None:
            continue
        assert block.lang in ("python", "py"), (
            f"{name}:{block.line}: a {block.lang or 'plain'} block must be Python that runs, "
            "or be marked <!-- fragment: why --> on the line before it"
        )
        # blank lines keep the block's line numbers those of the file in tracebacks
        runnable.append([name, "\n" * block.line + block.code])
    if not runnable:
        return
    (tmp_path / "blocks.json").write_text(json.dumps(runnable))
    (tmp_path / "run.py").write_text(RUNNER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "run.py", "blocks.json"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
