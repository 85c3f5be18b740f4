"""Stream an enriched JSONL file to an OTLP/HTTP (protobuf) traces endpoint, in bounded requests.

The file is read line by line the way the Parquet export reads it
(:func:`rollout_capture.summary.iter_enriched`), each record mapped to its trace
(:func:`.spans.weighed_spans`, its ids scoped to the project and the run: :mod:`.runs`) and the
spans sent in batches of at most ``batch_spans`` spans or about ``batch_bytes`` bytes, one batch on
the wire while the next is built: memory stays flat whatever the file's size. A rollout's spans
may go in several requests (spans, not rollouts, fill a batch), and each call's payloads are cut
to a budget (:mod:`.payloads`), so one huge rollout is sent like the others and never holds them up.

Before anything is sent the endpoint is probed with an empty export request, so an unreachable
endpoint, a wrong path, a redirect or refused credentials fail at once, naming the endpoint
(never the headers), rather than after the first batch. Every request is bounded whole by a
deadline and never follows a redirect (:mod:`.transport`).
"""

from __future__ import annotations

import gzip
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import orjson

from rollout_capture import __version__
from rollout_capture.secret_options import url_credentials
from rollout_capture.summary import EvidenceShapeError, attachment_of, iter_enriched, no_attachment_error
from rollout_capture.traces import require_otel
from rollout_capture.traces.ids import RunScope
from rollout_capture.traces.payloads import PAYLOAD_BUDGET
from rollout_capture.traces.runs import check_name, output_run
from rollout_capture.traces.spans import make_resource, weighed_spans
from rollout_capture.traces.transport import (
    MAX_ANSWER_BYTES,
    Answer,
    Connection,
    NoAnswer,
    TlsSettingsError,
    masked,
    one_line,
    shown_location,
)

_MISSING: ImportError | None = None
try:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
except ImportError as exc:  # no [otel] extra: the module imports, export_traces raises TracesUnavailable
    _MISSING = exc

TRACES_PATH = "/v1/traces"
BATCH_SPANS = 2048
"""Spans a request carries at most (the SDK's batch processor sends 512; bigger costs fewer round trips)."""
BATCH_BYTES = 4 * 1024 * 1024
"""About this many bytes a request carries at most (a span bigger alone goes alone)."""
MAX_REQUEST_BYTES = 16 * 1024 * 1024
"""A request's body at most once encoded: a batch past it is split in two before it is sent (the
OpenTelemetry Collector takes 20 MiB by default; the SDK drops batches over 64 MiB)."""
PROBE_TIMEOUT_S = 10.0
"""The endpoint probe's bound, answer included (an empty export is answered at once by a receiver):
its own, whatever a batch may take (``timeout_s``), within the export's ``deadline_s``."""
TRANSIENT_STATUS = frozenset({429, 502, 503, 504})
"""Answers that mean "later" (Phoenix answers 503 while its ingestion queue is full)."""
_CONTENT = {"Content-Type": "application/x-protobuf", "User-Agent": f"rollout-capture/{__version__}"}
_SAFE_AGAIN = "exporting again is safe: span ids are derived, so what landed is not doubled"


class OtlpEndpointError(RuntimeError):
    """The endpoint cannot take traces: unreachable, not an OTLP receiver, redirecting elsewhere,
    credentials refused, too slow, or a batch it refused. The message names the endpoint and what
    it answered, never the headers."""


