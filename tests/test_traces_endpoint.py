"""The trace exporter against endpoints that misbehave (issue 35), each a scripted receiver on a
loopback port: a redirect is a failure naming it and is followed nowhere (least of all to another
host with the headers); a trickling endpoint cannot hold a request, nor the export, past its
deadline; a huge answer is never read whole, a 60 kB reason phrase never shown whole, a header
echoed back never shown; a request too large is split, and one huge rollout is cut to fit so it
never holds up the others. No test here measures time: each waits on what the client does."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture.merge import merge_model_call_capture_into_record

from .conftest import SAMPLE
from .support.otlp_receiver import (
    OtlpReceiver,
    Received,
    answer_raw,
    huge_body,
    other_loopback_host,
    redirect,
    rejecting,
    span_count,
    too_large_over,
    too_many_spans_over,
    trickle,
)
from .support.tls import PrivateCA, private_ca

pytest.importorskip("opentelemetry.sdk.trace")
from rollout_capture.traces.exporter import OtlpEndpointError, check_endpoint, export_traces

SECRET = "sk-endpoint-0123456789-never-shown"
HEADERS = {"x-api-key": SECRET}
SAMPLE_SPANS = 26


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled sample enriched with payloads (10 rollouts, 26 spans)."""
    out = tmp_path_factory.mktemp("endpoint") / "sample.enriched.jsonl"
    lines = []
    for line in (SAMPLE / "rollouts.jsonl").read_bytes().splitlines():
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            lines.append(line)
            continue
        merged = merge_model_call_capture_into_record(record, [SAMPLE / "captures"], include_payloads=True)
        lines.append(orjson.dumps(merged))
    out.write_bytes(b"\n".join(lines) + b"\n")
    return out


@pytest.fixture
def elsewhere() -> Iterator[OtlpReceiver]:
    """A receiver on another host: where a redirect points, and where nothing may ever arrive."""
    server = OtlpReceiver(host=other_loopback_host())
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def _serving(script: Any) -> Iterator[OtlpReceiver]:
    """An endpoint answering as ``script`` says, stopped after the block."""
    endpoint = OtlpReceiver(script=script)
    try:
        yield endpoint
    finally:
        endpoint.stop()


def _clean(message: str) -> None:
    """An error as a user sees it: one bounded line, no header value, no query."""
    assert SECRET not in message and "token=" not in message
    assert len(message) < 1200 and "\n" not in message


# ---------------------------------------------------------------------- redirects


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_at_the_probe_fails_naming_it_and_nothing_goes_elsewhere(
    sample: Path, elsewhere: OtlpReceiver, status: int
) -> None:
    with (
        _serving(redirect(status, f"{elsewhere.url}/login?token=abc")) as endpoint,
        pytest.raises(OtlpEndpointError) as caught,
    ):
        export_traces(sample, endpoint.url, headers=HEADERS)
    message = str(caught.value)
    assert f"answered HTTP {status}" in message and f"redirecting to {elsewhere.url}/login;" in message
    assert "not followed" in message and "nothing was sent" in message
    _clean(message)
    assert len(endpoint.received) == 1  # the probe, once
    assert elsewhere.received == []  # neither the request nor its headers went to the other host


def test_a_redirect_of_a_batch_fails_the_export_and_is_followed_nowhere(
    sample: Path, elsewhere: OtlpReceiver
) -> None:
    # the probe is answered 200, the batch 307
    with (
        _serving(redirect(307, f"{elsewhere.url}/v1/traces", after=1)) as endpoint,
        pytest.raises(OtlpEndpointError, match=r"answered HTTP 307 .*redirecting to") as caught,
    ):
        export_traces(sample, endpoint.url, headers=HEADERS)
    assert "0 spans had been accepted" in str(caught.value)
    _clean(str(caught.value))
    assert elsewhere.received == []


def test_the_flows_start_up_check_follows_no_redirect_either(elsewhere: OtlpReceiver) -> None:
    """``check_endpoint`` is what the flows and ``enrich --otlp`` ask first, with the block's headers."""
    with (
        _serving(redirect(302, f"{elsewhere.url}/v1/traces")) as endpoint,
        pytest.raises(OtlpEndpointError, match="HTTP 302"),
    ):
        check_endpoint(endpoint.url, HEADERS)
    assert elsewhere.received == []


