"""Issue 51's figures of the optimizer/runtime seam, counted on the ``asteria/`` package of a
checkout: the static ones from its source alone, the dynamic ones by running it.

    python tools/seam_count.py [--root PATH] [--quick | --static-only]

``--root``: the checkout to measure (default: the one this file lives in); the dynamic part
imports ``asteria`` and ``bench`` from it. The output is a readable report, then, as the LAST
line of stdout, one JSON object: ``figures`` (the headline numbers, flat), ``static`` and
``dynamic`` (every listing behind them), ``commit`` (the measured checkout's HEAD, ``+dirty``
where its tracked files differ; ``$ASTERIA_COMMIT`` where set, for an exported tree),
``recorded`` (date, commit, torch, machine: Note [Recorded runs] in bench/_common.py). It
asserts no targets: it measures.

Static (an AST walk; nothing of the project is imported):

* Import graph: every ``import``/``from ... import`` statement of a module under ``asteria/``,
  resolved to the package's modules (``from a.b import c`` is an edge to module ``a.b.c`` where
  that is one, else to ``a.b``); ``asteria._C`` (the extension) is an outside leaf;
  ``importlib`` calls are not edges. Each edge is tagged ``module`` (runs at import),
  ``type_checking`` (under ``if TYPE_CHECKING:``) or ``function`` (inside a function body).
  Import circles: the strongly connected components of more than one module over all edges,
  package ``__init__`` modules left out (they take part in no circle), each listed with the
  edges between its members; ``runtime_cycles``: those components over the ``module`` and
  ``function`` edges alone (the circles that are cycles at run time).
* ``optim_to_runtime``: the edges from a module under ``asteria/optim`` to one under
  ``asteria/runtime``. ``upward_imports``: the edges that go up the layering of the package
  docstrings and docs/architecture.md (``LAYERS``: ``_C``/``_ext``/``_supported``/``_compat`` <
  ``ops`` < ``memory`` < ``lowlevel`` < ``optim`` < ``runtime`` < ``integrations``/``train``;
  ``asteria``, ``checkpoint``, ``info`` and the generated ``_build_info`` have no layer).
* ``modules_over_600``: modules of more than 600 lines (``wc -l``); ``fmt_skip``: the
  ``# fmt: skip`` comments in ``asteria/`` (comment tokens, so a docstring quoting one is not
  one).
* ``vocabulary``: the lines of ``asteria/optim`` with a case-insensitive word match of
  ``window``, ``ring``, ``slot`` or ``prefetch`` with an optional suffix (``s``, ``es``,
  ``ed``, ``ing``, ``er``, ``ers``, ``ted``, ``ting``): ``windows``, ``slotted`` and
  ``prefetched`` match, ``string``, ``during``
  and ``bring`` do not, nor does a part of a longer identifier (``_`` is a word character:
  ``window_bases``) -- issue 51's count (32 at ef69517). ``vocabulary_in_identifiers`` counts
  those parts as well (``window_bases``, ``BasesWindow``, ``staging_ring``): a line is split into
  words at ``_``, other non-letters and camel-case humps first.
* The ``Refresher`` protocol (the class of that name in asteria/optim/refresher.py, or elsewhere
  in ``asteria/`` if it moved): its members (methods, properties, annotated and assigned
  attributes; dunders apart); ``native_isinstance``: calls ``isinstance(x, ...)`` whose
  second argument names ``NativeRefresher``; ``refresher_probes``: calls of ``getattr`` or
  ``hasattr`` whose first argument mentions a name containing ``refresher``, or whose attribute
  name is a string constant naming a protocol member.
* ``python_lines``: ``wc -l`` over every ``asteria/**/*.py`` file on disk, as issue 51 counts
  ("today's 18,078": ef69517 built, which includes the 10 lines of the ``asteria/_build_info.py``
  that setup.py writes (gitignored); ``python_lines_source`` leaves that generated file out:
  18,068, the review's count of ef69517's 75 tracked modules).

Dynamic (``sys.setprofile``'s ``call`` events, no dispatch mode; the training thread only):
the model and tiers of bench/host_overhead.py, imported from the measured checkout: a decoder
of the preset's widths (``tiny``; ``--quick``: ``nano``) trained with byte tokens (batch 1,
32 tokens, one intra-op thread, seed 0), each optimizer as ``asteria.train.optimizers`` builds
it (refresh every 10 steps), natively and under ``asteria.Runtime`` (one worker, no
statistics lane, ``refresh='interval'``) with the GPU strategies forced on the CPU
(``host_overhead._forced``: a pretended CUDA device and staged snapshots) for the ``device``
tier (``placement={'bases': 'device'}``, 70 GiB free), the ``window`` tier (``placement=
{'bases': 'host'}``, 70 GiB free, host_overhead's default: a slot holds a shape group's bases,
so the step's pieces are its shape groups) and ``window_tight`` (the same with 16 MiB free: the
smallest window, a piece of one block, refilled at every step, what bases far larger than the
device meet). Between two steps, uncounted, every refresh in flight is finished
(``host_overhead._settle``), so every run is the same step by step. What counts as a step's
Python calls: every call in ``optimizer.step()``, and every call made while a function
of ``asteria`` runs that the forward or backward called (the runtime's module hooks), whatever
the hooks are called; not ``zero_grad``.

* ``calls_per_step``: Python calls per step averaged over one whole refresh period in the
  steady state (steps f+2 to 2f+1 of 2f+1 for a period of f = ``precondition_frequency``
  steps: one step that requests and one that installs each block), with the ratio to native's;
  of them ``hook_calls_per_step`` outside ``step()`` and ``asteria_calls_per_step`` in
  ``asteria``'s own functions; ``c_calls_per_step``: the C functions called from Python
  (``c_call`` events), and ``calls_with_c_per_step`` both, with its ratio to native's. Issue
  51's "about 6,400" Python calls of native SOAP at ``tiny`` and "about 1,300" of torch's
  foreach AdamW are this count (6,520 at ef69517; 1,297); its 1.21x and 1.85x on the device and
  window tiers are the device tier's and ``window_tight``'s (at ef69517: 1.22x and 1.81x
  Python calls, 1.23x and 1.85x with the C calls).
* ``quiet_modules``: the distinct ``asteria`` modules (a frame's ``__name__``) whose functions
  run in a quiet step, the period's step with the fewest calls (today: the 8 of 10 that neither
  request nor install, all equal); ``quiet_functions`` likewise.
* ``native_growth``: native's calls per step at the preset's layers L and at 2L (the same
  shapes: twice the blocks, the same shape groups), averaged over the period and on a quiet
  step, with the blocks and shape groups (distinct block shapes and dtypes) of each, from
  ``optimizer.blocks()``.
* ``one_request``: on a one-parameter model (one bias-free 64 x 64 Linear: one block, one job
  per dim) under the runtime, refreshing every 4 steps for 26 steps, the Python calls of one
  refresh request from "due" to the pool: the calls of the run's last step that builds a job
  (the block due and requested; late enough that Shampoo's factors are no longer young, so the
  request is not urgent) minus those of the quietest step since the request before it (nothing
  due, requested or installed; every such step of today's runs costs the same).
  ``asteria_calls``: the same difference counting the calls of ``asteria``'s functions alone
  (the rest: torch's and the standard library's Python). A generator expression, and on
  Python 3.11 a comprehension, is a call of its own. ``pool_submits`` counts the C
  calls named ``submit*`` in the step (one per job that reached the pool inside the step).
  ``jobs``: the refresh jobs made in the step (calls of the ``__init__`` of
  ``asteria.optim.refresher.RefreshJob``'s subclasses, other than from ``dataclasses``);
  ``jobs_copied``: copies of them (an ``__init__`` called by ``dataclasses.replace``, a
  ``copy.copy``/``copy.deepcopy`` of a job); ``jobs_built``: both; ``builds_per_job``:
  ``jobs_built / jobs``. The closure C++ makes of a job is not counted.

``asteria.runtime.testing``, which runs only because the tiers are forced through it, is counted
in the calls but left out of the modules.

``--quick``: SOAP alone at ``nano`` (native and the three tiers; native at L and 2L; one
request on the device tier): about 15 s on two cores. The full run adds KL-Shampoo and
Shampoo, the ``tiny`` preset, and one request on both tiers for each optimizer.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import json
import os
import platform
import re
import subprocess
import sys
import time
import tokenize
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
PACKAGE = "asteria"
#: The extension module: an outside leaf of the graph (no Python source)
EXTENSION = "asteria._C"
#: Written by setup.py at build time (gitignored): counted in ``python_lines`` alone
GENERATED = frozenset({"asteria/_build_info.py"})
#: Bottom to top (module docstring); a module's layer is that of its longest matching prefix
LAYERS: tuple[tuple[str, ...], ...] = (
    ("asteria._C", "asteria._ext", "asteria._supported", "asteria._compat"),
    ("asteria.ops",),
    ("asteria.memory",),
    ("asteria.lowlevel",),
    ("asteria.optim",),
    ("asteria.runtime",),
    ("asteria.integrations", "asteria.train"),
)
SIZE_LIMIT = 600
#: The runtime's tiers measured: the bases' placement and the device memory the pretended GPU
#: has free (module docstring)
TIERS = {
    "device": ("device", 70 * 2**30),
    "window": ("host", 70 * 2**30),
    "window_tight": ("host", 16 * 2**20),
}
#: The one-parameter model's refresh period (``one_request``)
REQUEST_PERIOD = 4
VOCABULARY = re.compile(r"\b(?:window|ring|slot|prefetch)(?:s|es|ed|ing|er|ers|ted|ting)?\b", re.I)
_VOCABULARY_WORD = re.compile(r"(?:window|ring|slot|prefetch)(?:s|es|ed|ing|er|ers|ted|ting)?")
_HUMPS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
RUNTIME_KINDS = ("module", "function")
#: Run only because the measurement forces the GPU tiers on the CPU through it (a GPU run does
#: not import it): its calls count, but it is no module of the step's path
HARNESS = frozenset({"asteria.runtime.testing"})


# -- static ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Edge:
    """``src`` imports ``dst`` at ``at`` (``path:line``); ``kind``: module, type_checking or
    function (module docstring)."""

    src: str
    dst: str
    kind: str
    at: str


def modules_of(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every Python module under ``root/asteria`` (a package by its
    ``__init__.py``)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[tuple[ast.stmt, str]]:
    """Each import statement of ``tree`` with its kind (module docstring)."""

    def walk(node: ast.AST, kind: str) -> Iterator[tuple[ast.stmt, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, "type_checking" if kind == "type_checking" else "function")
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), "type_checking")
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), kind)
            else:
                yield from walk(child, kind)

    yield from walk(tree, "module")


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module ``name`` is, or is in (``a.b.C`` -> ``a.b``); None outside."""
    if name == EXTENSION or name.startswith(EXTENSION + "."):
        return EXTENSION
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_edges(root: Path, modules: dict[str, Path] | None = None) -> list[Edge]:
    """Every import edge between modules of ``root/asteria`` (module docstring)."""
    modules = modules_of(root) if modules is None else modules
    edges = []
    for src, path in modules.items():
        rel = path.relative_to(root).as_posix()
        package = src if path.name == "__init__.py" else src.rpartition(".")[0]
        for node, kind in _imports(ast.parse(path.read_bytes(), filename=rel)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if _resolve(full, modules) == full else base)
            for target in targets:
                dst = _resolve(target, modules)
                if dst is not None and dst != src:
                    edges.append(Edge(src, dst, kind, f"{rel}:{node.lineno}"))
    return list(dict.fromkeys(edges))  # one edge per statement and target


