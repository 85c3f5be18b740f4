"""``rollout-capture``: the flows and the core from a terminal.

Exit codes: 0 done; 1 the work failed (storage faults outlasting retries, rollouts still
claimed after ``wait``); 2 bad input (missing file, malformed line under ``--strict``,
invalid id or option, a capture dir that is not there), always with a message naming the
input. ``--json`` prints one machine-readable summary on stdout instead, failures included.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import gc
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from importlib.metadata import PackageNotFoundError, version
from inspect import Parameter, signature
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from rollout_capture.filesystem import local_path
from rollout_capture.producer.settings import ProxySettings

if TYPE_CHECKING:
    from rollout_capture.location import Location

T = TypeVar("T")
HELP_MAX_WIDTH = 1000
"""No cap of our own: Click wraps help to the terminal's width (``COLUMNS`` when set), asked as it prints."""


def _plain(text: str | None) -> str | None:
    """Docstring text for ``--help``: reStructuredText's double backticks dropped."""
    return None if text is None else text.replace("``", "")


# Click's plain help, not rich panels: rich cuts option names to fit a narrow terminal
# ("--capture-d…"); Click keeps every name whole and wraps the text beside it.
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help=_plain(__doc__),
    rich_markup_mode=None,
    context_settings={"max_content_width": HELP_MAX_WIDTH},
)

CaptureDirOpt = Annotated[
    str, typer.Option("--capture-dir", "-c", help="Capture root: a path or fsspec URL.")
]
OptionsOpt = Annotated[
    str | None,
    typer.Option("--storage-options", help='fsspec options as JSON (no secrets), e.g. {"anon": false}.'),
]
BlockOpt = Annotated[
    str | None, typer.Option("--credentials-block", help="Name of a prefect-aws AwsCredentials block.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON summary on stdout instead.")]
AllowEmptyOpt = Annotated[
    bool, typer.Option(help="Accept a capture dir that does not exist or holds nothing.")
]
MaxGapShareOpt = Annotated[
    float | None,
    typer.Option(
        min=0,
        max=1,
        help='Above this share of rollouts with a gap: end "Completed with gaps", emit gaps-exceeded.',
    ),
]
MaxFailedShareOpt = Annotated[
    float | None,
    typer.Option(
        min=0,
        max=1,
        help='Above this share of failed calls: end "Completed with failed calls", emit '
        "failed-calls-exceeded.",
    ),
]


class RunnerName(StrEnum):
    """Where batches run."""

    threads = "threads"
    processes = "processes"
    dask = "dask"
    ray = "ray"


RunnerOpt = Annotated[RunnerName, typer.Option(help="Where batches run.")]
DaskAddressOpt = Annotated[
    str | None, typer.Option(help="Dask scheduler for --runner dask (tcp://host:8786); default local.")
]
RayAddressOpt = Annotated[
    str | None, typer.Option(help="Ray cluster for --runner ray (host:6379); default RAY_ADDRESS or local.")
]


class InputError(Exception):
    """Bad input: exit code 2."""


def _version(show: bool) -> None:
    if show:
        try:
            typer.echo(f"rollout-capture {version('rollout-capture')}")
        except PackageNotFoundError:  # pragma: no cover - run from a plain checkout
            typer.echo("rollout-capture (not installed)")
        raise typer.Exit


@app.callback()
def _main(
    show_version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_version, help="Print the version and exit.")
    ] = False,
) -> None:
    """Enrich LLM rollout records with their captured model calls."""


