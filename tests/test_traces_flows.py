"""The enrichment flows sending their output's traces (issues 30, 35): ``otlp_endpoint`` and the
``Secret`` block of its headers, on a real Prefect API and a local OTLP receiver. The headers
arrive; the UI's recorded parameters hold only the block's name; a bad endpoint fails the run
before anything is enriched; a refused export leaves the output written and the run Failed. Each
run is its own traces (named by its output, or as asked), a runs root's all in one project;
``enrich``, ``enrich-runs``, ``deploy`` and ``serve`` take the project and the run's name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import SAMPLE
from .support.otlp_receiver import OtlpReceiver, rejecting
from .support.prefect_api import artifacts, flow_run, logs, wait_for_logs

pytest.importorskip("opentelemetry.sdk.trace")

pytestmark = [pytest.mark.usefixtures("prefect_api"), pytest.mark.integration]

SECRET = "sk-flow-0123456789-never-recorded"
BLOCK = "otlp-test-headers"
SAMPLE_SPANS = 26
"""The bundled sample's trace: 10 rollouts, 14 calls, 2 agent invocations."""


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    server = OtlpReceiver()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def block() -> str:
    from prefect.blocks.system import Secret

    Secret(value={"api_key": SECRET}).save(BLOCK, overwrite=True)
    return BLOCK


def test_the_flow_sends_its_output_s_traces_with_the_block_s_headers(
    receiver: OtlpReceiver, block: str, tmp_path: Path
) -> None:
    from rollout_capture.flows import enrich_rollouts

    output = tmp_path / "sample.enriched.jsonl"
    state = enrich_rollouts(
        str(SAMPLE / "rollouts.jsonl"),
        str(SAMPLE / "captures"),
        output=str(output),
        otlp_endpoint=receiver.url,
        otlp_headers_block=block,
        return_state=True,
    )
    assert state.is_completed(), state.message
    summary = state.result()
    assert output.exists()
    assert len(receiver.spans()) == SAMPLE_SPANS
    assert summary.traces is not None and f"{SAMPLE_SPANS} span(s)" in summary.traces
    assert all(request.headers.get("api_key") == SECRET for request in receiver.received)
    assert {request.path for request in receiver.received} == {"/v1/traces"}
    run = flow_run(state.state_details.flow_run_id)
    assert run.parameters["otlp_headers_block"] == block
    assert run.parameters["otlp_endpoint"] == receiver.url
    assert SECRET not in json.dumps(run.parameters, default=str)
    wait_for_logs(run.id, "passed through")  # what reaches the API (warnings): never a header value
    assert not [line for line in logs(run.id) if SECRET in line]
    markdown = [a.data for a in artifacts(run.id) if a.type == "markdown"]
    assert any("- traces: 10 rollout(s), 14 call(s) sent as 26 span(s)" in str(m) for m in markdown)


def test_an_unreachable_endpoint_fails_the_run_before_any_enrichment(block: str, tmp_path: Path) -> None:
    from rollout_capture.flows import enrich_rollouts
    from rollout_capture.traces.exporter import OtlpEndpointError

    output = tmp_path / "sample.enriched.jsonl"
    with pytest.raises(OtlpEndpointError, match=r"127\.0\.0\.1:9/v1/traces is unreachable") as raised:
        enrich_rollouts(
            str(SAMPLE / "rollouts.jsonl"),
            str(SAMPLE / "captures"),
            output=str(output),
            otlp_endpoint="http://127.0.0.1:9",
            otlp_headers_block=block,
        )
    assert SECRET not in str(raised.value)
    assert not output.exists()


def test_a_missing_block_is_named(receiver: OtlpReceiver, tmp_path: Path) -> None:
    from rollout_capture.flows import enrich_rollouts

    with pytest.raises(ValueError, match="Secret block 'no-such-block' not found"):
        enrich_rollouts(
            str(SAMPLE / "rollouts.jsonl"),
            str(SAMPLE / "captures"),
            output=str(tmp_path / "out.jsonl"),
            otlp_endpoint=receiver.url,
            otlp_headers_block="no-such-block",
        )
    assert receiver.received == []