def strongly_connected(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {n: set() for n in nodes}
    for a, b in edges:
        if a in graph and b in graph:
            graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def circles(edges: list[Edge], modules: dict[str, Path]) -> dict[str, Any]:
    """Import circles over all edges and the run-time cycles (module docstring)."""
    nodes = [m for m, p in modules.items() if p.name != "__init__.py"]
    pairs = [(e.src, e.dst) for e in edges]
    found = []
    for component in strongly_connected(nodes, pairs):
        inside = set(component)
        closing = [asdict(e) for e in edges if e.src in inside and e.dst in inside]
        found.append({"modules": component, "edges": closing})
    live = [(e.src, e.dst) for e in edges if e.kind in RUNTIME_KINDS]
    cycles = strongly_connected(nodes, live)
    for circle in found:
        circle["runtime_cycle"] = any(set(c) <= set(circle["modules"]) for c in cycles)
    return {"circles": found, "runtime_cycles": cycles}


def layer_of(module: str) -> int | None:
    """``module``'s index in ``LAYERS`` (None: no layer)."""
    best, depth = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    return best


def upward(edges: list[Edge]) -> list[dict[str, Any]]:
    """The edges from a lower layer to a higher one."""
    out = []
    for e in edges:
        a, b = layer_of(e.src), layer_of(e.dst)
        if a is not None and b is not None and b > a:
            out.append({**asdict(e), "from_layer": a, "to_layer": b})
    return out


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def line_count(path: Path) -> int:
    """``wc -l``: the newlines in the file."""
    return path.read_bytes().count(b"\n")


def fmt_skips(root: Path, files: Iterable[Path]) -> list[str]:
    """``path:line`` of every ``# fmt: skip`` comment."""
    out = []
    for path in files:
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        for tok in tokens:
            if tok.type == tokenize.COMMENT and re.search(r"fmt:\s*skip", tok.string):
                out.append(f"{path.relative_to(root).as_posix()}:{tok.start[0]}")
    return out


def _identifier_words(line: str) -> list[str]:
    words = []
    for run in re.findall(r"[A-Za-z0-9]+", line):
        words += [w.lower() for w in _HUMPS.findall(run)]
    return words


def vocabulary(root: Path, files: Iterable[Path]) -> tuple[list[str], list[str]]:
    """``path:line: text`` of the vocabulary lines (word match; identifier parts as well)."""
    words, parts = [], []
    for path in files:
        rel = path.relative_to(root).as_posix()
        for n, line in enumerate(path.read_text().splitlines(), 1):
            entry = f"{rel}:{n}: {line.strip()}"
            if VOCABULARY.search(line):
                words.append(entry)
            if any(_VOCABULARY_WORD.fullmatch(w) for w in _identifier_words(line)):
                parts.append(entry)
    return words, parts


def _find_protocol(root: Path, modules: dict[str, Path]) -> tuple[Path, ast.ClassDef] | None:
    preferred = root / PACKAGE / "optim" / "refresher.py"
    for path in [preferred] + [p for p in modules.values() if p != preferred]:
        if not path.exists():
            continue
        for node in ast.walk(ast.parse(path.read_bytes())):
            if isinstance(node, ast.ClassDef) and node.name == "Refresher":
                return path, node
    return None


def protocol_members(cls: ast.ClassDef) -> list[str]:
    """Methods (properties included) and attributes of class ``cls``, dunders apart."""
    names = []
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.append(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
    return list(dict.fromkeys(n for n in names if not n.startswith("__")))


def _names_in(node: ast.AST) -> Iterator[str]:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            yield sub.id
        elif isinstance(sub, ast.Attribute):
            yield sub.attr


def probes(
    root: Path, files: Iterable[Path], members: Iterable[str]
) -> tuple[list[str], list[str]]:
    """``path:line: source`` of the ``isinstance(..., NativeRefresher)`` tests and of the
    ``getattr``/``hasattr`` probes on a refresher (module docstring)."""
    members = set(members)
    tests, found = [], []
    for path in files:
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id == "isinstance" and len(node.args) == 2:
                if "NativeRefresher" in _names_in(node.args[1]):
                    tests.append(_entry(rel, text, node))
            elif node.func.id in ("getattr", "hasattr") and len(node.args) >= 2:
                first, attr = node.args[0], node.args[1]
                mentions = any("refresher" in n.lower() for n in _names_in(first))
                member = isinstance(attr, ast.Constant) and attr.value in members
                if mentions or member:
                    found.append(_entry(rel, text, node))
    return sorted(tests, key=_place), sorted(found, key=_place)


def _place(entry: str) -> tuple[str, int]:
    path, line, _ = entry.split(":", 2)
    return path, int(line)


def _entry(rel: str, text: str, node: ast.AST) -> str:
    return f"{rel}:{node.lineno}: {ast.get_source_segment(text, node)}"


def static_report(root: Path) -> dict[str, Any]:
    """Every static figure of ``root/asteria`` (module docstring)."""
    modules = modules_of(root)
    if not modules:
        raise SystemExit(f"no Python modules under {root / PACKAGE}")
    files = sorted(set(modules.values()))
    rel = {p: p.relative_to(root).as_posix() for p in files}
    edges = import_edges(root, modules)
    found = circles(edges, modules)
    sizes = {rel[p]: line_count(p) for p in files}
    optim = [p for p in files if rel[p].startswith(f"{PACKAGE}/optim/")]
    words, parts = vocabulary(root, optim)
    protocol = _find_protocol(root, modules)
    members = protocol_members(protocol[1]) if protocol else []
    tests, found_probes = probes(root, files, members)
    kinds: dict[str, int] = {}
    for e in edges:
        kinds[e.kind] = kinds.get(e.kind, 0) + 1
    return {
        "modules": len(files),
        "python_lines": sum(sizes.values()),
        "python_lines_source": sum(n for p, n in sizes.items() if p not in GENERATED),
        "generated": sorted(p for p in sizes if p in GENERATED),
        "import_edges": kinds,
        "circles": found["circles"],
        "runtime_cycles": found["runtime_cycles"],
        "optim_to_runtime": [
            asdict(e)
            for e in edges
            if _in(e.src, "asteria.optim") and _in(e.dst, "asteria.runtime")
        ],
        "upward_imports": upward(edges),
        "modules_over_600": {p: n for p, n in sorted(sizes.items()) if n > SIZE_LIMIT},
        "largest": dict(sorted(sizes.items(), key=lambda kv: -kv[1])[:8]),
        "fmt_skip": fmt_skips(root, files),
        "vocabulary": words,
        "vocabulary_in_identifiers": parts,
        "refresher_protocol": None
        if protocol is None
        else f"{rel[protocol[0]]}:{protocol[1].lineno}",
        "refresher_members": members,
        "native_isinstance": tests,
        "refresher_probes": found_probes,
    }


def static_figures(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "import_circles": len(s["circles"]),
        "runtime_cycles": len(s["runtime_cycles"]),
        "optim_to_runtime_imports": len(s["optim_to_runtime"]),
        "upward_imports": len(s["upward_imports"]),
        "modules_over_600": len(s["modules_over_600"]),
        "fmt_skip": len(s["fmt_skip"]),
        "fmt_skip_optim_runtime_memory": sum(
            e.startswith(("asteria/optim/", "asteria/runtime/", "asteria/memory/"))
            for e in s["fmt_skip"]
        ),
        "optim_vocabulary_lines": len(s["vocabulary"]),
        "optim_vocabulary_lines_in_identifiers": len(s["vocabulary_in_identifiers"]),
        "refresher_members": len(s["refresher_members"]),
        "native_isinstance": len(s["native_isinstance"]),
        "refresher_probes": len(s["refresher_probes"]),
        "python_lines": s["python_lines"],
        "python_lines_source": s["python_lines_source"],
    }


# -- dynamic --------------------------------------------------------------------------------


class Recorder:
    """Counts a step's Python calls (module docstring): all of them while ``on`` (the
    optimizer's step), and outside it those made while an ``asteria`` function entered from
    other code runs; per step also the C calls, the ``asteria`` modules and functions that ran,
    the ``submit*`` C calls, and the refresh jobs built and copied."""

    def __init__(self, job_inits: frozenset, job_type: type | None) -> None:
        self.job_inits, self.job_type = job_inits, job_type
        self.on = False
        self._entered: Any = None
        self.reset()

    def reset(self) -> None:
        self._entered = None
        self.calls = self.hook_calls = self.asteria_calls = self.c_calls = 0
        self.submits = self.jobs_made = self.jobs_copied = 0
        self.functions: set[tuple[str, str]] = set()

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            module = frame.f_globals.get("__name__") or ""
            mine = module == PACKAGE or module.startswith(PACKAGE + ".")
            if not self.on:
                if self._entered is None:
                    if not mine:
                        return
                    self._entered = frame
                self.hook_calls += 1
            self.calls += 1
            code = frame.f_code
            if mine:
                self.asteria_calls += 1
                if module not in HARNESS:
                    self.functions.add((module, code.co_qualname))
            if code in self.job_inits:
                back = frame.f_back
                if back is not None and back.f_globals.get("__name__") == "dataclasses":
                    self.jobs_copied += 1  # dataclasses.replace
                else:
                    self.jobs_made += 1
            elif module == "copy" and code.co_name in ("copy", "deepcopy"):
                if self.job_type is not None and isinstance(frame.f_locals.get("x"), self.job_type):
                    self.jobs_copied += 1
        elif event == "return":
            if frame is self._entered:
                self._entered = None
        elif event == "c_call" and (self.on or self._entered is not None):
            self.c_calls += 1
            if getattr(arg, "__name__", "").startswith("submit"):
                self.submits += 1

    def row(self) -> dict[str, Any]:
        modules = sorted({m for m, _ in self.functions})
        return {
            "py_calls": self.calls,
            "hook_py_calls": self.hook_calls,
            "asteria_calls": self.asteria_calls,
            "c_calls": self.c_calls,
            "pool_submits": self.submits,
            "jobs_made": self.jobs_made,
            "jobs_copied": self.jobs_copied,
            "modules": modules,
            "functions": len(self.functions),
        }


class Project:
    """The measured checkout's code, imported from ``root`` (``asteria``, ``bench``)."""

    def __init__(self, root: Path) -> None:
        sys.path.insert(0, str(root))
        import torch

        import asteria

        where = Path(asteria.__file__).resolve()
        if root.resolve() not in where.parents:
            raise SystemExit(f"asteria imported from {where}, not from {root}")
        from asteria.runtime import Runtime, RuntimeConfig
        from asteria.train.data import VOCAB_SIZE
        from asteria.train.models import build_model, get_preset
        from asteria.train.optimizers import build_optimizer
        from bench import host_overhead

        torch.set_num_threads(1)
        self.torch, self.Runtime, self.RuntimeConfig = torch, Runtime, RuntimeConfig
        self.vocab, self.build_model, self.get_preset = VOCAB_SIZE, build_model, get_preset
        self.build_optimizer, self.bench = build_optimizer, host_overhead
        self.job_type, self.job_inits = _job_classes()

    def recorder(self) -> Recorder:
        return Recorder(self.job_inits, self.job_type)


def _job_classes() -> tuple[type | None, frozenset]:
    """``RefreshJob`` and the ``__init__`` code of each of its subclasses (a Python one)."""
    try:
        from asteria.optim.refresher import RefreshJob
    except ImportError:
        return None, frozenset()
    codes, todo = set(), list(RefreshJob.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        code = getattr(cls.__init__, "__code__", None)
        if code is not None:
            codes.add(code)
    return RefreshJob, frozenset(codes)


def _train(
    project: Project,
    model: Any,
    opt: Any,
    mode: str,
    batches: list[Any],
    loss: Callable[[Any, Any], Any],
) -> list[dict[str, Any]]:
    """One row (``Recorder.row``) per step of ``batches``, natively or under the runtime with
    ``mode``'s strategies forced (module docstring)."""
    torch, bench = project.torch, project.bench
    rec = project.recorder()
    rows = []
    bases, free = TIERS.get(mode, (None, 0))
    forced = "native" if bases is None else "device" if bases == "device" else "window"
    with bench._forced(forced, torch.device("cpu"), free) as stack:
        runtime = None
        if bases is not None:
            config = project.RuntimeConfig(
                workers=1, statistics_lane=False, refresh="interval", placement={"bases": bases}
            )
            runtime = stack.enter_context(project.Runtime(model, opt, config))
        for batch in batches:
            rec.reset()
            sys.setprofile(rec.profile)
            try:
                value = loss(model, batch)
                value.backward()
                rec.on = True
                opt.step()
                rec.on = False
            finally:
                rec.on = False
                sys.setprofile(None)
            opt.zero_grad(set_to_none=True)
            if not torch.isfinite(value.detach()):
                raise FloatingPointError(f"{type(opt).__name__} {mode}: loss {float(value)}")
            rows.append(rec.row())
            if runtime is not None:
                bench._settle(runtime)
    return rows


def _lm_loss(model: Any, batch: Any) -> Any:
    return model(input_ids=batch, labels=batch).loss


def _period(project: Project, name: str, mode: str, preset: Any) -> dict[str, Any]:
    """``name`` at ``preset`` for 2f+1 steps: the steady period's average and quiet step."""
    torch = project.torch
    model = project.build_model(preset, vocab_size=project.vocab, max_seq_len=32, seed=0)
    opt = project.build_optimizer(name.replace("_", "-"), model.parameters())
    f = int(opt.param_groups[0]["precondition_frequency"])
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, project.vocab, (1, 32), generator=gen) for _ in range(2 * f + 1)]
    rows = _train(project, model, opt, mode, batches, _lm_loss)
    period = rows[f + 1 :]
    least = min(r["py_calls"] for r in period)
    quiet = [r for r in period if r["py_calls"] == least]
    shapes = [(tuple(t.shape), t.dtype) for _, t, _, _ in opt.blocks()]
    return {
        "layers": preset.num_layers,
        "period": f,
        "blocks": len(shapes),
        "shape_groups": len(set(shapes)),
        "calls_per_step": sum(r["py_calls"] for r in period) / f,
        "asteria_calls_per_step": sum(r["asteria_calls"] for r in period) / f,
        "hook_calls_per_step": sum(r["hook_py_calls"] for r in period) / f,
        "c_calls_per_step": sum(r["c_calls"] for r in period) / f,
        "calls_with_c_per_step": sum(r["py_calls"] + r["c_calls"] for r in period) / f,
        "quiet_calls": least,
        "quiet_steps": len(quiet),
        "max_calls": max(r["py_calls"] for r in period),
        "quiet_modules": sorted(set().union(*(r["modules"] for r in quiet))),
        "quiet_functions": max(r["functions"] for r in quiet),
        "per_step": [r["py_calls"] for r in rows],
    }


def _one_request(project: Project, name: str, mode: str) -> dict[str, Any]:
    """The calls of one refresh request on a one-parameter model (module docstring)."""
    torch = project.torch
    steps = 26
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
    opt = project.build_optimizer(name.replace("_", "-"), model.parameters())
    opt.param_groups[0]["precondition_frequency"] = REQUEST_PERIOD
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 64, generator=gen) for _ in range(steps)]
    rows = _train(project, model, opt, mode, batches, _square_loss)
    asked = [i for i in range(1, steps) if rows[i]["jobs_made"] > 0]
    if len(asked) < 2:
        raise RuntimeError(f"{name} {mode}: fewer than two steps after the first built a job")
    step = asked[-1]
    a = rows[step]
    b = min(rows[asked[-2] + 1 : step], key=lambda r: r["py_calls"])
    jobs, built = a["jobs_made"], a["jobs_made"] + a["jobs_copied"]
    return {
        "step": step + 1,
        "calls": a["py_calls"] - b["py_calls"],
        "asteria_calls": a["asteria_calls"] - b["asteria_calls"],
        "due_step_calls": a["py_calls"],
        "quiet_step_calls": b["py_calls"],
        "c_calls": a["c_calls"] - b["c_calls"],
        "pool_submits": a["pool_submits"],
        "jobs": jobs,
        "jobs_built": built,
        "jobs_copied": a["jobs_copied"],
        "builds_per_job": built / jobs if jobs else None,
        "modules": len(a["modules"]),
        "new_modules": sorted(set(a["modules"]) - set(b["modules"])),
        "per_step": [r["py_calls"] for r in rows],
    }


