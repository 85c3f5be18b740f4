"""``report`` and ``export``: an enriched file (on disk or at a URL) as an HTML page or Parquet tables."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from rollout_capture.cli.options import JsonOpt, Storage, storage_options
from rollout_capture.cli.output import InputError, Output
from rollout_capture.cli.prefect_env import check_file, credentials
from rollout_capture.filesystem import local_copy, local_path


@contextmanager
def _local_input(path: str, what: str, storage: Storage) -> Iterator[str]:
    """A local, regular file: a path as it is, a URL (an S3 run's output) copied to a temporary one."""
    local = local_path(path)
    if local is not None:
        if not os.path.exists(local):
            raise InputError(f"{what} not found: {local}")
        if not os.path.isfile(local):
            raise InputError(f"{what} is not a regular file: {local}")
        yield local
        return
    where = storage.at(path)
    resolved = credentials(where.credentials_block, prefect=True)
    check_file(where, resolved, what)
    with local_copy(where.url, where.storage_options, credentials=resolved) as copy:
        yield copy


@storage_options(captures=False)
def report(
    storage: Storage,
    enriched: Annotated[str, typer.Argument(help="Enriched rollouts JSONL: a path or fsspec URL.")],
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            help="Where the HTML goes; default <stem>.report.html beside it (here, for a URL).",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Write one self-contained HTML report of an enriched file: latency, TTFT, tokens, failed calls, gaps.

    The file has no script and loads nothing: open it offline, attach it, archive it.
    """
    out = Output(json=as_json)
    with out.exits():
        from rollout_capture.report import default_report_path, write_report
        from rollout_capture.summary import tokens_text

        with _local_input(enriched, "enriched file", storage) as path:
            beside = default_report_path(path)
            target = output or (beside if path == local_path(enriched) else os.path.basename(beside))
            summary = write_report(path, target)
        out.result(
            lambda: {"report": target, "rollouts": summary.rollouts, **summary.digest()},
            text=f"wrote {target}: {summary.rollouts} rollout(s), {summary.calls} call(s), "
            f"{summary.failed_calls} failed, {summary.rollouts_with_gaps} with gaps, "
            f"{tokens_text(summary.tokens_total, summary.tokens_total_unknown_calls)}",
        )


OtlpOpt = Annotated[
    str | None,
    typer.Option(
        "--otlp",
        metavar="URL",
        help="Send every rollout as a trace to this OTLP/HTTP endpoint (a base URL gets /v1/traces).",
    ),
]
OtlpHeaderOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--otlp-header",
        metavar="'NAME: VALUE'",
        help="A header for every OTLP request (an API key; repeatable; never echoed). "
        "ROLLOUT_CAPTURE_OTLP_HEADERS=Name=value,... keeps it out of ps.",
    ),
]


@storage_options(captures=False)
def export(
    storage: Storage,
    enriched: Annotated[str, typer.Argument(help="Enriched rollouts JSONL: a path or fsspec URL.")],
    calls: Annotated[
        str | None, typer.Option(help="Parquet file of the calls (one row per captured call).")
    ] = None,
    rollouts: Annotated[
        str | None, typer.Option(help="Parquet file of the rollouts (one row per enriched rollout).")
    ] = None,
    otlp: OtlpOpt = None,
    otlp_header: OtlpHeaderOpt = None,
    otlp_project: Annotated[
        str | None, typer.Option(help="The Phoenix project the traces go to (default: Phoenix's own).")
    ] = None,
    otlp_run_name: Annotated[
        str | None,
        typer.Option(
            metavar="NAME", help="Names the run in its trace ids (default: the enriched file's location)."
        ),
    ] = None,
    include_payloads: Annotated[
        bool, typer.Option(help="Send each call's request and response messages with its span.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Export an enriched file as Parquet tables of calls and rollouts (needs the export extra), or as
    OpenTelemetry traces to an OTLP/HTTP endpoint such as Phoenix (needs the otel extra).

    Schema and trace mapping: docs/export.md. Each Parquet file is written whole or not at all;
    the endpoint is checked before anything is sent.
    """
    out = Output(json=as_json)
    with out.exits():
        if calls is None and rollouts is None and otlp is None:
            raise InputError("name --calls, --rollouts or both (or --otlp URL)")
        if otlp is None and (otlp_header or otlp_project or otlp_run_name or include_payloads):
            raise InputError(
                "--otlp-header, --otlp-project, --otlp-run-name and --include-payloads go with --otlp URL"
            )
        run = _run_named(enriched, otlp_project, otlp_run_name) if otlp is not None else ""
        headers = _checked_endpoint(otlp, otlp_header or []) if otlp is not None else None
        counts = traces = None
        with _local_input(enriched, "enriched file", storage) as path:
            if calls is not None or rollouts is not None:
                counts = _tables(path, calls, rollouts)
            if otlp is not None:
                traces = _traces(path, otlp, headers, (otlp_project, run), include_payloads, as_json)

        def written() -> None:
            if counts is not None:
                for name, where, n in (("call", calls, counts.calls), ("rollout", rollouts, counts.rollouts)):
                    if where is not None:
                        typer.echo(f"wrote {where}: {n} {name} row(s)")
            if traces is not None:
                typer.echo(f"traces: {traces.sent(otlp or '')}")  # what the flows' summaries say
            skipped = counts.lines_skipped if counts is not None else traces.lines_skipped if traces else 0
            if skipped:
                typer.echo(
                    f"{skipped} line(s) without a capture attachment skipped "
                    "(not JSON and naming none, passed through by enrichment; or records without an id)",
                    err=True,
                )

        value: dict[str, Any] = {}
        if counts is not None:
            value = {
                "calls_file": calls,
                "rollouts_file": rollouts,
                "calls": counts.calls,
                "rollouts": counts.rollouts,
                "lines_skipped": counts.lines_skipped,
            }
        if traces is not None:
            value["traces"] = {
                "endpoint": _shown(otlp),
                "rollouts": traces.rollouts,
                "calls": traces.calls,
                "spans": traces.spans,
                "batches": traces.batches,
                "lines_skipped": traces.lines_skipped,
                "project": traces.project,
                "run": traces.run,
                "calls_cut": traces.calls_cut,
            }
        out.result(value, text=written)


def _tables(path: str, calls: str | None, rollouts: str | None) -> Any:
    """The Parquet export (refused as bad input without its extra)."""
    from rollout_capture.export import ExportUnavailable, export_tables

    try:
        return export_tables(path, calls, rollouts)
    except ExportUnavailable as exc:
        raise InputError(str(exc)) from None


def _shown(endpoint: str | None) -> str:
    from rollout_capture.traces.exporter import shown_endpoint, traces_url

    return shown_endpoint(traces_url(endpoint or ""))


def _run_named(enriched: str, project: str | None, run_name: str | None) -> str:
    """The run the traces are (docs/contract.md 13): ``--otlp-run-name``, else the enriched file's
    own location (a copy's never); names checked before anything is read or sent."""
    from rollout_capture.traces.runs import check_name, output_run

    try:
        check_name(project, "--otlp-project")
        return check_name(run_name, "--otlp-run-name") or output_run(enriched)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def _checked_endpoint(endpoint: str, cli_headers: list[str]) -> Mapping[str, str]:
    """The headers (the variable's, then ``--otlp-header``'s) once the extra is there and the
    endpoint took an empty export with them: every refusal is bad input, before anything is sent."""
    import importlib.util

    from rollout_capture.traces import OTEL_MISSING

    for module in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise InputError(OTEL_MISSING)
    from rollout_capture.otlp_headers import otlp_headers
    from rollout_capture.traces.exporter import OtlpEndpointError, check_endpoint

    headers = otlp_headers(cli_headers, os.environ)
    try:
        check_endpoint(endpoint, headers)
    except OtlpEndpointError as exc:
        raise InputError(str(exc)) from None
    return headers


def _traces(
    path: str,
    endpoint: str,
    headers: Mapping[str, str] | None,
    where: tuple[str | None, str],
    include_payloads: bool,
    quiet: bool,
) -> Any:
    """The trace export, with a progress bar on stderr when it is a terminal (and not ``--json``)."""
    import sys

    from rollout_capture.traces import TracesUnavailable
    from rollout_capture.traces.exporter import OtlpEndpointError, TraceProgress, export_traces

    def send(progress: Callable[[TraceProgress], None] | None) -> Any:
        try:
            return export_traces(
                path,
                endpoint,
                headers=headers,
                include_payloads=include_payloads,
                project=where[0],
                run=where[1],
                progress=progress,
            )
        except TracesUnavailable as exc:
            raise InputError(str(exc)) from None
        except OtlpEndpointError as exc:
            raise TracesNotSent(str(exc)) from None

    if quiet or not sys.stderr.isatty():
        return send(None)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(),
        BarColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(f"sending traces to {_shown(endpoint)}", total=None)

        def advance(done: TraceProgress) -> None:
            bar.update(
                task,
                description=f"{_shown(endpoint)}: {done.rollouts} rollout(s), "
                f"{done.spans} span(s) in {done.batches} batch(es) accepted",
            )

        return send(advance)


class TracesNotSent(RuntimeError):
    """The endpoint refused a batch after the check passed (exit 1: the work failed, not the input)."""
