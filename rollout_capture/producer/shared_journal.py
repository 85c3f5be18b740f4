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
from typing import Any, Generic, TypeVar, cast

from rollout_capture.journal import STREAMS, Entry, JournalCommitter, JournalWriter, Stream
from rollout_capture.store import CaptureStore

logger = logging.getLogger("rollout_capture.producer")

T = TypeVar("T")
K = TypeVar("K", int, float)

_LOOKS_KEPT = 4096  # looks a host keeps for the rows still to come (a call that failed never sends one)

Tuning = tuple[int, float, int, float]
"""A stream's pacing as a worker's producer sets it: commits in flight, look delay, looks at once,
and how long rows must wait for their looks before a second goes at once."""


_BUSIEST = (max, min, max, min)
"""How the host joins its workers' :data:`Tuning`, knob by knob: the busiest worker's."""


class SharedJournalError(ConnectionError):
    """The parent's committer could not be asked, or failed the entries: they may or may not have
    landed (the caller marks the rollout incomplete)."""


def _tuning(writer: JournalCommitter) -> Tuning:
    return writer.in_flight, writer.look_delay_s, writer.look_in_flight, writer.rows_wait_share


def _retune(writer: JournalCommitter, tuning: Tuning) -> None:
    writer.in_flight, writer.look_delay_s, writer.look_in_flight, writer.rows_wait_share = tuning