# ---------------------------------------------------------------------- slow endpoints


def test_a_trickling_probe_answer_ends_at_its_deadline() -> None:
    """A byte of the status line every 50 ms, for ever: the probe gives up at its deadline, and
    hangs up (a socket timeout alone would wait for ever: every read gets its byte)."""
    with _serving(trickle(0.05)) as endpoint:
        with pytest.raises(OtlpEndpointError, match=r"gave no complete answer to an empty export within 1 s"):
            check_endpoint(endpoint.url, HEADERS, timeout_s=1)
        assert endpoint.hung_up.wait(60)


def test_a_trickling_answer_to_a_batch_is_sent_again_then_the_export_fails(sample: Path) -> None:
    """Each try of the batch ends at its 1 s bound and the batch is sent again while patience lasts
    (the probe has a bound of its own: a 1 s request bound never makes a healthy probe fail)."""
    with (
        _serving(trickle(0.05, after=1)) as endpoint,
        pytest.raises(OtlpEndpointError, match=r"gave no complete answer to a batch of \d+ spans") as caught,
    ):
        export_traces(sample, endpoint.url, headers=HEADERS, timeout_s=1, patience_s=4)
    assert "none within 1 s" in str(caught.value) and "after 0 spans" in str(caught.value)
    sent = re.search(r"sent (\d+) time\(s\)", str(caught.value))
    assert sent is not None and int(sent[1]) >= 2, str(caught.value)  # tried again
    assert len(endpoint.received) == 1 + int(sent[1])  # the probe, then each try of the batch


def _slow_probe(delay_s: float) -> Any:
    """The probe (the first request) answered 200 after ``delay_s``; batches at once."""

    def script(receiver: OtlpReceiver, index: int, request: Received, handler: Any) -> bool:
        if index > 0 or receiver.stopping.wait(delay_s):
            return False
        return answer_raw(receiver, handler, "200 OK", "application/x-protobuf", b"")

    return script


def test_the_probe_has_a_bound_of_its_own_not_a_batch_s(sample: Path) -> None:
    """A probe answered after 2 s passes though a batch's request is bounded to 1 s: the probe's
    bound is :data:`PROBE_TIMEOUT_S` (10 s), never the batches' ``timeout_s``."""
    with _serving(_slow_probe(2.0)) as endpoint:
        counts = export_traces(sample, endpoint.url, timeout_s=1)
    assert counts.spans == SAMPLE_SPANS == len(endpoint.spans())


def test_the_whole_export_ends_at_its_deadline(sample: Path) -> None:
    """Generous per-request and per-batch bounds; the export's own deadline ends it."""
    with (
        _serving(trickle(0.05, after=1)) as endpoint,
        pytest.raises(OtlpEndpointError, match="the export's deadline passed"),
    ):
        export_traces(sample, endpoint.url, timeout_s=600, patience_s=600, deadline_s=5)


# ---------------------------------------------------------------------- answers read bounded


def test_a_huge_error_answer_is_read_bounded(sample: Path) -> None:
    """A 400 with a 400 MB body: the client reads its first 64 kB and hangs up."""
    size = 400_000_000
    with _serving(huge_body(400, size, after=1)) as endpoint:
        with pytest.raises(
            OtlpEndpointError, match=r"refused a batch of \d+ spans \(HTTP 400 Bad Request"
        ) as caught:
            export_traces(sample, endpoint.url, headers=HEADERS)
        assert endpoint.hung_up.wait(120)
        assert endpoint.sent_bytes < size // 10
    _clean(str(caught.value))


def test_a_huge_answer_to_an_accepted_batch_is_not_read_whole(sample: Path) -> None:
    size = 400_000_000
    with _serving(huge_body(200, size, after=1, reason="OK")) as endpoint:
        counts = export_traces(sample, endpoint.url)
        assert endpoint.hung_up.wait(120)
        assert endpoint.sent_bytes < size // 10
    assert counts.spans == SAMPLE_SPANS and counts.batches == 1


