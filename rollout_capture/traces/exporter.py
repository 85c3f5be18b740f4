"""Stream an enriched JSONL file to an OTLP/HTTP (protobuf) traces endpoint, in bounded batches.

The file is read line by line the way the Parquet export reads it
(:func:`rollout_capture.summary.iter_enriched`), each record mapped to its trace
(:func:`.spans.rollout_spans`) and the spans sent in batches of at most ``batch_spans`` spans
(or about ``batch_bytes`` of payload text), one batch on the wire while the next is built: memory
stays flat whatever the file's size. Before anything is sent the endpoint is probed with an
empty export request, so an unreachable endpoint, a wrong path or refused credentials fail at
once, naming the endpoint (never the headers), rather than after the first batch.
"""

from __future__ import annotations

import http.client
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from rollout_capture.secret_options import refuse_url_credentials
from rollout_capture.summary import EvidenceShapeError, attachment_of, iter_enriched, no_attachment_error
from rollout_capture.traces import require_otel
from rollout_capture.traces.spans import make_resource, rollout_spans

_MISSING: ImportError | None = None
try:
    import requests  # the OTLP/HTTP exporter's own HTTP client
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExportResult
except ImportError as exc:  # no [otel] extra: the module imports, export_traces raises TracesUnavailable
    _MISSING = exc

TRACES_PATH = "/v1/traces"
BATCH_SPANS = 2048
"""Spans a request carries at most (the SDK's batch processor sends 512; bigger costs fewer round trips)."""
BATCH_BYTES = 4 * 1024 * 1024
"""About this much attribute text a request carries at most (payloads make spans big)."""


class OtlpEndpointError(RuntimeError):
    """The endpoint cannot take traces: unreachable, not an OTLP receiver, credentials refused,
    or a batch it refused. The message names the endpoint, never the headers."""


class OtlpHeaders(Mapping[str, str]):
    """Request headers (an API key) that never show: their repr and str name the keys only."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, str] | None = None) -> None:
        self._values = dict(values or {})

    def __getitem__(self, key: str) -> str:
        return self._values[key]

    def __iter__(self) -> Any:
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
    """What an export sent."""

    rollouts: int
    calls: int
    spans: int
    batches: int
    lines_skipped: int
    """Lines that are not JSON objects, or records without an attachment."""


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of ``endpoint``: a base URL (``http://host:4318``) gets
    ``/v1/traces``; a URL with a path is taken as it is. Credentials in the URL are refused."""
    refuse_url_credentials(endpoint, where="--otlp")
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"--otlp: expected an http(s) URL of an OTLP/HTTP receiver, got {shown_endpoint(endpoint)}"
        )
    if parts.path in ("", "/"):
        parts = parts._replace(path=TRACES_PATH)
    return urlunsplit(parts)


def shown_endpoint(endpoint: str) -> str:
    """The endpoint as an error names it: scheme, host and path (no query, no userinfo)."""
    parts = urlsplit(endpoint)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", "")) or "(no URL)"


