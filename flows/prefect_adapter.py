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
  worker (prefect-ray offers no public hook).
"""

from __future__ import annotations

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