@pytest.mark.parametrize(
    ("answers", "said"),
    [
        ({"refuse": 400}, "HTTP 400"),  # the batch refused
        (
            {"script": rejecting(SAMPLE_SPANS)},
            f"rejected {SAMPLE_SPANS} of the {SAMPLE_SPANS} span(s)",
        ),  # 200s
    ],
)
def test_a_refused_export_leaves_the_output_written_and_the_run_failed(
    block: str, tmp_path: Path, answers: dict[str, Any], said: str
) -> None:
    """A batch refused, or every span rejected in 200 answers (OTLP's partial success): the run
    fails saying so, its output written."""
    from rollout_capture.flows import enrich_rollouts

    refusing = OtlpReceiver(**answers)
    try:
        output = tmp_path / "sample.enriched.jsonl"
        state = enrich_rollouts(
            str(SAMPLE / "rollouts.jsonl"),
            str(SAMPLE / "captures"),
            output=str(output),
            otlp_endpoint=refusing.url,
            otlp_headers_block=block,
            return_state=True,
        )
    finally:
        refusing.stop()
    assert state.is_failed()
    assert output.exists() and len(output.read_text().splitlines()) == 12
    assert state.message is not None and f"{refusing.url}/v1/traces" in state.message, state.message
    assert said in state.message and SECRET not in state.message


def test_the_scheduled_job_sends_each_run_s_traces(
    receiver: OtlpReceiver, block: str, tmp_path: Path
) -> None:
    from rollout_capture.flows import enrich_completed_runs

    runs = tmp_path / "runs"
    shutil.copytree(SAMPLE, runs / "r1")
    (runs / "r1" / "_SUCCESS").touch()
    state = enrich_completed_runs(
        str(runs), otlp_endpoint=receiver.url, otlp_headers_block=block, return_state=True
    )
    assert state.is_completed(), state.message
    assert state.result().enriched == ["r1"]
    assert len(receiver.spans()) == SAMPLE_SPANS
    assert all(request.headers.get("api_key") == SECRET for request in receiver.received)
    assert SECRET not in json.dumps(flow_run(state.state_details.flow_run_id).parameters, default=str)