def check_endpoint(endpoint: str, headers: Mapping[str, str] | None = None, timeout_s: float = 5.0) -> None:
    """Raise :class:`OtlpEndpointError` unless ``endpoint`` accepts an (empty) OTLP export request.

    An empty ``ExportTraceServiceRequest`` is zero bytes of protobuf: a receiver answers it
    200 and stores nothing, so the probe sends no span.
    """
    url = traces_url(endpoint)
    shown = shown_endpoint(url)
    request = urllib.request.Request(
        url,
        data=b"",
        method="POST",
        headers={**(headers or {}), "Content-Type": "application/x-protobuf"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            status = int(answer.status)
    except urllib.error.HTTPError as exc:
        status = exc.code
        exc.close()
    except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, timeout, unresolved, not HTTP
        raise OtlpEndpointError(
            f"OTLP endpoint {shown} is unreachable ({type(exc).__name__}); nothing was sent"
        ) from None
    if status in (401, 403):
        raise OtlpEndpointError(
            f"OTLP endpoint {shown} refused the credentials (HTTP {status}); nothing was sent"
        )
    if status in (404, 405):
        raise OtlpEndpointError(
            f"OTLP endpoint {shown} has no OTLP/HTTP traces receiver there (HTTP {status}); "
            f"nothing was sent (the traces path is usually {TRACES_PATH})"
        )
    if not 200 <= status < 300:
        raise OtlpEndpointError(
            f"OTLP endpoint {shown} answered HTTP {status} to an empty export; nothing was sent"
        )


def _weight(span: ReadableSpan) -> int:
    """About how many bytes a span's text takes on the wire (its string attributes dominate)."""
    size = 200
    for value in (span.attributes or {}).values():
        size += len(value) if isinstance(value, str) else 16
    return size


TRANSIENT_STATUS = frozenset({429, 502, 503, 504})
"""Answers that mean "later" (Phoenix answers 503 while its ingestion queue is full)."""


class _Sender:
    """One batch on the wire while the next is built: a thread and a queue of one.

    A batch the endpoint pushes back (:data:`TRANSIENT_STATUS`, or no answer) is sent again
    with growing pauses for up to ``patience_s``: a receiver draining its queue slows the export
    down instead of failing it. Any other refusal fails at once.
    """

    def __init__(
        self, exporter: OTLPSpanExporter, shown: str, last: dict[str, int | None], patience_s: float
    ) -> None:
        self.exporter, self.shown, self.last, self.patience_s = exporter, shown, last, patience_s
        self.pending: queue.Queue[list[ReadableSpan] | None] = queue.Queue(maxsize=1)
        self.error: OtlpEndpointError | None = None
        self.sent_spans = self.sent_batches = self.retries = 0
        self.thread = threading.Thread(target=self._run, name="otlp-sender", daemon=True)
        self.thread.start()

    def _export(self, batch: list[ReadableSpan]) -> OtlpEndpointError | None:
        deadline = time.monotonic() + self.patience_s
        pause = 0.5
        while True:
            self.last["status"] = None
            if self.exporter.export(batch) is SpanExportResult.SUCCESS:
                return None
            status = self.last["status"]
            transient = status is None or status in TRANSIENT_STATUS
            if not transient or time.monotonic() + pause > deadline:
                answered = f"HTTP {status}" if status is not None else "no answer"
                waited = f" for {self.patience_s:g} s" if transient else ""
                return OtlpEndpointError(
                    f"OTLP endpoint {self.shown} refused a batch of {len(batch)} spans ({answered}{waited}) "
                    f"after {self.sent_spans} spans in {self.sent_batches} batches were accepted "
                    "(exporting again is safe: span ids are derived, so what landed is not doubled)"
                )
            self.retries += 1
            time.sleep(pause)
            pause = min(pause * 2, 10.0)

    def _run(self) -> None:
        while (batch := self.pending.get()) is not None:
            if self.error is not None:
                continue
            self.error = self._export(batch)
            if self.error is None:
                self.sent_spans += len(batch)
                self.sent_batches += 1

    def send(self, batch: list[ReadableSpan]) -> None:
        if self.error is not None:
            raise self.error
        self.pending.put(batch)

    def close(self) -> None:
        """Wait for the last batch; raise what the endpoint refused."""
        self.pending.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        """Stop after the batch on the wire (an error of our own is on its way up)."""
        self.error = self.error or OtlpEndpointError("export aborted")
        self.pending.put(None)
        self.thread.join()


def export_traces(
    path: str | Path,
    endpoint: str,
    *,
    headers: Mapping[str, str] | None = None,
    include_payloads: bool = False,
    project: str | None = None,
    batch_spans: int = BATCH_SPANS,
    batch_bytes: int = BATCH_BYTES,
    timeout_s: float = 30.0,
    compression: bool = False,
    patience_s: float = 300.0,
    progress: Callable[[TraceProgress], None] | None = None,
) -> TraceExportCounts:
    """Send every enriched rollout of the JSONL at ``path`` (a local file) to ``endpoint`` as one
    trace each; returns what was sent.

    ``headers`` go with every request (an API key header) and never appear in an error or a
    log. ``project`` names Phoenix's project (``openinference.project.name``). A batch pushed
    back (429, 502-504, no answer) is retried for up to ``patience_s``. ``progress`` is
    called after each batch the endpoint accepted. The endpoint is checked first
    (:func:`check_endpoint`): :class:`OtlpEndpointError` before anything is sent; a batch
    refused later raises it too, saying how much had landed. A malformed line raises
    :class:`EvidenceShapeError` naming file, line and field, as the Parquet export does.
    """
    require_otel(_MISSING)
    if batch_spans < 1 or batch_bytes < 1:
        raise ValueError("batch_spans and batch_bytes must be positive")
    url = traces_url(endpoint)
    hidden = OtlpHeaders(headers)
    check_endpoint(url, hidden, timeout_s=min(timeout_s, 10.0))
    resource = make_resource(project)
    fallback_ns = os.stat(path).st_mtime_ns
    session = requests.Session()
    last: dict[str, int | None] = {"status": None}

    def seen(answer: requests.Response, *args: Any, **kwargs: Any) -> None:
        last["status"] = answer.status_code  # the exporter says only "failed"; the sender needs why

    session.hooks["response"].append(seen)
    exporter = OTLPSpanExporter(
        endpoint=url,
        headers=dict(hidden),
        timeout=timeout_s,
        compression=Compression.Gzip if compression else Compression.NoCompression,
        session=session,
    )
    sender = _Sender(exporter, shown_endpoint(url), last, patience_s)
    batch: list[ReadableSpan] = []
    weight = rollouts = calls = spans = skipped = batches = 0
    try:
        for line, record in iter_enriched(path):
            try:
                attachment = attachment_of(record) if record is not None else None
                if record is None or attachment is None:
                    skipped += 1
                    continue
                made = rollout_spans(
                    record, include_payloads=include_payloads, resource=resource, fallback_time_ns=fallback_ns
                )
            except EvidenceShapeError as exc:
                raise EvidenceShapeError(f"{path}:{line}: {exc}") from None
            rollouts += 1
            calls += len(attachment["calls"])
            for span in made:
                batch.append(span)
                weight += _weight(span)
            if len(batch) >= batch_spans or weight >= batch_bytes:
                sender.send(batch)
                spans += len(batch)
                batches += 1
                batch, weight = [], 0
                if progress is not None:
                    progress(TraceProgress(rollouts, sender.sent_spans, sender.sent_batches))
        if not rollouts:
            raise no_attachment_error(path)
        if batch:
            sender.send(batch)
            spans += len(batch)
            batches += 1
    except BaseException:
        sender.abort()
        exporter.shutdown()  # type: ignore[no-untyped-call]
        raise
    sender.close()
    exporter.shutdown()  # type: ignore[no-untyped-call]
    if progress is not None:
        progress(TraceProgress(rollouts, sender.sent_spans, sender.sent_batches))
    return TraceExportCounts(
        rollouts=rollouts, calls=calls, spans=spans, batches=batches, lines_skipped=skipped
    )