def _square_loss(model: Any, batch: Any) -> Any:
    return model(batch).square().mean()


def dynamic_report(root: Path, quick: bool, log: Callable[[str], None]) -> dict[str, Any]:
    """Every dynamic figure (module docstring); ``log`` hears of each finished run."""
    project = Project(root)
    preset = project.get_preset("nano" if quick else "tiny")
    optimizers = ("soap",) if quick else ("soap", "kl_shampoo", "shampoo")
    request_modes = ("device",) if quick else ("device", "window")
    out: dict[str, Any] = {"preset": preset.name, "variants": {}, "one_request": {}}
    out["native_growth"] = {}
    for name in optimizers:
        for mode in ("native", *TIERS):
            start = time.perf_counter()
            out["variants"][f"{name}_{mode}"] = _period(project, name, mode, preset)
            log(f"{name}_{mode}: {time.perf_counter() - start:.1f} s")
        native = out["variants"][f"{name}_native"]
        for mode in TIERS:
            v = out["variants"][f"{name}_{mode}"]
            v["ratio_to_native"] = v["calls_per_step"] / native["calls_per_step"]
            v["quiet_ratio_to_native"] = v["quiet_calls"] / native["quiet_calls"]
            v["with_c_ratio_to_native"] = (
                v["calls_with_c_per_step"] / native["calls_with_c_per_step"]
            )
        double = dataclasses.replace(preset, num_layers=2 * preset.num_layers)
        grown = _period(project, name, "native", double)
        out["native_growth"][name] = {
            f"{key}@{v['layers']}": v[key]
            for v in (native, grown)
            for key in ("calls_per_step", "quiet_calls", "blocks", "shape_groups")
        }
        log(f"{name}_native at {double.num_layers} layers done")
        for mode in request_modes:
            out["one_request"][f"{name}_{mode}"] = _one_request(project, name, mode)
        log(f"{name}: one request done")
    return out