def test_a_60_kb_reason_phrase_is_shown_cut(sample: Path) -> None:
    with (
        _serving(huge_body(400, 10, after=1, reason="R" * 60_000)) as endpoint,
        pytest.raises(OtlpEndpointError, match=r"HTTP 400 R+…") as caught,
    ):
        export_traces(sample, endpoint.url)
    _clean(str(caught.value))


def _echoing(status: int) -> Any:
    """Every request answered ``status`` with a text body quoting the request's headers back."""

    def script(receiver: OtlpReceiver, index: int, request: Received, handler: Any) -> bool:
        body = f"denied: x-api-key was {request.headers.get('x-api-key')}".encode()
        return answer_raw(receiver, handler, f"{status} Nope", "text/plain", body)

    return script


def test_an_endpoint_quoting_the_key_back_never_gets_it_shown(sample: Path) -> None:
    with (
        _serving(_echoing(401)) as endpoint,
        pytest.raises(OtlpEndpointError, match="refused the credentials") as caught,
    ):
        export_traces(sample, endpoint.url, headers=HEADERS)
    assert "x-api-key was <hidden>" in str(caught.value)
    _clean(str(caught.value))


@pytest.mark.parametrize("rejected", [SAMPLE_SPANS, 3])
def test_spans_the_endpoint_rejects_in_an_accepted_batch_fail_the_export(sample: Path, rejected: int) -> None:
    """Every span rejected (OTLP's partial success, in a 200 answer) or some: the export fails
    once everything was sent, naming how many, what the endpoint said, and how many landed."""
    with (
        _serving(rejecting(rejected)) as endpoint,
        pytest.raises(OtlpEndpointError, match=f"rejected {rejected} of the {SAMPLE_SPANS} span") as caught,
    ):
        export_traces(sample, endpoint.url, headers=HEADERS)
    assert "(too old)" in str(caught.value) and f"{SAMPLE_SPANS - rejected} landed" in str(caught.value)
    _clean(str(caught.value))


def test_export_exits_1_when_the_endpoint_rejects_every_span(sample: Path) -> None:
    from typer.testing import CliRunner

    from rollout_capture.cli.app import app

    with _serving(rejecting(SAMPLE_SPANS)) as endpoint:
        done = CliRunner().invoke(app, ["export", str(sample), "--otlp", endpoint.url, "--json"])
    assert done.exit_code == 1, done.output
    assert f"rejected {SAMPLE_SPANS} of the {SAMPLE_SPANS} span(s)" in done.output


# ---------------------------------------------------------------------- requests too large


def test_a_request_the_endpoint_finds_too_large_is_split_until_it_passes(sample: Path) -> None:
    with _serving(too_large_over(12_000)) as endpoint:
        counts = export_traces(sample, endpoint.url)
    spans = endpoint.spans()  # those of the requests answered 200
    assert (
        len(spans) == counts.spans == SAMPLE_SPANS and len({bytes(s.span_id) for s in spans}) == SAMPLE_SPANS
    )
    assert counts.batches > 1 and endpoint.scripted  # some requests were refused 413, then split


def test_a_batch_of_two_spans_refused_as_too_large_is_sent_a_span_at_a_time(sample: Path) -> None:
    """The endpoint takes one span a request: each two-span batch is refused 413 once, then split
    in two that land; nothing fails and nothing is sent twice."""
    with _serving(too_many_spans_over(1)) as endpoint:
        counts = export_traces(sample, endpoint.url, batch_spans=2)
    spans = endpoint.spans()
    assert (
        len(spans) == counts.spans == SAMPLE_SPANS and len({bytes(s.span_id) for s in spans}) == SAMPLE_SPANS
    )
    refused = [span_count(endpoint.received[i].body) for i in sorted(endpoint.scripted)]
    assert refused and set(refused) == {2}  # batches of two, each refused whole once...
    assert counts.batches == SAMPLE_SPANS  # ...and sent a span at a time


