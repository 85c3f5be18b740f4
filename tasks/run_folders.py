"""Prefect tasks over run folders: find them, take one, fence and finish it, remember it.

Each retries transient storage faults only; ``LeaseLost`` is never retried (another
holder has the run: the answer will not change).
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rollout_capture.location import Location, LocationLike
from rollout_capture.run_folders import (
    DEFAULT_LEASE_S,
    Discovery,
    Lease,
    LeaseKeeper,
    RunFolder,
    RunsRoot,
    Taken,
)
from rollout_capture.tasks.credentials import credentials_from_block
from rollout_capture.tasks.naming import run_name
from rollout_capture.tasks.retry import storage_retries

MAX_NAMED_RUNS = 10
"""Runs a log line names; the rest are counted (a first tick may find thousands)."""


def named_few(names: list[str]) -> str:
    """``a, b, c`` for a few names; the first :data:`MAX_NAMED_RUNS` and how many more for many."""
    shown = ", ".join(names[:MAX_NAMED_RUNS])
    more = len(names) - MAX_NAMED_RUNS
    return f"{shown} and {more} more ({len(names)} in all)" if more > 0 else shown


def runs_root_at(runs_root: LocationLike, *, renewing: bool = False) -> RunsRoot:
    """The runs root at a location, its credentials resolved here from the location's block.

    ``renewing``: asked again at each use (a lease renewed for hours outlives temporary
    credentials), rather than once now.
    """
    where = Location.coerce(runs_root)
    block = where.credentials_block
    credentials = (lambda: credentials_from_block(block)) if renewing else credentials_from_block(block)
    return RunsRoot(where.url, where.storage_options, credentials=credentials)


@task(
    name="find_runs",
    task_run_name=run_name("find_runs {runs_root}"),
    cache_policy=NO_CACHE,
    **storage_retries(),
)
def find_runs(
    runs_root: LocationLike,
    full_scan: bool = False,
    recheck: list[str] | None = None,
) -> Discovery:
    """Every run folder under the root, finished or not (``.runs``); the index spares listing
    enriched ones. What is left alone for a link is in ``.refused``, each with why.

    Examples:
        ```python
        import shutil
        import tempfile
        from importlib.resources import files
        from pathlib import Path

        from prefect import flow

        from rollout_capture.tasks.run_folders import find_runs

        runs = Path(tempfile.mkdtemp())  # a runs root with one finished run, r1
        shutil.copytree(str(files("rollout_capture") / "sample"), runs / "r1")
        (runs / "r1" / "_SUCCESS").touch()


        @flow
        def listed() -> list[tuple[str, bool, bool]]:
            return [(run.name, run.finished, run.enriched) for run in find_runs(str(runs)).runs]


        print(listed())  # [('r1', True, False)]
        ```
    """
    root = runs_root_at(runs_root)
    root.backend.require_put_if_absent()  # leases and _ENRICHED rest on it: refused before any run is taken
    if root.backend.folders_exist and not root.backend.root_found():
        # A mistyped or unmounted root would otherwise read as "0 runs", green every tick.
        raise FileNotFoundError(f"runs root {runs_root} does not exist")
    found = root.discover(use_index=not full_scan, recheck=recheck or ())
    ready = [r.name for r in found.runs if r.finished and not r.enriched]
    get_run_logger().info(
        "%d run(s) under %s (%d folder(s) listed, %d known enriched from the index); ready to enrich: %s",
        len(found.runs),
        runs_root,
        found.listed,
        found.indexed,
        named_few(ready) or "none",
    )
    return found


@task(name="take_run", task_run_name="take_run {run.name}", cache_policy=NO_CACHE, **storage_retries())
def take_run(
    runs_root: LocationLike,
    run: RunFolder,
    lease_s: float = DEFAULT_LEASE_S,
    owner: str | None = None,
) -> Lease | Taken:
    """The run's lease, or ``"busy"`` (another flow run holds it) or ``"enriched"`` (done meanwhile).

    ``owner`` stays the same across retries, so a retry finds a lease an earlier try took.

    Examples:
        Two flow runs want the same run; the second is told it is busy:

        ```python
        import shutil
        import tempfile
        from importlib.resources import files
        from pathlib import Path

        from prefect import flow

        from rollout_capture.tasks.run_folders import find_runs, take_run

        runs = Path(tempfile.mkdtemp())  # a runs root with one finished run, r1
        shutil.copytree(str(files("rollout_capture") / "sample"), runs / "r1")
        (runs / "r1" / "_SUCCESS").touch()


        @flow
        def take_twice() -> list[object]:
            run = find_runs(str(runs)).runs[0]
            first = take_run(str(runs), run, lease_s=60)  # a Lease, generation 0
            second = take_run(str(runs), run, lease_s=60)  # another owner, while the lease lives
            return [first.generation, second]


        print(take_twice())  # [0, 'busy']
        ```
    """
    return runs_root_at(runs_root).take(run, lease_s, owner)


@task(
    name="fence_run", task_run_name="fence_run {keeper.run.name}", cache_policy=NO_CACHE, **storage_retries()
)
def fence_run(keeper: LeaseKeeper) -> Lease:
    """Renew the lease right before publishing: only its current holder gets past this.

    Examples:
        ```python
        import shutil
        import tempfile
        from importlib.resources import files
        from pathlib import Path

        from prefect import flow

        from rollout_capture.run_folders import LeaseKeeper, RunsRoot
        from rollout_capture.tasks.run_folders import fence_run, find_runs, finish_run, release_run, take_run

        runs = Path(tempfile.mkdtemp())  # a runs root with one finished run, r1
        shutil.copytree(str(files("rollout_capture") / "sample"), runs / "r1")
        (runs / "r1" / "_SUCCESS").touch()



        @flow
        def fenced() -> int:
            run = find_runs(str(runs)).runs[0]
            with LeaseKeeper(RunsRoot(str(runs)), run, take_run(str(runs), run)) as keeper:
                lease = fence_run(keeper)  # publish the output right after this
                release_run(keeper)
            return lease.generation


        print(fenced())  # 1: the fence renewed generation 0
        ```
    """
    lease = keeper.fence()
    get_run_logger().info("%s: lease generation %d is ours; publishing", keeper.run.name, lease.generation)
    return lease


@task(
    name="finish_run",
    task_run_name="finish_run {keeper.run.name}",
    cache_policy=NO_CACHE,
    **storage_retries(),
)
def finish_run(keeper: LeaseKeeper, summary: dict[str, Any]) -> None:
    """Fence, write ``_ENRICHED``, then drop the lease.

    Examples:
        The whole life of a lease: take, fence, finish:

        ```python
        import shutil
        import tempfile
        from importlib.resources import files
        from pathlib import Path

        from prefect import flow

        from rollout_capture.run_folders import LeaseKeeper, RunsRoot
        from rollout_capture.tasks.run_folders import fence_run, find_runs, finish_run, release_run, take_run

        runs = Path(tempfile.mkdtemp())  # a runs root with one finished run, r1
        shutil.copytree(str(files("rollout_capture") / "sample"), runs / "r1")
        (runs / "r1" / "_SUCCESS").touch()



        @flow
        def finished() -> list[str]:
            run = find_runs(str(runs)).runs[0]
            with LeaseKeeper(RunsRoot(str(runs)), run, take_run(str(runs), run)) as keeper:
                finish_run(keeper, {"rollouts": 10})  # the marker's body
            return sorted(p.name for p in (runs / "r1").iterdir() if p.name.startswith("_"))


        print(finished())  # ['_ENRICHED', '_SUCCESS']
        ```
    """
    keeper.finish(summary)


@task(
    name="release_run",
    task_run_name="release_run {keeper.run.name}",
    cache_policy=NO_CACHE,
    **storage_retries(),
)
def release_run(keeper: LeaseKeeper) -> None:
    """Give the lease back after a failure, so the next flow run may take the run at once.

    Examples:
        ```python
        import shutil
        import tempfile
        from importlib.resources import files
        from pathlib import Path

        from prefect import flow

        from rollout_capture.run_folders import LeaseKeeper, RunsRoot
        from rollout_capture.tasks.run_folders import fence_run, find_runs, finish_run, release_run, take_run

        runs = Path(tempfile.mkdtemp())  # a runs root with one finished run, r1
        shutil.copytree(str(files("rollout_capture") / "sample"), runs / "r1")
        (runs / "r1" / "_SUCCESS").touch()



        @flow
        def given_back() -> object:
            run = find_runs(str(runs)).runs[0]
            with LeaseKeeper(RunsRoot(str(runs)), run, take_run(str(runs), run)) as keeper:
                release_run(keeper)  # the enrichment failed: let the next flow run take it
            return take_run(str(runs), run).generation


        print(given_back())  # 2: the generation after the released one, taken at once
        ```
    """
    keeper.release()


@task(
    name="remember_enriched",
    task_run_name=run_name("remember_enriched {runs_root}"),
    cache_policy=NO_CACHE,
    **storage_retries(),
)
def remember_enriched(
    runs_root: LocationLike,
    names: list[str],
) -> None:
    """Add the runs just enriched to the root's index, so the next flow runs skip them unlisted.

    Examples:
        ```python
        import shutil
        import tempfile
        from importlib.resources import files
        from pathlib import Path

        from prefect import flow

        from rollout_capture.tasks.run_folders import find_runs, remember_enriched

        runs = Path(tempfile.mkdtemp())  # a runs root with one finished run, r1
        shutil.copytree(str(files("rollout_capture") / "sample"), runs / "r1")
        (runs / "r1" / "_SUCCESS").touch()

        (runs / "r1" / "_ENRICHED").write_text("{}")


        @flow
        def indexed() -> list[str]:
            remember_enriched(str(runs), ["r1"])  # next time r1 is not listed at all
            return [run.name for run in find_runs(str(runs)).runs if run.enriched]


        print(indexed(), (runs / "_rollout_capture_index.json").exists())  # ['r1'] True
        ```
    """
    runs_root_at(runs_root).remember_enriched(names)