def dynamic_figures(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, v in d["variants"].items():
        out[f"calls_per_step.{key}"] = round(v["calls_per_step"], 1)
        out[f"calls_with_c_per_step.{key}"] = round(v["calls_with_c_per_step"], 1)
        if "ratio_to_native" in v:
            out[f"calls_ratio.{key}"] = round(v["ratio_to_native"], 3)
            out[f"calls_with_c_ratio.{key}"] = round(v["with_c_ratio_to_native"], 3)
        out[f"quiet_modules.{key}"] = len(v["quiet_modules"])
    for name, g in d["native_growth"].items():
        for key, value in g.items():
            if key.startswith(("calls_per_step", "quiet_calls")):
                out[f"native_growth.{name}.{key}"] = round(value, 1)
    for key, r in d["one_request"].items():
        out[f"request_calls.{key}"] = r["calls"]
        out[f"request_asteria_calls.{key}"] = r["asteria_calls"]
        out[f"request_builds_per_job.{key}"] = r["builds_per_job"]
    return out


# -- report ---------------------------------------------------------------------------------


def git_commit(root: Path) -> str | None:
    """``root``'s HEAD (``+dirty`` where tracked files differ), or None without git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def recorded(commit: str | None) -> dict[str, Any]:
    """When, at which commit, with which torch and on what machine (Note [Recorded runs])."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        memory = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        memory = None
    torch = sys.modules.get("torch")
    accelerator = None
    if torch is not None and torch.cuda.is_available():
        accelerator = torch.cuda.get_device_name()
    try:
        torch_version = torch.__version__ if torch is not None else metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "torch": torch_version,
        "machine": {
            "cpu": cpu,
            "cpu_count": os.cpu_count(),
            "memory_gib": memory,
            "accelerator": accelerator,
            "platform": f"{platform.system()} {platform.machine()}",
        },
    }