def _options(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"--storage-options is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InputError("--storage-options must be a JSON object")
    return value


@dataclass(frozen=True)
class Storage:
    """How one command's URLs are read: ``--storage-options``, ``--credentials-block`` as typed, and
    (for the commands over one capture root) ``--capture-dir`` and ``--allow-empty``."""

    options: str | None = None
    block: str | None = None
    capture_dir: str = ""
    allow_empty: bool = False

    def at(self, url: str) -> Location:
        """``url`` as the flows will read it: the JSON parsed, secrets refused, the URL's shape checked."""
        from rollout_capture.location import Location

        return Location.of(url, _options(self.options), self.block)

    def captures(self) -> Location:
        """The ``--capture-dir`` location."""
        return self.at(self.capture_dir)

    def must_exist(self, captures: Location) -> list[Location]:
        """The capture roots the pre-flight check requires of ``captures`` (this ``--capture-dir``,
        validated once): none with ``--allow-empty``."""
        return [] if self.allow_empty else [captures]


Command = Callable[..., None]


def _storage_options(*, block: bool = True, captures: bool = True) -> Callable[[Command], Command]:
    """Give a command its storage options as one ``storage`` argument, declared once, here.

    ``--storage-options`` (and ``--credentials-block``) land before ``--json`` in the help; with
    ``captures``, also ``--capture-dir`` (after the command's arguments) and ``--allow-empty``.
    """

    def decorate(command: Command) -> Command:
        declared = signature(command, eval_str=True)
        kept = [p.replace(kind=Parameter.KEYWORD_ONLY) for p in declared.parameters.values()]
        kept = [p for p in kept if p.name != "storage"]
        option = functools.partial(Parameter, kind=Parameter.KEYWORD_ONLY, default=None)
        added = [option("storage_options", annotation=OptionsOpt)]
        if block:
            added.append(option("credentials_block", annotation=BlockOpt))
        if captures:
            added.insert(0, option("allow_empty", annotation=AllowEmptyOpt, default=False))
        _before_json(kept, added)
        if captures:
            first = next((i for i, p in enumerate(kept) if p.default is not Parameter.empty), len(kept))
            kept.insert(first, option("capture_dir", annotation=CaptureDirOpt, default=Parameter.empty))

        @functools.wraps(command)
        def run(
            storage_options: str | None = None, credentials_block: str | None = None, **given: Any
        ) -> None:
            # Without ``captures``, a command's own --capture-dir / --allow-empty stay its own.
            root = (
                (given.pop("capture_dir", ""), given.pop("allow_empty", False)) if captures else ("", False)
            )
            storage = Storage(storage_options, credentials_block, *root)
            command(storage=storage, **given)

        run.__signature__ = declared.replace(parameters=kept)  # type: ignore[attr-defined]
        return run

    return decorate


def _before_json(kept: list[Parameter], added: Sequence[Parameter]) -> None:
    """Options a decorator adds go before ``--json`` in a command's help."""
    at = next((i for i, p in enumerate(kept) if p.name == "as_json"), len(kept))
    kept[at:at] = added


# A loaded node (a training job beside it) takes far longer than Prefect's 20 s default.
TEMPORARY_SERVER_STARTUP_S = "180"
TEMPORARY_SERVER_NOTE = "starting a temporary Prefect server; set PREFECT_API_URL to use your own"


def _prefect_env() -> None:
    """No telemetry; a patient temporary server unless PREFECT_API_URL names one; core logs in the UI.

    Environment defaults only (the user's own settings win); set before Prefect is imported.
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "rollout_capture")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", TEMPORARY_SERVER_STARTUP_S)


def _api_url() -> str | None:
    """The Prefect API this process talks to (environment or profile); None: a temporary server."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def _start_prefect() -> None:
    """Called once the input is known to be good: say when a temporary server is about to start."""
    _prefect_env()
    if not _api_url():
        typer.echo(TEMPORARY_SERVER_NOTE, err=True)


class _WithoutTraceback(logging.Formatter):
    """Formats like ``inner`` but leaves the traceback to the API logs (the Prefect UI)."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text = saved


def _terminal_logging() -> None:
    """At a terminal, a failed run is one line from Prefect and one ``error:`` line from us."""
    from rollout_capture.flows.terminal import prefect_console_handlers

    for handler in prefect_console_handlers():
        if not isinstance(handler.formatter, _WithoutTraceback):
            handler.setFormatter(_WithoutTraceback(handler.formatter))


def _check_file(where: Location, credentials: Any, what: str) -> None:
    """The input is there and is a regular file (a FIFO or a folder would hang or mislead the read)."""
    from rollout_capture.filesystem import open_filesystem
    from rollout_capture.rollout_files import refuse_wrong_compression

    fs, path = open_filesystem(where.url, where.storage_options, credentials=credentials)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise InputError(f"{what} not found: {where}") from None
    if info.get("type") != "file":
        raise InputError(f"{what} is not a regular file: {where} ({info.get('type')})")
    refuse_wrong_compression(fs, path, where.url)


def _credentials(block: str | None, prefect: bool) -> Any:
    """The block's credentials, as the flow will resolve them (Prefect started first: its API holds it)."""
    if not block:
        return None
    if importlib.util.find_spec("prefect_aws") is None:
        raise InputError("--credentials-block needs prefect-aws: pip install 'rollout-capture[aws]'")
    if prefect:
        _start_prefect()
    from rollout_capture.tasks.credentials import credentials_from_block

    try:
        return credentials_from_block(block)
    except ValueError as exc:
        raise InputError(f"credentials block {block!r}: {exc}") from None


def _preflight(
    *,
    files: Sequence[tuple[Location, str]] = (),
    capture_dirs: Sequence[Location] = (),
    folders: Sequence[tuple[Location, str]] = (),
    prefect: bool = True,
) -> None:
    """Check every input before any Prefect server starts, with the credentials the flow will use.

    ``files``: (location, what) that must be regular files; ``capture_dirs``: capture roots that
    must be there (a folder on disk, a key under an object prefix); ``folders``: (location, what)
    roots that must exist where folders exist apart from their contents (a disk; an object prefix
    with nothing under it is fine). Only a credentials block needs Prefect (its API holds the
    block): then the server is started first, and the block's absence is bad input too.
    """
    from rollout_capture.backends import open_backend
    from rollout_capture.faults import missing_capture_dir

    every = [*(where for where, _ in files), *capture_dirs, *(where for where, _ in folders)]
    block = next((where.credentials_block for where in every if where.credentials_block), None)
    credentials = _credentials(block, prefect)
    for where, what in files:
        _check_file(where, credentials, what)
    for where in capture_dirs:
        if not where.capture_store(credentials, shared=False).root_found():
            raise InputError(missing_capture_dir(where.url))
    for where, what in folders:
        backend = open_backend(where.url, where.storage_options, credentials=credentials)
        found = backend.root_found()  # one LIST: on an object store, the credentials proved here
        if backend.folders_exist and not found:
            raise InputError(f"{what} not found: {where}")
    if prefect and not block:
        _start_prefect()


def _runner_available(
    runner: RunnerName, dask_address: str | None = None, ray_address: str | None = None
) -> None:
    """The runner's extra is installed, and a cluster address goes with its runner."""
    if runner is RunnerName.dask and importlib.util.find_spec("prefect_dask") is None:
        raise InputError("--runner dask needs prefect-dask: pip install 'rollout-capture[dask]'")
    if runner is RunnerName.ray and importlib.util.find_spec("prefect_ray") is None:
        raise InputError("--runner ray needs prefect-ray: pip install 'rollout-capture[ray]'")
    _addresses_match(runner, dask_address, ray_address)


def _addresses_match(runner: RunnerName, dask_address: str | None, ray_address: str | None) -> None:
    """A cluster address given for another runner than the chosen one is a mix-up: refused."""
    for option, address, needs in (
        ("--dask-address", dask_address, RunnerName.dask),
        ("--ray-address", ray_address, RunnerName.ray),
    ):
        if address and runner is not needs:
            raise InputError(f"{option} is for --runner {needs.value}; the runner is {runner.value}")


def _rounded(value: Any, places: int = 3) -> Any:
    """Floats rounded for people (a sum of latencies prints 164.547, not 164.54699999999997)."""
    if isinstance(value, float):
        return round(value, places)
    if isinstance(value, dict):
        return {key: _rounded(item, places) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(item, places) for item in value]
    return value


def _print_json(value: Any) -> None:
    typer.echo(json.dumps(_rounded(value), indent=2, default=str))


@contextmanager
def _exits(as_json: bool = False) -> Iterator[None]:
    """Turn errors into a one-line message and an exit code, never a bare traceback."""
    from rollout_capture.faults import is_transient_storage_error

    try:
        yield
    except typer.Exit:
        raise
    except (InputError, ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        code, message = 2, str(exc)
    except Exception as exc:
        if type(exc).__name__ == "NoCredentialsError":  # botocore's: nothing in the credential chain
            code, message = 2, f"{exc}: set AWS credentials (environment, profile, role) or a block"
        else:
            kind = "storage fault (after retries)" if is_transient_storage_error(exc) else type(exc).__name__
            code, message = 1, f"{kind}: {exc}"
    else:
        return
    typer.echo(f"error: {message}", err=True)
    if as_json:
        _print_json({"ok": False, "exit_code": code, "error": message})
    raise typer.Exit(code) from None


def _show(rows: Sequence[Sequence[str]], header: Sequence[str] | None = None) -> None:
    """A table for people (rich, no borders: easy to read and to grep)."""
    table = Table(box=None, show_header=header is not None, pad_edge=False)
    for name in header or ("",) * len(rows[0]):
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*row)
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def _num(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key} {n}" for key, n in counts.items()) or "-"


def _percentiles(values: dict[str, int | None], unit: str = "") -> str:
    if all(value is None for value in values.values()):
        return "unknown"
    return " / ".join(_num(values[key]) for key in values) + (f" {unit}" if unit else "")


def _evidence_rows(evidence: Any) -> list[tuple[str, str]]:
    """What the summary table says of failed calls, latency, tokens, models, gaps and orphans."""
    from rollout_capture.summary import tokens_text

    digest = evidence.digest()
    rows = [
        ("failed calls", f"{evidence.failed_calls} ({100 * evidence.failed_share:.1f}%)"),
        ("calls by status", _counts(digest["calls_by_status_class"])),
        ("calls by error", _counts(digest["calls_by_error_category"])),
        ("latency p50 / p90 / p99", _percentiles(digest["latency_ms"], "ms")),
        ("TTFT p50 / p90 / p99", _percentiles(digest["ttft_ms"], "ms")),
        ("capture hold p50 / p99", evidence.capture_hold_ms.p50_p99("ms")),
        ("tokens per rollout p50 / p99", _percentiles(digest["tokens_per_rollout"])),
    ]
    rows += [
        (
            f"model {name}",
            f"{m.calls} call(s) ({m.failed_calls} failed), "
            + tokens_text(m.tokens_total, m.tokens_total_unknown_calls),
        )
        for name, m in evidence.models_by_calls()
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


@contextmanager
def _progress(as_json: bool) -> Iterator[None]:
    """Progress bars on a TTY (never with --json: stdout is for the summary)."""
    if as_json:
        yield
        return
    from rollout_capture.flows.terminal import progress_bars

    with progress_bars():
        yield


def _flow_run(as_json: bool, start: Callable[[], T]) -> T:
    """Run a flow (its input already checked): Prefect's console tamed, progress bars at a TTY."""
    import rollout_capture.flows.enrich  # noqa: F401 - Prefect sets its console handlers up on import

    _terminal_logging()
    with _progress(as_json):
        return start()


def _rollouts_and_captures(storage: Storage, rollouts: str) -> tuple[Location, Location]:
    """``enrich``, ``demo`` and ``clear``: both inputs as the flow reads them, checked before it starts."""
    captures = storage.captures()
    source = captures.at(rollouts)
    _preflight(files=[(source, "rollouts file")], capture_dirs=storage.must_exist(captures))
    return source, captures


def _enrich(
    storage: Storage,
    rollouts: str,
    *,
    runner: RunnerName,
    as_json: bool,
    **parameters: Any,
) -> None:
    """``enrich`` and ``demo``: check the input, run the flow, print the summary."""
    _runner_available(runner, parameters.get("dask_address"), parameters.get("ray_address"))
    source, captures = _rollouts_and_captures(storage, rollouts)
    from rollout_capture.flows import enrich_rollouts

    summary = _flow_run(
        as_json,
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
    if as_json:
        _print_json(
            {
                "ok": True,
                **summary.model_dump(mode="json"),
                "gap_share": stats.gap_share,
                "evidence": stats.evidence.digest(),
            }
        )
        return
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
    rows += _evidence_rows(stats.evidence)
    _show(rows)
    for problem in stats.problems[:10]:
        typer.echo(f"{rollouts}:{problem.line}: {problem.reason}", err=True)


@app.command()
@_storage_options()
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
) -> None:
    """Enrich every rollout of ROLLOUTS with its captured model calls (and write its report beside it)."""
    with _exits(as_json):
        _enrich(
            storage,
            rollouts,
            runner=runner,
            as_json=as_json,
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
        )


@app.command()
def demo(
    output: Annotated[str, typer.Option(help="Where the enriched sample goes.")] = os.path.join(
        "rollout-capture-demo", "sample.enriched.jsonl"
    ),
    as_json: JsonOpt = False,
) -> None:
    """Enrich the bundled sample (ten NeMo Gym rollouts and their captures), from any folder."""
    from importlib.resources import files

    sample = files("rollout_capture") / "sample"
    with _exits(as_json):
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        _enrich(
            Storage(capture_dir=str(sample / "captures")),
            str(sample / "rollouts.jsonl"),
            runner=RunnerName.threads,
            as_json=as_json,
            output=output,
        )


@app.command()
@_storage_options()
def clear(
    storage: Storage,
    rollouts: Annotated[str, typer.Argument(help="Rollouts JSONL about to be dispatched.")],
    as_json: JsonOpt = False,
) -> None:
    """Remove the captures of the rollouts about to be dispatched."""
    with _exits(as_json):
        source, captures = _rollouts_and_captures(storage, rollouts)
        from rollout_capture.flows import prepare_dispatch

        cleared = _flow_run(
            True,  # quick: no progress to show
            lambda: prepare_dispatch(source.url, captures.url, **captures.flow_parameters()),
        )
        if as_json:
            _print_json({"ok": True, "capture_dir": captures.url, "rollout_ids_cleared": cleared})
        else:
            typer.echo(f"cleared captures of {cleared} rollout id(s)")


def _rollout_store(rollout_id: str, storage: Storage) -> Any:
    """``wait`` and ``inspect``: a valid rollout id, and a store whose root is there, read with the
    credentials block's credentials when one is named (Prefect only then: its API holds the block)."""
    from rollout_capture.identity import validate_rollout_id

    validate_rollout_id(rollout_id)
    captures = storage.captures()
    credentials = _credentials(captures.credentials_block, prefect=True)  # resolved once a process
    _preflight(capture_dirs=storage.must_exist(captures), prefect=False)
    return captures.capture_store(credentials, shared=False)


@app.command()
@_storage_options()
def wait(
    storage: Storage,
    rollout_id: Annotated[str, typer.Argument(help="Rollout id, e.g. 12-3 or 12-3-a1.")],
    timeout: Annotated[float, typer.Option(help="Seconds before giving up.")] = 10.0,
    poll: Annotated[float, typer.Option(help="Seconds between checks.")] = 0.05,
    as_json: JsonOpt = False,
) -> None:
    """Wait until no claimed capture write of the rollout is outstanding (exit 1 on timeout)."""
    with _exits(as_json):
        from rollout_capture import await_model_call_capture_quiescence

        store = _rollout_store(rollout_id, storage)
        quiet = asyncio.run(await_model_call_capture_quiescence(rollout_id, [store], timeout, poll))
        if as_json:
            _print_json({"ok": quiet, "rollout_id": rollout_id, "quiescent": quiet, "timeout_s": timeout})
        elif quiet:
            typer.echo(f"{rollout_id}: quiescent")
        else:
            typer.echo(f"{rollout_id}: still claimed after {timeout}s", err=True)
        if not quiet:
            raise typer.Exit(1)


@app.command("enrich-runs")
@_storage_options(captures=False)
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
    as_json: JsonOpt = False,
) -> None:
    """Enrich every finished, not yet enriched run under RUNS_ROOT (what the schedule runs)."""
    with _exits(as_json):
        _runner_available(runner, dask_address, ray_address)
        runs = storage.at(runs_root)
        captures = runs.at(capture_dir) if capture_dir else None
        _preflight(
            folders=[(runs, "runs root")], capture_dirs=[captures] if captures and not allow_empty else []
        )
        from rollout_capture.flows import enrich_completed_runs

        summary = _flow_run(
            as_json,
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
                **runs.flow_parameters(),
            ),
        )
        if as_json:
            dumped = summary.model_dump(mode="json")
            for name, outcome in summary.outcomes.items():
                if outcome.summary is not None:
                    dumped["outcomes"][name]["evidence"] = outcome.summary.stats.evidence.digest()
            _print_json({"ok": True, **dumped})
            return
        rows = [
            (what, ", ".join(names) or "-")
            for what, names in (
                ("enriched", summary.enriched),
                ("busy (another tick holds them)", summary.busy),
                ("lost (another tick took over)", summary.lost),
                ("unfinished (no _SUCCESS)", summary.unfinished),
                ("already enriched", summary.already_enriched),
            )
        ]
        _show(rows)
        per_run = [
            (
                name,
                outcome.status + (f" ({outcome.state_name})" if _poor_state(outcome.state_name) else ""),
                str(outcome.summary.stats.rollouts),
                str(outcome.summary.stats.calls),
                f"{outcome.summary.stats.evidence.failed_calls} ({_counts(e.calls_by_error_category)})",
                f"{100 * outcome.summary.stats.gap_share:.1f}%",
                _percentiles(e.latency_ms.percentiles()),
                _percentiles(e.ttft_ms.percentiles()),
                str(e.orphan_captures),
            )
            for name, outcome in summary.outcomes.items()
            if outcome.summary is not None
            for e in (outcome.summary.stats.evidence,)
        ]
        if per_run:
            typer.echo("")
            _show(
                per_run,
                (
                    "run",
                    "status",
                    "rollouts",
                    "calls",
                    "failed (by error)",
                    "gap share",
                    "latency p50/p90/p99 ms",
                    "TTFT p50/p90/p99 ms",
                    "orphans",
                ),
            )