class OtlpHeaders(Mapping[str, str]):
    """Request headers (an API key) that never show: their repr and str name the keys only."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, str] | None = None) -> None:
        self._values = dict(values or {})

    def __getitem__(self, key: str) -> str:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"OtlpHeaders({sorted(self._values)!r} values hidden)"

    __str__ = __repr__


@dataclass(frozen=True, slots=True)
class TraceProgress:
    """How far an export is, after each batch the endpoint accepted."""

    rollouts: int
    spans: int
    batches: int


@dataclass(frozen=True, slots=True)
class TraceExportCounts:
    """What an export sent, where, and what it had to cut."""

    rollouts: int
    calls: int
    spans: int
    batches: int
    lines_skipped: int
    """Lines that are not JSON objects, or records without an attachment."""
    project: str | None = None
    run: str = ""
    """What names the run (part of every trace id; on each root span as ``rollout_capture.run.name``)."""
    calls_cut: int = 0
    """Calls whose payloads were cut to the budget (``rollout_capture.call.payload_cut``)."""

    def sent(self, endpoint: str) -> str:
        """What was sent and where, as a summary says it: counts, endpoint, project, run, notes."""
        project = f"project {self.project}" if self.project else "the default project"
        return (
            f"{self.rollouts} rollout(s), {self.calls} call(s) sent as {self.spans} span(s) in "
            f"{self.batches} batch(es) to {shown_endpoint(traces_url(endpoint))} ({project}, run {self.run})"
            + "".join(f"; {note}" for note in self.notes())
        )

    def notes(self) -> list[str]:
        """What a summary should add to "sent ...": payloads cut."""
        out = []
        if self.calls_cut:
            out.append(f"payloads of {self.calls_cut} call(s) cut to fit (rollout_capture.call.payload_cut)")
        return out


URL_SECRET_ADVICE = (
    "send credentials as a header instead: --otlp-header 'Name: value', "
    "ROLLOUT_CAPTURE_OTLP_HEADERS='Name=value', or a Prefect Secret block (--otlp-headers-block, "
    "otlp_headers_block=)"
)


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of ``endpoint``: a base URL (``http://host:4318``) gets
    ``/v1/traces``; a URL with a path is taken as it is. Credentials in the URL are refused,
    pointing at the header options."""
    shown = url_credentials(endpoint)
    if shown is not None:
        raise ValueError(
            f"OTLP endpoint: credentials in the URL are not allowed ({shown}); {URL_SECRET_ADVICE}"
        )
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"OTLP endpoint: expected an http(s) URL of an OTLP/HTTP receiver, got {shown_endpoint(endpoint)}"
        )
    if parts.path in ("", "/"):
        parts = parts._replace(path=TRACES_PATH)
    return urlunsplit(parts)


def shown_endpoint(endpoint: str) -> str:
    """The endpoint as an error names it: scheme, host and path (no query, no userinfo)."""
    return shown_location(endpoint)


def _said(answer: Answer, headers: Mapping[str, str]) -> str:
    """What the endpoint said beside its status, one line: an OTLP error's message (a protobuf
    ``google.rpc.Status``), a JSON error's ``message``, or its text; header values masked."""
    text = ""
    if answer.content_type == "application/x-protobuf" and answer.body:
        try:
            from google.rpc.status_pb2 import Status  # type: ignore[import-untyped]

            text = Status.FromString(answer.body).message
        except Exception:  # not a Status: nothing worth showing
            text = ""
    elif answer.content_type == "application/json" and len(answer.body) < MAX_ANSWER_BYTES:
        try:
            value = orjson.loads(answer.body)
        except orjson.JSONDecodeError:
            value = None
        found = (
            value.get("message") or value.get("detail") or value.get("error")
            if isinstance(value, dict)
            else None
        )
        text = found if isinstance(found, str) else ""
    elif answer.content_type.startswith("text/"):
        text = answer.body[:2048].decode("utf-8", "replace")
    text = one_line(masked(text, headers))
    return f": {text}" if text else ""


def _redirect(shown: str, answer: Answer, headers: Mapping[str, str], then: str) -> OtlpEndpointError:
    where = masked(answer.location or "(no Location)", headers)
    return OtlpEndpointError(
        f"OTLP endpoint {shown} answered {answer.shown} redirecting to {where}; not followed (the "
        f"traces and their headers would go where you did not send them): if that is the "
        f"receiver, give it as the endpoint; {then}"
    )


def check_endpoint(endpoint: str, headers: Mapping[str, str] | None = None, timeout_s: float = 10.0) -> None:
    """Raise :class:`OtlpEndpointError` unless ``endpoint`` accepts an (empty) OTLP export request
    within ``timeout_s``, answer included.

    An empty ``ExportTraceServiceRequest`` is zero bytes of protobuf: a receiver answers it
    200 and stores nothing, so the probe sends no span.
    """
    url = traces_url(endpoint)
    shown, given = shown_endpoint(url), dict(headers or {})
    try:
        connection = Connection(url, {**given, **_CONTENT})
    except TlsSettingsError as exc:
        raise OtlpEndpointError(f"OTLP endpoint {shown}: {exc}; nothing was sent") from None
    try:
        answer = connection.post(b"", time.monotonic() + timeout_s)
    except NoAnswer as exc:
        if exc.timed_out:
            raise OtlpEndpointError(
                f"OTLP endpoint {shown} gave no complete answer to an empty export within {timeout_s:g} s; "
                "nothing was sent"
            ) from None
        raise OtlpEndpointError(f"OTLP endpoint {shown} is unreachable ({exc}); nothing was sent") from None
    finally:
        connection.close()
    status, said = answer.status, _said(answer, given)
    if 300 <= status < 400:
        raise _redirect(shown, answer, given, "nothing was sent")
    if status in (401, 403):
        raise OtlpEndpointError(
            f"OTLP endpoint {shown} refused the credentials ({answer.shown}{said}); nothing was sent"
        )
    if status in (404, 405):
        raise OtlpEndpointError(
            f"OTLP endpoint {shown} has no OTLP/HTTP traces receiver there ({answer.shown}{said}); "
            f"nothing was sent (the traces path is usually {TRACES_PATH})"
        )
    if not 200 <= status < 300:
        raise OtlpEndpointError(
            f"OTLP endpoint {shown} answered {answer.shown}{said} to an empty export; nothing was sent"
        )


