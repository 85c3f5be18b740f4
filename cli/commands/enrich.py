"""``enrich``, ``demo`` and ``enrich-runs``: the enrichment flows from a terminal, and their summaries."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rollout_capture.cli.options import (
    AllowEmptyOpt,
    DaskAddressOpt,
    FlowTraces,
    JsonOpt,
    MaxFailedShareOpt,
    MaxGapShareOpt,
    RayAddressOpt,
    RunnerName,
    RunnerOpt,
    Storage,
    runner_available,
    storage_options,
    traces_options,
)
from rollout_capture.cli.output import InputError, Output, counts, percentiles, show
from rollout_capture.cli.prefect_env import flow_run, preflight, rollouts_and_captures
from rollout_capture.printable import printable

if TYPE_CHECKING:
    from rollout_capture.flows.enrich_runs import RunsSummary
    from rollout_capture.flows.report import EnrichSummary


def evidence_rows(evidence: Any) -> list[tuple[str, str]]:
    """What the summary table says of failed calls, latency, tokens, models, gaps and orphans."""
    from rollout_capture.summary import tokens_text

    digest = evidence.digest()
    rows = [
        ("failed calls", f"{evidence.failed_calls} ({100 * evidence.failed_share:.1f}%)"),
        ("calls by status", counts(digest["calls_by_status_class"])),
        ("calls by error", counts(digest["calls_by_error_category"])),
        ("latency p50 / p90 / p99", percentiles(digest["latency_ms"], "ms")),
        ("TTFT p50 / p90 / p99", percentiles(digest["ttft_ms"], "ms")),
        ("capture hold p50 / p99", evidence.capture_hold_ms.p50_p99("ms")),
        ("tokens per rollout p50 / p99", percentiles(digest["tokens_per_rollout"])),
    ]
    rows += [  # a model as asked for, the names that answered for it beside
        (
            f"model {name}" + (f" (answered as {', '.join(served)})" if served else ""),
            f"{m.calls} call(s) ({m.failed_calls} failed), "
            + tokens_text(m.tokens_total, m.tokens_total_unknown_calls),
        )
        for name, served, m in evidence.model_groups()
    ]
    rows += [
        (f"failed {why}", f"{n} (first: {', '.join(digest['failure_examples'].get(why, []))})")
        for why, n in digest["calls_by_error_category"].items()
    ]
    gaps = {**evidence.gaps, **evidence.observation_gaps}
    rows += [
        (f"gap {code}", f"{n} (first: {', '.join(digest['gap_examples'].get(code, []))})")
        for code, n in sorted(gaps.items())
    ]
    orphans = str(evidence.orphan_captures)
    if evidence.orphan_examples:
        orphans += f" (first: {', '.join(evidence.orphan_examples)})"
    rows.append(("orphan captures", orphans))
    return rows


def _enrich(
    storage: Storage,
    rollouts: str,
    *,
    runner: RunnerName,
    out: Output,
    traces: FlowTraces | None = None,
    **parameters: Any,
) -> None:
    """``enrich`` and ``demo``: check the input, run the flow, print the summary."""
    traces = traces or FlowTraces()
    parameters.update(traces.parameters())
    runner_available(runner, parameters.get("dask_address"), parameters.get("ray_address"))
    if parameters.get("output"):
        storage.at(parameters["output"])  # credentials in it refused before any server starts
    traces.probe(prefect_started=False)
    source, captures = rollouts_and_captures(storage, rollouts)
    traces.probe(prefect_started=True)
    from rollout_capture.flows import enrich_rollouts

    with _endpoint_refusals():
        summary = flow_run(
            not out.json,
            lambda: enrich_rollouts(
                source.url,
                captures.url,
                runner=runner.value,
                allow_empty=storage.allow_empty,
                **captures.flow_parameters(),
                **parameters,
            ),
        )
    stats = summary.stats
    out.result(
        lambda: {
            **summary.model_dump(mode="json"),
            "gap_share": stats.gap_share,
            "evidence": stats.evidence.digest(),
        },
        text=lambda: _show_enriched(summary, rollouts),
    )


@contextmanager
def _endpoint_refusals() -> Iterator[None]:
    """The flow's start-up check of ``--otlp`` (unreachable, refused, a bad Secret block) as bad
    input: exit 2, nothing enriched or sent."""
    from rollout_capture.otlp_headers import HeaderError
    from rollout_capture.traces import TracesUnavailable
    from rollout_capture.traces.exporter import OtlpEndpointError

    try:
        yield
    except (OtlpEndpointError, HeaderError, TracesUnavailable) as exc:
        raise InputError(str(exc)) from None


def _show_enriched(summary: EnrichSummary, rollouts: str) -> None:
    """The enrichment's table, then the first lines passed through (on stderr)."""
    stats = summary.stats
    rows = [
        ("output", summary.output),
        ("report", summary.report or "-"),
        ("lines", str(stats.lines)),
        ("rollouts enriched", str(stats.rollouts)),
        ("model calls", str(stats.calls)),
        ("tokens in / out / total", stats.evidence.tokens_line()),
        ("rollouts with any gap", f"{stats.rollouts_with_gaps} ({100 * stats.gap_share:.1f}%)"),
        ("lines passed through", str(len(stats.problems))),
    ]
    if summary.traces is not None:
        rows.append(("traces", summary.traces))
    show(rows + evidence_rows(stats.evidence))
    for problem in stats.problems[:10]:
        typer.echo(printable(f"{rollouts}:{problem.line}: {problem.reason}"), err=True)


