"""``Runtime``: takes an optimizer's refreshes off the training critical path.

Owns: the C++ refresh pool (``asteria._C.WorkerPool``), the coherence registry, the module hooks
and, on CUDA, the shadow stream. It attaches to a SOAP / KL-Shampoo / Shampoo optimizer as its
``Refresher`` (optim/base.py) and runs DESIGN.md's "Asteria mode":

1. the optimizer updates a block's factors every step, as in native mode;
2. when a refresh is due at step ``t``, the runtime snapshots what the refresh reads (factors,
   current basis; on CUDA by an asynchronous copy on the low-priority shadow stream) and submits
   one job per factor to the pool, version ``t``, deadline ``t + S``; the step goes on;
3. at each later step boundary of the block, or when a hook says the block's module is about to
   run, a finished refresh is installed with the optimizer's ``install_refresh`` (which carries
   basis-dependent state over exactly); at step ``t + S`` the step waits for it (Note [Staleness
   bound] in registry.py);
4. a newer request for a block supersedes an older one still in flight (cancelled when queued,
   discarded when running), so a job's input basis is always the basis its result replaces.

Must not: change any algorithm's math (the optimizer's ``refresh_jobs``/``install_refresh`` are
the only way in), or register hooks itself (hooks.py does).
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from typing import Any

import torch

from asteria._ext import load_extension
from asteria.memory.staging import StagingSlots
from asteria.optim.base import BlockKey, KroneckerOptimizer, RefreshJob
from asteria.optim.matrix_functions import MatrixFunctionError
from asteria.runtime.config import RuntimeConfig
from asteria.runtime.hooks import ModuleSignals
from asteria.runtime.registry import (
    BlockEntry,
    PendingRefresh,
    RefreshFailedError,
    Registry,
    StalenessTimeoutError,
)

__all__ = ["Runtime"]


class Runtime:
    """Orchestrate ``optimizer``'s refreshes for ``model`` (see module docstring).

    Use as a context manager or call :meth:`close`; both detach everything (hooks, pool threads)
    and leave the optimizer in native mode with all finished work installed.
    """

    def __init__(
        self,
        model: torch.nn.Module | None,
        optimizer: KroneckerOptimizer,
        config: RuntimeConfig | None = None,
    ) -> None:
        if not isinstance(optimizer, KroneckerOptimizer):
            raise ValueError(
                "optimizer must be an Asteria optimizer (asteria.optim.SOAP, KLShampoo or "
                f"Shampoo), got {type(optimizer).__name__}"
            )
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        self.config = config if config is not None else RuntimeConfig()
        if not isinstance(self.config, RuntimeConfig):
            raise ValueError(f"config must be a RuntimeConfig, got {type(config).__name__}")
        self.optimizer = optimizer
        self.registry = Registry(self.config.staleness)
        self._lock = threading.RLock()
        self._names = self._param_names(model, optimizer)
        self._pid_of = {id(p): i for i, p in enumerate(_params(optimizer))}
        _C = load_extension()
        self._C = _C
        self._pool = _C.WorkerPool(
            workers=self.config.resolved_workers,
            lapack_threads=self.config.lapack_threads,
            affinity=list(self.config.affinity) if self.config.affinity else None,
        )
        # Device snapshots go through pinned staging slots on the shadow stream; CPU tensors are
        # copied by the pool itself at submission.
        self._staging: StagingSlots | None = None
        if any(p.is_cuda for p in _params(optimizer)):
            self._staging = StagingSlots(_C.ShadowStream())
        optimizer.attach_refresher(self)  # raises ValueError when already orchestrated
        self._signals = None
        if model is not None and self.config.hooks:
            self._signals = ModuleSignals(model, self._pid_of.keys(), self._on_signal)
        self._closed = False
        self._step = 0
        self._step_t0 = 0.0
        self._step_wait = 0.0
        self._submitted = 0
        self._failed = 0
        self._cancelled = 0
        self.per_step: dict[str, list[float]] = {"step_ms": [], "barrier_wait_ms": []}
        self._finalizer = weakref.finalize(self, Runtime._shutdown_pool, self._pool)

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(install_pending=exc[0] is None)

    def close(self, install_pending: bool = True) -> None:
        """Detach: remove hooks, install (or drop) refreshes in flight, stop the pool."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            if self._signals is not None:
                self._signals.remove()
            try:
                if install_pending:
                    self._install_in_flight()
            finally:
                self.optimizer.detach_refresher()
                self._pool.shutdown(wait=False)
                if self._staging is not None:
                    self._staging.clear()
                self._finalizer.detach()

    def _install_in_flight(self) -> None:
        """Install every refresh in flight; one not ready within the barrier timeout is dropped."""
        for key, e in list(self.registry.entries.items()):
            if e.pending is None:
                continue
            try:
                self._wait(e, self._current_step(key))
            except StalenessTimeoutError as err:
                warnings.warn(f"{err}; dropped at close()", RuntimeWarning, stacklevel=3)
                e.pending = None
                continue
            self._install(key, e, self._current_step(key))

    @staticmethod
    def _shutdown_pool(pool: Any) -> None:
        pool.shutdown(wait=False)

    # -- the Refresher protocol (called by the optimizer's step) ------------------------------

    def step_begin(self, opt: KroneckerOptimizer) -> None:
        self._step_t0 = time.perf_counter()
        self._step_wait = 0.0

    def block_boundary(
        self,
        opt: KroneckerOptimizer,
        key: BlockKey,
        block: dict,
        group: dict,
        step: int,
        due: bool,
    ) -> None:
        with self._lock:
            e = self.registry.entry(key, self._block_name(key))
            fixed = self.config.fixed_delay
            if e.pending is not None:
                age = step - e.pending.requested
                if fixed is not None:
                    if age >= fixed:
                        self._wait(e, step)
                        self._install(key, e, step, block)
                elif e.pending.done() or age >= self.config.staleness:
                    self._wait(e, step)
                    self._install(key, e, step, block)
            if due:
                if e.pending is not None:
                    self._supersede(e)
                self._request(key, e, block, group, step)
                if (
                    e.pending is not None
                    and (fixed if fixed is not None else self.config.staleness) == 0
                ):
                    self._wait(e, step)
                    self._install(key, e, step, block)

    def step_end(self, opt: KroneckerOptimizer) -> None:
        with self._lock:
            for e in self.registry.entries.values():
                if e.pending is not None and e.pending.copies:
                    self._submit_copied(e, wait=False)
        self._step += 1
        self.per_step["step_ms"].append((time.perf_counter() - self._step_t0) * 1e3)
        self.per_step["barrier_wait_ms"].append(self._step_wait * 1e3)

    # -- requests, waits, installs ------------------------------------------------------------

    def _request(self, key: BlockKey, e: BlockEntry, block: dict, group: dict, step: int) -> None:
        jobs = self.optimizer.refresh_jobs(block, group)
        if all(job is None for job in jobs):
            return  # nothing to refresh (e.g. SOAP's unfactored 1-D blocks)
        e.pending = PendingRefresh(requested=step, futures=[None] * len(jobs))
        for dim, job in enumerate(jobs):
            if job is None:
                continue
            if self._staging is not None:
                events = [self._staging.copy((key, dim, "factor"), job.factor)]
                if job.basis is not None:
                    events.append(self._staging.copy((key, dim, "basis"), job.basis))
                e.pending.copies.append((dim, job, events))
            else:
                e.pending.futures[dim] = self._submit(e, dim, job, job.factor, job.basis)

    def _submit(
        self,
        e: BlockEntry,
        dim: int,
        job: RefreshJob,
        factor: torch.Tensor,
        basis: torch.Tensor | None,
    ) -> Any:
        """One job on the pool (it copies its inputs): version = request step, deadline t + S."""
        self._submitted += 1
        name, version = f"{e.name}.dim{dim}", e.pending.requested
        deadline = version + self.config.staleness
        if job.kind == "qr":
            return self._pool.submit_qr_refresh(
                name, version, deadline, factor, basis, job.sort, job.dtype
            )
        return self._pool.submit_inverse_root(
            name, version, deadline, factor, job.root, job.epsilon, job.dtype
        )

    def _submit_copied(self, e: BlockEntry, wait: bool) -> None:
        """Submit the jobs whose snapshot copies have landed (all of them when ``wait``)."""
        remaining = []
        for dim, job, events in e.pending.copies:
            if wait:
                for ev in events:
                    ev.synchronize()
            elif not all(ev.query() for ev in events):
                remaining.append((dim, job, events))
                continue
            basis = events[1].host if len(events) > 1 else None
            e.pending.futures[dim] = self._submit(e, dim, job, events[0].host, basis)
        e.pending.copies = remaining

    def _supersede(self, e: BlockEntry) -> None:
        """A newer request replaces the one in flight (cancelled if queued, else discarded)."""
        for f in e.pending.futures:
            if f is not None and not f.done():
                self._cancelled += 1
        self.registry.superseded += 1
        e.pending = None

    def _wait(self, e: BlockEntry, step: int) -> None:
        """The bounded barrier: wait (GIL released) for every future of ``e``'s refresh."""
        t0 = time.perf_counter()
        limit = self.config.barrier_timeout_s
        if e.pending.copies:
            self._submit_copied(e, wait=True)
        for f in e.pending.futures:
            if f is None or f.done():
                continue
            remaining = limit - (time.perf_counter() - t0)
            try:
                f.result(timeout_s=max(remaining, 0.0))
            except self._C.FutureTimeoutError:
                raise StalenessTimeoutError(
                    f"Asteria: the refresh of block '{e.name}' requested at step "
                    f"{e.pending.requested} was not ready at step {step} (staleness budget "
                    f"{self.config.staleness}) after waiting {limit:g} s at the barrier "
                    f"(barrier_timeout_s)"
                ) from None
            except Exception:  # failures are handled by _install, which reads every result
                pass
        self._step_wait += time.perf_counter() - t0

    def _install(self, key: BlockKey, e: BlockEntry, step: int, block: dict | None = None) -> None:
        pending, e.pending = e.pending, None
        try:
            results = [None if f is None else f.result() for f in pending.futures]
        except (self._C.MatrixFunctionError, MatrixFunctionError) as err:
            self._failed += 1
            e.failures += 1
            e.consecutive_failures += 1
            if e.consecutive_failures >= self.config.max_consecutive_failures:
                raise RefreshFailedError(
                    f"Asteria: the refresh of block '{e.name}' failed "
                    f"{e.consecutive_failures} times in a row; last error: {err}"
                ) from err
            return  # keep the previous version
        except Exception as err:
            self._failed += 1
            raise RefreshFailedError(
                f"Asteria: the refresh of block '{e.name}' (version {pending.requested}) failed "
                f"in a worker: {err}"
            ) from err
        if block is None:
            block = self._block_state(key)
        results = [self._to_device(r, block) for r in results]
        self.optimizer.install_refresh(block, results)
        self.registry.record_install(e, pending.requested, step)

    @staticmethod
    def _to_device(result: Any, block: dict) -> Any:
        if result is None:
            return None
        device = next(t for t in block["factors"] if t is not None).device
        if isinstance(result, tuple):
            return tuple(None if r is None else r.to(device) for r in result)
        return result.to(device)

    # -- hooks: flush what is ready --------------------------------------------------------------

    def _on_signal(self, param_ids: tuple[int, ...], event: str) -> None:
        if self._closed or self.config.fixed_delay is not None:
            return  # fixed-delay installs happen exactly at their step, not earlier
        with self._lock:
            pids = {self._pid_of[i] for i in param_ids}
            for key, e in self.registry.entries.items():
                if key[0] not in pids or e.pending is None:
                    continue
                if e.pending.copies:
                    self._submit_copied(e, wait=False)
                if e.pending.done():
                    self._install(key, e, self._current_step(key))

    # -- introspection -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Figures the benchmarks read: per-step times, barrier waits, jobs, staleness."""
        pool = dict(self._pool.stats())
        hist = dict(sorted(self.registry.histogram.items()))
        return {
            "steps": self._step,
            "step_ms": list(self.per_step["step_ms"]),
            "barrier_wait_ms": list(self.per_step["barrier_wait_ms"]),
            "jobs": {
                "submitted": self._submitted,
                "completed": int(pool.get("completed", 0)),
                "cancelled": self._cancelled,
                "failed": self._failed,
                "superseded_refreshes": self.registry.superseded,
                "in_flight": self.registry.pending_count(),
            },
            "pool": pool,
            "staleness_histogram": hist,
            "max_staleness": max(hist) if hist else 0,
            "installs": sum(hist.values()),
            "blocks": self.registry.snapshot(),
        }

    # -- helpers ------------------------------------------------------------------------------

    def _current_step(self, key: BlockKey) -> int:
        p = _params(self.optimizer)[key[0]]
        return int(self.optimizer.state[p]["step"])

    def _block_state(self, key: BlockKey) -> dict:
        p = _params(self.optimizer)[key[0]]
        return self.optimizer.state[p]["blocks"][key[1]]

    def _block_name(self, key: BlockKey) -> str:
        return f"{self._names.get(key[0], f'param{key[0]}')}[{key[1]}]"

    @staticmethod
    def _param_names(model: torch.nn.Module | None, opt: KroneckerOptimizer) -> dict[int, str]:
        if model is None:
            return {}
        by_id = {id(p): n for n, p in model.named_parameters()}
        return {i: by_id[id(p)] for i, p in enumerate(_params(opt)) if id(p) in by_id}

    def __repr__(self) -> str:
        c = self.config
        return (
            f"asteria.Runtime(staleness={c.staleness}, workers={c.resolved_workers}, "
            f"fixed_delay={c.fixed_delay}, closed={self._closed})"
        )


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]
