"""The command line, as a user runs it: real processes, exit codes, messages naming the input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import CaptureStore

from .conftest import S3, SAMPLE

ROW = {
    "model_call_id": "c",
    "dialect": "chat",
    "status_code": 200,
    "latency_ms": 12.5,
    "response": {"model": "m"},
}


def cli(*args: str, api: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    if api:
        env["PREFECT_API_URL"] = api
    return subprocess.run(
        [sys.executable, "-m", "rollout_capture.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_enrich_the_sample(prefect_api: str, tmp_path: Path) -> None:
    out = tmp_path / "sample.enriched.jsonl"
    captures = ["--capture-dir", str(SAMPLE / "captures")]
    done = cli("enrich", str(SAMPLE / "rollouts.jsonl"), *captures, "--output", str(out), api=prefect_api)
    assert done.returncode == 0, done.stderr
    table = dict(re.split(r"\s+(?=\S+$)", line.strip(), maxsplit=1) for line in done.stdout.splitlines()[1:])
    assert table["rollouts enriched"] == "10" and table["lines passed through"] == "1"
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in done.stdout.splitlines())
    assert rows["gap model_call_capture_incomplete"] == "1 (first: 6-0)"  # which rollouts, named
    assert rows["failed calls"] == "0 (0.0%)" and rows["calls by status"] == "2xx 14"
    assert rows["latency p50 / p90 / p99"] == "2130 / 3294 / 3775 ms"  # whole ms
    assert rows["TTFT p50 / p90 / p99"] == "336 / 980 / 1016 ms"
    assert rows["model gpt-4.1-2025-04-14"] == "3 call(s) (0 failed), 2,635 tokens"
    assert rows["orphan captures"] == "0"
    assert rows["report"] == str(tmp_path / "sample.enriched.report.html")
    assert (tmp_path / "sample.enriched.report.html").is_file()
    assert done.stdout.splitlines()[0].split() == ["output", str(out)]
    assert "rollouts.jsonl:11: not JSON" in done.stderr  # the placeholder row, named
    assert "━" not in done.stderr  # no progress bar when not at a terminal
    assert len(out.read_bytes().splitlines()) == len((SAMPLE / "rollouts.jsonl").read_bytes().splitlines())


def test_json_summaries(prefect_api: str, tmp_path: Path) -> None:
    """``--json``: one machine-readable summary on stdout, for success and failure alike."""
    out = tmp_path / "sample.enriched.jsonl"
    captures = ["--capture-dir", str(SAMPLE / "captures")]
    done = cli(
        "enrich", str(SAMPLE / "rollouts.jsonl"), *captures, "--output", str(out), "--json", api=prefect_api
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["ok"] and summary["output"] == str(out) and summary["stats"]["rollouts"] == 10
    assert summary["stats"]["gaps"]["model_call_capture_incomplete"] == 1
    assert [p["line"] for p in summary["stats"]["problems"]] == [11]
    evidence = summary["evidence"]
    assert evidence["failed_calls"] == 0 and evidence["calls_by_status_class"] == {"2xx": 14}
    assert evidence["latency_ms"] == {"p50": 2130, "p90": 3294, "p99": 3775}
    assert evidence["gap_examples"]["model_call_capture_incomplete"] == ["6-0"]
    assert evidence["orphan_captures"] == 0 and summary["report"].endswith("sample.enriched.report.html")

    shown = json.loads(cli("inspect", "0-0", *captures, "--json").stdout)
    assert shown["rollout_id"] == "0-0" and shown["metrics"]["num_calls"] == len(shown["calls"]) > 0
    waited = json.loads(cli("wait", "0-0", *captures, "--json").stdout)
    assert waited == {"ok": True, "rollout_id": "0-0", "quiescent": True, "timeout_s": 10.0}

    failed = cli("enrich", str(tmp_path / "absent.jsonl"), *captures, "--json")
    assert failed.returncode == 2 and json.loads(failed.stdout) == {
        "ok": False,
        "exit_code": 2,
        "error": f"rollouts file not found: {tmp_path / 'absent.jsonl'}",
    }


def test_version() -> None:
    from importlib.metadata import version

    done = cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"rollout-capture {version('rollout-capture')}"


def test_a_mistyped_capture_dir_exits_2_unless_empty_is_allowed(prefect_api: str, tmp_path: Path) -> None:
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_bytes(b'{"_ng_task_index": 0, "_ng_rollout_index": 0}\n')
    wrong = tmp_path / "nonexistent" / "dir"
    done = cli("enrich", str(rollouts), "--capture-dir", str(wrong), api=prefect_api)
    assert done.returncode == 2 and f"error: capture dir {wrong} does not exist" in done.stderr
    assert not (tmp_path / "r.enriched.jsonl").exists()
    allowed = cli(
        "enrich", str(rollouts), "--capture-dir", str(wrong), "--allow-empty", "--json", api=prefect_api
    )
    assert allowed.returncode == 0 and json.loads(allowed.stdout)["stats"]["gaps"] == {
        "model_call_capture_no_records": 1
    }


def test_a_progress_bar_on_a_terminal(prefect_api: str, tmp_path: Path) -> None:
    """At a TTY the enrichment shows a bar (rich); piped, it stays quiet (the test above)."""
    import pty

    primary, secondary = pty.openpty()
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": prefect_api}
    env["COLUMNS"] = "120"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout_capture.cli",
            "enrich",
            str(SAMPLE / "rollouts.jsonl"),
            "--capture-dir",
            str(SAMPLE / "captures"),
            "--output",
            str(tmp_path / "out.jsonl"),
        ],
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env=env,
    )
    os.close(secondary)
    seen = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the other side closed: the process is done
            break
        if not chunk:
            break
        seen += chunk
    os.close(primary)
    assert process.wait(120) == 0, seen.decode(errors="replace")[-2000:]
    text = seen.decode(errors="replace")
    assert "━" in text and "sample/rollouts.jsonl" in text  # the bar, labelled by its input
    assert "rollouts enriched" in text


def test_missing_input_exits_2_naming_it(prefect_api: str, tmp_path: Path) -> None:
    done = cli("enrich", str(tmp_path / "absent.jsonl"), "--capture-dir", str(tmp_path), api=prefect_api)
    assert done.returncode == 2
    assert done.stderr == f"error: rollouts file not found: {tmp_path / 'absent.jsonl'}\n"


def test_strict_names_file_and_line(prefect_api: str, tmp_path: Path) -> None:
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_bytes(b'{"_ng_task_index": 0, "_ng_rollout_index": 0}\n[1]\n')
    done = cli("enrich", str(rollouts), "--capture-dir", str(tmp_path), "--strict", api=prefect_api)
    assert done.returncode == 2 and f"error: {rollouts}:2: not a JSON object (list)" in done.stderr
    assert "Traceback" not in done.stderr  # the traceback is in the run's logs, for the UI


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
    done = cli("enrich", str(tmp_path / "r.jsonl"), "--capture-dir", str(tmp_path), *args)
    assert done.returncode == 2 and message in done.stderr


def test_wait_and_inspect(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    store.record("4-2", ROW)
    store.record("4-2", {**ROW, "model_call_id": "d", "status_code": 429, "error_category": "rate_limit"})
    assert cli("wait", "4-2", "--capture-dir", str(tmp_path), "--timeout", "5").returncode == 0
    with store.claim("4-2"):
        held = cli("wait", "4-2", "--capture-dir", str(tmp_path), "--timeout", "0.2")
    assert held.returncode == 1 and "still claimed" in held.stderr
    shown = cli("inspect", "4-2", "--capture-dir", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    rows = [line.split() for line in shown.stdout.splitlines()]
    assert rows[0][:4] == ["#", "model", "dialect", "status"]
    assert rows[2][:4] == ["1", "m", "chat", "429"] and rows[2][-1] == "rate_limit"
    assert cli("inspect", "../x", "--capture-dir", str(tmp_path)).returncode == 2


def test_clear(prefect_api: str, tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "caps")
    store.record("0-0", ROW)
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_bytes(orjson.dumps({"_ng_task_index": 0, "_ng_rollout_index": 0}) + b"\n")
    done = cli("clear", str(rollouts), "--capture-dir", str(tmp_path / "caps"), api=prefect_api)
    assert done.returncode == 0 and "cleared captures of 1 rollout id(s)" in done.stdout
    assert not store.has_any("0-0")


def cold_cli(home: Path, *args: str, without: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """The CLI as on a fresh machine: no PREFECT_API_URL, a Prefect home of its own, none of the
    variables whose names start with one of ``without``."""
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(home)}
    env = {key: value for key, value in env.items() if not key.startswith(("PREFECT_API_URL", *without))}
    env["AWS_EC2_METADATA_DISABLED"] = "true"  # no instance-metadata wait for credentials (not on EC2)
    return subprocess.run(
        [sys.executable, "-m", "rollout_capture.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


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


def test_allow_empty_lets_clear_wait_and_inspect_take_a_missing_dir(prefect_api: str, tmp_path: Path) -> None:
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_bytes(b'{"_ng_task_index": 0, "_ng_rollout_index": 0}\n')
    missing = str(tmp_path / "later")
    assert cli("clear", str(rollouts), "-c", missing, "--allow-empty", api=prefect_api).returncode == 0
    assert cli("wait", "0-0", "-c", missing, "--allow-empty").returncode == 0
    shown = cli("inspect", "0-0", "-c", missing, "--allow-empty", "--json")
    assert (
        shown.returncode == 0
        and json.loads(shown.stdout)["gaps"][0]["code"] == "model_call_capture_no_records"
    )


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


def test_demo_enriches_the_bundled_sample_from_any_folder(prefect_api: str, tmp_path: Path) -> None:
    out = tmp_path / "elsewhere" / "demo.jsonl"
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": prefect_api}
    done = subprocess.run(
        [sys.executable, "-m", "rollout_capture.cli", "demo", "--output", str(out), "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["rollouts"] == 10
    assert len(out.read_bytes().splitlines()) == len((SAMPLE / "rollouts.jsonl").read_bytes().splitlines())


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
    run = [sys.executable, "-m", "rollout_capture.cli", "enrich", s3.url("r.jsonl"), "-c", s3.url("caps")]
    done = subprocess.run(
        [*run, "--credentials-block", "cli-preflight", "--json"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["calls"] == 1
    unknown = subprocess.run(
        [*run, "--credentials-block", "no-such-block"], env=env, capture_output=True, text=True
    )
    assert unknown.returncode == 2 and "credentials block 'no-such-block'" in unknown.stderr, unknown.stderr
    block = ["-c", s3.url("caps"), "--credentials-block", "cli-preflight", "--json"]
    cli_module = [sys.executable, "-m", "rollout_capture.cli"]
    shown = subprocess.run([*cli_module, "inspect", "0-0", *block], env=env, capture_output=True, text=True)
    assert shown.returncode == 0 and json.loads(shown.stdout)["metrics"]["num_calls"] == 1, shown.stderr
    waited = subprocess.run([*cli_module, "wait", "0-0", *block], env=env, capture_output=True, text=True)
    assert waited.returncode == 0 and json.loads(waited.stdout)["quiescent"], waited.stderr


def test_the_proxy_names_its_extra_when_its_http_stack_is_missing(tmp_path: Path) -> None:
    """As installed without ``[proxy]`` (httptools absent): one line naming the extra, exit 2."""
    script = (
        "import sys\n"
        "sys.modules['httptools'] = None  # what an install without the extra looks like to find_spec\n"
        "from rollout_capture.cli import main\n"
        "sys.argv = ['rollout-capture', 'proxy', '--upstream', 'http://127.0.0.1:9', '-c', sys.argv[1]]\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr == "error: the proxy needs httptools: pip install 'rollout-capture[proxy]'\n"


def test_the_proxy_command_takes_the_capture_switch(
    scripted_upstream: tuple[str, Any], tmp_path: Path
) -> None:
    """``--no-enabled`` (or ROLLOUT_CAPTURE_ENABLED=false) needs no capture dir and writes nothing;
    capture on without a dir is refused naming the variable and the switch."""
    import httpx

    base = [sys.executable, "-m", "rollout_capture.cli", "proxy", "--upstream", scripted_upstream[0]]
    env = {key: value for key, value in os.environ.items() if not key.startswith("ROLLOUT_CAPTURE_")}
    refused = subprocess.run(base, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "ROLLOUT_CAPTURE_ENABLED=false" in refused.stderr, refused.stderr
    off = subprocess.Popen(
        [*base, "--port", "0", "--log-level", "warning"],
        env={**env, "ROLLOUT_CAPTURE_ENABLED": "false"},
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert off.stderr is not None
        line = off.stderr.readline()
        url = line.split(" on ", 1)[1].split(" ", 1)[0]
        answer = httpx.post(
            f"{url}/ng-rollout/off-1/v1/chat/completions",
            json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert answer.status_code == 200 and answer.json()["object"] == "chat.completion"
    finally:
        off.terminate()
        off.wait(30)
    assert list(tmp_path.iterdir()) == []


def _floats(value: Any) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        return [f for item in value.values() for f in _floats(item)]
    if isinstance(value, list):
        return [f for item in value for f in _floats(item)]
    return []


def test_json_numbers_are_rounded(tmp_path: Path) -> None:
    """A sum of latencies is printed 164.547, not 164.54699999999997."""
    store = CaptureStore(tmp_path / "caps")
    for latency in (0.1, 0.2, 164.247):
        store.record("1-0", {**ROW, "model_call_id": f"c{latency}", "latency_ms": latency})
    shown = json.loads(cli("inspect", "1-0", "--capture-dir", str(tmp_path / "caps"), "--json").stdout)
    assert shown["metrics"]["latency_total_ms"] == 164.547
    assert all(round(f, 3) == f for f in _floats(shown))


def test_help_is_plain_wrapped_to_the_terminal_and_keeps_option_names_whole() -> None:
    env = {**os.environ, "COLUMNS": "60"}
    for command in ((), ("enrich",), ("enrich-runs",), ("report",), ("export",)):
        done = subprocess.run(
            [sys.executable, "-m", "rollout_capture.cli", *command, "--help"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        text = done.stdout
        assert "``" not in text and "\u2026" not in text  # no reST backticks, nothing cut with an ellipsis
        # Only an option's own names may pass the width (they are never cut); text wraps.
        assert all(len(line) <= 60 or line.lstrip().startswith("-") for line in text.splitlines())
        if command == ("enrich",):
            for name in ("--capture-dir", "--storage-options", "--max-failed-share", "--credentials-block"):
                assert name in text
    wide = subprocess.run(
        [sys.executable, "-m", "rollout_capture.cli", "enrich", "--help"],
        env={**os.environ, "COLUMNS": "160"},
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert max(len(line) for line in wide.splitlines()) > 60  # wider terminal, wider text


def test_report_and_export_commands(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from .test_report import build_corpus

    _, enriched = build_corpus(tmp_path / "bad")
    done = cli("report", str(enriched), "-o", str(tmp_path / "r.html"))
    assert done.returncode == 0, done.stderr
    assert "100 call(s), 10 failed" in done.stdout
    html = (tmp_path / "r.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "upstream_error" in html
    beside = cli("report", str(enriched), "--json")
    assert json.loads(beside.stdout)["report"] == str(tmp_path / "bad" / "enriched.report.html")

    calls, rollouts = tmp_path / "calls.parquet", tmp_path / "rollouts.parquet"
    done = cli("export", str(enriched), "--calls", str(calls), "--rollouts", str(rollouts))
    assert done.returncode == 0, done.stderr
    assert pq.read_table(calls).num_rows == 100 and pq.read_table(rollouts).num_rows == 22
    assert f"wrote {calls}: 100 call row(s)" in done.stdout

    missing = cli("report", str(tmp_path / "absent.jsonl"))
    assert missing.returncode == 2 and "enriched file not found" in missing.stderr
    neither = cli("export", str(enriched))
    assert neither.returncode == 2 and "name --calls, --rollouts or both" in neither.stderr
    bad = tmp_path / "bad.jsonl"
    call = {"latency_total_ms": "slow"}
    bad.write_bytes(orjson.dumps({"ng_model_call_capture": {"rollout_id": "x", "calls": [call]}}) + b"\n")
    broken = cli("report", str(bad))
    assert broken.returncode == 2 and f"{bad}:1:" in broken.stderr and "latency_total_ms" in broken.stderr


def test_report_and_export_read_an_output_on_s3(s3: S3, tmp_path: Path) -> None:
    """Where S3 runs write their output: read from the URL, the report written here by default."""
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from .test_report import build_corpus

    _, enriched = build_corpus(tmp_path / "bad")
    s3.fs().put_file(str(enriched), f"{s3.bucket}/runs/r1/rollouts.enriched.jsonl")
    url, options = (
        s3.url("runs/r1/rollouts.enriched.jsonl"),
        ["--storage-options", json.dumps(s3.storage_options)],
    )
    here = tmp_path / "here"
    here.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "rollout_capture.cli", "report", url, *options, "--json"],
        cwd=here,
        env={**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["report"] == "rollouts.enriched.report.html"
    assert (here / "rollouts.enriched.report.html").read_text().startswith("<!DOCTYPE html>")
    calls = tmp_path / "calls.parquet"
    exported = cli("export", url, *options, "--calls", str(calls))
    assert exported.returncode == 0 and pq.read_table(calls).num_rows == 100, exported.stderr
    missing = cli("report", s3.url("runs/absent.jsonl"), *options)
    assert missing.returncode == 2 and "enriched file not found: s3://" in missing.stderr, missing.stderr


def test_a_bad_enriched_file_on_s3_is_named_by_its_url(s3: S3, tmp_path: Path) -> None:
    """``report`` and ``export`` read a URL through a temporary copy: an error names the URL."""
    pytest.importorskip("pyarrow")
    call = {"latency_total_ms": "slow"}
    line = orjson.dumps({"ng_model_call_capture": {"rollout_id": "x", "calls": [call]}}) + b"\n"
    s3.fs().pipe_file(f"{s3.bucket}/runs/r1/bad.enriched.jsonl", line)
    url, options = s3.url("runs/r1/bad.enriched.jsonl"), ["--storage-options", json.dumps(s3.storage_options)]
    report = ["report", url, "-o", str(tmp_path / "r.html")]
    for command in (report, ["export", url, "--calls", str(tmp_path / "c.parquet")]):
        broken = cli(*command, *options)
        assert broken.returncode == 2 and f"{url}:1:" in broken.stderr, broken.stderr
        assert "rollout-capture-" not in broken.stderr  # the temporary copy's folder


def test_finish_tells_the_server_without_a_warning(prefect_api: str, tmp_path: Path) -> None:
    """The event is sent before the worker stops: no "EventsWorker - Still processing items"."""
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "rollouts.jsonl").write_bytes(b"")
    done = cli("finish", str(run), api=prefect_api)
    assert done.returncode == 0 and "the server was told" in done.stdout, done.stderr
    assert (run / "_SUCCESS").exists()
    assert "Still processing" not in done.stderr and "WARNING" not in done.stderr, done.stderr


def test_enrich_runs_prints_each_runs_evidence(prefect_api: str, tmp_path: Path) -> None:
    from .test_evidence_wiring import write_run

    runs = tmp_path / "runs"
    write_run(runs / "bad", poor=True)
    (runs / "bad" / "_SUCCESS").touch()
    done = cli("enrich-runs", str(runs), "--max-failed-share", "0.05", api=prefect_api)
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("bad ")]
    cells = re.split(r"\s{2,}", line.strip())
    assert cells[:4] == ["bad", "enriched (Completed with failed calls)", "22", "100"]
    assert cells[4].startswith("10 (upstream_error 6, rate_limit 2")
    assert cells[5:] == ["13.6%", "500 / 900 / 990", "50 / 90 / 99", "1"]

    write_run(runs / "again", poor=True)
    (runs / "again" / "_SUCCESS").touch()
    dumped = json.loads(cli("enrich-runs", str(runs), "--json", api=prefect_api).stdout)
    evidence = dumped["outcomes"]["again"]["evidence"]
    assert evidence["failed_calls"] == 10 and evidence["calls_by_error_category"]["rate_limit"] == 2
    assert evidence["ttft_ms"] == {"p50": 50, "p90": 90, "p99": 99}
    assert evidence["orphan_examples"] == ["24-1"]


def test_the_proxy_options_come_from_the_settings_model() -> None:
    """Each default, bound and description of the proxy's options lives once, on ProxySettings;
    ``--help`` still shows them, and a value past a bound is refused naming the option."""
    import re

    from typer.testing import CliRunner

    from rollout_capture.cli import PROXY_OPTIONS, app
    from rollout_capture.producer.settings import ProxySettings

    runner = CliRunner()
    shown = " ".join(runner.invoke(app, ["proxy", "--help"]).output.split())  # unwrapped
    # Each option's text: from its name to the next option's name.
    texts = dict(
        re.findall(r"(?:^| )((?:-c, )?--[a-z-]+(?: / --[a-z-]+)?) (.*?)(?= (?:-c, )?--[a-z]|$)", shown)
    )
    for field, names in PROXY_OPTIONS.items():
        info = ProxySettings.model_fields[field]
        name = ", ".join(reversed(names)) if len(names) > 1 else names[0].replace("/", " / ")
        text = texts[name]
        assert (info.description or "") in text, (field, text)
        if not info.is_required() and info.default_factory is None and info.default is not None:
            default = "enabled" if info.default is True else str(info.default)
            assert f"default: {default}" in text, (field, text)
    assert "default: 300.0" in texts["--claim-ttl"] and "default: 16777216" in texts["--max-body-bytes"]
    zero = runner.invoke(app, ["proxy", "--upstream", "http://x", "--no-enabled", "--claim-ttl", "0"])
    assert zero.exit_code == 2 and "--claim-ttl" in zero.output, zero.output


URL_SECRET = "hunter2SECRET"
CREDENTIALED = f"s3://AKIAEXAMPLE:{URL_SECRET}@bucket/x"


def _refused_unechoed(code: int, output: str) -> None:
    assert code == 2, output
    assert URL_SECRET not in output and "AKIAEXAMPLE" not in output, output
    assert "starting a temporary Prefect server" not in output  # refused before any server


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

    from rollout_capture.cli import app

    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text('{"_ng_rollout_id": "1-0"}\n')
    given = [a.replace("{rollouts}", str(rollouts)).replace("{tmp}", str(tmp_path)) for a in args]
    done = CliRunner().invoke(app, given)
    _refused_unechoed(done.exit_code, done.output)
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

    from rollout_capture.cli import app

    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text('{"_ng_rollout_id": "1-0"}\n')
    args = ["--capture-dir", str(tmp_path), "--storage-options", json.dumps(options)]
    done = CliRunner().invoke(app, ["enrich", str(rollouts), *args])
    _refused_unechoed(done.exit_code, done.output)
    assert "looks like a secret" in done.output


@pytest.mark.parametrize("through", ["option", "environment"])
def test_the_proxy_refuses_to_start_on_a_capture_dir_with_credentials(through: str) -> None:
    """A real process: exit 2 before it listens, the secret on neither stream."""
    args = ["proxy", "--upstream", "http://127.0.0.1:9", "--port", "0"]
    env = {**os.environ}
    if through == "option":
        args += ["--capture-dir", CREDENTIALED]
    else:
        env["ROLLOUT_CAPTURE_DIR"] = CREDENTIALED
    done = subprocess.run(
        [sys.executable, "-m", "rollout_capture.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    _refused_unechoed(done.returncode, done.stdout + done.stderr)
    assert "credentials in the URL are not allowed" in done.stderr and "(s3://bucket)" in done.stderr
