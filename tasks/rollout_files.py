"""Prefect tasks for the rollouts files: fetch the input, publish the output.

Both are retryable as a whole: staging re-copies the input from the start, publishing
re-uploads the finished spool. Neither can leave a partial file behind.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rollout_capture.location import Location, LocationLike
from rollout_capture.rollout_files import StagedRollouts, publish, stage_rollouts
from rollout_capture.tasks.credentials import credentials_for
from rollout_capture.tasks.naming import run_name
from rollout_capture.tasks.retry import storage_retries


@task(
    name="read_rollouts",
    task_run_name=run_name("read_rollouts {source}"),
    cache_policy=NO_CACHE,
    **storage_retries(),
)
def read_rollouts(source: LocationLike) -> StagedRollouts:
    """Make the rollouts file a local, uncompressed file to stream batches from.

    Examples:
        ```python
        from importlib.resources import files

        from prefect import flow

        from rollout_capture.tasks import read_rollouts


        @flow
        def stage(source: str) -> str:
            staged = read_rollouts(source)  # a .gz or s3:// input is copied to a local spool first
            return f"{staged.path}: {staged.size} bytes, copied: {staged.temporary}"


        print(stage(str(files("rollout_capture") / "sample" / "rollouts.jsonl")))
        ```
    """
    where = Location.coerce(source)
    with credentials_for(where) as credentials:
        staged = stage_rollouts(where.url, where.storage_options, credentials=credentials)
    how = "copied to a local spool" if staged.temporary else "read in place"
    get_run_logger().info("read %s: %d bytes, %s", source, staged.size, how)
    return staged


@task(
    name="write_enriched",
    task_run_name=run_name("write_enriched {output}"),
    cache_policy=NO_CACHE,
    **storage_retries(),
)
def write_enriched(
    spool_path: str,
    output: LocationLike,
    lines: int,
) -> int:
    """Publish the finished output atomically (rename on local disk, one object on S3).

    Examples:
        ```python
        import tempfile
        from pathlib import Path

        from prefect import flow

        from rollout_capture.tasks import write_enriched

        out = Path(tempfile.mkdtemp())


        @flow
        def publish() -> int:
            spool = out / "spool.jsonl"  # finished output, written elsewhere first
            spool.write_text('{"reward": 1.0}\\n')
            return write_enriched(str(spool), str(out / "rollouts.enriched.jsonl"), lines=1)


        print(publish(), sorted(p.name for p in out.iterdir()))  # 16 ['rollouts.enriched.jsonl']
        ```
    """
    where = Location.coerce(output)
    with credentials_for(where) as credentials:
        size = publish(spool_path, where.url, where.storage_options, credentials=credentials)
    get_run_logger().info("wrote %s: %d line(s), %d bytes", output, lines, size)
    return size
