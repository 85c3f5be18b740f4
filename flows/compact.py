"""``compact_capture_dirs``: the journals of finished runs compacted into a few large objects
each (``rollout_capture.compaction``), for runs enriched before compaction existed or without it."""

from __future__ import annotations

from typing import Annotated, Any

from prefect import get_run_logger
from prefect.futures import wait
from prefect.runtime import flow_run
from pydantic import Field

from rollout_capture.flows.guard import StorageOptions, guarded_flow
from rollout_capture.flows.report import show_core_logs
from rollout_capture.journal.compacted import DELETE_AFTER_S, QUIET_S
from rollout_capture.location import Location
from rollout_capture.secret_options import shown_url
from rollout_capture.tasks.capture import compact_captures


class CompactionRefused(RuntimeError):
    """Some capture dirs may still be written: left as they are (the others were compacted)."""


def compact_run_name() -> str:
    """``compact <first capture dir> (+N)``, URLs with credentials never shown."""
    dirs = flow_run.parameters.get("capture_dirs") or ["?"]
    more = f" (+{len(dirs) - 1})" if len(dirs) > 1 else ""
    return f"compact {shown_url(str(dirs[0]))}{more}"


@guarded_flow(name="compact_capture_dirs", flow_run_name=compact_run_name)
def compact_capture_dirs(
    capture_dirs: list[str],
    quiet_s: Annotated[float, Field(ge=0)] = QUIET_S,
    remove_after_s: Annotated[float, Field(ge=0)] = DELETE_AFTER_S,
    wait_quiet: bool = False,
    storage_options: StorageOptions = None,
    credentials_block: str | None = None,
) -> list[dict[str, Any]]:
    """Compact each capture dir's journal: its commits become a few parts and a manifest, read in a
    handful of requests, every row, its order and its evidence unchanged.

    A capture dir a writer may still write (a commit younger than ``quiet_s``, a live claim) is
    refused: the flow fails naming it, after compacting the others.

    Args:
        capture_dirs: Capture roots (paths or fsspec URLs) of finished runs.
        quiet_s: Refuse a root whose last commit is younger than this (seconds, by the store's clock).
        remove_after_s: Remove the replaced commits this long after the new manifest.
        wait_quiet: Wait out the quiet period of a root written just now, instead of refusing it.
        storage_options: fsspec options for every URL, without secrets (those come from credentials_block).
        credentials_block: Name of a prefect-aws AwsCredentials block to read and write S3 with.

    Examples:
        ```python
        import tempfile

        from rollout_capture import CaptureStore
        from rollout_capture.flows.compact import compact_capture_dirs

        captures = tempfile.mkdtemp()
        CaptureStore(captures, layout="journal").record("12-3", {"model_call_id": "a1", "dialect": "chat"})
        (done,) = compact_capture_dirs([captures], quiet_s=0, remove_after_s=0)
        print(done["status"], done["objects_before"], done["objects_after"])  # compacted 1 2
        ```
    """
    show_core_logs()
    roots = [Location.of(url, storage_options, credentials_block) for url in capture_dirs]  # refused if bad
    futures = [
        compact_captures.submit(root, quiet_s=quiet_s, remove_after_s=remove_after_s, wait_quiet=wait_quiet)
        for root in roots
    ]
    wait(futures)
    done = [future.result() for future in futures]
    refused = [str(item["reason"]) for item in done if item["status"] == "refused"]
    get_run_logger().info(
        "compacted %d capture dir(s), %d already compacted, %d refused",
        sum(item["status"] == "compacted" for item in done),
        sum(item["status"] == "already compacted" for item in done),
        len(refused),
    )
    if refused:
        raise CompactionRefused("; ".join(refused))
    return done
