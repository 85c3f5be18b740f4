"""Prefect from a command: its environment set before it loads, the API a command talks to (or a
temporary server, announced), the pre-flight check of every input before any server starts, the
credentials blocks, and a flow run with Prefect's console tamed. Prefect is imported only inside
functions (here and in the commands), so a command that runs no flow never loads it."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from rollout_capture.cli.output import InputError

if TYPE_CHECKING:
    from rollout_capture.cli.options import Storage
    from rollout_capture.location import Location

T = TypeVar("T")

# A loaded node (a training job beside it) takes far longer than Prefect's 20 s default.
TEMPORARY_SERVER_STARTUP_S = "180"
TEMPORARY_SERVER_NOTE = "starting a temporary Prefect server; set PREFECT_API_URL to use your own"


def prefect_env() -> None:
    """No telemetry; a patient temporary server unless PREFECT_API_URL names one; core logs in the UI.

    Environment defaults only (the user's own settings win); set before Prefect is imported.
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "rollout_capture")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", TEMPORARY_SERVER_STARTUP_S)


def api_url() -> str | None:
    """The Prefect API this process talks to (environment or profile); None: a temporary server."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def start_prefect() -> None:
    """Called once the input is known to be good: say when a temporary server is about to start."""
    prefect_env()
    if not api_url():
        typer.echo(TEMPORARY_SERVER_NOTE, err=True)


class _WithoutTraceback(logging.Formatter):
    """Formats like ``inner`` but leaves the traceback to the API logs (the Prefect UI), and shows
    control characters escaped."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        from rollout_capture.printable import printable_lines, printable_log_message

        self._printable, self._message = printable_lines, printable_log_message
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.msg, record.args
        record.exc_info, record.exc_text = None, None
        record.msg, record.args = self._message(record), None  # a line break in a name splits no line
        try:  # a model name or detail from a record in a log line acts on no terminal
            return self._printable(self.inner.format(record))
        finally:
            record.exc_info, record.exc_text, record.msg, record.args = saved


def _terminal_logging() -> None:
    """At a terminal, a failed run is one line from Prefect and one ``error:`` line from us."""
    from rollout_capture.flows.console import prefect_console_handlers

    for handler in prefect_console_handlers():
        if not isinstance(handler.formatter, _WithoutTraceback):
            handler.setFormatter(_WithoutTraceback(handler.formatter))


def check_file(where: Location, credentials: Any, what: str) -> None:
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


def credentials(block: str | None, prefect: bool) -> Any:
    """The block's credentials, as the flow will resolve them (Prefect started first: its API holds it)."""
    if not block:
        return None
    if importlib.util.find_spec("prefect_aws") is None:
        raise InputError("--credentials-block needs prefect-aws: pip install 'rollout-capture[aws]'")
    if prefect:
        start_prefect()
    from rollout_capture.tasks.credentials import credentials_from_block

    try:
        return credentials_from_block(block)
    except ValueError as exc:
        raise InputError(f"credentials block {block!r}: {exc}") from None


def block_exists(block: str) -> None:
    """The named credentials block is on the server (its values never read here): a deployment naming
    a missing one would fail every tick."""
    from rollout_capture.tasks.credentials import require_block

    try:
        require_block(block)
    except ValueError as exc:
        raise InputError(f"credentials block {block!r}: {exc}") from None


def preflight(
    *,
    files: Sequence[tuple[Location, str]] = (),
    capture_dirs: Sequence[Location] = (),
    folders: Sequence[tuple[Location, str]] = (),
    creates: Sequence[Location] = (),
    prefect: bool = True,
) -> None:
    """Check every input before any Prefect server starts, with the credentials the flow will use.

    ``files``: (location, what) that must be regular files; ``capture_dirs``: capture roots that
    must be there (a folder on disk, a key under an object prefix); ``folders``: (location, what)
    roots that must exist where folders exist apart from their contents (a disk; an object prefix
    with nothing under it is fine); ``creates``: roots the flow will create files in put-if-absent
    (leases, ``_ENRICHED``), whose store must be proven to refuse a second create. Only a credentials
    block needs Prefect (its API holds the block): then the server is started first, and the
    block's absence is bad input too.
    """
    from rollout_capture.backends import open_backend
    from rollout_capture.faults import missing_capture_dir, refusal_named

    every = [*(where for where, _ in files), *capture_dirs, *(where for where, _ in folders)]
    block = next((where.credentials_block for where in every if where.credentials_block), None)
    resolved = credentials(block, prefect)
    for where, what in files:
        with refusal_named(where.url, block, what):  # a refusal names the store and the credentials
            check_file(where, resolved, what)
    for where in capture_dirs:
        with refusal_named(where.url, block, "capture dir"):
            if not where.capture_store(resolved, shared=False).root_found():
                raise InputError(missing_capture_dir(where.url))
    for where, what in folders:
        with refusal_named(where.url, block, what):
            backend = open_backend(where.url, where.storage_options, credentials=resolved)
            found = backend.root_found()  # one LIST: on an object store, the credentials proved here
        if backend.folders_exist and not found:
            raise InputError(f"{what} not found: {where}")
    for where in creates:  # a store ignoring put-if-absent: refused (exit 2) before anything is written
        with refusal_named(where.url, block):
            open_backend(where.url, where.storage_options, credentials=resolved).require_put_if_absent()
    if prefect and not block:
        start_prefect()


def rollouts_and_captures(storage: Storage, rollouts: str) -> tuple[Location, Location]:
    """``enrich``, ``demo`` and ``clear``: both inputs as the flow reads them, checked before it starts."""
    captures = storage.captures()
    source = captures.at(rollouts)
    preflight(files=[(source, "rollouts file")], capture_dirs=storage.must_exist(captures))
    return source, captures


@contextmanager
def _progress(show: bool) -> Iterator[None]:
    """Progress bars on a TTY (never with --json: stdout is for the summary)."""
    if not show:
        yield
        return
    from rollout_capture.flows.terminal import progress_bars

    with progress_bars():
        yield


def flow_run(progress: bool, start: Callable[[], T]) -> T:
    """Run a flow (its input already checked): Prefect's console tamed, progress bars at a TTY."""
    import rollout_capture.flows.enrich  # noqa: F401 - Prefect sets its console handlers up on import

    _terminal_logging()
    with _progress(progress):
        return start()
