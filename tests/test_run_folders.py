"""Scheduled enrichment of run folders: finished runs only, once, never two at a time."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from flows import enrich_completed_runs
from rollout_capture.run_folders import RunsRoot

from .conftest import ROOT, S3
from .runs_helpers import make_run
from .spawned import take_lease


@pytest.mark.usefixtures("prefect_api")
def test_only_finished_runs_are_enriched_and_only_once(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    done = make_run(root, "2026-11-01-a", finished=True)
    make_run(root, "2026-11-01-b", finished=False)
    busy = make_run(root, "2026-11-01-c", finished=True)
    (root / "not-a-run").mkdir()
    runs = RunsRoot(str(root))
    lease = runs.acquire(next(r for r in runs.runs() if r.name == busy.name))  # another schedule holds it
    assert lease is not None

    first = enrich_completed_runs(str(root))

    assert (
        first.enriched == [done.name] and first.unfinished == ["2026-11-01-b"] and first.busy == [busy.name]
    )
    out = (done / "rollouts.enriched.jsonl").read_bytes().splitlines()
    assert len(out) == 3 and all(
        orjson.loads(x)["ng_model_call_capture"]["metrics"]["num_calls"] == 1 for x in out
    )
    marker = orjson.loads((done / "_ENRICHED").read_bytes())
    assert marker["stats"]["rollouts"] == 3 and marker["output"].endswith("rollouts.enriched.jsonl")
    assert not list(done.glob("_ENRICHING*"))  # the lease was given back
    assert not (root / "2026-11-01-b" / "rollouts.enriched.jsonl").exists()

    second = enrich_completed_runs(str(root))
    assert second.enriched == [] and second.already_enriched == [done.name]


@pytest.mark.usefixtures("prefect_api")
def test_runs_on_s3(s3: S3, tmp_path: Path) -> None:
    local = make_run(tmp_path, "run-1", finished=True)
    s3.fs().put(str(local), f"{s3.bucket}/runs/run-1", recursive=True)
    summary = enrich_completed_runs(s3.url("runs"), storage_options=s3.storage_options)
    assert summary.enriched == ["run-1"]
    assert s3.fs().exists(f"{s3.bucket}/runs/run-1/_ENRICHED")
    assert len(s3.fs().cat_file(f"{s3.bucket}/runs/run-1/rollouts.enriched.jsonl").splitlines()) == 3


def test_lease_expires_and_only_one_breaker_wins(tmp_path: Path) -> None:
    make_run(tmp_path, "r", finished=True)
    runs = RunsRoot(str(tmp_path))
    (run,) = runs.runs()
    stale = runs.acquire(run, lease_s=1.0)  # long enough to stay live on a busy machine
    assert stale is not None and runs.acquire(run) is None  # live: nobody else gets it
    time.sleep(max(0.0, stale.expires_at - time.time()) + 0.05)
    context = multiprocessing.get_context("spawn")
    go, results = context.Event(), context.Queue()
    racers = [context.Process(target=take_lease, args=(str(tmp_path), "r", go, results)) for _ in range(4)]
    for racer in racers:
        racer.start()
    go.set()
    for racer in racers:
        racer.join(60)
    assert sorted(results.get(timeout=10) for _ in racers) == [False, False, False, True]


def test_deployment_file_deploys(prefect_api: str, tmp_path: Path) -> None:
    """``prefect deploy --all --prefect-file deployments/prefect.yaml`` on a fresh server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    with get_client(sync_client=True) as client:  # once per server, as `make deploy` does
        try:
            client.create_work_pool(WorkPoolCreate(name="rollout-capture", type="process"))
        except Exception as exc:  # already there from an earlier test run
            assert "already exists" in str(exc).lower() or "conflict" in type(exc).__name__.lower()
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    command = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file"]
    done = subprocess.run(
        [*command, "deployments/prefect.yaml"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    with get_client(sync_client=True) as client:
        deployments = {d.name: d for d in client.read_deployments()}
    scheduled = deployments["enrich-completed-runs"]
    assert {"enrich-completed-runs", "enrich-rollouts", "prepare-dispatch"} <= set(deployments)
    assert scheduled.work_pool_name == "rollout-capture"
    assert scheduled.parameters["runs_root"] == "/data/runs"
    assert [s.schedule.cron for s in scheduled.schedules] == ["*/15 * * * *"]  # type: ignore[union-attr]


def test_s3_deployment_variant_pushes_code_and_deploys(prefect_api: str, s3: S3) -> None:
    """deployments/prefect-s3.yaml: code pushed to S3 with a credentials block, pulled back by workers."""
    from prefect.client.orchestration import get_client
    from prefect_aws import AwsClientParameters, AwsCredentials

    AwsCredentials(
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
        aws_client_parameters=AwsClientParameters(endpoint_url=s3.endpoint),
    ).save("rollout-capture", overwrite=True)
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "ROLLOUT_CAPTURE_CODE_BUCKET": s3.bucket,
        "ROLLOUT_CAPTURE_RUNS_BUCKET": "runs-bucket",
    }
    command = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file"]
    done = subprocess.run(
        [*command, "deployments/prefect-s3.yaml"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    pushed = {p.split("/rollout-capture/", 1)[1] for p in s3.fs().find(f"{s3.bucket}/rollout-capture")}
    assert {"flows/enrich_runs.py", "rollout_capture/store.py", "pyproject.toml"} <= pushed
    assert not any(p.startswith((".venv/", ".git/", "tests/")) for p in pushed)
    with get_client(sync_client=True) as client:
        deployment = next(d for d in client.read_deployments() if d.name == "enrich-completed-runs-s3")
    (pull,) = deployment.pull_steps or []
    assert "prefect_aws.deployments.steps.pull_from_s3" in pull
    assert deployment.parameters["runs_root"] == "s3://runs-bucket/runs"
    assert "testing" not in str(deployment.pull_steps)  # the block is referenced, not inlined
