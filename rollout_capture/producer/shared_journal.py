"""The journal committers a proxy's worker processes share (issue 48).

Workers that each ran committers of their own raced each other for the journal's numbers on one
stream: creates refused (412) and retried, looks past each other's commits, waits for numbers the
other held, each commit carrying half the calls (2.1 store requests a call against 0.73 for one
worker, p99 tens of seconds, measured on S3). Now the parent runs one committer a stream
(:class:`JournalHost`, the :class:`~rollout_capture.journal.JournalWriter` of its store) and each
worker hands its entries to them over a socket pair of its own (:class:`SharedJournal`): the
protocol sees one writer, and every worker's calls ride in its commits.

A worker whose parent is gone (killed outright) commits on its own again: what it had sent and not
heard back about fails (the caller marks the rollout incomplete, as for any write that may or may
not have landed), what it had not sent yet goes to its own writer.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
import pickle
import socket
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from rollout_capture.journal import STREAMS, Entry, JournalCommitter, JournalWriter, Stream
from rollout_capture.store import CaptureStore

logger = logging.getLogger("rollout_capture.producer")

_LOOKS_KEPT = 4096  # looks a host keeps for the rows still to come (a call that failed never sends one)

Tuning = tuple[int, float, int]
"""A stream's pacing as a worker's producer sets it: commits in flight, look delay, looks at once."""


class SharedJournalError(ConnectionError):
    """The parent's committer could not be asked, or failed the entries: they may or may not have
    landed (the caller marks the rollout incomplete)."""


def _tuning(writer: JournalCommitter) -> Tuning:
    return writer.in_flight, writer.look_delay_s, writer.look_in_flight


# ---------------------------------------------------------------------------------------- the worker


class _Look(concurrent.futures.Future[int]):
    """A look asked of the parent, named so the row that lands above it can name it back."""

    def __init__(self, look_id: int) -> None:
        super().__init__()
        self.look_id = look_id


@dataclass(slots=True)
class _Out:
    """Something to send: a submission, a look, or a stream's tuning."""

    kind: str
    stream: Stream
    future: concurrent.futures.Future[int] | None = None
    entries: Sequence[Entry] = ()
    look: concurrent.futures.Future[int] | None = None
    tuning: Tuning | None = None


