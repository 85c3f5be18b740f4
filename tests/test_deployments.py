"""Deployments as a user makes them from an install: `rollout-capture deploy` on a real API
(module entrypoints, no checkout), a deployment run refused by its parameter schema, the S3
variant run by a process worker in a user's own Prefect project, a tick whose root is missing,
and the shipped automation firing on an event."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import CaptureStore
from rollout_capture.flows import enrich_completed_runs, enrich_rollouts

from .conftest import ROOT, S3, wait_for
from .support.cli import CLI, interrupted, run_cli, running_until, start_worker, still_running
from .support.prefect_api import wait_for_events
from .support.runs_helpers import make_run

ROW = {"model_call_id": "c", "dialect": "chat", "response": {"usage": {"prompt_tokens": 3}}}


def environment(api: str | None, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **extra}
    env.pop("PREFECT_API_URL", None)
    if api:
        env["PREFECT_API_URL"] = api
    return env


def deploy(api: str | None, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return run_cli("deploy", *args, env=environment(api), cwd=cwd)


def deployments() -> dict[str, Any]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {d.name: d for d in client.read_deployments()}


def triggered_runs(deployment_id: Any) -> list[Any]:
    """The flow runs of one deployment that were not made by its schedule (its yearly tick's)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
        )
    return [r for r in runs if not r.auto_scheduled]


def finish_until_enriched(
    run: Path, prefect_api: str, deployment: str, runner: subprocess.Popen[str]
) -> None:
    """``rollout-capture finish`` the run until ``deployment``'s trigger has enriched it, then wait
    until every flow run of the deployment has ended (so a Ctrl-C after this stops nothing half
    done). The triggers service loads a new deployment's trigger in the background, when it does:
    an event before that goes unseen and makes no flow run, so the run is finished again while the
    deployment has no flow run under way. No window decides (pytest-timeout bounds a trigger that
    never fires): a finish answered "already enriched" means the run is. ``runner`` (the serve or
    the worker running the deployment's flow runs) must live meanwhile."""
    deployment_id = deployments()[deployment].id

    def alive() -> bool:
        return still_running(runner, f"waiting for {run.name} to be enriched by {deployment}")

    def under_way() -> list[Any]:
        return [r for r in triggered_runs(deployment_id) if r.state is None or not r.state.is_final()]

    while not (run / "_ENRICHED").exists():
        runs_before = len(triggered_runs(deployment_id))
        done = run_cli("finish", str(run), env=environment(prefect_api))
        assert done.returncode == 0, done.stderr
        if "already enriched" in done.stdout:
            break
        assert "the server was told" in done.stdout, done.stdout + done.stderr
        asked = time.monotonic()
        while not (run / "_ENRICHED").exists() and alive():  # enriched, or the event went unseen
            runs = triggered_runs(deployment_id)
            if len(runs) > runs_before and not under_way() and not (run / "_ENRICHED").exists():
                states = [f"{r.name}: {r.state and r.state.name} {r.state and r.state.message}" for r in runs]
                raise AssertionError(f"{run}: its deployment's runs ended, the run not enriched: {states}")
            if len(runs) == runs_before and time.monotonic() - asked > UNSEEN_AFTER_S:
                break  # no flow run: the trigger was not loaded yet; finish again
            time.sleep(0.2)
    while under_way() and alive():
        time.sleep(0.2)


OPERATOR_TIMEOUT_S = 900
"""The tests running a serve or a worker: each process may take minutes to start, and a flow run
as long, on a loaded machine (no window inside them decides; this bounds a hang)."""
UNSEEN_AFTER_S = 20.0
"""A finish whose event made no flow run of the deployment this long is finished again (a pace, not
a verdict: a flow run of the first event found later only enriches nothing twice, leases decide)."""


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
    done = run_cli("deploy", "--runs-root", "/data/runs", env=env, timeout=120)
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


def save_dummy_block(name: str, endpoint: str = "http://127.0.0.1:9") -> None:
    """An ``AwsCredentials`` block of dummy values: registering only needs its name to exist."""
    from prefect_aws import AwsClientParameters, AwsCredentials

    AwsCredentials(
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
        aws_client_parameters=AwsClientParameters(endpoint_url=endpoint),
    ).save(name, overwrite=True)


