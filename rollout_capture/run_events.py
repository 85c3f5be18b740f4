"""A run that started or finished as a Prefect event (``rollout-capture.run.started``,
``.finished``), without Prefect.

The event names a run folder as workers name it; a deployment's trigger matches the runs under
its root. :func:`post_run_event` sends it with one HTTP request to a self-hosted Prefect server's
``POST /events``, so ``rollout-capture start`` and ``finish`` need not load Prefect (1.5 s of their
time) in the plain case; anything else (an API key, custom client settings, a refusal) is left to
Prefect's own client.
"""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime

from rollout_capture.filesystem import absolute_location

RUN_FINISHED = "rollout-capture.run.finished"
RUN_STARTED = "rollout-capture.run.started"
"""A run began (``rollout-capture start``): a deployment of its root follows it while it runs."""
RUN_PREFIX = "rollout-capture.run."
"""A finished run's event: its resource id is this prefix and the run folder's location, so a
deployment's trigger matches the runs under its root (``rollout-capture.run.<root>/*``)."""
POST_TIMEOUT_S = 10.0
CLIENT_SETTINGS = (
    "PREFECT_API_KEY",
    "PREFECT_API_AUTH_STRING",
    "PREFECT_API_TLS",
    "PREFECT_API_SSL",
    "PREFECT_API_REQUEST_TIMEOUT",
    "PREFECT_CLIENT_",
    "PREFECT_CLOUD_",
)
"""Prefect client settings the plain path does not apply: with any in the environment (a key, an
auth string, TLS or header settings), Prefect's client sends the event."""


def run_resource(run: str) -> dict[str, str]:
    """A run folder (its location as workers name it) as an event resource."""
    return {
        "prefect.resource.id": RUN_PREFIX + run,
        "prefect.resource.name": run.rsplit("/", 1)[-1],
        "rollout-capture.run": run,
    }


def runs_under(runs_root: str) -> str:
    """The resource ids of every run under ``runs_root``, as a trigger's match pattern."""
    return f"{RUN_PREFIX}{absolute_location(runs_root).rstrip('/')}/*"


def plain_api_url() -> str | None:
    """``PREFECT_API_URL`` when the environment sets it and no other API or client setting: the
    case :func:`post_run_finished` handles alone; None otherwise."""
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        return None
    if any(value and key.startswith(CLIENT_SETTINGS) for key, value in os.environ.items()):
        return None
    return url


def post_run_finished(api_url: str, run: str) -> bool:
    """Send ``rollout-capture.run.finished`` naming ``run`` (:func:`post_run_event`).

    Example:
        ```python
        post_run_finished("http://127.0.0.1:4200/api", "/data/runs/r1")
        ```
    """
    return post_run_event(api_url, run, RUN_FINISHED)


def post_run_event(api_url: str, run: str, event_name: str) -> bool:
    """Send ``event_name`` (``RUN_STARTED``, ``RUN_FINISHED``) naming ``run`` in one ``POST
    {api}/events``; whether the server took it (False: refused or unreachable, so the caller sends
    it Prefect's way instead).

    Example:
        ```python
        post_run_event("http://127.0.0.1:4200/api", "/data/runs/r1", RUN_STARTED)
        ```
    """
    import httpx

    event = {
        "id": str(uuid.uuid4()),
        "occurred": datetime.now(UTC).isoformat(),
        "event": event_name,
        "resource": run_resource(run),
        "related": [],
        "payload": {},
    }
    try:
        answer = httpx.post(f"{api_url.rstrip('/')}/events", json=[event], timeout=POST_TIMEOUT_S)
    except httpx.HTTPError:
        return False
    return answer.status_code in (200, 201, 202, 204)
