"""``rollout-capture deploy``: the shipped deployments on a work pool, from an installed package."""

from __future__ import annotations

import contextlib
from importlib.resources import files
from typing import Any

import yaml
from prefect.automations import Automation
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from rollout_capture.deployments.shipped import shipped_deployments

AUTOMATIONS = files("rollout_capture.deployments") / "automations.yaml"


def register(
    runs_root: str,
    *,
    pool: str,
    cron: str,
    parameters: dict[str, Any],
    automation: bool = True,
    pool_type: str = "process",
) -> dict[str, Any]:
    """Create the pool if missing, then (re)register every shipped deployment and the automation.

    Example:
        ```python
        register("s3://my-runs/runs", pool="rollout-capture", cron="*/15 * * * *",
                 parameters={"credentials_block": "rollout-capture"})
        ```
    """
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):  # another deploy made it meanwhile
                client.create_work_pool(WorkPoolCreate(name=pool, type=pool_type))
    deployments = shipped_deployments(runs_root, cron=cron, scheduled_parameters=parameters)
    ids = [d.apply(work_pool_name=pool) for d in deployments]  # no code to build or push: module paths
    created: list[str] = []
    if automation:
        automations: Any = Automation  # async_dispatch methods: typed as coroutines, run sync here
        for spec in yaml.safe_load(AUTOMATIONS.read_text())["automations"]:
            try:
                automations.read(name=spec["name"], _sync=True)
            except ValueError:  # not there yet: prefect automation create does not deduplicate
                automations.model_validate(spec).create(_sync=True)
                created.append(spec["name"])
    return {
        "work_pool": pool,
        "deployments": {d.full_name: str(i) for d, i in zip(deployments, ids, strict=True)},
        "automations_created": created,
    }