def test_two_serves_of_two_runs_roots_share_no_deployment_name() -> None:
    """serve --name: the default names as they were; another names all four after it (a served
    deployment belongs to its process: one serve's Ctrl-C pauses only its own)."""
    from rollout_capture.deployments.shipped import shipped_deployments

    def names(**options: Any) -> list[str]:
        return [d.name for d in shipped_deployments("/data/runs", **options)]

    first = names(served=True)
    assert first == [
        "enrich-completed-runs-served",
        "follow-runs-served",
        "enrich-rollouts-served",
        "prepare-dispatch-served",
    ]
    second = names(served=True, name="lab")
    assert second == [
        "lab-served",
        "lab-follow-runs-served",
        "lab-enrich-rollouts-served",
        "lab-prepare-dispatch-served",
    ]
    # deploy's on-demand ones are shared; a root's follower is its own
    assert names(name="lab") == ["lab", "lab-follow-runs", "enrich-rollouts", "prepare-dispatch"]


@pytest.mark.timeout(OPERATOR_TIMEOUT_S)
def test_serve_never_changes_what_deploy_registered(prefect_api: str, tmp_path: Path) -> None:
    """deploy A, serve B (a real process, stopped by SIGINT as Ctrl-C does), deploy an S3 root C under
    a name of its own: A and C keep their parameters and active schedules; serve's own are B's."""
    root_a, root_b = tmp_path / "A", tmp_path / "B"
    root_a.mkdir()
    root_b.mkdir()
    from rollout_capture.deployments.register import register

    a = {"runner": "processes", "max_workers": 3}
    register(str(root_a), pool="rollout-capture", cron="*/15 * * * *", parameters=a, automation=False)
    registered_a = deployments()["enrich-completed-runs"].parameters
    assert registered_a["runs_root"] == str(root_a) and registered_a["max_workers"] == 3

    served = subprocess.Popen(
        [*CLI, "serve"],
        cwd=tmp_path,
        env=environment(prefect_api, ROLLOUT_CAPTURE_RUNS_ROOT=str(root_b)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        running_until(  # READY: the server has seen serve poll for it
            served,
            lambda: any(
                d.parameters.get("runs_root") == str(root_b) and d.status == "READY"
                for d in deployments().values()
            ),
            "serve to register its deployments and poll",
        )
    finally:
        output = interrupted(served)
    assert served.returncode == 0, output
    assert "nothing else was touched (deployments of work pools, other serves')" in output

    found = deployments()
    scheduled = found["enrich-completed-runs"]
    assert scheduled.parameters == registered_a, output  # never rewritten by serve...
    assert not scheduled.paused and all(s.active for s in scheduled.schedules)  # ...nor paused
    assert scheduled.work_pool_name == "rollout-capture"
    own = found["enrich-completed-runs-served"]
    assert own.parameters["runs_root"] == str(root_b) and own.work_pool_name is None
    assert own.paused  # what serve served stops with it

    save_dummy_block("rollout-capture-c")
    root_c = "s3://bucket-c/runs"
    args = ("--runs-root", root_c, "--name", "enrich-s3-runs", "--credentials-block", "rollout-capture-c")
    done = deploy(prefect_api, *args, "--capture-dir", "s3://bucket-c/captures")
    assert done.returncode == 0, done.stderr
    assert "enrich-completed-runs:" not in done.stderr  # A's deployment is not replaced...
    assert "enrich_rollouts/enrich-rollouts: registered again, unchanged" in done.stderr  # ...these are
    given_c = {**deployments()["enrich-s3-runs"].parameters, "max_workers": 2}
    given_c.pop("runs_root")
    again = register(
        root_c, pool="rollout-capture", cron="*/15 * * * *", parameters=given_c, name="enrich-s3-runs"
    )
    assert again["replaced"]["enrich_completed_runs/enrich-s3-runs"] == "max_workers 8 -> 2"

    found = deployments()
    for name, root in (("enrich-completed-runs", str(root_a)), ("enrich-s3-runs", root_c)):
        assert found[name].parameters["runs_root"] == root
        assert not found[name].paused and all(s.active for s in found[name].schedules)
    assert found["enrich-completed-runs"].parameters == registered_a
    assert found["enrich-s3-runs"].parameters["credentials_block"] == "rollout-capture-c"
    assert found["enrich-s3-runs"].parameters["capture_dir"] == "s3://bucket-c/captures"  # was dropped
    assert "testing" not in orjson.dumps(found["enrich-s3-runs"].parameters).decode()


def test_deploy_refuses_a_credentials_block_the_server_does_not_hold(prefect_api: str) -> None:
    """It used to register deployments whose every tick failed on the missing block."""
    done = deploy(prefect_api, "--runs-root", "s3://bucket/never", "--credentials-block", "absent")
    assert done.returncode == 2, done.stderr
    assert "credentials block 'absent'" in done.stderr and "Traceback" not in done.stderr
    assert all(d.parameters.get("runs_root") != "s3://bucket/never" for d in deployments().values())


def test_a_run_cancelled_by_the_concurrency_limit_says_a_tick_was_already_running(prefect_api: str) -> None:
    """The server cancels it saying only "Deployment concurrency limit reached."; the shipped
    automation rewrites the message to say why. No worker: the states are proposed as one would."""
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Pending, Running

    from rollout_capture.deployments.register import register

    register("/data/tick-limit", pool="rollout-capture", cron="0 0 1 1 *", parameters={}, name="tick-limit")
    deployment = deployments()["tick-limit"]
    with get_client(sync_client=True) as client:
        tick = client.create_flow_run_from_deployment(deployment.id)
        assert client.set_flow_run_state(tick.id, Pending()).status.value == "ACCEPT"
        client.set_flow_run_state(tick.id, Running())
        tried: list[Any] = []

        def cancelled_with_the_reason() -> str:
            """The triggers service loads a new automation when it does: until then a cancelled run
            keeps the server's message, so try another run until one is explained (a deadline)."""
            run = client.create_flow_run_from_deployment(deployment.id)
            tried.append(run.id)
            client.set_flow_run_state(run.id, Pending())  # what a worker proposes first
            try:
                return wait_for(
                    lambda: (
                        "already running" in (client.read_flow_run(run.id).state.message or "")
                        and client.read_flow_run(run.id).state.message
                    ),
                    10,
                    "the cancelled run's message",
                    poll_s=0.3,
                )
            except AssertionError:
                assert client.read_flow_run(run.id).state.is_cancelled()
                return ""

        try:
            message = wait_for(cancelled_with_the_reason, 90, "the explained cancellation", poll_s=0)
            assert message.startswith("Not run: a tick of this deployment was already running")
        finally:
            client.set_flow_run_state(tick.id, Completed())
            for run_id in (tick.id, *tried):
                client.delete_flow_run(run_id)
            client.delete_deployment(deployment.id)


@pytest.mark.timeout(OPERATOR_TIMEOUT_S)
def test_a_finished_run_is_enriched_at_once_by_its_deployments_trigger(
    prefect_api: str, tmp_path: Path
) -> None:
    """``rollout-capture finish`` writes _SUCCESS and emits the event; the scheduled deployment's
    trigger runs it on a real worker (its tick, yearly here, never comes): the run gets _ENRICHED."""
    from rollout_capture.deployments.register import register

    run = tmp_path / "runs" / "run-1"
    (run / "captures").mkdir(parents=True)
    CaptureStore(run / "captures").record("0-0", ROW)
    (run / "rollouts.jsonl").write_bytes(orjson.dumps({"_ng_task_index": 0, "_ng_rollout_index": 0}) + b"\n")
    pool = "rollout-capture-trigger"
    register(str(tmp_path / "runs"), pool=pool, cron="0 0 1 1 *", parameters={}, name="on-finish")
    worker = start_worker(pool, prefect_api, tmp_path)

    try:
        finish_until_enriched(run, prefect_api, "on-finish", worker)
    finally:
        output = interrupted(worker)
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            client.delete_deployment(deployments()["on-finish"].id)
    out = (run / "rollouts.enriched.jsonl").read_bytes().splitlines()
    assert [orjson.loads(line)["ng_model_call_capture"]["metrics"]["num_calls"] for line in out] == [1], (
        output
    )


UNREACHABLE_API = "http://127.0.0.1:9/api"
"""An API nobody answers: a command that asked it anything would fail (exit 1), not refuse (exit 2)."""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["deploy", "--name", "runs\nc"], "--name 'runs\\nc' holds a control character"),
        (["deploy", "--name", "runs-c-served"], "names ending so are `rollout-capture serve`'s"),
        (["deploy", "--pool", "pool/a"], "--pool 'pool/a' holds /"),
        (["deploy", "--credentials-block", "Block A"], "a block's name is lowercase letters"),
        (["serve", "--name", "runs\x1b[2Jc"], "--name 'runs\\x1b[2Jc' holds a control character"),
    ],
)
def test_a_bad_name_is_refused_as_bad_input_before_any_server(
    args: list[str], message: str, tmp_path: Path
) -> None:
    """Refused with exit 2 and the name shown escaped, the API (which nobody answers) never asked:
    a newline in --name was an InvalidURL, exit 1."""
    done = run_cli(*args, "--runs-root", str(tmp_path), env=environment(UNREACHABLE_API))
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "\x1b" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("command", ["deploy", "serve"])
@pytest.mark.parametrize("runs_root", ["/data/runs\x1b]0;PWNED\x07", "/data/runs\nINJECTED"])
def test_a_runs_root_with_a_control_character_is_refused_before_any_server(
    command: str, runs_root: str
) -> None:
    """A runs root the deployment stores (its parameters, its trigger's match, the UI): refused as
    ``--name`` is, exit 2, shown escaped, the API (which nobody answers) never asked."""
    done = run_cli(command, "--runs-root", runs_root, env=environment(UNREACHABLE_API))
    assert done.returncode == 2, done.stderr
    shown = runs_root.replace("\x1b", "\\x1b").replace("\x07", "\\x07").replace("\n", "\\n")
    assert f"--runs-root '{shown}' holds a control character" in done.stderr, done.stderr
    assert "\x1b" not in done.stderr and "\nINJECTED" not in done.stderr