def test_one_huge_rollout_is_cut_to_fit_and_never_holds_up_the_others(sample: Path, tmp_path: Path) -> None:
    """A rollout whose calls carry 12 MB of context each, between the sample's rollouts, against an
    endpoint taking 8 MiB a request (as a collector does): every rollout lands, the huge one's
    calls cut and marked; the export does not blame the endpoint."""
    lines = sample.read_bytes().splitlines()
    giant = next(orjson.loads(line) for line in lines if b'"rollout_id":"1-0"' in line)
    giant["ng_model_call_capture"]["rollout_id"] = "giant"
    for call in giant["ng_model_call_capture"]["calls"]:
        call["model_call_id"] = f"giant-{call['model_call_id']}"
        if isinstance(call.get("request"), dict):
            call["dialect"] = "chat"
            call["request"] = {
                "messages": [{"role": "user", "content": "x" * 12_000_000}, {"role": "user", "content": "?"}]
            }
    path = tmp_path / "with-a-giant.enriched.jsonl"
    path.write_bytes(b"\n".join([*lines[:4], orjson.dumps(giant), *lines[4:]]) + b"\n")
    with _serving(too_large_over(8 * 1024 * 1024)) as endpoint:
        counts = export_traces(path, endpoint.url, include_payloads=True)
    assert endpoint.scripted == set()  # no request was too large
    spans = endpoint.spans()
    expected = {
        orjson.loads(line)["ng_model_call_capture"]["rollout_id"]
        for line in lines
        if b"ng_model_call" in line
    }
    assert {s.name for s in spans if not s.parent_span_id} == {f"rollout {r}" for r in expected | {"giant"}}
    assert counts.rollouts == len(expected) + 1 and counts.calls_cut >= 1
    cut = [
        s
        for s in spans
        if any(a.key == "rollout_capture.call.payload_cut" and a.value.bool_value for a in s.attributes)
    ]
    assert len(cut) == counts.calls_cut
    sizes = {
        a.key: a.value.int_value for a in cut[0].attributes if a.key == "rollout_capture.call.payload_bytes"
    }
    assert sizes["rollout_capture.call.payload_bytes"] > 24_000_000


# ---------------------------------------------------------------------- the environment's proxy


