"""Reading what a flow run left in the Prefect API: task runs, state history, artifacts, logs."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
    TaskRunFilter,
    TaskRunFilterStartTime,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import FlowRun, StateType, TaskRun

from ..conftest import wait_for


def task_runs(flow_run_id: UUID, name_prefix: str, at_least: int = 1) -> list[TaskRun]:
    """The flow run's task runs named ``name_prefix...``, once ``at_least`` of them are recorded
    and each is in a final state.

    A task run's states reach the API as events, recorded by the server in the background: read
    at once after the flow, a finished task can still read ``Pending`` (it did on a loaded
    machine), or not be recorded at all (CI's run read none), so this waits for the record (the
    flow run's own state is written directly). ``at_least=0`` for a run expected to have none."""
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()  # sent from this process in the background

    def settled() -> tuple[list[TaskRun]] | None:
        with get_client(sync_client=True) as client:
            only_this_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            runs = client.read_task_runs(flow_run_filter=only_this_run)
        named = [run for run in runs if run.name.startswith(name_prefix)]
        final = all(run.state is not None and run.state.is_final() for run in named)
        return (named,) if final and len(named) >= at_least else None

    return wait_for(settled, 240, f"the {name_prefix} task runs' final states", poll_s=0.1)[0]


def running_task_runs(name_prefix: str, since: datetime) -> list[TaskRun]:
    """Task runs started after ``since`` that are running right now (a killed process's stay so)."""
    running = TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.RUNNING]))
    only_running = TaskRunFilter(state=running, start_time=TaskRunFilterStartTime(after_=since))
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(task_run_filter=only_running)
    return [run for run in runs if run.name.startswith(name_prefix)]


def state_history(task_run_id: UUID) -> list[str]:
    with get_client(sync_client=True) as client:
        states = client.read_task_run_states(task_run_id)
    return [state.name for state in sorted(states, key=lambda s: s.timestamp)]


def artifacts(flow_run_id: UUID) -> list[Any]:
    only_this_run = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
    with get_client(sync_client=True) as client:
        return list(client.read_artifacts(artifact_filter=only_this_run))


def flow_run(flow_run_id: UUID) -> FlowRun:
    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def logs(flow_run_id: UUID) -> list[str]:
    """Every log message of the flow run and its task runs."""
    with get_client(sync_client=True) as client:
        found = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [entry.message for entry in found]


def wait_for_logs(flow_run_id: UUID, containing: str, timeout_s: float = 10.0) -> list[str]:
    """The run's logs once one contains ``containing`` (logs are shipped in the background)."""

    def found() -> list[str]:
        lines = logs(flow_run_id)
        return lines if any(containing in line for line in lines) else []

    return wait_for(found, timeout_s, f"a log of the run containing {containing!r}", poll_s=0.1)


def events(name: str, resource_id: str) -> list[Any]:
    """Events of one name about one resource the server has stored so far."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()  # sent from this process in the background
    wanted = EventFilter(  # built afresh: its time window ends when it is built
        event=EventNameFilter(name=[name]), resource=EventResourceFilter(id=[resource_id])
    )
    with get_client(sync_client=True) as client:
        return list(client.read_events(filter=wanted, limit=50).events)


def wait_for_events(name: str, resource_id: str, timeout_s: float = 30.0) -> list[Any]:
    """Events of one name about one resource, once the server has stored at least one."""
    return wait_for(lambda: events(name, resource_id), timeout_s, f"a {name} event about {resource_id}", 0.2)


def flow_runs_under(parent: UUID) -> list[FlowRun]:
    """The subflow runs of a flow run."""
    from prefect.client.schemas.filters import FlowRunFilterParentFlowRunId

    only_children = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent]))
    with get_client(sync_client=True) as client:
        return list(client.read_flow_runs(flow_run_filter=only_children))


def run_rows(flow_run_id: UUID) -> dict[str, dict[str, Any]]:
    """Every run's row of the tables a tick's batches filed (under their task runs), by run, with
    the batch's task run id beside it (``task_run_id``)."""
    import orjson

    rows = {}
    for artifact in artifacts(flow_run_id):
        if artifact.type == "table" and artifact.task_run_id is not None:
            for row in orjson.loads(artifact.data):
                rows[row["run"]] = {**row, "task_run_id": artifact.task_run_id}
    return rows