def test_finish_shows_a_hostile_run_name_escaped_and_names_a_success_folder(tmp_path: Path) -> None:
    """A run folder named with an escape sequence, a BEL and a carriage return: ``finish`` shows it
    as the characters it holds. A ``_SUCCESS`` that is a folder is named as such, not as the
    temporary file the write went through."""
    root = tmp_path / "runs"
    hostile = root / "evil\x1b]0;PWNED\x07RED\rOVER"
    hostile.mkdir(parents=True)
    (hostile / "rollouts.jsonl").write_bytes(b"{}\n")
    done = run_cli("finish", str(hostile), env=environment(None))
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout + done.stderr and "\x07" not in done.stdout and "\r" not in done.stdout
    assert f"finished {root}/evil\\x1b]0;PWNED\\x07RED\\rOVER" in done.stdout, done.stdout
    assert (hostile / "_SUCCESS").is_file()

    folder = root / "r2"
    (folder / "_SUCCESS").mkdir(parents=True)
    (folder / "rollouts.jsonl").write_bytes(b"{}\n")
    refused = run_cli("finish", str(folder), env=environment(None))
    assert refused.returncode == 2, refused.stderr
    (error,) = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert error == (
        f"error: run folder {folder}: _SUCCESS is a folder, not the empty file that marks a run "
        "finished: remove it, then finish the run"
    )
    assert ".tmp-" not in refused.stderr


