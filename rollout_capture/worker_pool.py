"""Batch merging on all cores: a persistent pool of worker processes.

Parsing and normalizing rows is CPU-bound, so threads cannot use more than one core.
Workers are spawned once per process (filesystems are not fork-safe, and each worker
opens its own) and import only the core, so they start in a fraction of a second. A
batch travels as a slice of a local file and comes back as a part file: no batch bytes
go through the pipes, so the parent stays free to orchestrate (retries, the UI).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import socket
import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from rollout_capture.backends import ListingScope
from rollout_capture.batch import BatchStats, enrich_blob
from rollout_capture.faults import is_transient_storage_error
from rollout_capture.filesystem import is_local, local_path
from rollout_capture.rollout_files import LineRange
from rollout_capture.store import shared_store

_pools: dict[int, ProcessPoolExecutor] = {}
_pools_lock = threading.Lock()


class ClaimsPending(Exception):
    """A batch holds rollouts with live claims: the caller waits, then submits it again."""

    def __init__(self, rollout_ids: list[str]) -> None:
        super().__init__(rollout_ids)
        self.rollout_ids = rollout_ids


class TransientStorageFault(ConnectionError):
    """A transient storage fault raised in a worker, carried back in a picklable form."""


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """This process's pool of ``workers`` spawned processes (created once, then reused)."""
    workers = max(1, min(workers, os.cpu_count() or 1))
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn")
            )
        return pool


@atexit.register
def _shutdown_pools() -> None:
    for pool in _pools.values():
        pool.shutdown(wait=False, cancel_futures=True)


def where_this_runs() -> str:
    """This worker, for an error message: its host and process."""
    return f"{socket.gethostname()} (pid {os.getpid()})"


def sees_capture_root(capture_dir: str) -> bool:
    """Whether this process sees a local capture root with something in it (else: a URL, or nothing)."""
    return is_local(capture_dir) and _capture_root_state(capture_dir) is None


def _capture_root_state(capture_dir: str) -> str | None:
    """What is wrong with a local capture root as this process sees it (None: it holds entries)."""
    path = local_path(capture_dir)
    if path is None:
        return None  # an object store means the same everywhere
    try:
        with os.scandir(path) as entries:
            return None if next(entries, None) is not None else "is empty"
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be read ({type(exc).__name__}: {exc.strerror or exc})"


def require_capture_root(capture_dir: str) -> None:
    """On a worker: the local capture root the flow saw must be there, with something in it.

    A worker that cannot see it (a share mounted on the flow's machine only, an empty
    mount point) would read every rollout as uncaptured and the run would pass; this
    fails the batch instead, naming the path and the worker.
    """
    wrong = _capture_root_state(capture_dir)
    if wrong is not None:
        raise FileNotFoundError(
            f"capture dir {local_path(capture_dir)} {wrong} on worker {where_this_runs()}, though the "
            "flow found captures there: mount it at the same path on every worker, or use a URL "
            "every worker can read"
        )


def _raise_pending(pending: set[str]) -> set[str]:
    raise ClaimsPending(sorted(pending))


def enrich_in_worker(
    batch: LineRange,
    parts_dir: str,
    capture_dir: str,
    storage_options: Mapping[str, Any] | None,
    credentials: Mapping[str, Any] | None,
    include_payloads: bool,
    stop_on_claims: bool,
    scope: ListingScope | None = None,
) -> tuple[str, int, BatchStats]:
    """In a worker: enrich the lines of ``batch`` into a part file; returns (part path, lines, stats).

    With ``stop_on_claims``, rollouts holding live claims raise :class:`ClaimsPending`
    instead of being waited for here; otherwise they are not waited for at all (the
    caller already did). Errors come back picklable, transient ones as
    :class:`TransientStorageFault`.
    """
    try:
        store = shared_store(capture_dir, storage_options, credentials=credentials)
        try:
            data = batch.read()
        except OSError as exc:
            raise _not_visible("input slice", exc) from None
        blob, lines, stats = enrich_blob(
            data,
            [store],
            first_line=batch.first_line,
            include_payloads=include_payloads,
            # Any positive timeout makes claimed rollouts reach the waiter, which stops here.
            quiescence_timeout_s=1.0 if stop_on_claims else 0.0,
            waiter=_raise_pending,
            scope=scope,
        )
        part = os.path.join(parts_dir, f"part-{batch.first_line:012d}-{uuid.uuid4().hex[:8]}.jsonl")
        try:
            with open(part, "wb") as out:
                out.write(blob)
        except FileNotFoundError as exc:
            raise _not_visible("parts dir", exc) from None
        return part, lines, stats
    except ClaimsPending:
        raise
    except Exception as exc:
        if is_transient_storage_error(exc):
            raise TransientStorageFault(f"{type(exc).__name__}: {exc}") from None
        if type(exc).__module__ == "builtins":
            raise
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from None


def _not_visible(what: str, exc: OSError) -> OSError:
    """The worker's error for a file of the flow it cannot reach, naming the file and the worker."""
    return type(exc)(
        exc.errno, f"{what} not readable on worker {where_this_runs()}: {exc.strerror}", exc.filename
    )
