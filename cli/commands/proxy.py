"""``proxy``: the capture proxy in front of a model server, its options made from ``ProxySettings``."""

from __future__ import annotations

import importlib.util
import logging
from enum import StrEnum
from typing import Annotated, Any

import typer

from rollout_capture.cli.options import JsonOpt, parse_storage_options, settings_options
from rollout_capture.cli.output import InputError, Output
from rollout_capture.producer.settings import ENV_NAMES, ProxySettings


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


@settings_options(ProxySettings, PROXY_OPTIONS, ENV_NAMES)
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
    out = Output(json=as_json)
    with out.exits():
        _proxy_stack_available()
        from pydantic import ValidationError

        from rollout_capture.location import describe_errors
        from rollout_capture.producer.server import serve_proxy

        if "storage_options" in settings:
            settings["storage_options"] = parse_storage_options(settings["storage_options"]) or {}
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
            announce=lambda line: out.result({"serving": line}, text=lambda: typer.echo(line, err=True)),
        )