def test_the_enrich_command_passes_the_endpoint_and_the_block_name(
    prefect_api: str, receiver: OtlpReceiver, block: str, tmp_path: Path
) -> None:
    from .support.cli import run_cli

    captures = ["--capture-dir", str(SAMPLE / "captures")]
    output = tmp_path / "out.jsonl"
    unreachable = run_cli(
        "enrich", str(SAMPLE / "rollouts.jsonl"), *captures, "--output", str(output),
        "--otlp", "http://127.0.0.1:9", "--otlp-headers-block", block, api=prefect_api,
    )  # fmt: skip
    assert unreachable.returncode == 2, unreachable.stderr
    assert "OTLP endpoint http://127.0.0.1:9/v1/traces is unreachable" in unreachable.stderr
    assert not output.exists() and SECRET not in unreachable.stderr + unreachable.stdout
    done = run_cli(
        "enrich", str(SAMPLE / "rollouts.jsonl"), *captures, "--output", str(output),
        "--otlp", receiver.url, "--otlp-headers-block", block, "--json", api=prefect_api,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["traces"].startswith("10 rollout(s), 14 call(s) sent as 26 span(s)")
    assert len(receiver.spans()) == SAMPLE_SPANS
    assert all(request.headers.get("api_key") == SECRET for request in receiver.received)
    assert SECRET not in done.stderr + done.stdout


def _roots(receiver: OtlpReceiver) -> list[dict[str, Any]]:
    """The root spans received, their attributes as a dict (strings and ints)."""
    roots = []
    for span in receiver.spans():
        if not span.parent_span_id:
            values = {a.key: a.value.string_value or a.value.int_value for a in span.attributes}
            roots.append({"trace_id": bytes(span.trace_id).hex(), **values})
    return roots


def test_each_run_of_a_root_is_its_own_trace_and_the_root_one_project(
    receiver: OtlpReceiver, tmp_path: Path
) -> None:
    """Two runs with the same rollout ids (copies of the sample): twenty traces, not ten; every
    run's root span names its run (its output's location); all in the runs root's project,
    which each run's summary names."""
    from rollout_capture.flows import enrich_completed_runs

    runs = tmp_path / "nightly-runs"
    for name in ("r1", "r2"):
        shutil.copytree(SAMPLE, runs / name)
        (runs / name / "_SUCCESS").touch()
    state = enrich_completed_runs(str(runs), otlp_endpoint=receiver.url, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    roots = _roots(receiver)
    assert len(roots) == 20 and len({root["trace_id"] for root in roots}) == 20
    outputs = {str(runs / name / "rollouts.enriched.jsonl") for name in ("r1", "r2")}
    assert {root["rollout_capture.run.name"] for root in roots} == outputs
    assert {(r["openinference.project.name"], r["service.name"]) for r in receiver.resources()} == {
        ("nightly-runs", "rollout-capture")
    }
    for name in ("r1", "r2"):
        traces = summary.outcomes[name].traces
        assert "(project nightly-runs, run " in traces and str(runs / name) in traces


def test_the_root_s_runs_can_be_named_and_put_in_a_project(receiver: OtlpReceiver, tmp_path: Path) -> None:
    from rollout_capture.flows import enrich_completed_runs

    runs = tmp_path / "runs"
    shutil.copytree(SAMPLE, runs / "r1")
    (runs / "r1" / "_SUCCESS").touch()
    state = enrich_completed_runs(
        str(runs),
        otlp_endpoint=receiver.url,
        otlp_project="team-evals",
        otlp_run_name="nightly",
        return_state=True,
    )
    assert state.is_completed(), state.message
    assert {root["rollout_capture.run.name"] for root in _roots(receiver)} == {"nightly/r1"}
    assert {r["openinference.project.name"] for r in receiver.resources()} == {"team-evals"}
    run = flow_run(state.state_details.flow_run_id)
    assert run.parameters["otlp_project"] == "team-evals" and run.parameters["otlp_run_name"] == "nightly"


def test_enrich_names_its_project_and_run(prefect_api: str, receiver: OtlpReceiver, tmp_path: Path) -> None:
    from .support.cli import run_cli

    output = tmp_path / "out.jsonl"
    done = run_cli(
        "enrich", str(SAMPLE / "rollouts.jsonl"), "--capture-dir", str(SAMPLE / "captures"),
        "--output", str(output), "--otlp", receiver.url, "--otlp-project", "p1", "--otlp-run-name",
        "exp-7", "--json", api=prefect_api,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "(project p1, run exp-7)" in json.loads(done.stdout)["traces"]
    assert {root["rollout_capture.run.name"] for root in _roots(receiver)} == {"exp-7"}
    assert {r["openinference.project.name"] for r in receiver.resources()} == {"p1"}


def test_enrich_with_a_refused_endpoint_says_one_line_and_starts_nothing(tmp_path: Path) -> None:
    """No block to load: the endpoint is asked before any Prefect server starts; exit 2 with one
    ``error:`` line, no Prefect ERROR line, no EventsWorker warning."""
    from .support.cli import cli_env, run_cli

    env = cli_env(PREFECT_HOME=str(tmp_path / "home"))
    env.pop("PREFECT_API_URL", None)
    done = run_cli(
        "enrich", str(SAMPLE / "rollouts.jsonl"), "--capture-dir", str(SAMPLE / "captures"),
        "--output", str(tmp_path / "out.jsonl"), "--otlp", "http://127.0.0.1:1", env=env,
    )  # fmt: skip
    assert done.returncode == 2
    refused = "OTLP endpoint http://127.0.0.1:1/v1/traces is unreachable (connection refused)"
    assert done.stderr.splitlines() == [f"error: {refused}; nothing was sent"]
    assert done.stdout == "" and not (tmp_path / "out.jsonl").exists()


def test_deploy_registers_the_schedule_s_traces_and_serve_checks_them(prefect_api: str, block: str) -> None:
    from prefect.client.orchestration import get_client

    from .support.cli import run_cli

    done = run_cli(
        "deploy", "--runs-root", "/data/traced-runs", "--name", "traced-runs", "--no-automation",
        "--otlp", "http://phoenix:6006", "--otlp-headers-block", block, "--otlp-project", "evals",
        "--otlp-run-name", "cluster-a", api=prefect_api,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with get_client(sync_client=True) as client:
        found = {d.name: d for d in client.read_deployments()}["traced-runs"]
    assert {k: v for k, v in found.parameters.items() if k.startswith("otlp")} == {
        "otlp_endpoint": "http://phoenix:6006",
        "otlp_headers_block": block,
        "otlp_project": "evals",
        "otlp_run_name": "cluster-a",
    }
    for command, args, says in (
        ("serve", ["--otlp-project", "evals"], "go with --otlp URL"),
        ("deploy", ["--otlp", f"http://h:1/?api_key={SECRET}"], "--otlp-header"),
        ("serve", ["--otlp", "http://h:1", "--otlp-run-name", "a\tb"], "control character"),
        (
            "deploy",
            ["--otlp", "http://h:1", "--otlp-headers-block", "no-such-block"],
            "'no-such-block' not found",
        ),
    ):
        refused = run_cli(command, "--runs-root", "/data/traced-runs", *args, api=prefect_api)
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr
        assert SECRET not in refused.stderr + refused.stdout