@dataclass(frozen=True, slots=True)
class _Limits:
    """How long the sender waits, for what, and how big a request may be."""

    timeout_s: float
    patience_s: float
    deadline: float | None
    max_request_bytes: int
    compression: bool


class _Sender:
    """One batch on the wire while the next is built: a thread and a queue of one.

    A batch is encoded here, split in two while it is over ``max_request_bytes`` (or refused as
    too large, 413), and sent; one the endpoint pushes back (:data:`TRANSIENT_STATUS`, or no
    complete answer within ``timeout_s``) is sent again with growing pauses for up to
    ``patience_s``. A redirect or any other refusal fails at once.
    """

    def __init__(
        self, connection: Connection, shown: str, headers: Mapping[str, str], limits: _Limits
    ) -> None:
        self.connection, self.shown, self.headers, self.limits = connection, shown, headers, limits
        self.pending: queue.Queue[list[ReadableSpan] | None] = queue.Queue(maxsize=1)
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.sent_spans = self.sent_batches = self.retries = self.rejected = 0
        self.rejected_said = ""
        """What the first answer rejecting spans said (its partial success's message)."""
        self.thread = threading.Thread(target=self._run, name="otlp-sender", daemon=True)
        self.thread.start()

    def _encode(self, batch: list[ReadableSpan]) -> bytes:
        body: bytes = encode_spans(batch).SerializeToString()
        return gzip.compress(body, compresslevel=1) if self.limits.compression else body

    def _failure(self, batch: list[ReadableSpan], verb: str, detail: str) -> OtlpEndpointError:
        """``OTLP endpoint URL <verb> a batch of N spans (<detail>) after ...``: what happened to
        which batch, and how much had landed before it."""
        return OtlpEndpointError(
            f"OTLP endpoint {self.shown} {verb} a batch of {len(batch)} spans ({detail}) after "
            f"{self.sent_spans} spans in {self.sent_batches} batches were accepted ({_SAFE_AGAIN})"
        )

    def _deliver(self, batch: list[ReadableSpan]) -> None:
        """Send one batch whole (split when too large), retrying what means "later"."""
        body = self._encode(batch)
        if len(body) > self.limits.max_request_bytes and len(batch) > 1:
            self._deliver(batch[: len(batch) // 2])
            self._deliver(batch[len(batch) // 2 :])
            return
        answer = self._answer(batch, body)
        if answer.status == 413 and len(batch) > 1:
            self._deliver(batch[: len(batch) // 2])
            self._deliver(batch[len(batch) // 2 :])
            return
        if not 200 <= answer.status < 300:
            if 300 <= answer.status < 400:
                raise _redirect(
                    self.shown, answer, self.headers, f"{self.sent_spans} spans had been accepted"
                )
            said = _said(answer, self.headers)
            size = f"{len(body):,} bytes" + (", as too large: one span alone" if answer.status == 413 else "")
            raise self._failure(batch, "refused", f"{answer.shown}{said}; {size}")
        rejected, said = _rejected(answer)
        self.rejected += rejected
        if rejected and not self.rejected_said:
            self.rejected_said = one_line(masked(said, self.headers))
        self.sent_spans += len(batch)
        self.sent_batches += 1

    def _answer(self, batch: list[ReadableSpan], body: bytes) -> Answer:
        """The endpoint's answer to ``body``, sent again while it pushes back (within patience)."""
        limits = self.limits
        started = time.monotonic()
        patience_end = started + limits.patience_s
        pause, tries = 0.5, 0
        headers = {"Content-Encoding": "gzip"} if limits.compression else None
        while True:
            tries += 1
            deadline = time.monotonic() + limits.timeout_s
            if limits.deadline is not None:
                deadline = min(deadline, limits.deadline)
            try:
                answer = self.connection.post(body, deadline, headers)
                if answer.status not in TRANSIENT_STATUS:
                    return answer
                verb, problem, wait = "pushed back", answer.shown, answer.retry_after_s
            except NoAnswer as exc:
                verb, wait = "gave no complete answer to", None
                problem = f"none within {limits.timeout_s:g} s" if exc.timed_out else str(exc)
            now = time.monotonic()
            pause_s = min(wait if wait is not None else pause, 60.0)
            out_of_time = limits.deadline is not None and now + pause_s >= limits.deadline
            if now + pause_s > patience_end or out_of_time:
                over = "the export's deadline passed" if out_of_time else f"after {limits.patience_s:g} s"
                raise self._failure(batch, verb, f"{problem}; sent {tries} time(s), given up {over}")
            self.retries += 1
            if self.stopping.wait(pause_s):
                raise self._failure(batch, "was not sent", "the export stopped")
            pause = min(pause * 2, 10.0)

    def _run(self) -> None:
        while (batch := self.pending.get()) is not None:
            if self.error is not None:
                continue
            try:
                self._deliver(batch)
            except BaseException as exc:  # raised to the caller by send() or close()
                self.error = exc

    def send(self, batch: list[ReadableSpan]) -> None:
        if self.error is not None:
            raise self.error
        self.pending.put(batch)

    def close(self) -> None:
        """Wait for the last batch; raise what the endpoint refused."""
        self.pending.put(None)
        self.thread.join()
        self.connection.close()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        """Stop after the request on the wire (an error of our own is on its way up)."""
        self.error = self.error or OtlpEndpointError("export aborted")
        self.stopping.set()
        self.pending.put(None)
        self.thread.join()
        self.connection.close()


def _rejected(answer: Answer) -> tuple[int, str]:
    """Spans an accepted request's answer says were rejected (OTLP's partial success), and its
    message."""
    if answer.content_type != "application/x-protobuf" or not answer.body:
        return 0, ""
    try:
        decoded = ExportTraceServiceResponse.FromString(answer.body)
    except Exception:  # an answer that is no ExportTraceServiceResponse: nothing to count
        return 0, ""
    if not decoded.HasField("partial_success"):
        return 0, ""
    partial = decoded.partial_success
    return int(partial.rejected_spans), str(partial.error_message)


def _rejections(sender: _Sender) -> OtlpEndpointError:
    """Spans rejected in accepted answers, as the export's error: how many of all, what the
    endpoint said, how many landed."""
    said = sender.rejected_said or "no reason given"
    landed = max(sender.sent_spans - sender.rejected, 0)
    return OtlpEndpointError(
        f"OTLP endpoint {sender.shown} rejected {sender.rejected} of the {sender.sent_spans} span(s) "
        f"it was sent in {sender.sent_batches} batch(es) ({said}); {landed} landed ({_SAFE_AGAIN})"
    )


@dataclass(slots=True)
class _Batches:
    """The batch being built, handed to the sender when full, and the counts of what was sent."""

    sender: _Sender
    batch_spans: int
    batch_bytes: int
    progress: Callable[[TraceProgress], None] | None
    batch: list[ReadableSpan] = field(default_factory=list)
    weight: int = 0
    rollouts: int = 0
    calls: int = 0
    calls_cut: int = 0
    spans: int = 0
    skipped: int = 0
    batches: int = 0

    def add(self, made: list[tuple[ReadableSpan, int]], calls: int) -> None:
        """One rollout's spans (with their weights), each into the batch; a batch that would be
        too full goes on the wire."""
        self.rollouts += 1
        self.calls += calls
        for span, weight in made:
            if self.batch and (
                len(self.batch) >= self.batch_spans or self.weight + weight > self.batch_bytes
            ):
                self.flush()
            self.batch.append(span)
            self.weight += weight
            if (span.attributes or {}).get("rollout_capture.call.payload_cut"):
                self.calls_cut += 1

    def flush(self) -> None:
        """Send the batch being built and start the next."""
        self.sender.send(self.batch)
        self.spans += len(self.batch)
        self.batches += 1
        self.batch, self.weight = [], 0
        if self.progress is not None:
            self.progress(TraceProgress(self.rollouts, self.sender.sent_spans, self.sender.sent_batches))


@dataclass(frozen=True, slots=True)
class _Mapping:
    """How each record becomes spans: its scope, payloads and their budget, its resource."""

    scope: RunScope
    include_payloads: bool
    payload_budget: int
    resource: Resource
    fallback_ns: int


def _send_file(path: str | Path, out: _Batches, how: _Mapping) -> None:
    """Every record of the file into ``out``, line by line; a malformed line is named by file
    and line, a file without any attachment refused."""
    for line, record in iter_enriched(path):
        try:
            attachment = attachment_of(record) if record is not None else None
            if record is None or attachment is None:
                out.skipped += 1
                continue
            made = weighed_spans(
                record,
                include_payloads=how.include_payloads,
                scope=how.scope,
                payload_budget=how.payload_budget,
                resource=how.resource,
                fallback_time_ns=how.fallback_ns,
            )
        except EvidenceShapeError as exc:
            raise EvidenceShapeError(f"{path}:{line}: {exc}") from None
        out.add(made, len(attachment["calls"]))
    if not out.rollouts:
        raise no_attachment_error(path)
    if out.batch:
        out.flush()


def export_traces(
    path: str | Path,
    endpoint: str,
    *,
    headers: Mapping[str, str] | None = None,
    include_payloads: bool = False,
    project: str | None = None,
    run: str | None = None,
    batch_spans: int = BATCH_SPANS,
    batch_bytes: int = BATCH_BYTES,
    payload_budget: int = PAYLOAD_BUDGET,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    timeout_s: float = 30.0,
    compression: bool = False,
    patience_s: float = 300.0,
    deadline_s: float | None = None,
    progress: Callable[[TraceProgress], None] | None = None,
) -> TraceExportCounts:
    """Send every enriched rollout of the JSONL at ``path`` (a local file) to ``endpoint`` as one
    trace each; returns what was sent.

    ``headers`` go with every request (an API key header) and never appear in an error or a
    log. ``project`` names Phoenix's project (``openinference.project.name``); ``run`` names the
    run (default: ``path``'s absolute location, :func:`.runs.output_run`; callers exporting a
    copy pass the original's): both go into every trace id. Each request is bounded whole by
    ``timeout_s`` (the probe by :data:`PROBE_TIMEOUT_S`); a batch pushed back (429, 502-504, no
    complete answer) is retried for up to ``patience_s``; ``deadline_s`` bounds the whole export.
    Payloads (``include_payloads``) are cut to ``payload_budget`` bytes a call. ``progress`` is
    called after each batch is handed to the sender. The endpoint is checked first (:func:`check_endpoint`):
    :class:`OtlpEndpointError` before anything is sent; a batch refused later raises it too,
    saying how much had landed. A malformed line raises :class:`EvidenceShapeError` naming file,
    line and field, as the Parquet export does.
    """
    require_otel(_MISSING)
    if min(batch_spans, batch_bytes, payload_budget, max_request_bytes) < 1:
        raise ValueError("batch_spans, batch_bytes, payload_budget and max_request_bytes must be positive")
    started = time.monotonic()
    deadline = started + deadline_s if deadline_s is not None else None
    url = traces_url(endpoint)
    scope = RunScope(
        check_name(project, "OTLP project") or "", check_name(run, "OTLP run name") or output_run(str(path))
    )
    hidden = OtlpHeaders(headers)
    probe_s = PROBE_TIMEOUT_S if deadline_s is None else min(PROBE_TIMEOUT_S, deadline_s)
    check_endpoint(url, hidden, timeout_s=probe_s)
    how = _Mapping(scope, include_payloads, payload_budget, make_resource(project), os.stat(path).st_mtime_ns)
    limits = _Limits(timeout_s, patience_s, deadline, max_request_bytes, compression)
    sender = _Sender(Connection(url, {**dict(hidden), **_CONTENT}), shown_endpoint(url), hidden, limits)
    out = _Batches(sender, batch_spans, batch_bytes, progress)
    try:
        _send_file(path, out, how)
    except BaseException:
        sender.abort()
        raise
    sender.close()
    if progress is not None:
        progress(TraceProgress(out.rollouts, sender.sent_spans, sender.sent_batches))
    if sender.rejected:
        raise _rejections(sender)
    return TraceExportCounts(
        rollouts=out.rollouts,
        calls=out.calls,
        spans=out.spans,
        batches=sender.sent_batches,
        lines_skipped=out.skipped,
        project=project,
        run=scope.run,
        calls_cut=out.calls_cut,
    )
