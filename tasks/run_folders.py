"""Prefect tasks over run folders: find them, take one, mark it enriched."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rollout_capture.run_folders import DEFAULT_LEASE_S, Lease, RunFolder, RunsRoot
from tasks.credentials import credentials_from_block
from tasks.retry import storage_retries


def _root(runs_root: str, storage_options: dict[str, Any] | None, credentials_block: str | None) -> RunsRoot:
    return RunsRoot(runs_root, storage_options, credentials=credentials_from_block(credentials_block))


@task(name="find_runs", cache_policy=NO_CACHE, **storage_retries())
def find_runs(
    runs_root: str, storage_options: dict[str, Any] | None = None, credentials_block: str | None = None
) -> list[RunFolder]:
    """Every run folder under the root, finished or not."""
    runs = _root(runs_root, storage_options, credentials_block).runs()
    ready = [r.name for r in runs if r.finished and not r.enriched]
    get_run_logger().info("%d run(s) under %s; ready to enrich: %s", len(runs), runs_root, ready or "none")
    return runs


@task(name="take_run", cache_policy=NO_CACHE, **storage_retries())
def take_run(
    runs_root: str,
    run: RunFolder,
    lease_s: float = DEFAULT_LEASE_S,
    storage_options: dict[str, Any] | None = None,
    credentials_block: str | None = None,
) -> Lease | None:
    """The run's lease, or None when another scheduled run is enriching it."""
    return _root(runs_root, storage_options, credentials_block).acquire(run, lease_s)


@task(name="finish_run", cache_policy=NO_CACHE, **storage_retries())
def finish_run(
    runs_root: str,
    run: RunFolder,
    lease: Lease,
    summary: dict[str, Any] | None,
    storage_options: dict[str, Any] | None = None,
    credentials_block: str | None = None,
) -> None:
    """Write ``_ENRICHED`` (when there is a summary: the run succeeded), then give the lease back."""
    root = _root(runs_root, storage_options, credentials_block)
    if summary is not None:
        root.mark_enriched(run, summary)
    root.release(run, lease)