def _poor_state(name: str | None) -> bool:
    return bool(name) and name != "Completed"


@app.command()
@_storage_options()
def inspect(
    storage: Storage,
    rollout_id: Annotated[str, typer.Argument(help="Rollout id, e.g. 12-3.")],
    as_json: JsonOpt = False,
) -> None:
    """Show a rollout's captured calls: tokens, latency, status and gaps."""
    with _exits(as_json):
        from rollout_capture.attachment import build_attachment
        from rollout_capture.evidence import gather_evidence

        store = _rollout_store(rollout_id, storage)
        attachment = build_attachment(rollout_id, gather_evidence([rollout_id], [store])[rollout_id])
        if as_json:
            _print_json({"ok": True, **attachment})
            return
        rows: list[tuple[str, ...]] = []
        for call in attachment["calls"]:
            rows.append(
                (
                    str(call["call_index"]),
                    _num(call["model"]),
                    _num(call["dialect"]),
                    _num(call["status_code"]),
                    _num(call["tokens_in"]),
                    _num(call["tokens_out"]),
                    _num(call["tokens_total"]),
                    _num(call["latency_total_ms"]),
                    _num(call["error_category"]),
                )
            )
        metrics = attachment["metrics"]
        rows.append(
            (
                "all",
                "",
                "",
                "",
                _num(metrics["tokens_in"]),
                _num(metrics["tokens_out"]),
                _num(metrics["tokens_total"]),
                _num(metrics["latency_total_ms"]),
                "",
            )
        )
        _show(rows, ("#", "model", "dialect", "status", "in", "out", "total", "latency ms", "error"))
        for invocation in attachment.get("verifier_invocations", []):
            typer.echo(
                f"verifier {invocation['verifier_invocation_id']}: reward {_num(invocation['reward'])}, "
                f"judge calls {invocation['model_call_ids']}"
            )
        for gap in attachment.get("gaps", []):
            typer.echo(f"gap: {gap['code']}" + (f" ({gap['detail']})" if "detail" in gap else ""))


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
    import tempfile

    from rollout_capture.filesystem import open_filesystem

    where = storage.at(path)
    credentials = _credentials(where.credentials_block, prefect=True)
    _check_file(where, credentials, what)
    fs, remote = open_filesystem(where.url, where.storage_options, credentials=credentials)
    with tempfile.TemporaryDirectory(prefix="rollout-capture-") as folder:
        copy = os.path.join(folder, remote.rstrip("/").rsplit("/", 1)[-1])
        fs.get_file(remote, copy)
        try:
            yield copy
        except Exception as exc:
            renamed = _naming(exc, copy, where.url)
            if renamed is None:
                raise
            raise renamed.with_traceback(exc.__traceback__) from None


