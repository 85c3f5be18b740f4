"""``follow``: a run followed while it runs (the ``follow_run`` flow), until it is finished and
published; Ctrl-C stops it cleanly after the round in hand, saying where it stood."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rollout_capture.cli.options import (
    AllowEmptyOpt,
    FlowTraces,
    JsonOpt,
    MaxFailedShareOpt,
    MaxGapShareOpt,
    Storage,
    storage_options,
    traces_options,
)
from rollout_capture.cli.output import Output, counts, percentiles, show
from rollout_capture.cli.prefect_env import credentials, flow_run, preflight

if TYPE_CHECKING:
    from rollout_capture.flows.follow import FollowSummary

STOPPED_EXIT = 130
"""The exit code of a follower stopped by Ctrl-C (or SIGTERM): 128 + SIGINT, as shells expect."""


@contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """Ctrl-C (SIGINT) and SIGTERM stop the follower after the round in hand; a second one stops
    the command at once (the signal's own way)."""
    from rollout_capture.flows.follow import STOP, stop_following

    STOP.clear()  # this command's follower starts unstopped
    previous: dict[int, Any] = {}

    def stop(signum: int, frame: FrameType | None) -> None:
        typer.echo("stopping after the round in hand (again to stop at once)", err=True)
        stop_following()
        for number, handler in previous.items():
            signal.signal(number, handler)

    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, stop)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


@storage_options(captures=False)
@traces_options
def follow(
    storage: Storage,
    run: Annotated[
        str,
        typer.Argument(help="Run folder (<runs_root>/<run>: rollouts.jsonl or rollouts.parts/, captures/)."),
    ],
    capture_dir: Annotated[
        str | None, typer.Option(help="Where the captures are; default the run's own captures/.")
    ] = None,
    include_payloads: Annotated[bool, typer.Option(help="Keep requests and responses in the calls.")] = False,
    quiescence_timeout: Annotated[
        float, typer.Option(min=0, help="Seconds a record waits for its calls still being written.")
    ] = 10.0,
    lease_s: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="Seconds the run's lease holds unrenewed (how soon a killed follower's run is retaken).",
        ),
    ] = 120.0,
    max_gap_share: MaxGapShareOpt = None,
    max_failed_share: MaxFailedShareOpt = None,
    allow_empty: AllowEmptyOpt = False,
    as_json: JsonOpt = False,
    *,
    traces: FlowTraces,
) -> None:
    """Follow RUN while it runs: each record enriched within seconds of landing, appended to
    RUN/rollouts.enriched.live.jsonl (object stores: RUN/rollouts.enriched.live/); once RUN has
    finished, it is published as enrich-runs publishes it, and the command exits 0. Ctrl-C stops it
    (exit 130), the lease given back; following again goes on where it stopped."""
    out = Output(json=as_json)
    with out.exits():
        parameters = traces.parameters()
        where = storage.at(run)
        if capture_dir:
            where.at(capture_dir)  # credentials in it refused before any server starts
        traces.probe(prefect_started=False)
        preflight(creates=[where])  # leases, live parts and _ENRICHED are created put-if-absent
        from rollout_capture.run_folders import run_folder

        resolved = credentials(where.credentials_block, prefect=False)
        run_folder(where.url, where.storage_options, credentials=resolved, needs="started")  # refused: exit 2
        traces.probe(prefect_started=True)
        from rollout_capture.flows.follow import follow_run

        with _stopped_by_signals():
            summary = flow_run(
                not as_json,
                lambda: follow_run(
                    where.url,
                    capture_dir=capture_dir,
                    include_payloads=include_payloads,
                    quiescence_timeout_s=quiescence_timeout,
                    lease_s=lease_s,
                    allow_empty=allow_empty,
                    max_gap_share=max_gap_share,
                    max_failed_share=max_failed_share,
                    **parameters,
                    **where.flow_parameters(),
                ),
            )
        out.result(lambda: summary.model_dump(mode="json"), text=lambda: _show(summary))
        if summary.status == "stopped":
            raise typer.Exit(STOPPED_EXIT)
        if summary.status in ("busy", "lost", "failed"):
            raise typer.Exit(1)


def _show(summary: FollowSummary) -> None:
    """What following came to: where it stood, and the published run's evidence."""
    typer.echo(summary.message, err=summary.status != "published")
    outcome = summary.outcome
    if summary.status != "published" or outcome is None:
        return
    evidence = outcome.evidence or {}
    rows = [
        ("output", outcome.output or "-"),
        ("report", outcome.report or "-"),
        ("live output", summary.live_output or "-"),
        (
            "lines live",
            f"{summary.live:,}"
            + (f" ({summary.resumed:,} by an earlier follower)" if summary.resumed else ""),
        ),
        (
            "enriched again at the end",
            f"{summary.late or 0:,}"
            + (f" (first: {', '.join(summary.late_examples)})" if summary.late else ""),
        ),
        ("rollouts", str(outcome.rollouts)),
        ("model calls", str(outcome.calls)),
        ("failed calls", f"{outcome.failed_calls} ({counts(evidence.get('calls_by_error_category') or {})})"),
        ("rollouts with any gap", f"{outcome.rollouts_with_gaps} ({100 * (outcome.gap_share or 0.0):.1f}%)"),
        ("latency p50 / p90 / p99", percentiles(evidence.get("latency_ms") or {}, "ms")),
        ("TTFT p50 / p90 / p99", percentiles(evidence.get("ttft_ms") or {}, "ms")),
        ("events sent mid-run", ", ".join(summary.live_events) or "-"),
    ]
    show(rows)
