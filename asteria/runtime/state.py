"""The runtime's part of a checkpoint: its refreshes in flight, finished and saved with results.

Owns: ``save`` and ``load`` (``Runtime.state_dict`` / ``load_state_dict``) and their format
(``format`` 1: the refreshes in flight, each with its block, request step, results or error, job
options and, under torch.distributed, the rank expected to send it).

Note [Checkpoints with work in flight]: a refresh requested at step ``t`` and not yet installed
is waited for (the bounded barrier) and saved with its request step and results, not submitted
again on load (its inputs, step ``t``'s factors, are not in the checkpoint). After ``load`` it is
installed at the step it would have been, so a ``fixed_delay`` run resumed from a checkpoint
follows the uninterrupted run bit for bit (tests/unit/test_checkpoint.py). Saved next to (and in)
``optimizer.state_dict()``, loaded after it. Under torch.distributed the state is the rank's, no
collective: the owner saves a replicated block's results, the others "expected from rank
``r``", and the sync at the deadline proceeds after a load on the same ranks. ``load`` checks
every refresh first (``check``) and changes nothing where one does not fit; an optimizer's
``load_state_dict`` runs the same check before it changes anything (Note [Transactional loads]
in asteria/optim/state_io.py).

Must not: install, submit or decide anything (the plan takes the restored refreshes from there
as any others).
"""

from __future__ import annotations

from typing import Any

import torch

from asteria.optim.refresher import RefreshJob
from asteria.runtime.refreshes import Refreshes
from asteria.runtime.registry import PendingRefresh, Resolved

__all__ = ["FORMAT", "load", "save"]

#: The version of what ``save`` writes.
FORMAT = 1


def save(refreshes: Refreshes) -> dict[str, Any]:
    """Every refresh in flight, finished first (the caller holds the runtime's lock and has
    waited for the statistics lane)."""
    pending = []
    for key, e in sorted(refreshes.registry.entries.items()):
        p = e.pending
        if p is None:
            continue
        item: dict[str, Any] = {
            "key": key,
            "requested": p.requested,
            "results": None,
            "error": None,
            "jobs": [None if j is None else j.options() for j in p.jobs],
            "owner": p.owner,
        }
        if p.owner is None:  # computed here (a local block, or this rank owns it)
            refreshes.wait(e, refreshes.current_step(key))
            try:
                item["results"] = refreshes.results(key, e, p, None, consume=False)
            except refreshes.errors as err:
                item["error"] = str(err)
        pending.append(item)
    return {"format": FORMAT, "pending": pending}


def load(refreshes: Refreshes, state: dict[str, Any], budget: int) -> None:
    """Put the refreshes of ``save`` back in flight (after the optimizer's state is loaded):
    everything is checked first (``check``), then what was in flight is dropped and replaced."""
    blocks = {
        key: (b, refreshes.current_step(key)) for key, _, b, _ in refreshes.optimizer.blocks()
    }
    restored = check(state, blocks, budget, refreshes.coherence, refreshes.block_name)
    refreshes.drop_all()
    for key, pending in restored:
        refreshes.entry(key).pending = pending