def test_finish_refuses_a_missing_folder_and_a_link_writing_nothing_outside_the_root(tmp_path: Path) -> None:
    """A missing folder is said not to exist; a run folder that is a link (to a run outside the
    root), or holds a ``_SUCCESS`` link, is refused: no ``_SUCCESS`` lands outside the root. All
    before the API (nobody answers it) is asked anything."""
    root, outside = tmp_path / "runs", tmp_path / "elsewhere"
    target = outside / "r"
    target.mkdir(parents=True)
    (target / "rollouts.jsonl").write_bytes(b"{}\n")
    root.mkdir()
    (root / "linked").symlink_to(target)
    (root / "r2").mkdir()
    (root / "r2" / "rollouts.jsonl").write_bytes(b"{}\n")
    (root / "r2" / "_SUCCESS").symlink_to(outside / "planted")
    env = environment(UNREACHABLE_API)

    missing = run_cli("finish", str(root / "nope"), env=env)
    assert missing.returncode == 2, missing.stderr
    assert f"run folder {root / 'nope'} does not exist" in missing.stderr
    linked = run_cli("finish", str(root / "linked"), env=env)
    assert linked.returncode == 2 and "is a symbolic link" in linked.stderr, linked.stderr
    planted = run_cli("finish", str(root / "r2"), env=env)
    assert planted.returncode == 2 and "_SUCCESS: a symbolic link" in planted.stderr, planted.stderr
    assert sorted(p.name for p in outside.rglob("*")) == ["r", "rollouts.jsonl"]  # nothing written there