def print_report(s: dict[str, Any], d: dict[str, Any] | None) -> None:
    """The readable report of ``static_report`` and ``dynamic_report`` (None: not run)."""
    generated = ", ".join(s["generated"]) or "generated files"
    lines = [
        f"asteria/: {s['modules']} modules, {s['python_lines']} Python lines "
        f"({s['python_lines_source']} without {generated})",
        f"import edges: {s['import_edges']}",
        f"import circles: {len(s['circles'])} ({len(s['runtime_cycles'])} cycles at run time)",
    ]
    for c in s["circles"]:
        lines.append(
            f"  {' <-> '.join(c['modules'])}{'  [run time]' if c['runtime_cycle'] else ''}"
        )
        lines += [f"      {e['src']} -> {e['dst']}  {e['kind']}  {e['at']}" for e in c["edges"]]
    for title, key in (
        ("optim -> runtime imports", "optim_to_runtime"),
        ("upward imports", "upward_imports"),
    ):
        lines.append(f"{title}: {len(s[key])}")
        lines += [f"  {e['at']}  {e['src']} -> {e['dst']} ({e['kind']})" for e in s[key]]
    lines.append(f"modules over {SIZE_LIMIT} lines: {len(s['modules_over_600'])}")
    lines += [f"  {path}: {n}" for path, n in s["modules_over_600"].items()]
    lines.append(f"# fmt: skip: {len(s['fmt_skip'])}")
    parts = len(s["vocabulary_in_identifiers"])
    lines.append(
        f"window/ring/slot/prefetch lines in asteria/optim: {len(s['vocabulary'])} "
        f"({parts} counting identifier parts)"
    )
    lines += [f"  {line[:110]}" for line in s["vocabulary"]]
    members = s["refresher_members"]
    lines.append(
        f"Refresher protocol ({s['refresher_protocol']}): {len(members)} members: "
        + ", ".join(members)
    )
    for title, key in (
        ("isinstance(..., NativeRefresher)", "native_isinstance"),
        ("getattr/hasattr probes on a refresher", "refresher_probes"),
    ):
        lines.append(f"{title}: {len(s[key])}")
        lines += [f"  {line[:110]}" for line in s[key]]
    if d is not None:
        lines += _dynamic_lines(d)
    print("\n".join(lines))