def _naming(exc: Exception, copy: str, url: str) -> Exception | None:
    """``exc`` (of the same type) naming ``url`` where it names the temporary ``copy`` of it,
    so an error says which file the user gave; None when it does not name the copy."""
    if isinstance(exc, OSError):
        if exc.filename != copy:
            return None
        exc.filename = url
        return exc
    text = str(exc)
    if copy not in text:
        return None
    try:
        return type(exc)(text.replace(copy, url))
    except Exception:  # a type not built from one message: left as it was
        return None


@app.command()
@_storage_options(captures=False)
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
    with _exits(as_json):
        from rollout_capture.report import default_report_path, write_report
        from rollout_capture.summary import tokens_text

        with _local_input(enriched, "enriched file", storage) as path:
            beside = default_report_path(path)
            target = output or (beside if path == local_path(enriched) else os.path.basename(beside))
            summary = write_report(path, target)
        if as_json:
            _print_json({"ok": True, "report": target, "rollouts": summary.rollouts, **summary.digest()})
        else:
            typer.echo(
                f"wrote {target}: {summary.rollouts} rollout(s), {summary.calls} call(s), "
                f"{summary.failed_calls} failed, {summary.rollouts_with_gaps} with gaps, "
                f"{tokens_text(summary.tokens_total, summary.tokens_total_unknown_calls)}"
            )


