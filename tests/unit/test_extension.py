"""The extension asteria._C as a whole: its build record and the import check, the info report,
the refresh worker pool from Python, and the CPU build's count_nonfinite."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import asteria
from asteria import _C
from asteria.optim import matrix_functions as mf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _spd(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n + 3, generator=gen, dtype=torch.float64)
    return (a @ a.T / n + 1e-3 * torch.eye(n, dtype=torch.float64)).to(dtype)


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


@pytest.fixture
def pool():
    p = _C.WorkerPool(2)
    yield p
    p.shutdown()


class _Busy:
    """Keeps a pool's workers busy until ``release()``, whatever the machine's speed: float64
    eighs of deadline -1 (ahead of any job a test queues), one running per worker and ``queued``
    more behind them (seconds of work on any machine: a test's submissions are made long before
    they could run out). ``release()`` supersedes the queued ones with trivial jobs (they are
    cancelled), so the workers reach the test's jobs once the eighs they are running end."""

    def __init__(self, pool: _C.WorkerPool, queued: int = 100, n: int = 400) -> None:
        self.pool, self.big = pool, _spd(n, torch.float64)
        self.running = [self._submit(f"busy{i}", 0, self.big) for i in range(pool.workers)]
        while any(f.status() == "queued" for f in self.running):
            time.sleep(0.001)
        self.queued = [self._submit(f"queued{i}", 0, self.big) for i in range(queued)]

    def _submit(self, block: str, version: int, factor: torch.Tensor) -> _C.Future:
        return self.pool.submit_eigh(block, version, -1, factor, torch.float64, copy=False)

    def release(self) -> None:
        # the first queued eighs may have run meanwhile (each takes milliseconds); what matters is
        # that the queue had not run dry, so the workers never reached the test's jobs early
        assert not self.queued[-1].done(), (
            "the workers ran out of work before the test released them"
        )
        tiny = torch.eye(1, dtype=torch.float64)
        for i, f in enumerate(self.queued):
            if not f.done():
                self._submit(f"queued{i}", 1, tiny)


# ---- build record, import check, info ---------------------------------------------------------


def test_build_info_fields():
    info = _C.build_info()
    assert info["torch_version"] == torch.__version__.split("+")[0]
    assert info["cuda"] is _C.cuda_enabled()
    assert info["cuda"] == (info["cuda_version"] != "")
    if torch.version.cuda is None:
        assert info["cuda"] is False
    assert info["lapack_backend"] in torch.__config__.show().lower()
    assert info["eigh_path"] in ("aten", "mkl_direct")
    assert info["default_workers"] == (os.cpu_count() or 1)
    assert info["cplusplus"] >= 201703
    assert isinstance(info["thread_local_openmp"], bool) and isinstance(info["compiler"], str)


def test_version_and_recorded_build():
    from asteria import _build_info

    assert asteria.__version__ == "0.1.0"
    assert _build_info.TORCH_VERSION == torch.__version__
    assert _build_info.CUDA is _C.build_info()["cuda"]
    assert "-O2" in _build_info.CXX_FLAGS
    assert not any(f in _build_info.CXX_FLAGS for f in ("-fopenmp", "-march=native"))


