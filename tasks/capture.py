"""Prefect tasks over capture stores: clear, wait for quiescence, merge a batch.

Thin wrappers around the core: each works on a batch (never one task per rollout) and
retries transient storage faults only. A batch task is idempotent: rerunning it after a
crash reads the same captures and returns the same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.asyncutils import run_coro_as_sync
from pydantic import BaseModel

from rollout_capture.backends import ListingScope
from rollout_capture.batch import BatchStats, enrich_blob
from rollout_capture.location import Location, LocationLike
from rollout_capture.quiescence import CAPTURE_DRAIN_TIMEOUT_S, DEFAULT_POLL_S, await_quiescence_many
from rollout_capture.rollout_files import LineRange
from rollout_capture.store import CaptureStore
from rollout_capture.tasks.credentials import credentials_for, credentials_from_block
from rollout_capture.tasks.naming import run_name
from rollout_capture.tasks.retry import storage_retries
from rollout_capture.worker_pool import ClaimsPending, enrich_in_worker, require_capture_root, worker_pool


def capture_store(capture_dir: LocationLike) -> CaptureStore:
    """This process's store for the location, with credentials resolved here from its named block.

    Examples:
        Open the store of a capture root (with a block's credentials, if named):

        ```python
        from importlib.resources import files

        from rollout_capture.tasks import capture_store

        store = capture_store(str(files("rollout_capture") / "sample" / "captures"))
        print(len(store.read("0-0")), store.live_claims("0-0"))  # its rows; no call in flight
        ```
    """
    where = Location.coerce(capture_dir)
    return where.capture_store(credentials_from_block(where.credentials_block))


@task(
    name="check_capture_dir",
    task_run_name=run_name("check_capture_dir {capture_dir}"),
    cache_policy=NO_CACHE,
    **storage_retries(),
)
def check_capture_dir(capture_dir: LocationLike, allow_empty: bool = False) -> None:
    """Fail before any reading when the capture dir is not there (a mistyped path, a wrong prefix).

    Otherwise every rollout would come out ``model_call_capture_no_records`` and the run
    would pass. A refused request (wrong key) fails here too, at once and named.

    Examples:
        Refuse a mistyped capture dir before reading anything:

        ```python
        import tempfile

        from prefect import flow

        from rollout_capture.tasks.capture import check_capture_dir


        @flow
        def checked(capture_dir: str) -> str:
            try:
                check_capture_dir(capture_dir)
            except FileNotFoundError as exc:
                return str(exc)  # "capture dir ... does not exist or holds no capture ..."
            return "ok"


        print(checked(tempfile.mkdtemp() + "/captrues"))
        ```
    """
    where = Location.coerce(capture_dir)
    with credentials_for(where) as credentials:
        found = where.capture_store(credentials).root_found()
    if not found and not allow_empty:
        raise FileNotFoundError(
            f"capture dir {capture_dir} does not exist or holds no capture "
            "(pass allow_empty=True / --allow-empty if that is expected)"
        )
    if not found:
        get_run_logger().warning("capture dir %s holds no capture; every rollout will say so", capture_dir)


@task(
    name="clear_captures",
    task_run_name=run_name("clear_captures {capture_dir}"),
    cache_policy=NO_CACHE,
    **storage_retries(),
)
def clear_captures(rollout_ids: list[str], capture_dir: LocationLike) -> int:
    """Remove the captures of a batch of (already validated) rollout ids.

    Examples:
        ```python
        import tempfile

        from prefect import flow

        from rollout_capture import CaptureStore
        from rollout_capture.tasks import clear_captures

        captures = tempfile.mkdtemp()
        CaptureStore(captures).record("12-3", {"model_call_id": "a1", "dialect": "chat"})


        @flow
        def before_retry() -> int:
            return clear_captures(["12-3", "12-4"], captures)


        print(before_retry(), CaptureStore(captures).has_any("12-3"))  # 2 False
        ```
    """
    where = Location.coerce(capture_dir)
    with credentials_for(where) as credentials:
        cleared = where.capture_store(credentials).clear(rollout_ids)
    get_run_logger().info("cleared captures of %d rollout(s) in %s", len(cleared), capture_dir)
    return len(cleared)


@task(
    name="await_quiescence",
    task_run_name=run_name("await_quiescence {capture_dir}"),
    cache_policy=NO_CACHE,
    **storage_retries(),
)
async def await_quiescence(
    rollout_ids: list[str],
    capture_dir: LocationLike,
    timeout_s: float = CAPTURE_DRAIN_TIMEOUT_S,
    poll_s: float = DEFAULT_POLL_S,
) -> list[str]:
    """Wait, under one deadline for all of them, until no id has a live claim; return those still pending.

    The wait is bounded by its own deadline (not ``timeout_seconds``, which cannot
    interrupt a sync wait), and it is async so it never holds a worker thread idle.

    Examples:
        ```python
        import asyncio
        import tempfile

        from prefect import flow

        from rollout_capture import CaptureStore
        from rollout_capture.tasks import await_quiescence

        captures = tempfile.mkdtemp()


        @flow
        async def wait_for_writes() -> list[str]:
            with CaptureStore(captures).claim("12-3", model_call_id="a1"):  # a call still streaming
                return await await_quiescence(["12-3", "12-4"], captures, timeout_s=0.5)


        print(asyncio.run(wait_for_writes()))  # ['12-3']: still claimed after half a second
        ```
    """
    where = Location.coerce(capture_dir)
    with credentials_for(where) as credentials:
        store = where.capture_store(credentials)
        pending = sorted(await await_quiescence_many(rollout_ids, [store], timeout_s, poll_s))
    logger = get_run_logger()
    if pending:
        logger.warning("%d rollout(s) still claimed after %.1fs: %s", len(pending), timeout_s, pending[:5])
    else:
        logger.info("%d rollout(s) quiescent", len(rollout_ids))
    return pending


class BatchInput(BaseModel):
    """A batch of rollout lines: a slice of the staged input, plus its bytes for workers elsewhere.

    Workers on this machine read the slice themselves, so only its coordinates travel.
    A holder rather than bare bytes so the task can let go of them once it has succeeded:
    Prefect's run engine keeps its parameters in reference cycles that only a full garbage
    collection clears, which would otherwise hold every batch.
    """

    lines: LineRange
    blob: bytes | None = None

    def data(self) -> bytes:
        """The batch's bytes: carried along, or read from the slice."""
        return self.blob if self.blob is not None else self.lines.read()


class BatchOutput(BaseModel):
    """A merged batch as the flow needs it: output bytes (or a worker's part file) and stats.

    The flow empties ``blob`` once written, for the same reason.
    """

    blob: bytes = b""
    part: str | None = None
    lines: int
    stats: BatchStats


@task(
    name="merge_batch",
    task_run_name="merge_batch lines {batch.lines.first_line}-{batch.lines.last_line}",
    cache_policy=NO_CACHE,
    persist_result=False,
    **storage_retries(),
)
def merge_batch(
    batch: BatchInput,
    capture_dir: LocationLike,
    include_payloads: bool = False,
    quiescence_timeout_s: float = CAPTURE_DRAIN_TIMEOUT_S,
    source: str = "rollouts",
    strict: bool = False,
    worker_processes: int = 0,
    parts_dir: str | None = None,
    scope: ListingScope | None = None,
    capture_root_seen: bool = False,
) -> BatchOutput:
    """Enrich one batch of rollout lines; rollouts still claimed are awaited in a nested task.

    With ``worker_processes`` the merge runs in this process's pool (its part files in ``parts_dir``);
    a ``scope``'s batches share one listing; ``capture_root_seen``: a worker blind to the dir fails.

    Examples:
        Merge the first five lines of the bundled sample, as one batch of ``enrich_rollouts``:

        ```python
        from importlib.resources import files

        from prefect import flow

        from rollout_capture.rollout_files import iter_line_ranges
        from rollout_capture.tasks import merge_batch
        from rollout_capture.tasks.capture import BatchInput

        sample = files("rollout_capture") / "sample"


        @flow
        def first_batch() -> dict[str, int]:
            lines = next(iter_line_ranges(str(sample / "rollouts.jsonl"), 5))
            merged = merge_batch(BatchInput(lines=lines), str(sample / "captures"))
            return merged.stats.gaps  # gap counts of those five rollouts


        print(first_batch())
        ```
    """
    where = Location.coerce(capture_dir)
    if capture_root_seen:
        require_capture_root(where.url)
    output = _merge(batch, where, include_payloads, quiescence_timeout_s, worker_processes, parts_dir, scope)
    if strict and output.stats.problems:
        _refuse_first_problem(output, source)
    batch.blob = None  # done with it (see BatchInput); a retry only follows a failure
    return output


def _refuse_first_problem(output: BatchOutput, source: str) -> None:
    """``strict``: the batch fails on its first line that is not a rollout record (its part removed)."""
    if output.part is not None:
        os.unlink(output.part)
    problem = output.stats.problems[0]
    raise ValueError(f"{source}:{problem.line}: {problem.reason}")


def _merge(
    batch: BatchInput,
    where: Location,
    include_payloads: bool,
    quiescence_timeout_s: float,
    worker_processes: int,
    parts_dir: str | None,
    scope: ListingScope | None,
) -> BatchOutput:
    """The batch merged here or, with ``worker_processes``, in the pool; claimed rollouts awaited."""

    def wait(pending: set[str]) -> set[str]:
        still = run_coro_as_sync(await_quiescence(sorted(pending), where, timeout_s=quiescence_timeout_s))
        return set(still or ())

    with credentials_for(where) as credentials:
        if not worker_processes:
            blob, lines, stats = enrich_blob(
                batch.data(),
                [where.capture_store(credentials)],
                first_line=batch.lines.first_line,
                include_payloads=include_payloads,
                quiescence_timeout_s=quiescence_timeout_s,
                waiter=wait,
                scope=scope,
            )
            return BatchOutput(blob=blob, lines=lines, stats=stats)
        if parts_dir is None:
            raise ValueError("worker_processes needs a parts_dir for the workers' output")
        return _merge_in_pool(
            batch.lines,
            parts_dir,
            where,
            credentials,
            include_payloads,
            scope,
            wait,
            quiescence_timeout_s > 0,
            worker_processes,
        )


def _merge_in_pool(
    batch: LineRange,
    parts_dir: str,
    where: Location,
    credentials: dict[str, Any] | None,
    include_payloads: bool,
    scope: ListingScope | None,
    wait: Callable[[set[str]], set[str]],
    wait_for_claims: bool,
    workers: int,
) -> BatchOutput:
    """The merge in a worker process; claimed rollouts send the batch back for a wait here."""
    pool = worker_pool(workers)
    arguments = (batch, parts_dir, where.url, where.storage_options, credentials, include_payloads)
    waited = 0
    try:
        part, lines, stats = pool.submit(enrich_in_worker, *arguments, wait_for_claims, scope).result()
    except ClaimsPending as pending:
        waited = len(pending.rollout_ids)
        wait(set(pending.rollout_ids))  # visible as a nested task run
        part, lines, stats = pool.submit(enrich_in_worker, *arguments, False, scope).result()
    stats.waited_for = waited
    return BatchOutput(part=part, lines=lines, stats=stats)


@task(
    name="compact_captures",
    task_run_name=run_name("compact_captures {capture_dir}"),
    cache_policy=NO_CACHE,
    **storage_retries(),
)
def compact_captures(
    capture_dir: LocationLike,
    quiet_s: float | None = None,
    remove_after_s: float | None = None,
    wait_quiet: bool = False,
) -> dict[str, Any]:
    """Compact a finished run's journal into a few large objects (``CaptureStore.compact``).

    Refused (``status`` ``refused``, ``reason`` naming the root) while a writer may still write it;
    rerun after a crash, it finishes or removes what a stopped compaction left.

    Examples:
        ```python
        import tempfile

        from prefect import flow

        from rollout_capture import CaptureStore
        from rollout_capture.tasks.capture import compact_captures

        captures = tempfile.mkdtemp()
        store = CaptureStore(captures, layout="journal")
        store.record("12-3", {"model_call_id": "a1", "dialect": "chat"})


        @flow
        def compact_now() -> str:
            return compact_captures(captures, quiet_s=0, remove_after_s=0)["status"]


        print(compact_now())  # compacted: one part and its manifest, the commits removed
        ```
    """
    where = Location.coerce(capture_dir)
    options: dict[str, Any] = {"wait_quiet": wait_quiet}
    if quiet_s is not None:
        options["quiet_s"] = quiet_s
    if remove_after_s is not None:
        options["remove_after_s"] = remove_after_s
    with credentials_for(where) as credentials:
        done = where.capture_store(credentials, shared=False).compact(**options)
    logger = get_run_logger()
    if done.status == "refused":
        logger.warning("not compacted: %s", done.reason)
    else:
        logger.info(
            "%s: %s (%d objects before, %s after)",
            where,
            done.status,
            done.objects_before,
            done.objects_after,
        )
    return done.as_dict()