@app.command()
@_storage_options(captures=False)
def export(
    storage: Storage,
    enriched: Annotated[str, typer.Argument(help="Enriched rollouts JSONL: a path or fsspec URL.")],
    calls: Annotated[
        str | None, typer.Option(help="Parquet file of the calls (one row per captured call).")
    ] = None,
    rollouts: Annotated[
        str | None, typer.Option(help="Parquet file of the rollouts (one row per enriched rollout).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Export an enriched file as Parquet tables of calls and rollouts (needs the export extra).

    Schema: docs/export.md. Each file is written whole or not at all.
    """
    with _exits(as_json):
        from rollout_capture.export import ExportUnavailable, export_tables

        if calls is None and rollouts is None:
            raise InputError("name --calls, --rollouts or both")
        with _local_input(enriched, "enriched file", storage) as path:
            try:
                counts = export_tables(path, calls, rollouts)
            except ExportUnavailable as exc:
                raise InputError(str(exc)) from None
        if as_json:
            _print_json(
                {
                    "ok": True,
                    "calls_file": calls,
                    "rollouts_file": rollouts,
                    "calls": counts.calls,
                    "rollouts": counts.rollouts,
                    "lines_skipped": counts.lines_skipped,
                }
            )
            return
        for name, where, n in (("call", calls, counts.calls), ("rollout", rollouts, counts.rollouts)):
            if where is not None:
                typer.echo(f"wrote {where}: {n} {name} row(s)")
        if counts.lines_skipped:
            typer.echo(
                f"{counts.lines_skipped} line(s) without a capture attachment skipped "
                "(not JSON and naming none, passed through by enrichment; or records without an id)",
                err=True,
            )


class LogLevel(StrEnum):
    """How much the proxy logs."""

    critical = "critical"
    error = "error"
    warning = "warning"
    info = "info"
    debug = "debug"


class HttpImpl(StrEnum):
    """uvicorn's HTTP/1.1 server protocol (auto: httptools when installed)."""

    auto = "auto"
    h11 = "h11"
    httptools = "httptools"


class LoopImpl(StrEnum):
    """uvicorn's event loop (auto: uvloop when installed)."""

    auto = "auto"
    asyncio = "asyncio"
    uvloop = "uvloop"


PROXY_STACK = ("aiohttp", "uvicorn", "httptools")


def _proxy_stack_available() -> None:
    """The proxy's HTTP stack is an extra: name it, as httpx's CLI does, rather than fail on import."""
    missing = [name for name in PROXY_STACK if importlib.util.find_spec(name) is None]
    if missing:
        raise InputError(f"the proxy needs {', '.join(missing)}: pip install 'rollout-capture[proxy]'")


PROXY_OPTIONS: dict[str, tuple[str, ...]] = {
    "upstream": ("--upstream",),
    "capture_dir": ("--capture-dir", "-c"),
    "enabled": ("--enabled/--no-enabled",),
    "server_name": ("--server-name",),
    "claim_ttl_s": ("--claim-ttl",),
    "max_body_bytes": ("--max-body-bytes",),
    "connect_timeout_s": ("--connect-timeout",),
    "read_timeout_s": ("--read-timeout",),
    "max_connections": ("--max-connections",),
    "shutdown_grace_s": ("--shutdown-grace",),
    "layout": ("--layout",),
    "claims": ("--claims",),
    "storage_options": ("--storage-options",),
    "upstream_client": ("--client",),
}
"""The ``ProxySettings`` fields the proxy command takes, and their option names; each option's
type, default, bounds, help and environment variable come from the field itself."""


def _bounds(field: str, metadata: Sequence[Any]) -> dict[str, Any]:
    """A field's numeric bounds (pydantic's ``ge``/``gt``/``le``) as the option's range and check."""
    found: dict[str, Any] = {}
    for item in metadata:
        for name, key in (("ge", "min"), ("gt", "min"), ("le", "max")):
            if getattr(item, name, None) is not None:
                found[key] = getattr(item, name)
        if getattr(item, "gt", None) is not None:
            found["callback"] = _above(field, item.gt)
    return found


def _above(field: str, low: float) -> Callable[[float | None], float | None]:
    """A check for a strict lower bound (Click's ranges here are closed)."""

    def check(value: float | None) -> float | None:
        if value is not None and value <= low:
            raise typer.BadParameter(f"{value} is not above {low} ({field} > {low})")
        return value

    return check


def _choice(field: str, choices: Sequence[str]) -> Any:
    """An enum of a ``Literal`` field's values: Click lists them in ``--help`` and refuses others."""
    return StrEnum(field, {choice: choice for choice in choices})


def _settings_option(model: type[Any], field: str, names: tuple[str, ...]) -> Parameter:
    """One command-line option made from a settings field: its type, default, bounds, help, env var."""
    import typing

    from rollout_capture.producer.settings import ENV_NAMES

    info = model.model_fields[field]
    kind = info.annotation
    choices = [str(a) for a in typing.get_args(kind) if a is not type(None)]
    option: dict[str, Any] = {"help": info.description, "envvar": ENV_NAMES.get(field)}
    annotation: Any = str | None
    if kind in (bool, int, float):
        annotation = kind
        option.update(_bounds(field, info.metadata))
    elif typing.get_origin(kind) is typing.Literal:
        annotation = _choice(field, choices)
    if info.is_required():
        default: Any = Parameter.empty
    elif info.default_factory is not None:
        default = None  # a mapping, given as JSON
    else:
        default = info.default
    return Parameter(
        field,
        Parameter.KEYWORD_ONLY,
        annotation=Annotated[annotation, typer.Option(*names, **option)],
        default=default,
    )


def _settings_options(model: type[Any], options: dict[str, tuple[str, ...]]) -> Callable[[Command], Command]:
    """Give a command one option per settings field, handed to it as one ``settings`` mapping.

    Each default, bound and description lives once, on the settings model; ``--help`` shows them.
    """

    def decorate(command: Command) -> Command:
        declared = signature(command, eval_str=True)
        kept = [p.replace(kind=Parameter.KEYWORD_ONLY) for p in declared.parameters.values()]
        kept = [p for p in kept if p.name != "settings"]
        generated = [_settings_option(model, field, names) for field, names in options.items()]

        @functools.wraps(command)
        def run(**given: Any) -> None:
            values = {field: given.pop(field) for field in options}
            values = {k: v.value if isinstance(v, StrEnum) else v for k, v in values.items() if v is not None}
            command(settings=values, **given)

        run.__signature__ = declared.replace(parameters=[*generated, *kept])  # type: ignore[attr-defined]
        return run

    return decorate


@app.command()
@_settings_options(ProxySettings, PROXY_OPTIONS)
def proxy(
    settings: dict[str, Any],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0 picks a free one).")] = 8100,
    log_level: Annotated[LogLevel, typer.Option(help="Log level.")] = LogLevel.info,
    access_log: Annotated[bool, typer.Option(help="Log every request.")] = False,
    as_json: JsonOpt = False,
    http: Annotated[HttpImpl, typer.Option(help="HTTP server protocol.")] = HttpImpl.auto,
    loop: Annotated[LoopImpl, typer.Option(help="Event loop.")] = LoopImpl.auto,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help="Worker processes on the one port, each with its own event loop (one loop is one core).",
        ),
    ] = 1,
) -> None:
    """Reverse proxy in front of a model server, capturing calls under /ng-rollout/<id>/v1/."""
    with _exits(as_json):
        _proxy_stack_available()
        from pydantic import ValidationError

        from rollout_capture.location import describe_errors
        from rollout_capture.producer.proxy import serve_proxy

        if "storage_options" in settings:
            settings["storage_options"] = _options(settings["storage_options"]) or {}
        try:
            validated = ProxySettings(**settings)
        except ValidationError as exc:
            raise InputError(describe_errors(exc)) from None
        logging.basicConfig(level=log_level.value.upper(), format="%(levelname)s %(name)s: %(message)s")
        serve_proxy(
            validated,
            host=host,
            port=port,
            log_level=log_level.value,
            access_log=access_log,
            http=http.value,
            loop=loop.value,
            workers=workers,
            announce=(lambda line: _print_json({"ok": True, "serving": line}))
            if as_json
            else (lambda line: typer.echo(line, err=True)),
        )


