"""The one retry policy of every storage-touching task.

Retries wait a fixed delay with jitter and fire only for transient storage faults
(connections, timeouts, throttling, 5xx, s3fs giving up); bad input fails at once, so
the UI shows the real error instead of a string of doomed retries.

The delay is one number, not a list: the Prefect UI's task configuration panel shows
a list of delays as "NaNs". It is the mean of the exponential schedule it replaced
(``BASE_DELAY_S * 2**i`` for each retry), so all retries together still ride out the same
minute-long outage, and the jitter still spreads the retries of many tasks apart.
"""

from __future__ import annotations

import os
from typing import Any

from prefect import Task
from prefect.client.schemas.objects import State, TaskRun

from rollout_capture.faults import is_transient_storage_error

# Overridable for tests and impatient operators; the defaults ride out a minute-long outage.
RETRIES = int(os.environ.get("ROLLOUT_CAPTURE_TASK_RETRIES", "5"))
BASE_DELAY_S = float(os.environ.get("ROLLOUT_CAPTURE_RETRY_BASE_S", "2"))
JITTER = 0.5
DELAY_S = round(BASE_DELAY_S * (2**RETRIES - 1) / max(RETRIES, 1), 3)
"""Seconds before each retry (jittered by +-JITTER): 12.4 s by default, 62 s over the five."""


def retry_on_transient(task: Task[Any, Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Retry only when the failure is a transient storage fault.

    Examples:
        ```python
        from prefect import task

        from rollout_capture.tasks import retry_on_transient


        @task(retries=3, retry_delay_seconds=1, retry_condition_fn=retry_on_transient)
        def head(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read(100)


        try:
            head("/no/such/rollouts.jsonl")
        except FileNotFoundError as exc:  # bad input: failed at once, never retried
            print("not retried:", exc)
        ```
    """
    try:
        state.result()
    except Exception as exc:
        return is_transient_storage_error(exc)
    return False


def storage_retries() -> dict[str, Any]:
    """Keyword arguments for ``@task``: retries, their delay (one number), jitter and the condition.

    Examples:
        ```python
        from importlib.resources import files

        import fsspec
        from prefect import task

        from rollout_capture.tasks import storage_retries


        @task(**storage_retries())  # jittered retries, for transient storage faults only
        def names(url: str) -> list[str]:
            fs, path = fsspec.core.url_to_fs(url)
            return sorted(fs.ls(path, detail=False))


        print(names(str(files("rollout_capture") / "sample")))
        ```
    """
    return {
        "retries": RETRIES,
        "retry_delay_seconds": DELAY_S,
        "retry_jitter_factor": JITTER,
        "retry_condition_fn": retry_on_transient,
    }