def _dynamic_lines(d: dict[str, Any]) -> list[str]:
    lines = [f"\nPython calls per step, preset {d['preset']} (average over a refresh period)"]
    rows = [("variant", "blocks", "calls/step", "x native", "quiet step", "x native", "modules")]
    for key, v in d["variants"].items():
        rows.append(
            (
                key,
                v["blocks"],
                f"{v['calls_per_step']:.0f}",
                _x(v.get("ratio_to_native")),
                v["quiet_calls"],
                _x(v.get("quiet_ratio_to_native")),
                len(v["quiet_modules"]),
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [str(c).rjust(w) for c, w in zip(r, widths)]
        lines.append("  ".join([str(r[0]).ljust(widths[0])] + cells[1:]))
    lines.append("native's calls per step at L and 2L layers (blocks, shape groups):")
    lines += [f"  {name}: {g}" for name, g in d["native_growth"].items()]
    lines.append("one refresh request (one-parameter model): calls from due to the pool; jobs")
    for key, r in d["one_request"].items():
        lines.append(
            f"  {key}: {r['calls']} calls ({r['due_step_calls']} - {r['quiet_step_calls']}; "
            f"{r['asteria_calls']} of asteria), {r['pool_submits']} pool submits, {r['jobs']} "
            f"jobs built {r['jobs_built']} times ({r['jobs_copied']} copies)"
        )
    return lines


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=HERE, help="the checkout to measure")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="the fast dynamic subset")
    group.add_argument("--static-only", action="store_true", help="no dynamic part")
    args = p.parse_args(argv)
    root = args.root.resolve()
    static = static_report(root)
    dynamic = None
    if not args.static_only:
        dynamic = dynamic_report(root, args.quick, lambda m: print(f"   {m}", file=sys.stderr))
    print_report(static, dynamic)
    commit = os.environ.get("ASTERIA_COMMIT") or git_commit(root)
    figures = static_figures(static) | ({} if dynamic is None else dynamic_figures(dynamic))
    mode = "static" if dynamic is None else "quick" if args.quick else "full"
    result = {
        "tool": "seam_count",
        "mode": mode,
        "root": str(root),
        "commit": commit,
        "figures": figures,
        "static": static,
        "dynamic": dynamic,
        "recorded": recorded(commit),
    }
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