CronOpt = Annotated[
    str,
    typer.Option(envvar="ROLLOUT_CAPTURE_CRON", show_envvar=True, help="When the scheduled enrichment runs."),
]
CaptureDirForRunsOpt = Annotated[str | None, typer.Option(help="One capture root for all runs.")]
MaxWorkersOpt = Annotated[int, typer.Option(min=1, help="Batches at once, per run.")]
MaxParallelRunsOpt = Annotated[int, typer.Option(min=1, help="Runs enriched at once.")]


@dataclass(frozen=True)
class Scheduled:
    """The scheduled flow's options ``deploy`` and ``serve`` share, as typed."""

    cron: str
    capture_dir: str | None
    runner: RunnerName
    dask_address: str | None
    ray_address: str | None
    max_workers: int
    max_parallel_runs: int


SCHEDULED_OPTIONS: dict[str, tuple[Any, Any]] = {
    "cron": (CronOpt, "*/15 * * * *"),
    "capture_dir": (CaptureDirForRunsOpt, None),
    "runner": (RunnerOpt, RunnerName.threads),
    "dask_address": (DaskAddressOpt, None),
    "ray_address": (RayAddressOpt, None),
    "max_workers": (MaxWorkersOpt, 8),
    "max_parallel_runs": (MaxParallelRunsOpt, 4),
}
"""The fields of :class:`Scheduled` as options: (annotation, default), declared once for both commands."""


