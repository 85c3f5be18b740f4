"""Deployments as a user makes them from an install: `rollout-capture deploy` on a real API
(module entrypoints, no checkout), a deployment run refused by its parameter schema, the S3
variant run by a process worker in a user's own Prefect project, a tick whose root is missing,
and the shipped automation firing on an event."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import CaptureStore
from rollout_capture.flows import enrich_completed_runs, enrich_rollouts

from .conftest import ROOT, S3, wait_for
from .prefect_api import wait_for_events

ROW = {"model_call_id": "c", "dialect": "chat", "response": {"usage": {"prompt_tokens": 3}}}
CLI = [sys.executable, "-m", "rollout_capture.cli"]


def environment(api: str | None, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **extra}
    env.pop("PREFECT_API_URL", None)
    if api:
        env["PREFECT_API_URL"] = api
    return env


def deploy(api: str | None, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "deploy", *args], cwd=cwd, env=environment(api), capture_output=True, text=True, timeout=300
    )


def deployments() -> dict[str, Any]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {d.name: d for d in client.read_deployments()}


def test_the_deploy_command_registers_the_shipped_deployments(prefect_api: str, tmp_path: Path) -> None:
    """From any folder: the pool is created, the entrypoints are module paths, runs_root as given."""
    done = deploy(prefect_api, "--runs-root", "/data/runs", "--pool", "rollout-capture", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    found = deployments()
    scheduled = found["enrich-completed-runs"]
    assert {"enrich-completed-runs", "enrich-rollouts", "prepare-dispatch"} <= set(found)
    assert scheduled.entrypoint == "rollout_capture.flows.enrich_runs.enrich_completed_runs"
    assert found["enrich-rollouts"].entrypoint == "rollout_capture.flows.enrich.enrich_rollouts"
    assert scheduled.work_pool_name == "rollout-capture"
    assert scheduled.parameters["runs_root"] == "/data/runs"
    assert [s.schedule.cron for s in scheduled.schedules] == ["*/15 * * * *"]
    assert scheduled.concurrency_options.collision_strategy == "CANCEL_NEW"  # never a pile of queued ticks
    assert scheduled.job_variables["env"]["PREFECT_LOGGING_EXTRA_LOGGERS"] == "rollout_capture"

    schema = found["enrich-rollouts"].parameter_openapi_schema["properties"]
    assert schema["batch_size"]["minimum"] == 1 and schema["max_workers"]["minimum"] == 1
    assert schema["runner"]["enum"] == ["threads", "processes", "dask", "ray"]
    assert schema["capture_dir"]["description"].startswith("Where the captures are")
    assert "propertyNames" in str(schema["storage_options"])

    from prefect.automations import Automation

    assert Automation.read(name="rollout-capture-gaps-exceeded")  # created once...
    again = deploy(prefect_api, "--runs-root", "/data/runs", "--json", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert orjson.loads(again.stdout)["automations_created"] == []  # ...and not twice


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--runs-root"),
        (["--runs-root", "runs"], "must be absolute or a URL"),
        (["--runs-root", "/data/runs", "--storage-options", '{"secret": "x"}'], "storage_options.secret"),
    ],
)
def test_deploy_refuses_bad_input_naming_it(prefect_api: str, args: list[str], message: str) -> None:
    done = deploy(prefect_api, *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_deploy_without_a_server_says_so_and_starts_none(tmp_path: Path) -> None:
    env = environment(None, PREFECT_HOME=str(tmp_path / "home"))
    done = subprocess.run(
        [*CLI, "deploy", "--runs-root", "/data/runs"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "set PREFECT_API_URL" in done.stderr, done.stderr
    assert "temporary" not in done.stderr and not list(tmp_path.rglob("*.db"))


def test_a_scheduled_tick_whose_local_root_is_missing_fails_naming_it(prefect_api: str, s3: S3) -> None:
    with pytest.raises(FileNotFoundError, match="runs root /does/not/exist does not exist"):
        enrich_completed_runs("/does/not/exist")
    empty = enrich_completed_runs(s3.url("runs"), storage_options=s3.storage_options)  # no runs yet: fine
    assert empty.enriched == [] and empty.unfinished == []


def test_a_deployment_run_with_a_secret_option_is_refused_and_never_stored(prefect_api: str) -> None:
    """A deployment's parameters are stored by the server before any flow code runs: the schema
    refuses secret-looking storage options there, so no run holding one exists."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.exceptions import PrefectHTTPStatusError

    if "enrich-rollouts" not in deployments():
        assert deploy(prefect_api, "--runs-root", "/data/runs").returncode == 0
    deployment = deployments()["enrich-rollouts"]
    secret = {"client_kwargs": {"aws_secret_access_key": "hunter2"}}
    with get_client(sync_client=True) as client:
        with pytest.raises(PrefectHTTPStatusError, match="409"):
            client.create_flow_run_from_deployment(
                deployment.id,
                parameters={"rollouts": "r.jsonl", "capture_dir": "/c", "storage_options": secret},
            )
        fine = client.create_flow_run_from_deployment(
            deployment.id,
            parameters={"rollouts": "r.jsonl", "capture_dir": "/c", "storage_options": {"anon": False}},
        )
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        )
        client.delete_flow_run(fine.id)
    assert [run.id for run in runs] == [fine.id]
    assert "hunter2" not in orjson.dumps([run.parameters for run in runs]).decode()


