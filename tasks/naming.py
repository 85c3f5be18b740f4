"""Task-run names made from a task's parameters, a URL with credentials never shown.

Prefect records a task run's name before the task's body can refuse its input, so a name
that shows a URL shows it as :func:`rollout_capture.secret_options.shown_url` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect.runtime import task_run

from rollout_capture.location import Location
from rollout_capture.secret_options import shown_url


def _shown(value: Any) -> Any:
    return shown_url(str(value)) if isinstance(value, str | Location) else value


def run_name(template: str) -> Callable[[], str]:
    """A ``task_run_name``: ``template`` formatted with the task's parameters, as Prefect formats
    a template, each path or URL shown without credentials."""

    def name() -> str:
        return template.format(**{key: _shown(value) for key, value in task_run.parameters.items()})

    return name
