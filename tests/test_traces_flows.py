"""The enrichment flows sending their output's traces (issue 30): ``otlp_endpoint`` and the
``Secret`` block of its headers, on a real Prefect API and a local OTLP receiver. The headers
arrive; the UI's recorded parameters hold only the block's name; a bad endpoint fails the run
before anything is enriched; a refused export leaves the output written and the run Failed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import SAMPLE
from .support.otlp_receiver import OtlpReceiver
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


def test_a_refused_export_leaves_the_output_written_and_the_run_failed(block: str, tmp_path: Path) -> None:
    from rollout_capture.flows import enrich_rollouts

    refusing = OtlpReceiver(refuse=400)
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
    assert "HTTP 400" in state.message and SECRET not in state.message


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