class SharedJournal:
    """A worker's end: a committer a stream that hands entries and looks to the parent's.

    One thread sends (building rows off the caller's loop, many messages a frame), one receives
    the answers; both start with the first message.
    """

    def __init__(self, link: socket.socket) -> None:
        self._conn = Connection(link.detach())  # ours alone: nothing else reads or writes it
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._outbox: list[_Out] = []
        self._waiting: dict[int, concurrent.futures.Future[int]] = {}
        self._ids = itertools.count()
        self._broken: str | None = None
        self._started = False
        self._own: dict[Stream, JournalWriter] = {}
        self._committers: dict[Stream, _Committer] = {}

    def committer(self, own: JournalWriter) -> JournalCommitter:
        """The stand-in for ``own`` (this process's writer of its stream, used once the parent is gone)."""
        with self._lock:
            self._own[own.stream] = own
            found = self._committers.get(own.stream)
            if found is None:
                found = self._committers[own.stream] = _Committer(self, own.stream, _tuning(own))
            return found

    # -- what the committers send

    def _send(self, out: _Out) -> concurrent.futures.Future[int] | None:
        """Queue ``out``; None when the parent is gone (the caller goes to its own writer)."""
        with self._lock:
            if self._broken is not None:
                return None
            self._outbox.append(out)
            if len(self._outbox) == 1:
                self._wake.notify()
            if not self._started:
                self._started = True
                for target, name in ((self._sending, "shared-out"), (self._receiving, "shared-in")):
                    threading.Thread(target=target, name=f"rollout-capture-{name}", daemon=True).start()
        return out.future

    def submit(
        self, stream: Stream, entries: Sequence[Entry], look: concurrent.futures.Future[int] | None
    ) -> concurrent.futures.Future[int]:
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        if self._send(_Out("submit", stream, future, entries, look)) is None:
            return self._own[stream].submit(entries, look=look)
        return future

    def look(self, stream: Stream) -> concurrent.futures.Future[int]:
        future = _Look(next(self._ids))
        if self._send(_Out("look", stream, future)) is None:
            return self._own[stream].look()
        return future

    def tune(self, stream: Stream, tuning: Tuning) -> None:
        if self._send(_Out("tune", stream, tuning=tuning)) is None:
            _retune(self._own[stream], tuning)

    # -- the threads

    def _sending(self) -> None:
        while True:
            with self._lock:
                while not self._outbox and self._broken is None:
                    self._wake.wait()
                if self._broken is not None:
                    return
                batch, self._outbox = self._outbox, []
            frame, framed = [], []
            for out in batch:
                message = self._message(out)
                if message is not None:
                    frame.append(message)
                    framed.append(out)
            try:
                self._conn.send_bytes(pickle.dumps(frame, pickle.HIGHEST_PROTOCOL))
            except (OSError, ValueError) as exc:
                # A frame not sent whole was taken by no one (the parent reads whole frames): its
                # entries go to this process's own writer with what was not sent yet.
                self._lose(f"{type(exc).__name__}: {exc}", framed)
                return

    def _message(self, out: _Out) -> tuple[Any, ...] | None:
        """The wire form of ``out`` (its future awaited from now on); None when it failed here."""
        if out.kind == "tune":
            return ("tune", out.stream, out.tuning)
        assert out.future is not None
        message_id = out.future.look_id if isinstance(out.future, _Look) else next(self._ids)
        if out.kind == "look":
            body: tuple[Any, ...] = ("look", message_id, out.stream)
        else:
            try:  # a row built here, off the caller's loop; one that cannot be fails its own call only
                out.entries = [
                    e if not callable(e.line) else Entry(e.op, e.rollout_id, e.line(), e.claim_id)
                    for e in out.entries
                ]
            except Exception as exc:
                out.future.set_exception(exc)
                return None
            wire = [(e.op, e.rollout_id, e.line, e.claim_id) for e in out.entries]
            look_id = out.look.look_id if isinstance(out.look, _Look) else None
            body = ("submit", message_id, out.stream, wire, look_id)
        with self._lock:
            self._waiting[message_id] = out.future
        return body

    def _receiving(self) -> None:
        while True:
            try:
                frame = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError) as exc:
                self._lose(type(exc).__name__)
                return
            for kind, message_id, value in frame:
                with self._lock:
                    future = self._waiting.pop(message_id, None)
                if future is None or future.done():
                    continue
                if kind == "ok":
                    future.set_result(value)
                else:
                    future.set_exception(SharedJournalError(f"the proxy's journal committer: {value}"))

    def _lose(self, why: str, unsent: Sequence[_Out] = ()) -> None:
        """The parent is gone: what it took fails (it may or may not have landed); what it never
        took (``unsent``, and what was still to send) goes to this process's own writers."""
        with self._lock:
            if self._broken is not None:
                return
            self._broken = why
            never = {id(out.future) for out in unsent}
            waiting = {k: f for k, f in self._waiting.items() if id(f) not in never}
            self._waiting = {}
            unsent = [*unsent, *self._outbox]
            self._outbox = []
            self._wake.notify_all()
        logger.warning(
            "the proxy's parent process is gone (%s): this worker commits its journal entries itself; "
            "%d in flight there may or may not have landed (their rollouts are marked incomplete)",
            why,
            sum(not isinstance(f, _Look) for f in waiting.values()),
        )
        for future in waiting.values():
            if not future.done():
                future.set_exception(SharedJournalError(f"the proxy's parent process is gone ({why})"))
        for out in unsent:
            own = self._own[out.stream]
            if out.kind == "tune":
                assert out.tuning is not None
                _retune(own, out.tuning)
            elif out.future is not None:
                done = own.look() if out.kind == "look" else own.submit(out.entries, look=out.look)
                done.add_done_callback(functools.partial(_copy, future=out.future))
        with self._lock:
            committers = list(self._committers.values())
        for committer in committers:
            _retune(self._own[committer.stream], committer.tuning)
        self._conn.close()


def _copy(done: concurrent.futures.Future[int], future: concurrent.futures.Future[int]) -> None:
    if future.done():
        return
    error = done.exception()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(done.result())


def _retune(writer: JournalCommitter, tuning: Tuning) -> None:
    writer.in_flight, writer.look_delay_s, writer.look_in_flight = tuning


class _Committer:
    """One stream's stand-in in a worker (:class:`~rollout_capture.journal.JournalCommitter`): its
    pacing knobs go to the parent too, which paces by its busiest worker."""

    def __init__(self, journal: SharedJournal, stream: Stream, tuning: Tuning) -> None:
        self._journal = journal
        self.stream: Stream = stream
        self._tuning = tuning

    @property
    def tuning(self) -> Tuning:
        return self._tuning

    def _set(self, tuning: Tuning) -> None:
        if tuning != self._tuning:
            self._tuning = tuning
            self._journal.tune(self.stream, tuning)

    @property
    def in_flight(self) -> int:
        return self._tuning[0]

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        self._set((value, self._tuning[1], self._tuning[2]))

    @property
    def look_delay_s(self) -> float:
        return self._tuning[1]

    @look_delay_s.setter
    def look_delay_s(self, value: float) -> None:
        self._set((self._tuning[0], value, self._tuning[2]))

    @property
    def look_in_flight(self) -> int:
        return self._tuning[2]

    @look_in_flight.setter
    def look_in_flight(self, value: int) -> None:
        self._set((self._tuning[0], self._tuning[1], value))

    def submit(
        self, entries: Sequence[Entry], *, look: concurrent.futures.Future[int] | None = None
    ) -> concurrent.futures.Future[int]:
        return self._journal.submit(self.stream, entries, look)

    def write(self, entries: Sequence[Entry]) -> int:
        return self.submit(entries).result()

    def look(self) -> concurrent.futures.Future[int]:
        return self._journal.look(self.stream)


# ---------------------------------------------------------------------------------------- the parent


class JournalHost:
    """The parent's committers (its store's journal writers), serving each worker over a socket
    pair: :meth:`link` makes one for a worker about to start, :meth:`handed` lets go of the
    worker's end once it started (so a worker that dies is seen gone). Paced by the busiest worker:
    the most commits in flight any asks for, the shortest look delay."""

    def __init__(self, store: CaptureStore) -> None:
        self._writers = {stream: store.journal_writer_of(stream) for stream in STREAMS}
        # Where a worker's committers start (its own writers' defaults, as the parent's): until it
        # says otherwise, each worker counts as asking for these.
        self._defaults = {stream: _tuning(writer) for stream, writer in self._writers.items()}
        self._lock = threading.Lock()
        self._tunings: dict[int, dict[Stream, Tuning]] = {}
        self._handing: dict[int, socket.socket] = {}
        self._links: dict[int, _HostLink] = {}
        self._ids = itertools.count()

    def link(self, index: int) -> socket.socket:
        """A new link for worker ``index``: the worker's end (passed to it when it is spawned)."""
        ours, theirs = socket.socketpair()
        link_id = next(self._ids)
        served = _HostLink(self, link_id, ours)
        with self._lock:
            self._handing[index] = theirs
            self._links[link_id] = served
            self._tunings[link_id] = dict(self._defaults)
        threading.Thread(target=served.run, name=f"rollout-capture-journal-host-{index}", daemon=True).start()
        return theirs

    def handed(self, index: int) -> None:
        """Worker ``index`` started: its end now lives in it alone."""
        with self._lock:
            theirs = self._handing.pop(index, None)
        if theirs is not None:
            theirs.close()

    def close(self) -> None:
        """Stop serving (the workers have stopped): the links close, commits in flight land."""
        with self._lock:
            links = list(self._links.values())
            handing, self._handing = list(self._handing.values()), {}
        for theirs in handing:
            theirs.close()
        for served in links:
            served.close()

    def writer(self, stream: Stream) -> JournalCommitter:
        return self._writers[stream]

    def tune(self, link_id: int, stream: Stream, tuning: Tuning | None) -> None:
        """A worker's pacing of ``stream`` (None: the worker is gone); the writers follow the busiest."""
        with self._lock:
            if tuning is None:
                self._tunings.pop(link_id, None)
            elif link_id in self._tunings:
                self._tunings[link_id][stream] = tuning
            for each in STREAMS:
                asked = [t[each] for t in self._tunings.values() if each in t]
                if not asked:
                    continue
                _retune(
                    self._writers[each],
                    (max(t[0] for t in asked), min(t[1] for t in asked), max(t[2] for t in asked)),
                )

    def forget(self, link_id: int) -> None:
        self.tune(link_id, STREAMS[0], None)
        with self._lock:
            self._links.pop(link_id, None)