def _scheduled_options(command: Command) -> Command:
    """Give a command the scheduled flow's options as one ``scheduled`` argument (before ``--json``)."""
    declared = signature(command, eval_str=True)
    kept = [p.replace(kind=Parameter.KEYWORD_ONLY) for p in declared.parameters.values()]
    kept = [p for p in kept if p.name != "scheduled"]
    added = [
        Parameter(name, Parameter.KEYWORD_ONLY, annotation=annotation, default=default)
        for name, (annotation, default) in SCHEDULED_OPTIONS.items()
    ]
    _before_json(kept, added)

    @functools.wraps(command)
    def run(**given: Any) -> None:
        scheduled = Scheduled(**{name: given.pop(name) for name in SCHEDULED_OPTIONS})
        command(scheduled=scheduled, **given)

    run.__signature__ = declared.replace(parameters=kept)  # type: ignore[attr-defined]
    return run


def _scheduled(
    storage: Storage, runs_root: str | None, options: Scheduled
) -> tuple[Location, dict[str, Any]]:
    """``deploy`` and ``serve``: the runs root checked (absolute or a URL) and the scheduled flow's
    other parameters; then the API, which both need (a temporary server would forget them)."""
    capture_dir, runner = options.capture_dir, options.runner
    dask_address, ray_address = options.dask_address, options.ray_address
    if not runs_root:
        raise InputError("no runs root: give --runs-root or set ROLLOUT_CAPTURE_RUNS_ROOT")
    local = local_path(runs_root)
    if local is not None and not os.path.isabs(local):
        raise InputError(f"--runs-root must be absolute or a URL (workers resolve it): {runs_root}")
    runs = storage.at(runs_root)  # refused here if bad: every tick would fail
    if capture_dir:
        runs.at(capture_dir)
    _addresses_match(runner, dask_address, ray_address)  # the workers have the extras, maybe not here
    parameters: dict[str, Any] = {
        "runner": runner.value,
        "max_workers": options.max_workers,
        "max_parallel_runs": options.max_parallel_runs,
    }
    given = {"capture_dir": capture_dir, "dask_address": dask_address, "ray_address": ray_address}
    parameters.update({key: value for key, value in given.items() if value})
    parameters.update(runs.flow_parameters())
    _prefect_env()
    if not _api_url():
        raise InputError(
            "deployments live on your Prefect server (one started for this command alone would "
            "forget them): set PREFECT_API_URL first"
        )
    if runs.credentials_block:
        _block_exists(runs.credentials_block)
    return runs, parameters