def test_info_report_runs():
    out = subprocess.run(
        [sys.executable, "-m", "asteria.info"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert asteria.__version__ in out.stdout and torch.__version__ in out.stdout
    assert "LAPACK backend" in out.stdout and "verdict" in out.stdout
    cuda_line = next(line for line in out.stdout.splitlines() if line.startswith("CUDA extension"))
    if not _C.cuda_enabled():
        assert cuda_line.split()[-1] == "off"
        assert "CUDA off" in out.stdout


IMPORT_ASTERIA = """
    try:
        import asteria
    except ImportError as e:
        print("ImportError:", e)
        sys.exit(3)
"""
FAKE_BUILD = (
    """
    import sys, types, torch
    fake = types.ModuleType("asteria._build_info")
    fake.TORCH_VERSION = {recorded!r}
    sys.modules["asteria._build_info"] = fake
    {patch}
"""
    + IMPORT_ASTERIA
)


def test_import_refuses_an_extension_built_for_another_torch():
    out = _python(FAKE_BUILD.format(recorded="2.0.1+cu118", patch=""))
    assert out.returncode == 3, out.stderr
    assert "built against torch 2.0.1+cu118" in out.stdout
    assert f"torch {torch.__version__} is running" in out.stdout
    assert "pip install --no-build-isolation" in out.stdout and "make build" in out.stdout


def test_import_checks_the_compiled_torch_version_too():
    # The record agrees with the (patched) running torch, but the binary was compiled for 2.13.
    patch = 'torch.__version__ = "9.9.9"'
    out = _python(FAKE_BUILD.format(recorded="9.9.9", patch=patch))
    assert out.returncode == 3, out.stderr
    assert f"compiled against torch {torch.__version__.split('+')[0]}" in out.stdout
    assert "torch 9.9.9 is running" in out.stdout


def test_import_explains_an_unloadable_extension():
    setup = """
    import sys
    sys.modules["asteria._C"] = None  # the importer then fails, as on a bad dlopen
"""
    out = _python(setup + IMPORT_ASTERIA)
    assert out.returncode == 3, out.stderr
    assert "asteria._C cannot be loaded" in out.stdout
    assert f"running torch {torch.__version__}" in out.stdout


def test_stub_covers_every_binding():
    """asteria/_C.pyi names every function, class, method and property the module binds."""
    tree = ast.parse(open(os.path.join(ROOT, "asteria", "_C.pyi")).read())
    stub: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            stub[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            stub[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    bound = {name for name in dir(_C) if not name.startswith("__")}
    assert bound <= set(stub) | {"RefreshResult"}, bound - set(stub)
    for name, members in stub.items():
        obj = getattr(_C, name)
        if isinstance(obj, type) and not issubclass(obj, BaseException):
            public = {m for m in vars(obj) if not m.startswith("_")}
            named = {m for m in members if not m.startswith("_")}  # dunders: __init__, __enter__
            assert public == named, (name, public ^ named)


# ---- worker pool ------------------------------------------------------------------------------


def test_pool_results_equal_the_pure_torch_functions(pool):
    a = _spd(48, seed=1)
    basis = mf.eigh_descending(_spd(48, seed=2))[1]
    f_eigh = pool.submit_eigh("L", 1, 3, a)
    f_qr = pool.submit_qr_refresh("R", 1, 3, a, basis, True, torch.float32)
    f_qr_unsorted = pool.submit_qr_refresh("R2", 1, 3, a, basis, sort=False)
    f_root = pool.submit_inverse_root("P", 1, 3, a, 4.0, 1e-6, torch.float64)

    evals, evecs = f_eigh.result()
    ref_evals, ref_evecs = mf.eigh_descending(a)
    assert torch.allclose(evals, ref_evals, atol=1e-5)
    assert torch.allclose((evecs.T @ ref_evecs).abs(), torch.eye(48), atol=1e-3)
    q, perm = f_qr.result()
    ref_q, ref_perm = mf.qr_refresh(a, basis)
    assert torch.equal(perm, ref_perm) and torch.allclose(q, ref_q, atol=1e-5)
    q2, none = f_qr_unsorted.result()
    assert none is None and torch.allclose(q2, mf.qr_refresh(a, basis, sort=False)[0], atol=1e-5)
    root = f_root.result()
    assert root.dtype == torch.float64
    assert torch.allclose(root, mf.inverse_root(a, 4.0, 1e-6, torch.float64), atol=1e-10)

    assert (f_eigh.block, f_eigh.version, f_eigh.deadline) == ("L", 1, 3)
    assert f_eigh.done() and not f_eigh.cancelled() and f_eigh.status() == "succeeded"
    assert f_eigh.started_at <= f_eigh.finished_at <= time.monotonic()
    assert pool.stats()["completed"] == 4


def test_deadline_order_with_one_worker():
    pool = _C.WorkerPool(1)
    busy = _Busy(pool)
    deadlines = {"a": 5, "b": 1, "c": 3, "d": 1, "e": 2}
    futures = {k: pool.submit_eigh(k, 1, d, _spd(32)) for k, d in deadlines.items()}
    busy.release()  # all five are queued: the worker picks them in deadline order
    for f in futures.values():
        f.result(timeout_s=60)
    started = sorted(futures, key=lambda k: futures[k].started_at)
    assert started == ["b", "d", "e", "c", "a"]  # ties: first submitted first
    assert busy.running[0].finished_at <= futures["b"].started_at
    pool.shutdown()


def test_superseded_job_is_cancelled():
    pool = _C.WorkerPool(1)
    busy = _Busy(pool)
    old = pool.submit_eigh("L0", 1, 10, _spd(16))
    new = pool.submit_eigh("L0", 2, 12, _spd(16, seed=1))
    assert old.cancelled() and old.done() and old.started_at is None
    with pytest.raises(
        _C.CancelledError, match=r"block 'L0' \(version 1\).*superseded by version 2"
    ):
        old.result()
    assert isinstance(_C.CancelledError("x"), RuntimeError)
    assert pool.stats()["cancelled"] == 1
    pool.submit_eigh("L1", 5, 0, _spd(4))  # still queued behind the busy worker
    with pytest.raises(ValueError, match="older than its queued version"):
        pool.submit_eigh("L1", 4, 0, _spd(4))
    busy.release()
    new_evals = new.result(timeout_s=60)[0]
    assert torch.allclose(new_evals, mf.eigh_descending(_spd(16, seed=1))[0], atol=1e-5)
    pool.shutdown()


def test_errors_carry_the_block_and_the_original_message(pool):
    non_square = pool.submit_eigh("model.w/L", 3, 0, torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"^block 'model.w/L' \(version 3\): factor must be a sq"):
        non_square.result()
    assert non_square.status() == "failed"
    nan = torch.eye(5)
    nan[0, 1] = float("nan")
    bad = pool.submit_inverse_root("model.w/R", 4, 0, nan, 2.0)
    with pytest.raises(
        _C.MatrixFunctionError, match=r"^block 'model.w/R' \(version 4\): inverse_r"
    ):
        bad.result()
    assert pool.stats()["failed"] == 2


def test_submit_checks_arguments_at_once(pool):
    with pytest.raises(ValueError, match="dtype"):
        pool.submit_eigh("L", 0, 0, torch.eye(3), torch.float16)
    with pytest.raises(ValueError, match="root"):
        pool.submit_inverse_root("L", 0, 0, torch.eye(3), -1.0)
    with pytest.raises(ValueError, match="workers"):
        _C.WorkerPool(0)
    with pytest.raises(ValueError, match="CPU"):
        _C.WorkerPool(1, affinity=[1 << 20])


def test_job_owns_its_inputs():
    pool = _C.WorkerPool(1)
    busy = _Busy(pool)
    a = _spd(12)
    expected = mf.eigh_descending(a)[0]
    fut = pool.submit_eigh("L", 1, 0, a)
    a.fill_(float("nan"))  # the caller reuses its buffer before the job even started
    assert fut.status() == "queued"
    busy.release()
    assert torch.allclose(fut.result(timeout_s=60)[0], expected, atol=1e-5)
    pool.shutdown()


def test_result_timeout():
    pool = _C.WorkerPool(1)
    busy = _Busy(pool)
    fut = pool.submit_eigh("L", 1, 0, _spd(8))
    with pytest.raises(TimeoutError, match="no result after"):
        fut.result(timeout_s=0.001)
    with pytest.raises(_C.FutureTimeoutError):
        fut.result(timeout_s=0.0)
    busy.release()
    assert fut.result(timeout_s=60.0)[0].shape == (8,)
    pool.shutdown()


def test_result_releases_the_gil():
    """A Python thread runs while the main thread blocks in result(): it supersedes the job the
    main thread waits for (queued behind a busy worker), which ends the wait with CancelledError.
    Were the GIL held, that thread could run only after the job had run and result() returned."""
    pool = _C.WorkerPool(1)
    busy = _Busy(pool)
    fut = pool.submit_eigh("waited", 1, 0, _spd(8))
    waiting = threading.Event()

    def supersede() -> None:
        waiting.wait(60)
        time.sleep(0.05)  # (sleeping frees the GIL: the main thread goes on into result())
        pool.submit_eigh("waited", 2, 0, _spd(8))

    thread = threading.Thread(target=supersede)
    thread.start()
    waiting.set()
    with pytest.raises(_C.CancelledError, match="superseded by version 2"):
        fut.result(timeout_s=60)
    thread.join(60)
    assert fut.started_at is None  # it never ran: the wait ended while the worker was busy
    busy.release()
    pool.shutdown()


def test_pool_leaves_the_main_threads_setting_alone():
    before = torch.get_num_threads()
    pool = _C.WorkerPool(2, lapack_threads=1)
    pool.submit_eigh("L", 1, 0, _spd(64)).result()
    assert torch.get_num_threads() == before
    assert pool.workers == 2 and pool.lapack_threads == 1
    pool.shutdown()


def test_shutdown_cancels_queued_and_finishes_running():
    pool = _C.WorkerPool(1)
    busy = _Busy(pool)
    running = busy.running[0]
    queued = [pool.submit_eigh(f"q{i}", 1, 0, _spd(8)) for i in range(3)]
    pool.shutdown(wait=True)
    assert running.status() == "succeeded"
    assert all(f.cancelled() for f in queued + busy.queued)
    with pytest.raises(_C.CancelledError, match="shut down"):
        queued[0].result()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit_eigh("late", 1, 0, _spd(8))
    assert pool.is_shutdown()
    pool.shutdown()  # idempotent


@pytest.mark.parametrize(
    "ending",
    [
        "pool.shutdown(wait=True)",
        "pool.shutdown(wait=False)",
        "pass  # interpreter exit with jobs running: the atexit hook stops the pool",
        "del pool",
    ],
)
def test_shutdown_while_jobs_run_does_not_hang(ending):
    out = _python(
        f"""
        import time, torch
        from asteria import _C
        pool = _C.WorkerPool(2)
        a = torch.randn(512, 512, dtype=torch.float64)
        a = a @ a.T
        futures = [pool.submit_eigh(f"b{{i}}", 1, i, a, torch.float64) for i in range(16)]
        while pool.stats()["running"] == 0:
            time.sleep(0.001)
        {ending}
        print("exited cleanly")
        """,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "exited cleanly" in out.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_an_idle_worker_returns_freed_memory_to_the_system():
    """Note [Returning freed memory] (refresh_pool.cpp): after bursts of large jobs whose results
    are then released, a pool that trims on going idle holds far less resident memory than one
    that does not (measured: ~15 MiB against ~130-220 MiB over a fresh process). A result is
    owned by its future alone, so it is freed when the future goes: each burst's results but the
    last two are released while its last jobs still run, so that the trim on going idle finds
    them free, and the measure waits for the last burst's trim."""
    script = """
        import sys, time, torch
        from asteria import _C
        torch.set_num_threads(1)
        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) / 1024
        pool = _C.WorkerPool(1, trim_bytes=int(sys.argv[1]))
        a = torch.randn(500, 500, dtype=torch.float64)
        a = a @ a.T
        start = rss()
        trims = 0
        for _ in range(4):
            trims = pool.stats()["trims"]
            futures = [pool.submit_eigh(f"hog{i}", 0, 0, a, torch.float64) for i in range(40)]
            for f in futures[:-2]:
                f.result()
            del futures[:-2]  # released while the last jobs run
            for f in futures:
                f.result()
            del futures
        deadline = time.monotonic() + 60  # only a hang runs out of it
        while int(sys.argv[1]) and pool.stats()["trims"] <= trims and time.monotonic() < deadline:
            time.sleep(0.01)
        print(rss() - start, pool.stats()["trims"])
        """
    growth = {}
    for trim_bytes in (0, 64 << 20):
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script), str(trim_bytes)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert out.returncode == 0, out.stderr
        mib, trims = out.stdout.split()
        growth[trim_bytes] = float(mib)
        assert (int(trims) >= 1) == (trim_bytes > 0)
    assert growth[64 << 20] < growth[0] / 3, growth


# ---- count_nonfinite: the CPU build --------------------------------------------------------------


def test_count_nonfinite_on_cpu():
    t = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0])
    assert _C.count_nonfinite(t).item() == 3
    assert _C.count_nonfinite(t.to(torch.bfloat16)).item() == 3
    assert _C.count_nonfinite(torch.arange(4)).item() == 0
    assert _C.count_nonfinite(torch.empty(0)).item() == 0
    assert _C.count_nonfinite(torch.ones(3)).dtype == torch.long


# Note [One libstdc++]: the extension must use the process's shared libstdc++ for iostreams and
# locales. The first H200 build (2026-12-04, the image's toolchain, torch 2.11, Python 3.12)
# exported its own copies of std::basic_ostream<char>::_M_insert<long> and the codecvt facets:
# every message formatted with ``<<`` of an integer (a cancelled job's "(version N)", a bad
# size's ValueError) segfaulted in num_put. Reproduced here by linking with -static-libstdc++
# (LDFLAGS) and the old setup.py: 424 such symbols, and "(version 1)" printed as "(version ".
# setup.py now drops that flag and hides what static archives bring (--exclude-libs). This names
# the symptom wherever nm is there to read the symbol table, before any test crashes.
_IOSTREAM_SYMBOLS = re.compile(
    r" std::(locale|basic_ostream|basic_istream|basic_ios|ios_base|codecvt|num_put|num_get|ctype)\b"
)


def test_the_extension_uses_the_shared_libstdcxx_for_iostreams():
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils' nm is not installed")
    out = subprocess.run(
        [nm, "-D", "--defined-only", "-C", _C.__file__], capture_output=True, text=True, check=True
    ).stdout
    own = [line.split(" ", 2)[-1] for line in out.splitlines() if _IOSTREAM_SYMBOLS.search(line)]
    assert not own, (
        f"{_C.__file__} defines {len(own)} libstdc++ iostream/locale symbols of its own (a "
        f"statically linked libstdc++: check the link command's flags), e.g. {own[:3]}"
    )
