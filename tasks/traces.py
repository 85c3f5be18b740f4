"""The enriched output's traces, sent to an OTLP/HTTP endpoint once the output is written.

The endpoint's headers (an API key) come from a Prefect ``Secret`` block loaded here, where the
task runs: only the block's name is a parameter, so the UI never records a header value.
"""

from __future__ import annotations

from typing import Any, cast

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rollout_capture.filesystem import local_copy
from rollout_capture.location import Location, LocationLike
from rollout_capture.otlp_headers import HeaderError, headers_of_secret
from rollout_capture.tasks.credentials import credentials_for
from rollout_capture.tasks.naming import run_name
from rollout_capture.tasks.retry import storage_retries
from rollout_capture.traces.exporter import (
    OtlpHeaders,
    TraceExportCounts,
    check_endpoint,
    export_traces,
)
from rollout_capture.traces.runs import check_name, output_run


def headers_from_block(block: str | None) -> OtlpHeaders:
    """The headers held by the Prefect ``Secret`` block named ``block`` (none without a name).

    Loaded where it is used (the flow, its export task): only the name travels in parameters.
    """
    if not block:
        return OtlpHeaders()
    from prefect.blocks.system import Secret

    try:
        # _sync: this also runs inside async contexts, where load() would return a coroutine.
        secret = cast(Secret[Any], Secret.load(block, _sync=True))  # type: ignore[call-arg]
    except ValueError as exc:
        raise HeaderError(f"Secret block {block!r} not found ({type(exc).__name__})") from None
    return headers_of_secret(secret.get(), block)


def check_traces_endpoint(
    endpoint: str, headers_block: str | None, project: str | None = None, run: str | None = None
) -> None:
    """Fail fast, at a flow's start, when the endpoint would not take the traces (its check, with
    the block's headers): :class:`~rollout_capture.traces.exporter.OtlpEndpointError` naming it;
    a malformed project or run name: ``ValueError`` naming the parameter."""
    check_name(project, "otlp_project")
    check_name(run, "otlp_run_name")
    check_endpoint(endpoint, headers_from_block(headers_block))


@task(
    name="export_traces",
    task_run_name=run_name("export_traces {output}"),
    cache_policy=NO_CACHE,
    **storage_retries(),
)
def export_output_traces(
    output: LocationLike,
    endpoint: str,
    headers_block: str | None = None,
    include_payloads: bool = False,
    project: str | None = None,
    run: str | None = None,
) -> TraceExportCounts:
    """Send every rollout of the written ``output`` as a trace to ``endpoint`` (an output at a URL
    is read through a temporary local copy, as the CLI's ``export`` reads it), into Phoenix's
    ``project``, as the run ``run`` (default: the output's own location, never the copy's).

    Examples:
        ```python
        from rollout_capture.tasks.traces import export_output_traces

        # In a flow, after the output is written (the Secret block holds {"api_key": "..."}):
        # export_output_traces("out/sample.enriched.jsonl", "http://localhost:6006", "phoenix-key")
        print(export_output_traces.name)  # export_traces
        ```
    """
    where = Location.coerce(output)
    headers = headers_from_block(headers_block)
    with (
        credentials_for(where) as credentials,
        local_copy(where.url, where.storage_options, credentials=credentials) as path,
    ):
        counts = export_traces(
            path,
            endpoint,
            headers=headers,
            include_payloads=include_payloads,
            project=project,
            run=run or output_run(where.url),
        )
    get_run_logger().info("sent %s", counts.sent(endpoint))
    for note in counts.notes():
        get_run_logger().warning("traces of %s: %s", where, note)
    return counts
