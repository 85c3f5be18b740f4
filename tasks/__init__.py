"""Prefect tasks: thin, batch-sized, retryable wrappers around the core."""

from rollout_capture.tasks.capture import (
    await_quiescence,
    capture_store,
    clear_captures,
    compact_captures,
    merge_batch,
)
from rollout_capture.tasks.retry import retry_on_transient, storage_retries
from rollout_capture.tasks.rollout_files import read_rollouts, write_enriched

__all__ = [
    "await_quiescence",
    "capture_store",
    "clear_captures",
    "compact_captures",
    "merge_batch",
    "read_rollouts",
    "retry_on_transient",
    "storage_retries",
    "write_enriched",
]