class _Outbox(Generic[T]):
    """What many threads queue for one sender, taken in batches: many messages a frame (each end
    of a link has one: the worker's messages, the parent's answers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._items: list[T] = []
        self._closed = False

    def put(self, item: T) -> bool:
        """Queue ``item``; False once closed (nothing will send it)."""
        with self._lock:
            if self._closed:
                return False
            self._items.append(item)
            if len(self._items) == 1:
                self._wake.notify()
            return True

    def take(self) -> list[T] | None:
        """Everything queued, once something is; None once closed."""
        with self._lock:
            while not self._items and not self._closed:
                self._wake.wait()
            if self._closed:
                return None
            batch, self._items = self._items, []
            return batch

    def close(self) -> list[T]:
        """Stop taking (the sender's :meth:`take` returns None); what was queued and not taken."""
        with self._lock:
            self._closed = True
            left, self._items = self._items, []
            self._wake.notify_all()
            return left


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
    own: JournalWriter  # the worker's own writer of the stream
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
        self._outbox: _Outbox[_Out] = _Outbox()
        self._waiting: dict[int, concurrent.futures.Future[int]] = {}
        self._ids = itertools.count()
        self._broken: str | None = None
        self._started = False

    def committer(self, own: JournalWriter) -> JournalCommitter:
        """The stand-in for ``own``, this process's writer of its stream: it keeps the stream's
        pacing, and commits once the parent is gone (asked once a stream: ``commit_through``)."""
        return _Committer(self, own)

    # -- what the committers send

    def _send(self, out: _Out) -> bool:
        """Queue ``out``; False when the parent is gone (the caller goes to its own writer)."""
        if not self._outbox.put(out):
            return False
        with self._lock:
            if self._started:
                return True
            self._started = True
        for target, name in ((self._sending, "shared-out"), (self._receiving, "shared-in")):
            threading.Thread(target=target, name=f"rollout-capture-{name}", daemon=True).start()
        return True

    def submit(
        self, own: JournalWriter, entries: Sequence[Entry], look: concurrent.futures.Future[int] | None
    ) -> concurrent.futures.Future[int]:
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        if not self._send(_Out("submit", own, future, entries, look)):
            return own.submit(entries, look=look)
        return future

    def look(self, own: JournalWriter) -> concurrent.futures.Future[int]:
        future = _Look(next(self._ids))
        if not self._send(_Out("look", own, future)):
            return own.look()
        return future

    def tune(self, own: JournalWriter) -> None:
        """``own``'s pacing, as just set, told to the parent (nothing to tell once it is gone)."""
        self._send(_Out("tune", own, tuning=_tuning(own)))

    # -- the threads

    def _sending(self) -> None:
        while (batch := self._outbox.take()) is not None:
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
            with self._lock:
                why = self._broken
            if why is not None:  # sent as the parent went: no answer will come
                _fail([out.future for out in framed], why)

    def _message(self, out: _Out) -> tuple[Any, ...] | None:
        """The wire form of ``out`` (its future awaited from now on); None when it failed here."""
        stream = out.own.stream
        if out.kind == "tune":
            return ("tune", stream, out.tuning)
        assert out.future is not None
        message_id = out.future.look_id if isinstance(out.future, _Look) else next(self._ids)
        if out.kind == "look":
            body: tuple[Any, ...] = ("look", message_id, stream)
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
            body = ("submit", message_id, stream, wire, look_id)
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
        took (``unsent``, and what was still to send) goes to this process's own writers, which
        already hold each stream's pacing."""
        never = {id(out.future) for out in unsent}
        with self._lock:
            first, self._broken = self._broken is None, self._broken or why
            waiting = [f for f in self._waiting.values() if id(f) not in never]
            self._waiting = {}
        unsent = [*unsent, *self._outbox.close()]
        if first:
            logger.warning(
                "the proxy's parent process is gone (%s): this worker commits its journal entries "
                "itself; %d in flight there may or may not have landed (their rollouts are marked "
                "incomplete)",
                why,
                sum(not isinstance(f, _Look) for f in waiting),
            )
            self._conn.close()
        _fail(waiting, why)
        for out in unsent:
            if out.kind != "tune" and out.future is not None:
                done = out.own.look() if out.kind == "look" else out.own.submit(out.entries, look=out.look)
                done.add_done_callback(functools.partial(_copy, future=out.future))


def _fail(futures: Sequence[concurrent.futures.Future[int] | None], why: str) -> None:
    """Fail what the parent took and will never answer: it may or may not have landed."""
    for future in futures:
        if future is not None and not future.done():
            future.set_exception(SharedJournalError(f"the proxy's parent process is gone ({why})"))


def _copy(done: concurrent.futures.Future[int], future: concurrent.futures.Future[int]) -> None:
    if future.done():
        return
    error = done.exception()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(done.result())


class _Knob(Generic[K]):
    """A pacing knob of a worker's stand-in: read from the worker's own writer, each change told
    to the parent (:meth:`_Committer._set`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, committer: _Committer, owner: type | None = None) -> K:
        value: K = getattr(committer._own, self._name)
        return value

    def __set__(self, committer: _Committer, value: K) -> None:
        committer._set(self._name, value)


class _Committer:
    """One stream's stand-in in a worker (:class:`~rollout_capture.journal.JournalCommitter`). Its
    pacing is kept on the worker's own writer (idle while the parent commits, it needs that pacing
    once the parent is gone) and each change is sent to the parent, which paces by its busiest
    worker."""

    def __init__(self, journal: SharedJournal, own: JournalWriter) -> None:
        self._journal = journal
        self._own = own
        self.stream: Stream = own.stream

    def _set(self, name: str, value: object) -> None:
        if getattr(self._own, name) != value:
            setattr(self._own, name, value)
            self._journal.tune(self._own)

    in_flight: _Knob[int] = _Knob()
    look_delay_s: _Knob[float] = _Knob()
    look_in_flight: _Knob[int] = _Knob()
    rows_wait_share: _Knob[float] = _Knob()

    def submit(
        self, entries: Sequence[Entry], *, look: concurrent.futures.Future[int] | None = None
    ) -> concurrent.futures.Future[int]:
        return self._journal.submit(self._own, entries, look)

    def write(self, entries: Sequence[Entry]) -> int:
        return self.submit(entries).result()

    def look(self) -> concurrent.futures.Future[int]:
        return self._journal.look(self._own)


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
            unhanded = self._handing.pop(index, None)  # a start of this worker that failed
            self._handing[index] = theirs
            self._links[link_id] = served
            self._tunings[link_id] = dict(self._defaults)
        if unhanded is not None:
            unhanded.close()  # its link then ends as a dead worker's
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

    def tune(self, link_id: int, stream: Stream, tuning: Tuning) -> None:
        """A worker's pacing of ``stream``; the writers follow the busiest worker."""
        with self._lock:
            if link_id in self._tunings:
                self._tunings[link_id][stream] = tuning
            self._pace()

    def forget(self, link_id: int) -> None:
        """A worker gone: its link, and its pacing, no longer count."""
        with self._lock:
            self._tunings.pop(link_id, None)
            self._links.pop(link_id, None)
            self._pace()

    def _pace(self) -> None:
        """Each writer as the busiest worker asks: the most commits and looks in flight, the
        shortest look delay and row wait for a second look (under the lock)."""
        for stream in STREAMS:
            asked = [t[stream] for t in self._tunings.values() if stream in t]
            if asked:
                busiest = tuple(pick(t[i] for t in asked) for i, pick in enumerate(_BUSIEST))
                _retune(self._writers[stream], cast(Tuning, busiest))


class _HostLink:
    """The parent's side of one worker's link: its messages taken in order, its answers sent in batches."""

    def __init__(self, host: JournalHost, link_id: int, sock: socket.socket) -> None:
        self._host = host
        self._id = link_id
        self._sock = sock  # shut down to wake the reading thread when the host closes
        self._conn = Connection(os.dup(sock.fileno()))
        self._answers: _Outbox[tuple[str, int, Any]] = _Outbox()
        self._looks: OrderedDict[int, concurrent.futures.Future[int]] = OrderedDict()

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
        self._answers.put(answer)  # dropped once the link is closed

    def _answering(self) -> None:
        while (batch := self._answers.take()) is not None:
            try:
                self._conn.send_bytes(pickle.dumps(batch, pickle.HIGHEST_PROTOCOL))
            except (OSError, ValueError):
                self.close()
                return

    def close(self) -> None:
        """Stop answering and wake the reading thread (twice is harmless)."""
        self._answers.close()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
