"""Deployments as a user makes them: `prefect deploy` on a real API, a deployment run refused by
its parameter schema, the S3 variant run by a process worker whose Python lacks
rollout-capture, and the shipped automation firing on an event."""

from __future__ import annotations

import contextlib
import os
import shutil
import site
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import CaptureStore
from rollout_capture.flows import enrich_rollouts

from .conftest import ROOT, S3
from .prefect_api import wait_for_events

ROW = {"model_call_id": "c", "dialect": "chat", "response": {"usage": {"prompt_tokens": 3}}}
DEPLOY = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file"]


def environment(api: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **extra}


def ensure_pool() -> None:
    """Prefect will not deploy to a missing pool in non-interactive mode (`make deploy` creates it)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client, contextlib.suppress(ObjectAlreadyExists):
        client.create_work_pool(WorkPoolCreate(name="rollout-capture", type="process"))


def deployments() -> dict[str, Any]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {d.name: d for d in client.read_deployments()}


def test_deployment_file_deploys(prefect_api: str) -> None:
    """``prefect deploy --all --prefect-file deployments/prefect.yaml`` on a fresh server."""
    ensure_pool()
    done = subprocess.run(
        [*DEPLOY, "deployments/prefect.yaml"],
        cwd=ROOT,
        env=environment(prefect_api),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = deployments()
    scheduled = found["enrich-completed-runs"]
    assert {"enrich-completed-runs", "enrich-rollouts", "prepare-dispatch"} <= set(found)
    assert scheduled.work_pool_name == "rollout-capture"
    assert scheduled.parameters["runs_root"] == "/data/runs"
    assert [s.schedule.cron for s in scheduled.schedules] == ["*/15 * * * *"]
    assert scheduled.concurrency_options.collision_strategy == "CANCEL_NEW"  # never a pile of queued ticks
    assert scheduled.job_variables["env"]["PREFECT_LOGGING_EXTRA_LOGGERS"] == "rollout_capture"

    schema = found["enrich-rollouts"].parameter_openapi_schema["properties"]
    assert schema["batch_size"]["minimum"] == 1 and schema["max_workers"]["minimum"] == 1
    assert schema["runner"]["enum"] == ["threads", "processes", "dask"]
    assert schema["capture_dir"]["description"].startswith("Where the captures are")
    assert "propertyNames" in str(schema["storage_options"])


def test_a_deployment_run_with_a_secret_option_is_refused_and_never_stored(prefect_api: str) -> None:
    """A deployment's parameters are stored by the server before any flow code runs: the schema
    refuses secret-looking storage options there, so no run holding one exists."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.exceptions import PrefectHTTPStatusError

    if "enrich-rollouts" not in deployments():
        test_deployment_file_deploys(prefect_api)
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


def bare_worker_python(tmp_path: Path) -> Path:
    """A Python with Prefect and the project's dependencies but no rollout-capture at all.

    Built in a second: a venv whose site-packages links to this one's, minus the project.
    """
    venv = tmp_path / "worker-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    target = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    linked = tmp_path / "linked-site-packages"
    linked.mkdir()
    (source,) = (Path(p) for p in site.getsitepackages() if Path(p, "prefect").exists())
    for entry in source.iterdir():
        if "rollout_capture" in entry.name or entry.name.startswith("__editable__"):
            continue
        (linked / entry.name).symlink_to(entry)
    (target / "linked.pth").write_text(f"{linked}\n")
    return python


def test_s3_variant_runs_on_a_worker_without_rollout_capture(
    prefect_api: str, s3: S3, tmp_path: Path
) -> None:
    """Push the code to S3, deploy, and let a process worker whose Python has never seen
    rollout-capture run one flow run: the pull steps install it from the pulled code."""
    from prefect.client.orchestration import get_client
    from prefect_aws import AwsClientParameters, AwsCredentials

    AwsCredentials(
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
        aws_client_parameters=AwsClientParameters(endpoint_url=s3.endpoint),
    ).save("rollout-capture", overwrite=True)
    ensure_pool()
    run = tmp_path / "runs" / "run-1"
    (run / "captures").mkdir(parents=True)
    for task in range(3):
        CaptureStore(run / "captures").record(f"{task}-0", ROW)
    lines = [orjson.dumps({"_ng_task_index": t, "_ng_rollout_index": 0}) for t in range(3)]
    (run / "rollouts.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (run / "_SUCCESS").write_bytes(b"")
    s3.fs().put(str(run), f"{s3.bucket}/runs/run-1", recursive=True)

    done = subprocess.run(
        [*DEPLOY, "deployments/prefect-s3.yaml"],
        cwd=ROOT,
        env=environment(
            prefect_api, ROLLOUT_CAPTURE_CODE_BUCKET=s3.bucket, ROLLOUT_CAPTURE_RUNS_BUCKET=s3.bucket
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    pushed = {p.split("/rollout-capture/", 1)[1] for p in s3.fs().find(f"{s3.bucket}/rollout-capture")}
    assert {"flows/enrich_runs.py", "rollout_capture/store.py", "pyproject.toml"} <= pushed
    assert "deployments/worker-requirements.txt" in pushed
    assert not any(p.startswith((".venv/", ".git/", "tests/")) for p in pushed)
    deployment = deployments()["enrich-completed-runs-s3"]
    assert deployment.parameters["runs_root"] == f"s3://{s3.bucket}/runs"
    assert "testing" not in str(deployment.pull_steps)  # the block is referenced, not inlined
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run_from_deployment(deployment.id)

    python = bare_worker_python(tmp_path)
    probe = subprocess.run([str(python), "-c", "import rollout_capture"], capture_output=True, cwd=tmp_path)
    assert probe.returncode != 0  # the worker's Python really lacks it
    worker_env = {
        key: value
        for key, value in environment(prefect_api).items()
        if not key.startswith(("AWS_", "VIRTUAL_ENV", "PYTHONPATH"))
    }
    worker_env["PATH"] = f"{python.parent}:/usr/bin:/bin"
    worker_env["PREFECT_HOME"] = str(tmp_path / "worker-home")
    worker = subprocess.run(
        [str(python), "-m", "prefect", "worker", "start", "--pool", "rollout-capture", "--run-once"],
        cwd=tmp_path,
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
    installed = subprocess.run(
        [str(python), "-m", "pip", "show", "rollout-capture"], capture_output=True, text=True, env=worker_env
    )
    assert (
        installed.returncode == 0 and str(python.parent.parent) in installed.stdout
    )  # into the worker's env
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
            "deployments/automations.yaml",
        ],
        cwd=ROOT,
        env=environment(prefect_api),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    automation = Automation.read(name="rollout-capture-gaps-exceeded")
    time.sleep(2)  # the triggers service loads new automations on its own clock
    (tmp_path / "caps").mkdir()
    (tmp_path / "r.jsonl").write_bytes(b'{"_ng_task_index": 1, "_ng_rollout_index": 0}\n')
    try:
        enrich_rollouts(str(tmp_path / "r.jsonl"), str(tmp_path / "caps"), max_gap_share=0.5)
        (fired,) = wait_for_events("prefect.automation.triggered", f"prefect.automation.{automation.id}")
        assert fired.payload["triggering_event"]["event"] == "rollout-capture.enrichment.gaps-exceeded"
    finally:
        automation.delete()
        shutil.rmtree(tmp_path / "caps")
