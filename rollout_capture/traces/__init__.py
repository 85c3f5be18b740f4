"""Every enriched rollout as an OpenTelemetry trace (needs ``pip install 'rollout-capture[otel]'``).

:func:`~rollout_capture.traces.spans.rollout_spans` maps one record to its spans;
:func:`~rollout_capture.traces.exporter.export_traces` streams an enriched file to an OTLP/HTTP
endpoint. Only this package imports opentelemetry, and its modules still import without it
(every installed module imports with the core's dependencies alone): calling them then raises
:class:`TracesUnavailable`, naming the extra.
"""


class TracesUnavailable(RuntimeError):
    """The ``[otel]`` extra (opentelemetry-sdk, its OTLP/HTTP exporter) is not installed."""


OTEL_MISSING = "exporting traces needs OpenTelemetry: pip install 'rollout-capture[otel]'"


def require_otel(missing: ImportError | None) -> None:
    """Raise :class:`TracesUnavailable` when the module's opentelemetry import failed."""
    if missing is not None:
        raise TracesUnavailable(f"{OTEL_MISSING} ({missing})") from missing