@storage_options()
@traces_options
def enrich(
    storage: Storage,
    rollouts: Annotated[str, typer.Argument(help="Rollouts JSONL (any fsspec URL, .gz too).")],
    output: Annotated[
        str | None, typer.Option(help="Default: <input stem>.enriched.jsonl beside the input.")
    ] = None,
    include_payloads: Annotated[bool, typer.Option(help="Keep requests and responses in the calls.")] = False,
    strict: Annotated[bool, typer.Option(help="Fail on a line that is not a rollout record.")] = False,
    batch_size: Annotated[int, typer.Option(min=1)] = 1000,
    max_workers: Annotated[int, typer.Option(min=1)] = 8,
    runner: RunnerOpt = RunnerName.threads,
    dask_address: DaskAddressOpt = None,
    ray_address: RayAddressOpt = None,
    quiescence_timeout: Annotated[float, typer.Option(help="Seconds to wait for claimed writes.")] = 10.0,
    max_gap_share: MaxGapShareOpt = None,
    max_failed_share: MaxFailedShareOpt = None,
    as_json: JsonOpt = False,
    *,
    traces: FlowTraces,
) -> None:
    """Enrich every rollout of ROLLOUTS with its captured model calls (and write its report beside it)."""
    out = Output(json=as_json)
    with out.exits():
        _enrich(
            storage,
            rollouts,
            runner=runner,
            out=out,
            output=output,
            include_payloads=include_payloads,
            quiescence_timeout_s=quiescence_timeout,
            batch_size=batch_size,
            max_workers=max_workers,
            dask_address=dask_address,
            ray_address=ray_address,
            strict=strict,
            max_gap_share=max_gap_share,
            max_failed_share=max_failed_share,
            traces=traces,
        )


def demo(
    output: Annotated[str, typer.Option(help="Where the enriched sample goes.")] = os.path.join(
        "rollout-capture-demo", "sample.enriched.jsonl"
    ),
    as_json: JsonOpt = False,
) -> None:
    """Enrich the bundled sample (ten NeMo Gym rollouts and their captures), from any folder."""
    from importlib.resources import files

    sample = files("rollout_capture") / "sample"
    out = Output(json=as_json)
    with out.exits():
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        _enrich(
            Storage(capture_dir=str(sample / "captures")),
            str(sample / "rollouts.jsonl"),
            runner=RunnerName.threads,
            out=out,
            output=output,
        )


