"""The one place that leans on how Prefect behaves rather than on what it documents.

Everything else in ``flows/``, ``tasks/`` and ``deployments/`` uses Prefect's public API
only. What is here has no public equivalent; ``tests/test_prefect_adapter.py`` pins each
assumption, so a Prefect upgrade that breaks one fails that test by name instead of
silently recording secrets or losing a flow's options:

- the engine serializes a run's parameters through ``Flow.serialize_parameters`` before it
  sends them to the API (the guard redacts there);
- ``Flow.with_options`` builds a plain ``Flow``, and every option ``Flow.__init__`` takes is
  readable back from the flow under the name in :data:`FLOW_OPTIONS` (a subclass rebuilds
  its copies from them).
- prefect-ray submits each task through its static ``RayTaskRunner._run_prefect_task``, which
  ``flows/runners.py`` wraps so a Ray batch's last states reach the API before Ray ends the
  worker (prefect-ray offers no public hook);
- a sync flow run keeps its heartbeats in ``prefect.flow_engine._send_heartbeats``, looked up
  by that name when the run starts, and joining that thread at the end waits out the rest of
  its one-second sleep: :func:`heartbeats_unjoined` lets the run end without that wait, as
  Prefect's own async engine does (``join_on_exit=False``).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, TypeVar

from prefect import Flow

F = TypeVar("F", bound=Flow[Any, Any])

FLOW_OPTIONS: dict[str, str] = {
    "fn": "fn",
    "name": "name",
    "version": "version",
    "flow_run_name": "flow_run_name",
    "retries": "retries",
    "retry_delay_seconds": "retry_delay_seconds",
    "task_runner": "task_runner",
    "description": "description",
    "timeout_seconds": "timeout_seconds",
    "validate_parameters": "should_validate_parameters",
    "persist_result": "persist_result",
    "result_storage": "result_storage",
    "result_serializer": "result_serializer",
    "cache_result_in_memory": "cache_result_in_memory",
    "log_prints": "log_prints",
    "on_completion": "on_completion_hooks",
    "on_failure": "on_failure_hooks",
    "on_cancellation": "on_cancellation_hooks",
    "on_crashed": "on_crashed_hooks",
    "on_running": "on_running_hooks",
}
"""``Flow.__init__``'s parameters, each with the attribute a built flow keeps it in."""


def rebuild(cls: type[F], plain: Flow[Any, Any]) -> F:
    """``plain`` (a copy ``Flow.with_options`` made) built again as ``cls``, every option kept.

    Constructed through the public constructor, so the copy is a ``cls`` from its first
    line (no class swap on a live object).
    """
    return cls(**{option: getattr(plain, attribute) for option, attribute in FLOW_OPTIONS.items()})


_heartbeats_lock = threading.Lock()


def heartbeats_unjoined() -> None:
    """Let a sync flow run end without joining its heartbeat thread (up to a second's wait per run).

    The thread is a daemon and returns by itself at its next one-second tick once the run has
    stopped it, never sending a heartbeat after that: the heartbeats sent are the same, only the
    wait at the run's end goes. Idempotent; for this process's flow runs from then on.
    """
    import prefect.flow_engine  # imported by the first flow run anyway

    with _heartbeats_lock:
        current = prefect.flow_engine._send_heartbeats
        if isinstance(current, functools.partial):
            return
        prefect.flow_engine._send_heartbeats = functools.partial(current, join_on_exit=False)
