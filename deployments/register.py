"""``rollout-capture deploy``: the shipped deployments on a work pool, from an installed package."""

from __future__ import annotations

import contextlib
from importlib.resources import files
from typing import Any

import yaml
from prefect.automations import Automation
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.deployments.runner import RunnerDeployment
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from rollout_capture.deployments.names import SCHEDULED, SERVED_SUFFIX, is_served_name
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
    name: str = SCHEDULED,
) -> dict[str, Any]:
    """Create the pool if missing, then (re)register every shipped deployment and the automation.

    The scheduled deployment is ``name``: one server holds several runs roots side by side,
    one name each. ``replaced`` says, for each deployment that existed, what registering changed.

    Example:
        ```python
        register("s3://my-runs/runs", pool="rollout-capture", cron="*/15 * * * *",
                 parameters={"credentials_block": "rollout-capture"})
        ```
    """
    if is_served_name(name):
        raise Served(f"{name} ends with {SERVED_SUFFIX}: names ending so are serve's; deploy under another")
    deployments = shipped_deployments(runs_root, cron=cron, scheduled_parameters=parameters, name=name)
    replaced = {d.full_name: change for d in deployments if (change := replacement(d, pool)) is not None}
    with get_client(sync_client=True) as client:  # refused above: nothing written, not even the pool
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):  # another deploy made it meanwhile
                client.create_work_pool(WorkPoolCreate(name=pool, type=pool_type))
    ids = [d.apply(work_pool_name=pool) for d in deployments]  # no code to build or push: module paths
    created = ensure_automations() if automation else []
    return {
        "work_pool": pool,
        "deployments": {d.full_name: str(i) for d, i in zip(deployments, ids, strict=True)},
        "automations_created": created,
        "replaced": replaced,
    }


def ensure_automations() -> list[str]:
    """Create each shipped automation the server lacks (by name); returns the names created.

    Example:
        ```python
        ensure_automations()  # ["rollout-capture-tick-already-running"] on a server that lacked it
        ```
    """
    created: list[str] = []
    automations: Any = Automation  # async_dispatch methods: typed as coroutines, run sync here
    for spec in yaml.safe_load(AUTOMATIONS.read_text())["automations"]:
        try:
            automations.read(name=spec["name"], _sync=True)
        except ValueError:  # not there yet: prefect automation create does not deduplicate
            automations.model_validate(spec).create(_sync=True)
            created.append(spec["name"])
    return created


class Served(ValueError):
    """A deployment of the name is on no work pool: a serve's, which deploy never takes over."""


def replacement(deployment: RunnerDeployment, pool: str) -> str | None:
    """What registering ``deployment`` on ``pool`` changes in the one of its name (None: there is none).

    Parameters are names and settings, never secrets (the schema refuses those), so they are shown.
    Raises :class:`Served` when the one of its name is on no work pool: a serve registered it (and
    may be serving it now), so moving it onto a pool would take it from under that process.
    """
    with get_client(sync_client=True) as client:
        try:
            existing = client.read_deployment_by_name(deployment.full_name)
        except ObjectNotFound:
            return None
    if not existing.work_pool_name:
        raise Served(
            f"deployment {deployment.full_name} is on no work pool (registered by serve, which may be "
            "serving it now): deploy leaves it alone; stop that serve and delete it, "
            "or deploy under another --name"
        )
    before, after = existing.parameters, deployment.parameters
    changes = [
        f"{key} {_shown(before, key)} -> {_shown(after, key)}"
        for key in sorted({*before, *after})
        if before.get(key) != after.get(key)
    ]
    if existing.work_pool_name != pool:
        changes.append(f"work pool {existing.work_pool_name} -> {pool}")
    old_crons = [getattr(s.schedule, "cron", None) for s in existing.schedules]
    new_crons = [getattr(s.schedule, "cron", None) for s in deployment.schedules or []]
    if old_crons != new_crons:
        changes.append(f"schedule {old_crons} -> {new_crons}")
    if existing.paused:
        changes.append("paused -> active")
    return "; ".join(changes) or "unchanged"


def _shown(parameters: dict[str, Any], key: str) -> str:
    return repr(parameters[key]) if key in parameters else "(unset)"