@storage_options(captures=False)
@traces_options
def enrich_runs(
    storage: Storage,
    runs_root: Annotated[
        str, typer.Argument(help="Folder of runs: <root>/<run>/rollouts.jsonl, captures/, _SUCCESS.")
    ],
    capture_dir: Annotated[str | None, typer.Option(help="One capture root for all runs.")] = None,
    runner: RunnerOpt = RunnerName.threads,
    dask_address: DaskAddressOpt = None,
    ray_address: RayAddressOpt = None,
    max_parallel_runs: Annotated[int, typer.Option(min=1, help="Runs enriched at once.")] = 4,
    lease_s: Annotated[
        float,
        typer.Option(
            min=0.001, help="Seconds a run's lease holds unrenewed (how soon a crashed run is retaken)."
        ),
    ] = 120.0,
    full_scan: Annotated[
        bool, typer.Option(help="List every run folder, ignoring the root's index.")
    ] = False,
    recheck: Annotated[
        list[str] | None,
        typer.Option(help="A run to look at even if the index says it is enriched (repeatable)."),
    ] = None,
    allow_empty: AllowEmptyOpt = False,
    max_gap_share: MaxGapShareOpt = None,
    max_failed_share: MaxFailedShareOpt = None,
    compact: Annotated[
        bool, typer.Option(help="Then compact each enriched run's journal into a few large objects.")
    ] = False,
    as_json: JsonOpt = False,
    *,
    traces: FlowTraces,
) -> None:
    """Enrich every finished, not yet enriched run under RUNS_ROOT (what the schedule runs)."""
    out = Output(json=as_json)
    with out.exits():
        parameters = traces.parameters()
        runner_available(runner, dask_address, ray_address)
        runs = storage.at(runs_root)
        captures = runs.at(capture_dir) if capture_dir else None
        traces.probe(prefect_started=False)
        preflight(
            folders=[(runs, "runs root")],
            capture_dirs=[captures] if captures and not allow_empty else [],
            creates=[runs],  # leases and _ENRICHED
        )
        traces.probe(prefect_started=True)
        from rollout_capture.flows import enrich_completed_runs

        with _endpoint_refusals():
            summary = flow_run(
                not as_json,
                lambda: enrich_completed_runs(
                    runs_root,
                    capture_dir=capture_dir,
                    runner=runner.value,
                    dask_address=dask_address,
                    ray_address=ray_address,
                    max_parallel_runs=max_parallel_runs,
                    lease_s=lease_s,
                    full_scan=full_scan,
                    recheck=recheck,
                    allow_empty=allow_empty,
                    max_gap_share=max_gap_share,
                    max_failed_share=max_failed_share,
                    compact=compact,
                    **parameters,
                    **runs.flow_parameters(),
                ),
            )
        out.result(lambda: _runs_dumped(summary), text=lambda: _show_runs(summary))


def _runs_dumped(summary: RunsSummary) -> dict[str, Any]:
    """The runs' summary as JSON, each enriched run's evidence digest in its outcome."""
    return summary.model_dump(mode="json")


RUN_COLUMNS = (
    "run",
    "status",
    "rollouts",
    "calls",
    "failed (by error)",
    "gap share",
    "latency p50/p90/p99 ms",
    "TTFT p50/p90/p99 ms",
    "orphans",
)


def _show_runs(summary: RunsSummary) -> None:
    """Which runs went which way, then a row per enriched run."""
    show(
        [
            (what, ", ".join(names) or "-")
            for what, names in (
                ("enriched", summary.enriched),
                ("busy (another tick holds them)", summary.busy),
                ("lost (another tick took over)", summary.lost),
                ("unfinished (no _SUCCESS)", summary.unfinished),
                ("already enriched", summary.already_enriched),
                ("held (refused before; finish again to retry)", list(summary.held)),
                ("links (not run folders; left alone)", list(summary.links)),
            )
        ]
    )
    for name, why in summary.held.items():
        typer.echo(printable(f"held {name}: {why}"))
    per_run = [
        (
            name,
            outcome.status + (f" ({outcome.state_name})" if _poor_state(outcome.state_name) else ""),
            str(outcome.rollouts),
            str(outcome.calls),
            f"{e['failed_calls']} ({counts(e['calls_by_error_category'])})",
            f"{100 * (outcome.gap_share or 0.0):.1f}%",
            percentiles(e["latency_ms"]),
            percentiles(e["ttft_ms"]),
            str(e["orphan_captures"]),
        )
        for name, outcome in summary.outcomes.items()
        if outcome.evidence is not None
        for e in (outcome.evidence,)
    ]
    if per_run:
        typer.echo("")
        show(per_run, RUN_COLUMNS)


def _poor_state(name: str | None) -> bool:
    """A run's end state worth naming beside its status (anything but Completed)."""
    return bool(name) and name != "Completed"