def test_finish_on_an_enriched_run_says_nothing_will_happen(prefect_api: str, tmp_path: Path) -> None:
    """With a server: no event (a tick would do nothing); without one: no claim that a tick enriches it."""
    run = tmp_path / "runs" / "done"
    run.mkdir(parents=True)
    (run / "rollouts.jsonl").write_bytes(b"{}\n")
    (run / "_ENRICHED").write_bytes(b"{}")
    told = run_cli("finish", "--json", str(run), env=environment(prefect_api))
    assert told.returncode == 0, told.stderr
    assert orjson.loads(told.stdout) == {
        "ok": True,
        "run": str(run),
        "event_sent": False,
        "already_enriched": True,
    }
    for env in (environment(prefect_api), environment(None, PREFECT_HOME=str(tmp_path / "home"))):
        done = run_cli("finish", str(run), env=env)
        assert done.returncode == 0, done.stderr
        assert "already enriched" in done.stdout and "nothing will happen" in done.stdout, done.stdout
        assert "told" not in done.stdout and "tick" not in done.stdout + done.stderr
    assert not (run / "_SUCCESS").exists()  # nothing written


def finish_here(*args: str) -> Any:
    """``rollout-capture finish`` run in this process with no Prefect API set (the unit tier's way:
    what it refuses, and an enriched run, are answered before Prefect is loaded)."""
    from typer.testing import CliRunner

    from rollout_capture.cli.app import app

    return CliRunner().invoke(app, ["finish", *args], env={"PREFECT_API_URL": None})


@pytest.mark.parametrize("link", ["folder", "_SUCCESS", "rollouts.jsonl", "_ENRICHED"])
def test_finish_never_follows_a_link_at_the_run_folder_or_in_it(link: str, tmp_path: Path) -> None:
    """The run folder reached through a link, or a part of it (_SUCCESS where it would write,
    rollouts.jsonl, _ENRICHED where it looks) that is a link out of the root: refused, exit 2, and
    nothing is written through it (a tick would never enrich it; a write would land outside)."""
    root, outside = tmp_path / "runs", tmp_path / "elsewhere"
    elsewhere = outside / "r"
    elsewhere.mkdir(parents=True)
    (elsewhere / "rollouts.jsonl").write_bytes(b"{}\n")
    root.mkdir()
    run = root / "r"
    if link == "folder":
        run.symlink_to(elsewhere)
    else:
        run.mkdir()
        if link != "rollouts.jsonl":
            (run / "rollouts.jsonl").write_bytes(b"{}\n")
        (run / link).symlink_to(elsewhere / ("rollouts.jsonl" if link == "rollouts.jsonl" else "planted"))
    done = finish_here("--json", str(run))
    assert done.exit_code == 2, done.output
    assert "symbolic link" in done.output and "Traceback" not in done.output
    assert "_SUCCESS" not in {p.name for p in run.iterdir()} - ({link} if link == "_SUCCESS" else set())
    assert sorted(p.name for p in outside.rglob("*")) == ["r", "rollouts.jsonl"]  # nothing written there


