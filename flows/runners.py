"""Where batches run: threads (default), a process pool (all cores), or Dask (many machines)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

Runner = Literal["threads", "processes", "dask"]


LOCAL_THREADS = 2


def effective_workers(runner: Runner, max_workers: int, capture_dir: str) -> int:
    """How many batches to run at once.

    Threads only help while batches wait on storage: on a local disk, beyond two they
    add memory and interpreter-lock contention, never speed. The process pool gets one
    worker per core at most; Dask takes ``max_workers`` as given.
    """
    local = "://" not in capture_dir or capture_dir.startswith("file://")
    if runner == "processes":
        return min(max_workers, os.cpu_count() or 1)
    return min(max_workers, LOCAL_THREADS) if runner == "threads" and local else max_workers


def make_task_runner(runner: Runner, max_workers: int, dask_address: str | None = None) -> TaskRunner[Any]:
    """A task runner for the batches; process pools spawn (filesystems are not fork-safe)."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be at least 1; got {max_workers}")
    if runner == "threads":
        return ThreadPoolTaskRunner(max_workers=max_workers)
    if runner == "processes":  # task runs in threads here; their merges in a worker pool
        return ThreadPoolTaskRunner(max_workers=max_workers)
    if runner == "dask":
        try:
            from prefect_dask.task_runners import DaskTaskRunner
        except ImportError as exc:
            raise ValueError("runner='dask' needs prefect-dask: pip install 'rollout-capture[dask]'") from exc
        if dask_address:
            return DaskTaskRunner(address=dask_address)
        workers = min(max_workers, os.cpu_count() or 1)
        return DaskTaskRunner(
            cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True}
        )
    raise ValueError(f"runner must be 'threads', 'processes' or 'dask'; got {runner!r}")


def current_api_url() -> str | None:
    """The API this process talks to: the configured one, or its running temporary server."""
    configured = PREFECT_API_URL.value()
    if configured:
        return str(configured)
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer._instances.get(None)
    return server.api_url if server is not None and server.running else None


@contextmanager
def api_shared_with_workers(runner: Runner) -> Iterator[None]:
    """Let batches running in other processes report to this process's API.

    Workers get the settings of the submitting context; without an explicit URL there
    (the embedded temporary server), each worker would boot a server of its own: seconds
    lost per worker, and task runs the UI of this flow run would never show.
    """
    url = current_api_url() if runner == "dask" and not PREFECT_API_URL.value() else None
    if url is None:
        yield
        return
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield
