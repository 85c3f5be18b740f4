"""Serving the capture proxy: ``serve_proxy`` binds its sockets, runs uvicorn on them, and with
``workers=N`` runs N worker processes on one port (see ``workers.py``); the app itself is
:class:`~rollout_capture.producer.proxy.CaptureProxy`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import uvicorn

from rollout_capture.producer.proxy import CaptureProxy
from rollout_capture.producer.settings import ProxySettings

if TYPE_CHECKING:
    from rollout_capture.producer.shared_journal import JournalHost

logger = logging.getLogger("rollout_capture.producer")


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket whose connections have Nagle off.

    IPPROTO_TCP, not 0: asyncio disables Nagle only on sockets that say they are TCP, and
    connections of a pre-bound socket would otherwise stall 40 ms on delayed ACKs.
    """
    return _listener(host, port, "no")


def bind_listeners(host: str, port: int, count: int) -> list[socket.socket]:
    """Listening sockets on one port for ``count`` worker processes: one each on Linux.

    One socket shared by all lets whichever worker wakes first accept every connection
    waiting (asyncio takes them all): a burst of keep-alive clients lands on one worker
    (measured: 32 of 32). Sockets of their own with SO_REUSEPORT have the kernel spread new
    connections over them instead. The first is bound before SO_REUSEPORT is set, so a port
    another server holds is refused as usual rather than silently shared with it. Elsewhere
    (no SO_REUSEPORT balancing): one socket, shared.
    """
    if count == 1 or not sys.platform.startswith("linux"):
        return [bind_listener(host, port)]
    sockets = [_listener(host, port, "after_bind")]
    try:
        bound = sockets[0].getsockname()[1]
        sockets.extend(_listener(host, bound, "before_bind") for _ in range(count - 1))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _listener(host: str, port: int, reuse_port: Literal["no", "after_bind", "before_bind"]) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port == "before_bind":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if reuse_port == "after_bind":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass(frozen=True)
class ServerOptions:
    """uvicorn's side of serving, the same in the one process or in every worker."""

    log_level: str = "info"
    access_log: bool = False
    http: Literal["auto", "h11", "httptools"] = "auto"
    loop: Literal["auto", "asyncio", "uvloop"] = "auto"


def _server(app: CaptureProxy, options: ServerOptions) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        lifespan="on",
        log_level=options.log_level,
        access_log=options.access_log,
        http=options.http,
        loop=options.loop,
        timeout_graceful_shutdown=max(1, math.ceil(app.settings.shutdown_grace_s)),
        server_header=False,  # the upstream's own Server and Date headers pass through
        date_header=False,
    )
    return uvicorn.Server(config)


class _WorkerProxy(CaptureProxy):
    """The proxy of one worker process: its writer stops with its lifespan.

    A worker's process ends as soon as its server returns (uvicorn raises the stop signal
    again), so nothing after that would run.
    """

    async def aclose(self) -> None:
        await super().aclose()
        await asyncio.to_thread(self.close_writer)


def _serve_worker(
    settings_json: str, sock: socket.socket, options: ServerOptions, journal_link: socket.socket | None = None
) -> None:
    """A worker process: its own loop, proxy, upstream pool and capture writer on the shared socket;
    ``journal_link``: its link to the parent's journal committers, which the workers share.

    Settings come as JSON and are validated again here (no secrets ever travel: they are refused).
    """
    from rollout_capture.producer.workers import STARTUP_FAILURE, follow_parent

    follow_parent()
    if not logging.getLogger().handlers:  # spawned: nothing configured logging here yet
        logging.basicConfig(level=options.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        app = _WorkerProxy(ProxySettings.model_validate_json(settings_json), journal_link=journal_link)
    except Exception:
        logger.exception("a proxy worker could not start")
        sys.exit(STARTUP_FAILURE)
    server = _server(app, options)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # a forced stop (a second SIGINT): uvicorn raises it again once done
        pass
    finally:
        app.close_writer()  # after a forced stop: no lifespan shutdown ran
    if not server.started:  # its lifespan startup failed
        sys.exit(STARTUP_FAILURE)


def serve_proxy(
    settings: ProxySettings,
    *,
    host: str = "127.0.0.1",
    port: int = 8100,
    log_level: str = "info",
    access_log: bool = False,
    http: Literal["auto", "h11", "httptools"] = "auto",
    loop: Literal["auto", "asyncio", "uvloop"] = "auto",
    announce: Callable[[str], None] | None = None,
    workers: int = 1,
) -> None:
    """Run the proxy until SIGINT/SIGTERM; calls in flight get ``shutdown_grace_s`` to finish.

    Port 0 picks a free port; ``announce`` is told the address actually bound. ``http`` and
    ``loop`` are uvicorn's (auto: the C httptools parser and uvloop when installed).
    ``workers`` > 1 serves from that many spawned processes on the one port, each with its
    own loop, upstream pool (``max_connections`` each) and capture writer: one loop is one core.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1; got {workers}")
    options = ServerOptions(log_level=log_level, access_log=access_log, http=http, loop=loop)
    app = CaptureProxy(settings)  # bad settings fail here, before anything is bound
    journal = None
    if workers > 1:
        app.close_writer()  # a check here; each worker opens its own, committing the journal here
        if settings.enabled and app.writer.store.layout == "journal":
            from rollout_capture.producer.shared_journal import JournalHost

            journal = JournalHost(app.writer.store)
    sockets = bind_listeners(host, port, workers)
    bound = sockets[0].getsockname()[1]
    if announce is not None:
        shown = f"[{host}]" if sockets[0].family == socket.AF_INET6 else host
        many = f" ({workers} workers)" if workers > 1 else ""
        announce(f"rollout-capture proxy on http://{shown}:{bound} -> {settings.upstream}{many}")
    if workers > 1:
        try:
            _serve_workers(settings, sockets, options, workers, journal)
        finally:
            if journal is not None:
                journal.close()
        return
    server = _server(app, options)
    try:
        server.run(sockets=sockets)
    finally:
        app.close_writer()
        for sock in sockets:
            sock.close()


def _serve_workers(
    settings: ProxySettings,
    sockets: list[socket.socket],
    options: ServerOptions,
    workers: int,
    journal: JournalHost | None,
) -> None:
    """``serve_proxy`` of ``workers`` > 1: spawned worker processes on the bound sockets, supervised;
    with the journal layout each hands its entries to ``journal``, this process's committers, so the
    workers' calls share commits and never race each other for the journal's numbers (issue 48)."""
    from rollout_capture.producer.workers import supervise

    settings_json = settings.model_dump_json()

    def close_sockets() -> None:
        for sock in sockets:
            sock.close()

    try:
        supervise(
            _serve_worker,
            lambda index: (
                settings_json,
                sockets[index % len(sockets)],
                options,
                journal.link(index) if journal is not None else None,
            ),
            workers,
            # A stuck worker is killed once its stop took well past both its waits (calls, writes).
            stop_timeout_s=2 * settings.shutdown_grace_s + 30,
            on_stop=close_sockets,  # once the workers close theirs, new connections are refused
            started=journal.handed if journal is not None else None,
            name="proxy worker",
        )
    finally:
        close_sockets()
