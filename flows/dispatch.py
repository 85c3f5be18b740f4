"""``prepare_dispatch``: clear stale captures of the rollouts about to be dispatched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import orjson
from prefect import get_run_logger
from prefect.futures import wait
from prefect.runtime import flow_run
from pydantic import Field

from rollout_capture.clear import rollout_ids_of
from rollout_capture.enrich_options import DEFAULT_BATCH_SIZE
from rollout_capture.flows.guard import StorageOptions, guarded_flow
from rollout_capture.flows.report import show_core_logs
from rollout_capture.location import Location
from rollout_capture.rollout_files import iter_line_batches, remove_staged, split_lines
from rollout_capture.secret_options import shown_url
from rollout_capture.tasks.capture import clear_captures
from rollout_capture.tasks.rollout_files import read_rollouts


def _ids_from_file(path: str, source: str) -> list[str]:
    """Every rollout id of a JSONL file; a line that is not a record is an error naming it."""
    ids: list[str] = []
    for first_line, blob in iter_line_batches(path, DEFAULT_BATCH_SIZE):
        lines = split_lines(blob)
        records = []
        for offset, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                records.append(orjson.loads(line))
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"{source}:{first_line + offset}: not JSON ({exc.msg})") from None
        try:
            ids.extend(rollout_ids_of(records))
        except ValueError as exc:
            raise ValueError(f"{source} (batch from line {first_line}): {exc}") from None
    return list(dict.fromkeys(ids))


def dispatch_run_name() -> str:
    """``prepare-dispatch <capture dir>``, a URL with credentials never shown."""
    return f"prepare-dispatch {shown_url(str(flow_run.parameters.get('capture_dir', '?')))}"


@guarded_flow(name="prepare_dispatch", flow_run_name=dispatch_run_name)
def prepare_dispatch(
    rollouts: str | Sequence[dict[str, Any]],
    capture_dir: str,
    batch_size: Annotated[int, Field(ge=1)] = DEFAULT_BATCH_SIZE,
    storage_options: StorageOptions = None,
    credentials_block: str | None = None,
) -> int:
    """Remove the captures of these rollouts so a retry never appends onto an old attempt.

    ``rollouts`` is a JSONL URL or the records themselves. Every id is derived and
    validated before anything is deleted; returns how many ids were cleared.

    Args:
        rollouts: The rollouts about to be dispatched: a JSONL path or URL, or the records.
        capture_dir: Where the captures are: a path or fsspec URL.
        batch_size: Rollout ids per clearing task.
        storage_options: fsspec options for every URL, without secrets (those come from credentials_block).
        credentials_block: Name of a prefect-aws AwsCredentials block to read and write S3 with.

    Examples:
        Clear an old attempt's capture before dispatching the rollout again:

        ```python
        import tempfile

        from rollout_capture import CaptureStore
        from rollout_capture.flows import prepare_dispatch

        captures = tempfile.mkdtemp()
        CaptureStore(captures).record("12-3", {"model_call_id": "a1", "dialect": "chat"})
        records = [{"_ng_task_index": 12, "_ng_rollout_index": 3, "prompt": "..."}]
        print(prepare_dispatch(records, captures))  # 1: rollout 12-3 starts from an empty capture
        ```
    """
    show_core_logs()
    captures = Location.of(capture_dir, storage_options, credentials_block)  # refused here if bad
    if isinstance(rollouts, str):
        staged = read_rollouts(captures.at(rollouts))
        try:
            ids = _ids_from_file(staged.path, rollouts)
        finally:
            remove_staged(staged)
    else:
        ids = rollout_ids_of(rollouts)
    futures = [
        clear_captures.submit(ids[start : start + batch_size], captures)
        for start in range(0, len(ids), batch_size)
    ]
    wait(futures)
    cleared = sum(future.result() for future in futures)
    get_run_logger().info("cleared captures of %d rollout id(s) in %s", cleared, capture_dir)
    return cleared
