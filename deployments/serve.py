"""``rollout-capture serve``: the shipped deployments served from this machine, no work pool or worker.

Served deployments have names of their own (``enrich-completed-runs-served``...): serving, and
stopping with Ctrl-C (which pauses what was served), never changes what ``rollout-capture deploy``
registered for the workers.
"""

from __future__ import annotations

import os
from typing import Any

from prefect import serve
from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound

from rollout_capture.deployments.register import ensure_automations
from rollout_capture.deployments.shipped import DEFAULT_CRON, JOB_VARIABLES, SCHEDULED, shipped_deployments


class NotServed(ValueError):
    """A deployment of a served name exists on a work pool: serving it would take it over."""


def serve_shipped(
    runs_root: str,
    *,
    cron: str = DEFAULT_CRON,
    parameters: dict[str, Any] | None = None,
    name: str = SCHEDULED,
) -> None:
    """Serve the scheduled enrichment of ``runs_root`` and the on-demand flows until interrupted.

    ``name`` (as ``deploy``'s): another than the default names every served deployment after it,
    so a second serve, of another runs root, shares none with the first.

    Example:
        ```python
        serve_shipped("/data/runs", cron="*/5 * * * *", parameters={"max_parallel_runs": 2})
        ```
    """
    for key, value in JOB_VARIABLES["env"].items():  # what a worker's job variables would set
        os.environ.setdefault(key, value)
    deployments = shipped_deployments(
        runs_root, cron=cron, scheduled_parameters=parameters, name=name, served=True
    )
    with get_client(sync_client=True) as client:
        for deployment in deployments:
            try:
                existing = client.read_deployment_by_name(deployment.full_name)
            except ObjectNotFound:
                continue
            if existing.work_pool_name:
                raise NotServed(
                    f"deployment {deployment.full_name} is on work pool {existing.work_pool_name} "
                    "(registered by deploy): serve leaves it alone; delete or rename it first"
                )
    ensure_automations()  # the served ones have the same concurrency limit to explain
    serve(*deployments)