def json_documents(text: str) -> list[Any]:
    """Every JSON document in ``text``, one after another (however each is laid out)."""
    import json

    decoder, found, at = json.JSONDecoder(), [], 0
    while rest := text[at:].lstrip():
        document, at = decoder.raw_decode(text, len(text) - len(rest))
        found.append(document)
    return found


def test_finish_on_an_enriched_run_answers_once_and_writes_nothing(tmp_path: Path) -> None:
    """One result (a script reading the JSON reads one document), no _SUCCESS, nothing sent."""
    run = tmp_path / "runs" / "done"
    run.mkdir(parents=True)
    (run / "rollouts.jsonl").write_bytes(b"{}\n")
    (run / "_ENRICHED").write_bytes(b"{}")
    done = finish_here("--json", str(run))
    assert done.exit_code == 0, done.output
    assert json_documents(done.stdout) == [
        {"ok": True, "run": str(run), "event_sent": False, "already_enriched": True}
    ]
    assert not (run / "_SUCCESS").exists()
    shown = finish_here(str(run))
    assert shown.exit_code == 0 and shown.stdout.count("already enriched") == 1, shown.output
    assert "finished" not in shown.output and not (run / "_SUCCESS").exists()


def _automations_of(deployment_name: str) -> list[Any]:
    """The automations a deployment's triggers made (owned by it)."""
    from prefect.client.orchestration import get_client

    deployment = deployments()[deployment_name]
    with get_client(sync_client=True) as client:
        return list(client.read_resource_related_automations(f"prefect.deployment.{deployment.id}"))


