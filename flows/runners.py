"""Where batches run: threads (default), a process pool (all cores), or Dask (many machines)."""

from __future__ import annotations

import os
from typing import Any, Literal

from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner

Runner = Literal["threads", "processes", "dask"]


def make_task_runner(runner: Runner, max_workers: int, dask_address: str | None = None) -> TaskRunner[Any]:
    """A task runner for the batches; process pools spawn (filesystems are not fork-safe)."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be at least 1; got {max_workers}")
    if runner == "threads":
        return ThreadPoolTaskRunner(max_workers=max_workers)
    if runner == "processes":
        return ProcessPoolTaskRunner(max_workers=min(max_workers, os.cpu_count() or 1))
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
