"""Prefect tasks over run folders: find them, take one, fence and finish it, remember it.

Each retries transient storage faults only; ``LeaseLost`` is never retried (another
holder has the run: the answer will not change).
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rollout_capture.run_folders import DEFAULT_LEASE_S, Lease, LeaseKeeper, RunFolder, RunsRoot, Taken
from rollout_capture.tasks.credentials import credentials_from_block
from rollout_capture.tasks.retry import storage_retries


def _root(runs_root: str, storage_options: dict[str, Any] | None, credentials_block: str | None) -> RunsRoot:
    return RunsRoot(runs_root, storage_options, credentials=credentials_from_block(credentials_block))


@task(name="find_runs", cache_policy=NO_CACHE, **storage_retries())
def find_runs(
    runs_root: str,
    storage_options: dict[str, Any] | None = None,
    credentials_block: str | None = None,
    full_scan: bool = False,
    recheck: list[str] | None = None,
) -> list[RunFolder]:
    """Every run folder under the root, finished or not; the index spares listing enriched ones."""
    found = _root(runs_root, storage_options, credentials_block).discover(
        use_index=not full_scan, recheck=recheck or ()
    )
    ready = [r.name for r in found.runs if r.finished and not r.enriched]
    get_run_logger().info(
        "%d run(s) under %s (%d folder(s) listed, %d known enriched from the index); ready to enrich: %s",
        len(found.runs),
        runs_root,
        found.listed,
        found.indexed,
        ready or "none",
    )
    return found.runs


@task(name="take_run", cache_policy=NO_CACHE, **storage_retries())
def take_run(
    runs_root: str,
    run: RunFolder,
    lease_s: float = DEFAULT_LEASE_S,
    storage_options: dict[str, Any] | None = None,
    credentials_block: str | None = None,
    owner: str | None = None,
) -> Lease | Taken:
    """The run's lease, or ``"busy"`` (another flow run holds it) or ``"enriched"`` (done meanwhile).

    ``owner`` stays the same across retries, so a retry finds a lease an earlier try took.
    """
    return _root(runs_root, storage_options, credentials_block).take(run, lease_s, owner)


@task(name="fence_run", cache_policy=NO_CACHE, **storage_retries())
def fence_run(keeper: LeaseKeeper) -> Lease:
    """Renew the lease right before publishing: only its current holder gets past this."""
    lease = keeper.fence()
    get_run_logger().info("%s: lease generation %d is ours; publishing", keeper.run.name, lease.generation)
    return lease


@task(name="finish_run", cache_policy=NO_CACHE, **storage_retries())
def finish_run(keeper: LeaseKeeper, summary: dict[str, Any]) -> None:
    """Fence, write ``_ENRICHED``, then drop the lease."""
    keeper.finish(summary)


@task(name="release_run", cache_policy=NO_CACHE, **storage_retries())
def release_run(keeper: LeaseKeeper) -> None:
    """Give the lease back after a failure, so the next flow run may take the run at once."""
    keeper.release()


@task(name="remember_enriched", cache_policy=NO_CACHE, **storage_retries())
def remember_enriched(
    runs_root: str,
    names: list[str],
    storage_options: dict[str, Any] | None = None,
    credentials_block: str | None = None,
) -> None:
    """Add the runs just enriched to the root's index, so the next flow runs skip them unlisted."""
    _root(runs_root, storage_options, credentials_block).remember_enriched(names)