@pytest.mark.timeout(OPERATOR_TIMEOUT_S)
def test_deploy_never_takes_over_a_running_serve_and_its_ctrl_c_leaves_no_trigger(
    prefect_api: str, tmp_path: Path
) -> None:
    """deploy A on a pool with a worker; serve C (``--name runs-c``, a real process). ``deploy --name
    runs-c-served`` is refused and changes nothing: C's run is still enriched by the serve. Ctrl-C
    pauses serve's own deployments and disables their trigger, and touches nothing of A's: A's
    trigger still has the worker enrich A's runs."""
    from rollout_capture.deployments.register import register

    root_a, root_c = tmp_path / "A", tmp_path / "C"
    pool = "rollout-capture-i36"
    register(str(root_a), pool=pool, cron="0 0 1 1 *", parameters={}, name="runs-a")
    worker = start_worker(pool, prefect_api, tmp_path)
    make_run(root_c, "c1", finished=False, rollouts=1)
    served = subprocess.Popen(
        [*CLI, "serve", "--name", "runs-c", "--cron", "0 0 1 1 *"],
        cwd=tmp_path,
        env=environment(prefect_api, ROLLOUT_CAPTURE_RUNS_ROOT=str(root_c)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    output = ""
    try:
        running_until(
            served,
            lambda: "runs-c-served" in (found := deployments()) and found["runs-c-served"].status == "READY",
            "serve to register its deployments and poll",
        )
        taken = deploy(
            prefect_api, "--runs-root", str(tmp_path / "D"), "--pool", pool, "--name", "runs-c-served"
        )
        assert taken.returncode == 2, taken.stdout + taken.stderr
        assert "names ending so are `rollout-capture serve`'s" in taken.stderr
        own = deployments()["runs-c-served"]
        assert own.work_pool_name is None and own.parameters["runs_root"] == str(root_c) and not own.paused
        finish_until_enriched(root_c / "c1", prefect_api, "runs-c-served", served)
    finally:
        output = interrupted(served)
    try:
        assert served.returncode == 0, output
        found = deployments()
        assert all(found[name].paused for name in found if name.startswith("runs-c-"))
        triggers = _automations_of("runs-c-served")
        assert [a.name for a in triggers] == ["runs-c-served: a run finished"]
        assert not any(a.enabled for a in triggers), output  # a later finish under C starts nothing
        assert "stopped: paused enrich_completed_runs/runs-c-served, " in output, output
        assert "disabled their triggers: runs-c-served: a run finished" in output, output
        assert not found["runs-a"].paused and all(a.enabled for a in _automations_of("runs-a"))
        make_run(root_a, "a1", finished=False, rollouts=1)
        finish_until_enriched(root_a / "a1", prefect_api, "runs-a", worker)
    finally:
        worker_output = interrupted(worker)
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            for name, deployment in deployments().items():
                if name == "runs-a" or name.startswith("runs-c-"):
                    client.delete_deployment(deployment.id)
    assert "Traceback" not in worker_output, worker_output[-4000:]


_CUT_SHORT = """
import os, signal, sys
from prefect.runner import Runner
from rollout_capture.cli.app import main

registered = Runner.add_deployment
def register_then_ctrl_c(self, deployment):
    deployment_id = registered(self, deployment)
    if deployment.name == "cut-short-served":  # the first: Ctrl-C while the others register
        os.kill(os.getpid(), signal.SIGINT)
    return deployment_id
Runner.add_deployment = register_then_ctrl_c
sys.argv = ["rollout-capture", "serve", "--name", "cut-short", "--cron", "0 0 1 1 *"]
main()
"""


def test_a_serve_stopped_while_it_registers_stops_all_it_registered(prefect_api: str, tmp_path: Path) -> None:
    """Ctrl-C as serve registers its deployments (seconds on a loaded server): it registers them
    whole, then stops them all, as when stopped serving. Cut short, one stayed active with its
    schedule and nothing serving it; the others, or its trigger, were never made."""
    from prefect.client.orchestration import get_client

    (tmp_path / "runs").mkdir()
    env = environment(prefect_api, ROLLOUT_CAPTURE_RUNS_ROOT=str(tmp_path / "runs"))
    done = subprocess.run(
        [sys.executable, "-c", _CUT_SHORT], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    said = done.stdout + done.stderr
    assert done.returncode == 130 and "stopped before serving began" in said, said
    names = ["cut-short-served", "cut-short-enrich-rollouts-served", "cut-short-prepare-dispatch-served"]
    found = deployments()
    try:
        assert all(found[name].paused for name in names), said
        triggers = _automations_of("cut-short-served")
        assert [(a.name, a.enabled) for a in triggers] == [("cut-short-served: a run finished", False)]
        assert "stopped: paused enrich_completed_runs/cut-short-served, " in said
        assert " until Ctrl-C" not in said  # it never served
    finally:
        with get_client(sync_client=True) as client:
            for name in names:
                if name in found:
                    client.delete_deployment(found[name].id)


def test_stopping_a_serve_disables_its_own_triggers_and_never_a_users_automation(
    prefect_api: str, tmp_path: Path
) -> None:
    """The user's own automation acting on a served deployment (a rerun, an alert) is related to it
    as the serve's trigger is: stopping the serve pauses its deployments and disables its trigger,
    and leaves the user's automation enabled. No serve process: its deployments as serve registers
    them (on no work pool), then what its Ctrl-C does."""
    from prefect.client.orchestration import get_client
    from prefect.events.actions import RunDeployment
    from prefect.events.schemas.automations import AutomationCore, EventTrigger

    from rollout_capture.deployments.serve import stop_served
    from rollout_capture.deployments.shipped import shipped_deployments

    served = shipped_deployments(str(tmp_path / "runs"), served=True, name="own-alerts")
    ids = [d.apply() for d in served]  # as serve registers them: triggers made automations
    scheduled = served[0].full_name
    with get_client(sync_client=True) as client:
        users = client.create_automation(
            AutomationCore(
                name="rerun the nightly enrichment when the lab says so",
                trigger=EventTrigger(expect={"lab.rerun"}, posture="Reactive", threshold=1),
                actions=[RunDeployment(deployment_id=ids[0])],
            )
        )
        try:
            related = client.read_resource_related_automations(f"prefect.deployment.{ids[0]}")
            assert sorted(a.name for a in related) == [
                "own-alerts-served: a run finished",
                "rerun the nightly enrichment when the lab says so",
            ]
            stopped = stop_served(served)
            assert stopped.paused == [d.full_name for d in served] and scheduled in stopped.paused
            assert stopped.triggers_disabled == [  # its own two: the scheduled job's and the follower's
                "own-alerts-served: a run finished",
                "own-alerts-follow-runs-served: a run started",
            ]
            found = {
                a.name: a for a in client.read_resource_related_automations(f"prefect.deployment.{ids[0]}")
            }
            assert not found["own-alerts-served: a run finished"].enabled
            assert found["rerun the nightly enrichment when the lab says so"].enabled  # the user's: untouched
        finally:
            client.delete_automation(users)
            for deployment_id in ids:
                client.delete_deployment(deployment_id)


@pytest.mark.parametrize("made_by", ["an older serve", "an older serve, on demand", "flow.serve()"])
def test_deploy_never_takes_over_a_deployment_on_no_work_pool(
    prefect_api: str, made_by: str, tmp_path: Path
) -> None:
    """A deployment of a name deploy registers, on no work pool: an older serve's (serve used deploy's
    names then: the scheduled one and the on-demand ones), or one a user's ``flow.serve()`` made.
    A process may be serving it: deploy refuses, naming it, and changes nothing (not even the pool)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    from rollout_capture.deployments.register import Served, register
    from rollout_capture.deployments.shipped import shipped_deployments

    root = str(tmp_path / "runs")
    name = f"served-before-{uuid.uuid4().hex[:8]}"
    if made_by == "flow.serve()":  # what flow.serve(name) registers before it polls
        there = enrich_completed_runs.to_deployment(name=name, parameters={"runs_root": "/theirs"})
    else:
        older = shipped_deployments("/theirs", name=name)  # deploy's names, on no work pool
        there = older[0] if made_by == "an older serve" else older[1]
        there.job_variables = {}  # served: its environment was its own process's
    pool = f"{name}-pool"
    with get_client(sync_client=True) as client:
        if made_by == "an older serve, on demand":  # the on-demand name every deploy registers
            with contextlib.suppress(ObjectNotFound):
                client.delete_deployment(client.read_deployment_by_name(there.full_name).id)
        there_id = there.apply()
        before = client.read_deployment(there_id)
        try:
            assert before.work_pool_name is None
            with pytest.raises(Served, match=f"deployment {re.escape(there.full_name)} is on no work pool"):
                register(root, pool=pool, cron="0 0 1 1 *", parameters={}, name=name)
            after = client.read_deployment(there_id)
            assert after.work_pool_name is None and after.parameters == before.parameters
            assert after.updated == before.updated  # not written at all
            with pytest.raises(ObjectNotFound):
                client.read_work_pool(pool)  # refused before anything was written
        finally:
            client.delete_deployment(there_id)
            with contextlib.suppress(ObjectNotFound):  # taken over, had the refusal failed
                client.delete_deployment(client.read_deployment_by_name(f"enrich_completed_runs/{name}").id)


def test_finish_tells_a_plain_server_without_loading_prefect(prefect_api: str, tmp_path: Path) -> None:
    """PREFECT_API_URL alone in the environment: the event goes in one POST, Prefect never imported
    (1.5 s of the command), and the server stores it as Prefect's client would send it."""
    from rollout_capture.run_events import RUN_FINISHED, RUN_PREFIX

    run = tmp_path / "runs" / "plain"
    run.mkdir(parents=True)
    (run / "rollouts.jsonl").write_bytes(b"{}\n")
    script = (
        "import sys\n"
        "from rollout_capture.cli.app import app\n"
        f"try:\n    app(['finish', {str(run)!r}])\nexcept SystemExit as done:\n    code = done.code\n"
        "print('prefect loaded' if 'prefect' in sys.modules else 'prefect not loaded', code)\n"
    )
    env = {k: v for k, v in environment(prefect_api).items() if not k.startswith(("PREFECT_API_KEY",))}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.splitlines()[-2:] == [
        f"finished {run}: the server was told",
        "prefect not loaded 0",
    ], done.stdout + done.stderr
    assert (run / "_SUCCESS").exists()
    (stored,) = wait_for_events(RUN_FINISHED, RUN_PREFIX + str(run))
    assert stored.resource["rollout-capture.run"] == str(run)