class _HostLink:
    """The parent's side of one worker's link: its messages taken in order, its answers sent in batches."""

    def __init__(self, host: JournalHost, link_id: int, sock: socket.socket) -> None:
        self._host = host
        self._id = link_id
        self._sock = sock  # shut down to wake the reading thread when the host closes
        self._conn = Connection(os.dup(sock.fileno()))
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._answers: list[tuple[str, int, Any]] = []
        self._looks: OrderedDict[int, concurrent.futures.Future[int]] = OrderedDict()
        self._closed = False

    def run(self) -> None:
        threading.Thread(target=self._answering, name="rollout-capture-journal-answers", daemon=True).start()
        try:
            while True:
                try:
                    frame = pickle.loads(self._conn.recv_bytes())
                except (EOFError, OSError):
                    return
                for message in frame:
                    self._take(message)
        finally:
            self.close()
            self._conn.close()
            self._host.forget(self._id)

    def _take(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "tune":
            self._host.tune(self._id, message[1], message[2])
            return
        message_id, stream = message[1], message[2]
        writer = self._host.writer(stream)
        if kind == "look":
            future = writer.look()
            self._looks[message_id] = future
            while len(self._looks) > _LOOKS_KEPT:
                self._looks.popitem(last=False)
        else:
            wire, look_id = message[3], message[4]
            entries = [Entry(op, rollout_id, line, claim_id) for op, rollout_id, line, claim_id in wire]
            look = self._looks.pop(look_id, None) if look_id is not None else None
            try:
                future = writer.submit(entries, look=look)
            except Exception as exc:  # pragma: no cover - submit never raises on the store
                self._answer(message_id, exc)
                return
        future.add_done_callback(lambda done: self._answer(message_id, done))

    def _answer(self, message_id: int, done: concurrent.futures.Future[int] | BaseException) -> None:
        if isinstance(done, BaseException):
            answer: tuple[str, int, Any] = ("error", message_id, f"{type(done).__name__}: {done}")
        elif (error := done.exception()) is not None:
            answer = ("error", message_id, f"{type(error).__name__}: {error}")
        else:
            answer = ("ok", message_id, done.result())
        with self._lock:
            if self._closed:
                return
            self._answers.append(answer)
            if len(self._answers) == 1:
                self._wake.notify()

    def _answering(self) -> None:
        while True:
            with self._lock:
                while not self._answers and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                batch, self._answers = self._answers, []
            try:
                self._conn.send_bytes(pickle.dumps(batch, pickle.HIGHEST_PROTOCOL))
            except (OSError, ValueError):
                self.close()
                return

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
