"""The command line as a whole, as a user runs it (real processes): the version, the help, bad
options, input refused before any Prefect server starts, a temporary server, secrets never echoed."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rollout_capture import CaptureStore

from .conftest import S3
from .support.cli import CREDENTIALED, ROW, URL_SECRET, refused_unechoed, run_cli


def test_version() -> None:
    from importlib.metadata import version

    done = run_cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"rollout-capture {version('rollout-capture')}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--runner", "fibers"], "'fibers' is not one of"),
        (["--storage-options", "{oops"], "--storage-options is not JSON"),
        (["--storage-options", '{"key": "AKIA"}'], "storage_options.key looks like a secret"),
    ],
)
def test_bad_options_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "r.jsonl").write_bytes(b"{}\n")
    done = run_cli("enrich", str(tmp_path / "r.jsonl"), "--capture-dir", str(tmp_path), *args)
    assert done.returncode == 2 and message in done.stderr


def cold_cli(home: Path, *args: str, without: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """The CLI as on a fresh machine: no PREFECT_API_URL, a Prefect home of its own, none of the
    variables whose names start with one of ``without``."""
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(home)}
    env = {key: value for key, value in env.items() if not key.startswith(("PREFECT_API_URL", *without))}
    env["AWS_EC2_METADATA_DISABLED"] = "true"  # no instance-metadata wait for credentials (not on EC2)
    return run_cli(*args, env=env)


def no_server_started(home: Path, done: subprocess.CompletedProcess[str]) -> bool:
    """Nothing announced, no Prefect database made: bad input was refused before any server."""
    return "temporary" not in done.stderr and not list(home.rglob("*.db"))


@pytest.mark.parametrize(
    "case",
    [
        "enrich-capture-dir",
        "clear-capture-dir",
        "fifo",
        "folder",
        "runs-root",
        "wait",
        "inspect",
        "compact",
        "runner",
        "fake-gz",
        "s3-runs-root-without-credentials",
        "serve-without-an-api",
        "serve-without-a-runs-root",
    ],
)
def test_bad_input_is_refused_before_any_prefect_server_starts(tmp_path: Path, case: str) -> None:
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_bytes(b'{"_ng_task_index": 0, "_ng_rollout_index": 0}\n')
    fake_gz = tmp_path / "r.jsonl.gz"
    fake_gz.write_bytes(rollouts.read_bytes())  # plain JSONL behind a .gz name
    missing = tmp_path / "does" / "not" / "exist"
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    args, message = {
        "enrich-capture-dir": (
            ["enrich", str(rollouts), "-c", str(missing)],
            f"capture dir {missing} does not",
        ),
        "clear-capture-dir": (
            ["clear", str(rollouts), "-c", str(missing)],
            f"capture dir {missing} does not",
        ),
        "fifo": (["enrich", str(fifo), "-c", str(tmp_path)], f"not a regular file: {fifo}"),
        "folder": (["clear", str(tmp_path), "-c", str(tmp_path)], f"not a regular file: {tmp_path}"),
        "runs-root": (["enrich-runs", str(missing)], f"runs root not found: {missing}"),
        "wait": (["wait", "1-0", "-c", str(missing)], f"capture dir {missing} does not"),
        "inspect": (["inspect", "1-0", "-c", str(missing)], f"capture dir {missing} does not"),
        "compact": (["compact", str(missing)], f"capture dir {missing} does not"),
        "runner": (["enrich", str(rollouts), "-c", str(missing), "--runner", "fibers"], "fibers"),
        "fake-gz": (["enrich", str(fake_gz), "-c", str(tmp_path)], f"{fake_gz} is not valid gzip data"),
        "s3-runs-root-without-credentials": (
            ["enrich-runs", "s3://no-such-bucket/runs"],
            "Unable to locate credentials",
        ),
        "serve-without-an-api": (["serve", "--runs-root", str(tmp_path)], "set PREFECT_API_URL"),
        "serve-without-a-runs-root": (["serve"], "ROLLOUT_CAPTURE_RUNS_ROOT"),
    }[case]
    home = tmp_path / "home"
    done = cold_cli(home, *args, without=("AWS_", "ROLLOUT_CAPTURE_RUNS_ROOT"))
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert no_server_started(home, done)


def test_a_temporary_server_is_announced_and_waited_for(tmp_path: Path) -> None:
    """No PREFECT_API_URL: the user is told what starts and how to avoid it; the work is done."""
    caps = tmp_path / "caps"
    CaptureStore(caps).record("0-0", ROW)
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_bytes(b'{"_ng_task_index": 0, "_ng_rollout_index": 0}\n')
    done = cold_cli(tmp_path / "home", "clear", str(rollouts), "-c", str(caps))
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith(
        "starting a temporary Prefect server; set PREFECT_API_URL to use your own\n"
    ), done.stderr
    assert not CaptureStore(caps).has_any("0-0")


def test_the_pre_flight_check_uses_the_credentials_block(prefect_api: str, s3: S3, tmp_path: Path) -> None:
    """With no AWS variables at all, the block alone lets the CLI check and read S3, as the flow does."""
    from prefect_aws import AwsClientParameters, AwsCredentials

    AwsCredentials(
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
        aws_client_parameters=AwsClientParameters(endpoint_url=s3.endpoint),
    ).save("cli-preflight", overwrite=True)
    CaptureStore(s3.url("caps"), storage_options=s3.storage_options).record("0-0", ROW)
    s3.fs().pipe_file(f"{s3.bucket}/r.jsonl", b'{"_ng_task_index": 0, "_ng_rollout_index": 0}\n')
    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    env |= {"PREFECT_API_URL": prefect_api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    run = ["enrich", s3.url("r.jsonl"), "-c", s3.url("caps")]
    done = run_cli(*run, "--credentials-block", "cli-preflight", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["calls"] == 1
    unknown = run_cli(*run, "--credentials-block", "no-such-block", env=env)
    assert unknown.returncode == 2 and "credentials block 'no-such-block'" in unknown.stderr, unknown.stderr
    block = ["-c", s3.url("caps"), "--credentials-block", "cli-preflight", "--json"]
    shown = run_cli("inspect", "0-0", *block, env=env)
    assert shown.returncode == 0 and json.loads(shown.stdout)["metrics"]["num_calls"] == 1, shown.stderr
    waited = run_cli("wait", "0-0", *block, env=env)
    assert waited.returncode == 0 and json.loads(waited.stdout)["quiescent"], waited.stderr


def test_help_is_plain_wrapped_to_the_terminal_and_keeps_option_names_whole() -> None:
    env = {**os.environ, "COLUMNS": "60"}
    for command in ((), ("enrich",), ("enrich-runs",), ("report",), ("export",)):
        done = run_cli(*command, "--help", env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        text = done.stdout
        assert "``" not in text and "\u2026" not in text  # no reST backticks, nothing cut with an ellipsis
        # Only an option's own names may pass the width (they are never cut); text wraps.
        assert all(len(line) <= 60 or line.lstrip().startswith("-") for line in text.splitlines())
        if command == ("enrich",):
            for name in ("--capture-dir", "--storage-options", "--max-failed-share", "--credentials-block"):
                assert name in text
    wide = run_cli("enrich", "--help", env={**os.environ, "COLUMNS": "160"}, timeout=60).stdout
    assert max(len(line) for line in wide.splitlines()) > 60  # wider terminal, wider text


@pytest.mark.parametrize(
    "args",
    [
        ["enrich", "{rollouts}", "--capture-dir", CREDENTIALED],
        ["enrich", CREDENTIALED.replace("/x", "/r.jsonl"), "--capture-dir", "{tmp}"],
        ["enrich", "{rollouts}", "--capture-dir", "{tmp}", "--output", CREDENTIALED + ".jsonl"],
        ["enrich-runs", CREDENTIALED],
        ["clear", "{rollouts}", "--capture-dir", CREDENTIALED],
        ["wait", "1-0", "--capture-dir", CREDENTIALED],
        ["inspect", "1-0", "--capture-dir", CREDENTIALED],
    ],
)
def test_credentials_in_a_url_exit_2_and_are_never_echoed(args: list[str], tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from rollout_capture.cli.app import app

    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text('{"_ng_rollout_id": "1-0"}\n')
    given = [a.replace("{rollouts}", str(rollouts)).replace("{tmp}", str(tmp_path)) for a in args]
    done = CliRunner().invoke(app, given)
    refused_unechoed(done.exit_code, done.output)
    assert "credentials in the URL are not allowed; use storage options / a credentials block" in done.output
    assert "(s3://bucket)" in done.output


@pytest.mark.parametrize(
    "options",
    [
        {"AWS_SECRET_ACCESS_KEY": URL_SECRET},
        {"client_kwargs": {"headers": {"Authorization": f"Bearer {URL_SECRET}"}}},
        {"client_kwargs": {"headers": [{"API-KEY": URL_SECRET}]}},
    ],
)
def test_secret_storage_options_in_any_case_and_depth_exit_2_unechoed(
    options: dict[str, Any], tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from rollout_capture.cli.app import app

    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text('{"_ng_rollout_id": "1-0"}\n')
    args = ["--capture-dir", str(tmp_path), "--storage-options", json.dumps(options)]
    done = CliRunner().invoke(app, ["enrich", str(rollouts), *args])
    refused_unechoed(done.exit_code, done.output)
    assert "looks like a secret" in done.output


def test_finish_tells_the_server_without_a_warning(prefect_api: str, tmp_path: Path) -> None:
    """The event is sent before the worker stops: no "EventsWorker - Still processing items"."""
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "rollouts.jsonl").write_bytes(b"")
    done = run_cli("finish", str(run), api=prefect_api)
    assert done.returncode == 0 and "the server was told" in done.stdout, done.stderr
    assert (run / "_SUCCESS").exists()
    assert "Still processing" not in done.stderr and "WARNING" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    "endpoint",
    [
        f"http://127.0.0.1:4318/v1/traces?api_key={URL_SECRET}",
        f"http://AKIAEXAMPLE:{URL_SECRET}@127.0.0.1:4318",
    ],
)
@pytest.mark.parametrize("command", ["enrich", "export"])
def test_credentials_in_an_otlp_endpoint_exit_2_and_are_never_echoed(
    endpoint: str, command: str, tmp_path: Path
) -> None:
    """In its query (``?api_key=``) or its userinfo: refused before a flow could record it."""
    from typer.testing import CliRunner

    from rollout_capture.cli.app import app

    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text('{"_ng_rollout_id": "1-0"}\n')
    args = [command, str(rollouts), "--otlp", endpoint]
    done = CliRunner().invoke(app, args + (["--capture-dir", str(tmp_path)] if command == "enrich" else []))
    refused_unechoed(done.exit_code, done.output)
    assert "OTLP endpoint: credentials in the URL are not allowed" in done.output
    assert "(http://127.0.0.1:4318)" in done.output
    assert "--otlp-header" in done.output and "ROLLOUT_CAPTURE_OTLP_HEADERS" in done.output  # what to use