def _block_exists(block: str) -> None:
    """The named credentials block is on the server (its values never read here): a deployment naming
    a missing one would fail every tick."""
    from rollout_capture.tasks.credentials import require_block

    try:
        require_block(block)
    except ValueError as exc:
        raise InputError(f"credentials block {block!r}: {exc}") from None


@app.command()
@_storage_options(captures=False)
@_scheduled_options
def deploy(
    storage: Storage,
    scheduled: Scheduled,
    runs_root: Annotated[
        str,
        typer.Option(help="Runs root the schedule enriches, as the workers see it: absolute path or URL."),
    ],
    name: Annotated[
        str,
        typer.Option(
            help="The scheduled deployment's name: one per runs root, several side by side on one server."
        ),
    ] = "enrich-completed-runs",
    pool: Annotated[str, typer.Option(help="Work pool (created as a process pool if missing).")] = (
        "rollout-capture"
    ),
    automation: Annotated[
        bool, typer.Option(help="Also create the shipped automations (once per server).")
    ] = True,
    as_json: JsonOpt = False,
) -> None:
    """Register the shipped deployments on the server PREFECT_API_URL names, from this install.

    Workers need rollout-capture installed (pip install 'rollout-capture[aws]' for S3); the
    entrypoints are module paths, so no code is pushed anywhere. Registering a name again
    updates it in place and says what it replaces.
    """
    with _exits(as_json):
        _, parameters = _scheduled(storage, runs_root, scheduled)
        from rollout_capture.deployments.register import register

        done = register(
            runs_root, pool=pool, cron=scheduled.cron, parameters=parameters, automation=automation, name=name
        )
        if as_json:
            _print_json({"ok": True, "api": _api_url(), **done})
            return
        _show([(name, str(ident)) for name, ident in done["deployments"].items()], ("deployment", "id"))
        for replaced, change in done["replaced"].items():
            typer.echo(
                f"{replaced}: registered again, {change}"
                if change == "unchanged"
                else f"replaced {replaced}: {change}",
                err=True,
            )
        typer.echo(f"work pool {pool}: start a worker with `prefect worker start --pool {pool}`", err=True)


@app.command()
@_storage_options(captures=False)
@_scheduled_options
def serve(
    storage: Storage,
    scheduled: Scheduled,
    runs_root: Annotated[
        str | None,
        typer.Option(
            envvar="ROLLOUT_CAPTURE_RUNS_ROOT",
            show_envvar=True,
            help="Runs root the schedule enriches (required): absolute path or URL.",
        ),
    ] = None,
    name: Annotated[
        str,
        typer.Option(
            help="The scheduled deployment's name (NAME-served); another than the default also names "
            "the on-demand ones (NAME-enrich-rollouts-served...): one per serve of another runs root."
        ),
    ] = "enrich-completed-runs",
    as_json: JsonOpt = False,
) -> None:
    """Serve deployments of its own (enrich-completed-runs-served...) from this machine until Ctrl-C.

    Never changes what deploy registered; Ctrl-C pauses only the served ones. Needs PREFECT_API_URL.
    """
    with _exits(as_json):
        runs, parameters = _scheduled(storage, runs_root, scheduled)
        _preflight(folders=[(runs, "runs root")], prefect=False)  # served here: the root is this machine's
        from rollout_capture.deployments.serve import serve_shipped

        try:
            serve_shipped(runs.url, cron=scheduled.cron, parameters=parameters, name=name)  # until Ctrl-C
        except KeyboardInterrupt:
            typer.echo("stopped before serving began", err=True)
            raise typer.Exit(130) from None
        typer.echo(
            "stopped: the served deployments (*-served) are paused; deployments of work pools "
            "were not touched",
            err=True,
        )


@app.command()
@_storage_options(captures=False)
def finish(
    storage: Storage,
    run: Annotated[str, typer.Argument(help="Run folder (<runs_root>/<run>, with its rollouts.jsonl).")],
    as_json: JsonOpt = False,
) -> None:
    """Mark a run finished: write its _SUCCESS and tell the Prefect server, whose deployments of its
    runs root then enrich it at once (without PREFECT_API_URL: the next schedule tick does)."""
    with _exits(as_json):
        where = storage.at(run)
        _prefect_env()
        if not _api_url():  # an event on a server started for this command would reach nobody
            from rollout_capture.run_folders import mark_finished

            finished = mark_finished(where.url, where.storage_options, credentials=None)
            typer.echo(f"no PREFECT_API_URL: no event sent; the next tick enriches {finished}", err=True)
            sent = False
        else:
            from rollout_capture.flows.events import mark_run_finished

            _credentials(where.credentials_block, prefect=False)  # a missing block named, exit 2
            finished = mark_run_finished(where.url, **where.flow_parameters())
            sent = True
        if as_json:
            _print_json({"ok": True, "run": finished, "event_sent": sent})
        else:
            typer.echo(f"finished {finished}" + (": the server was told" if sent else ""))


def main() -> None:
    """Console entry point."""
    # Registered first, so it runs last at exit (after Prefect's drains): the interpreter's final
    # collection over every object Prefect and pydantic built costs a few tenths of a second;
    # frozen, the memory goes back with the process instead.
    atexit.register(gc.freeze)
    run: Callable[[], Any] = app
    sys.exit(run())