def test_s3_variant_runs_on_a_worker_in_a_users_own_project(prefect_api: str, s3: S3, tmp_path: Path) -> None:
    """Deploy for S3 with a credentials block, then a process worker started in a Prefect project
    that has its own ``flows`` and ``tasks`` packages runs one flow run with no AWS variables."""
    from prefect.client.orchestration import get_client
    from prefect_aws import AwsClientParameters, AwsCredentials

    AwsCredentials(
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
        aws_client_parameters=AwsClientParameters(endpoint_url=s3.endpoint),
    ).save("rollout-capture", overwrite=True)
    run = tmp_path / "runs" / "run-1"
    (run / "captures").mkdir(parents=True)
    for task in range(3):
        CaptureStore(run / "captures").record(f"{task}-0", ROW)
    lines = [orjson.dumps({"_ng_task_index": t, "_ng_rollout_index": 0}) for t in range(3)]
    (run / "rollouts.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (run / "_SUCCESS").write_bytes(b"")
    s3.fs().put(str(run), f"{s3.bucket}/runs/run-1", recursive=True)

    project = tmp_path / "project"  # the common layout of a user's own Prefect project
    for package in ("flows", "tasks"):
        (project / package).mkdir(parents=True)
        (project / package / "__init__.py").write_text("OWNER = 'user'\n")
    pool = "rollout-capture-s3"
    done = deploy(
        prefect_api,
        *("--runs-root", f"s3://{s3.bucket}/runs", "--pool", pool, "--credentials-block", "rollout-capture"),
        cwd=project,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    deployment = deployments()["enrich-completed-runs"]
    assert deployment.parameters["runs_root"] == f"s3://{s3.bucket}/runs"
    assert deployment.parameters["credentials_block"] == "rollout-capture"
    assert "testing" not in orjson.dumps(deployment.parameters).decode()  # the block is named, not inlined
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run_from_deployment(deployment.id)

    worker_env = {
        key: value
        for key, value in environment(prefect_api).items()
        if not key.startswith(("AWS_", "PYTHONPATH"))
    }
    worker_env["PREFECT_HOME"] = str(tmp_path / "worker-home")
    worker = subprocess.run(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--run-once"],
        cwd=project,
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    with get_client(sync_client=True) as client:
        finished = client.read_flow_run(flow_run.id)
    assert finished.state is not None and finished.state.is_completed(), (
        worker.stdout[-4000:] + worker.stderr[-4000:]
    )
    out = s3.fs().cat_file(f"{s3.bucket}/runs/run-1/rollouts.enriched.jsonl").splitlines()
    assert [orjson.loads(line)["ng_model_call_capture"]["metrics"]["num_calls"] for line in out] == [1, 1, 1]
    assert s3.fs().exists(f"{s3.bucket}/runs/run-1/_ENRICHED")


def test_the_shipped_automation_fires_when_gaps_exceed_the_threshold(
    prefect_api: str, tmp_path: Path
) -> None:
    from prefect.automations import Automation

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect",
            "automation",
            "create",
            "--from-file",
            str(ROOT / "deployments" / "automations.yaml"),
        ],
        cwd=ROOT,
        env=environment(prefect_api),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    automation = Automation.read(name="rollout-capture-gaps-exceeded")
    (tmp_path / "caps").mkdir()
    (tmp_path / "r.jsonl").write_bytes(b'{"_ng_task_index": 1, "_ng_rollout_index": 0}\n')
    triggered = ("prefect.automation.triggered", f"prefect.automation.{automation.id}")

    def enriched_until_it_fires() -> list[Any]:
        """The triggers service loads a new automation in the background, when it does: an
        enrichment before that goes unseen, so enrich again until one is seen (a deadline)."""
        enrich_rollouts(str(tmp_path / "r.jsonl"), str(tmp_path / "caps"), max_gap_share=0.5)
        try:
            return wait_for_events(*triggered, timeout_s=10)
        except AssertionError:
            return []

    try:
        (fired,) = wait_for(enriched_until_it_fires, 120, "the automation to fire", poll_s=0)
        assert fired.payload["triggering_event"]["event"] == "rollout-capture.enrichment.gaps-exceeded"
    finally:
        automation.delete()
        shutil.rmtree(tmp_path / "caps")