def check(
    state: Any,
    blocks: dict[tuple[int, int], tuple[dict, int]],
    budget: int,
    coherence: Any,
    name_of: Any,
) -> list[tuple[tuple[int, int], PendingRefresh]]:
    """The refreshes in flight of ``state`` (a ``save``) checked against ``blocks`` (key -> (block
    state, its step)): a ``ValueError`` names the first that does not fit, and nothing changes. A
    refresh must be installable within ``B`` of its block's step (``0 <= s - requested < B``), so
    that the staleness contract holds from the load on."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"not a Runtime.state_dict() of this version (format {FORMAT})")
    items = state.get("pending")
    if not isinstance(items, (list, tuple)):
        raise ValueError("a Runtime.state_dict()'s 'pending' must be a list of refreshes in flight")
    out = []
    seen: set[tuple[int, int]] = set()
    for n, item in enumerate(items):
        where = f"Runtime.load_state_dict: pending[{n}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} is {type(item).__name__}, a dict is needed")
        raw = item.get("key")
        if (
            not isinstance(raw, (list, tuple))
            or len(raw) != 2
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in raw)
        ):
            raise ValueError(f"{where}: 'key' must be (parameter index, block index), got {raw!r}")
        key = (int(raw[0]), int(raw[1]))
        if key not in blocks:
            raise ValueError(
                f"the checkpoint has a refresh in flight for block {key}, which the "
                "optimizer does not have: load the optimizer's state_dict first"
            )
        if key in seen:
            raise ValueError(f"{where}: a second refresh in flight for block {key}")
        seen.add(key)
        block, step = blocks[key]
        name = name_of(key)
        where = f"Runtime.load_state_dict: the refresh in flight of block '{name}'"
        requested = item.get("requested")
        if isinstance(requested, bool) or not isinstance(requested, int):
            raise ValueError(f"{where}: 'requested' must be a step (an int), got {requested!r}")
        if not 0 <= step - requested < budget:
            raise ValueError(
                f"{where} was requested at step {requested}; the block is at step {step}, so it "
                f"could not be installed within the budget {budget} (Note [Staleness contract]): "
                "load the Runtime.state_dict() saved with this optimizer state, into a runtime "
                "with the same staleness / fixed_delay"
            )
        factors = block.get("factors") or []
        jobs = _checked_jobs(item, len(factors), where)
        owner = item.get("owner")
        if owner is not None and (isinstance(owner, bool) or not isinstance(owner, int)):
            raise ValueError(f"{where}: 'owner' must be a rank (an int) or None, got {owner!r}")
        if owner is not None and (coherence is None or coherence.owner(key) != owner):
            raise ValueError(
                f"the checkpoint expects block {key}'s refresh in flight from rank "
                f"{owner}, which does not own it here: load on the ranks that saved it"
            )
        error = item.get("error")
        if error is not None and not isinstance(error, str):
            raise ValueError(f"{where}: 'error' must be a message (a str) or None")
        if owner is not None:
            futures: list[Any] = [None] * len(jobs)
        elif error is not None:
            futures = [Resolved(error=error)]
        else:
            futures = _checked_results(item.get("results"), jobs, factors, where)
        made = PendingRefresh(requested=requested, futures=futures, copies=[], jobs=jobs)
        made.owner = owner
        out.append((key, made))
    return out


def _checked_jobs(item: dict, dims: int, where: str) -> list[Any]:
    """The saved job options, one per dim of the block (a checkpoint without them: none)."""
    options = item.get("jobs", [])
    if not isinstance(options, (list, tuple)) or (options and len(options) != dims):
        raise ValueError(f"{where}: 'jobs' must be one entry per dim of the block ({dims})")
    jobs = []
    for dim, o in enumerate(options):
        if o is None:
            jobs.append(None)
            continue
        try:
            jobs.append(RefreshJob.from_options(o))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(
                f"{where}: jobs[{dim}] is not a refresh job's options ({o!r}: {err!r})"
            ) from None
        if not isinstance(jobs[-1].dtype, torch.dtype):
            raise ValueError(f"{where}: jobs[{dim}] has no torch dtype ({o.get('dtype')!r})")
    return jobs


def _checked_results(results: Any, jobs: list[Any], factors: list[Any], where: str) -> list[Any]:
    """Resolved futures of the saved results: one per dim, each a ``d x d`` floating-point
    matrix (and a permutation of ``d`` where the job sorts) for a factor of dim ``d``."""
    if not isinstance(results, (list, tuple)) or len(results) != len(factors):
        got = len(results) if isinstance(results, (list, tuple)) else type(results).__name__
        raise ValueError(f"{where}: 'results' has {got} entries, one per dim ({len(factors)})")
    futures: list[Any] = []
    for dim, (r, f) in enumerate(zip(results, factors)):
        job = jobs[dim] if jobs else None
        if f is None or r is None:
            if f is not None or r is not None or job is not None:
                raise ValueError(f"{where}: results[{dim}] does not match the block's factors")
            futures.append(None)
            continue
        d = int(f.shape[0])
        pair = isinstance(r, (tuple, list)) and len(r) == 2
        if job is not None and pair != (job.kind == "qr"):
            shape = "(basis, permutation or None)" if job.kind == "qr" else "a matrix"
            raise ValueError(f"{where}: results[{dim}] must be {shape} for a {job.kind} job")
        matrix, perm = (r[0], r[1]) if pair else (r, None)
        if (
            not isinstance(matrix, torch.Tensor)
            or tuple(matrix.shape) != (d, d)
            or not matrix.is_floating_point()
        ):
            got = tuple(matrix.shape) if isinstance(matrix, torch.Tensor) else type(matrix).__name__
            raise ValueError(
                f"{where}: results[{dim}] is {got}, a floating-point {d} x {d} matrix is needed "
                "(a checkpoint of a model of another shape?)"
            )
        wants_perm = job is not None and job.permutes
        if wants_perm and (
            not isinstance(perm, torch.Tensor)
            or perm.dtype != torch.int64
            or tuple(perm.shape) != (d,)
        ):
            raise ValueError(f"{where}: results[{dim}] needs a permutation of {d} (int64)")
        futures.append(Resolved(r))
    return futures