def test_the_environment_s_proxy_carries_the_requests_and_no_proxy_bypasses_it(
    sample: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As OpenTelemetry's own exporter did (through requests): ``http_proxy`` is asked for the
    endpoint's whole URL, with the proxy's credentials; ``no_proxy`` names hosts it skips."""
    with _serving(None) as proxy:
        monkeypatch.setenv("http_proxy", proxy.url.replace("http://", "http://user:pa%3Ass@"))
        counts = export_traces(sample, "http://otlp.example.invalid:4318", headers=HEADERS)
        assert counts.spans == SAMPLE_SPANS == len(proxy.spans())
        assert {r.path for r in proxy.received} == {"http://otlp.example.invalid:4318/v1/traces"}
        assert {r.headers["host"] for r in proxy.received} == {"otlp.example.invalid:4318"}
        assert {r.headers["proxy-authorization"] for r in proxy.received} == {"Basic dXNlcjpwYTpzcw=="}
        monkeypatch.setenv("no_proxy", "otlp.example.invalid")
        with pytest.raises(OtlpEndpointError, match="unreachable"):
            export_traces(sample, "http://otlp.example.invalid:4318")
        assert len(proxy.received) == counts.batches + 1


def test_all_proxy_carries_the_requests_when_no_scheme_s_proxy_is_named(
    sample: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    with _serving(None) as proxy:
        monkeypatch.setenv("all_proxy", proxy.url)
        counts = export_traces(sample, "http://otlp.example.invalid:4318")
        assert counts.spans == SAMPLE_SPANS == len(proxy.spans())
        assert {r.path for r in proxy.received} == {"http://otlp.example.invalid:4318/v1/traces"}


def test_a_proxy_named_without_a_port_is_reached_on_80(sample: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``http_proxy=http://host``: port 80, as every client reads it (8080 is nobody's default)."""
    for name in ("all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    host = other_loopback_host()
    try:
        proxy = OtlpReceiver(host=host, port=80)
    except OSError as exc:  # not allowed to bind port 80 here, or taken
        pytest.skip(f"port 80 on {host}: {exc}")
    try:
        monkeypatch.setenv("http_proxy", f"http://{host}")
        counts = export_traces(sample, "http://otlp.example.invalid:4318")
        assert counts.spans == SAMPLE_SPANS == len(proxy.spans())
    finally:
        proxy.stop()


# ---------------------------------------------------------------------- TLS and kept-alive connections


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> PrivateCA:
    return private_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def no_tls_settings(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No proxy, no CA bundle, no OpenTelemetry TLS variable from the machine."""
    for name in (
        *("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"),
        *("SSL_CERT_FILE", "SSL_CERT_DIR"),
        *(f"OTEL_EXPORTER_OTLP_{kind}{what}" for kind in ("", "TRACES_") for what in _TLS_WHAT),
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


_TLS_WHAT = ("CERTIFICATE", "CLIENT_CERTIFICATE", "CLIENT_KEY")


def test_an_endpoint_with_a_private_ca_is_trusted_as_otel_exporter_otlp_certificate_says(
    sample: Path, ca: PrivateCA, no_tls_settings: pytest.MonkeyPatch
) -> None:
    endpoint = OtlpReceiver(tls=ca.server_context())
    try:
        with pytest.raises(
            OtlpEndpointError, match=r"unreachable \(TLS failed \(SSLCertVerificationError\)\)"
        ):
            check_endpoint(endpoint.url)  # a CA nobody trusts: refused, naming why
        no_tls_settings.setenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", str(ca.ca))
        counts = export_traces(sample, endpoint.url, headers=HEADERS)
        assert counts.spans == SAMPLE_SPANS == len(endpoint.spans())
        assert {r.headers["x-api-key"] for r in endpoint.received} == {SECRET}
    finally:
        endpoint.stop()


def test_a_collector_asking_for_a_client_certificate_gets_the_one_the_variables_name(
    sample: Path, ca: PrivateCA, no_tls_settings: pytest.MonkeyPatch
) -> None:
    """Mutual TLS: OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE and _CLIENT_KEY; a file that is not there
    is named before anything is sent."""
    endpoint = OtlpReceiver(tls=ca.server_context(client_certificates=True))
    try:
        no_tls_settings.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(ca.ca))
        with pytest.raises(OtlpEndpointError, match="unreachable"):
            check_endpoint(endpoint.url)  # no client certificate: the server hangs up
        no_tls_settings.setenv("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", str(ca.client_cert))
        no_tls_settings.setenv("OTEL_EXPORTER_OTLP_CLIENT_KEY", str(ca.client_key))
        counts = export_traces(sample, endpoint.url)
        assert counts.spans == SAMPLE_SPANS == len(endpoint.spans())
        no_tls_settings.setenv("OTEL_EXPORTER_OTLP_CLIENT_KEY", str(ca.client_key) + ".missing")
        with pytest.raises(OtlpEndpointError, match=r"OTEL_EXPORTER_OTLP_CLIENT_KEY names .*\.missing"):
            check_endpoint(endpoint.url)
    finally:
        endpoint.stop()


def test_an_https_proxy_is_spoken_to_over_tls(
    sample: Path, ca: PrivateCA, no_tls_settings: pytest.MonkeyPatch
) -> None:
    """``http_proxy=https://...``: TLS to the proxy (its certificate checked against SSL_CERT_FILE),
    the endpoint's whole URL asked of it inside."""
    proxy = OtlpReceiver(tls=ca.server_context())
    try:
        no_tls_settings.setenv("SSL_CERT_FILE", str(ca.ca))
        no_tls_settings.setenv("http_proxy", proxy.url)
        counts = export_traces(sample, "http://otlp.example.invalid:4318")
        assert counts.spans == SAMPLE_SPANS == len(proxy.spans())
        assert {r.path for r in proxy.received} == {"http://otlp.example.invalid:4318/v1/traces"}
    finally:
        proxy.stop()


def test_a_kept_alive_connection_the_server_closed_is_no_retry(sample: Path) -> None:
    """A server closing every connection after its answer without saying so (a keep-alive that ran
    out, as uvicorn's 5 s or a proxy's): each batch goes on a connection of its own at once, never
    a retry (with no patience at all, a retry would fail the export)."""
    endpoint = OtlpReceiver(close_after_answer=True)
    try:
        counts = export_traces(sample, endpoint.url, batch_spans=5, patience_s=0)
    finally:
        endpoint.stop()
    assert counts.batches == 6 and counts.spans == SAMPLE_SPANS == len(endpoint.spans())
    assert len(endpoint.received) == 1 + counts.batches  # the probe, then each batch once
