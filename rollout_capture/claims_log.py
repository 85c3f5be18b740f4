"""The claims log (spec 3 and 11, extension): a producer's claims on a local disk without a
file per call.

Each writer process appends its claims and releases, one ``write`` of one line each
(``O_APPEND``), to a log of its own, ``_claims/{host}-{pid}-{nonce}.jsonl`` under the capture
root, and holds an exclusive ``flock`` on it for as long as it may still release a claim in it.
Creating and removing a claim file per call was 40-60% of a proxy's CPU on ext4; two appends
to a file already open cost a fraction of that.

Lines: ``["claim", R, {claim body}]``, ``["release", R, claim_id]``, and ``["clear", R]``
(written by a clear, from another process, starting on a fresh line): what came before it in
that log for ``R`` is void. A claim is open from its line until its release or a clear of its
rollout, in the same log.

Readers list ``_claims/``, read each log from where they stopped, and try its lock: a log whose
lock they can take belongs to a dead writer, so its open claims are abandoned at once (nobody
can release them any more), and a dead log with nothing open is removed. A log whose lock is held
belongs to a writer that lives: its open claims are live whatever their ``claimed_at``, their TTL
or the reader's clock say (the TTL is for claim files and object stores, where nothing else can
tell). A writer starts a
fresh log (a new name: a log is never truncated nor renamed once readers can see it) when its
log has grown past :data:`MAX_LOG_BYTES`; the old one is removed once nothing in it is open.
A log is only ever removed with nothing open in it, so a log that vanished held no claim.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import math
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import ValidationError

from rollout_capture.claims import Claim, claim_fields, current_time
from rollout_capture.names import CLAIMS_LOG_DIR

logger = logging.getLogger(__name__)

MAX_LOG_BYTES = 1 << 20
"""A log this large is replaced by a fresh one for the next claims (readers read a new log whole)."""
_RESERVE = MAX_LOG_BYTES + (64 << 10)
# Temp files of a writer killed between creating and publishing its log are removed after this.
_STALE_TEMP_S = 60.0
_SUFFIX = ".jsonl"
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FALLOC_FL_KEEP_SIZE = 1
TORN_END = b"\x00\n"
"""Written before a line that may follow a cut one (a writer's short write, another process's
clear): a NUL ends whatever was cut as a line that is not JSON, so a line cut just before its
newline (whole but for it, never acknowledged) is never completed into an entry; alone, it is a
blank line, skipped silently."""


def _reserver() -> Any:
    """libc's ``fallocate`` (Linux), to reserve a log's blocks without changing its size."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fallocate = libc.fallocate
    except (OSError, AttributeError):
        return None
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate.restype = ctypes.c_int
    return fallocate


_fallocate = _reserver()


def _reserve(fd: int) -> None:
    """Reserve the log's blocks ahead: a release (an append) then succeeds on a full disk, as the
    unlink of a claim file did. Best effort: a filesystem without it appends as usual."""
    if _fallocate is not None:
        _fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, _RESERVE)


def _open_folder(root: str, *, create: bool) -> int:
    """``_claims/`` under the root, opened without following a link (the root itself may be one)."""
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        if not create:
            raise
        os.makedirs(root, exist_ok=True)
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            return os.open(CLAIMS_LOG_DIR, _FOLDER, dir_fd=root_fd)
        except FileNotFoundError:
            if not create:
                raise
            with contextlib.suppress(FileExistsError):
                os.mkdir(CLAIMS_LOG_DIR, 0o755, dir_fd=root_fd)
            return os.open(CLAIMS_LOG_DIR, _FOLDER, dir_fd=root_fd)
    finally:
        os.close(root_fd)


def _write_line(fd: int, line: bytes) -> None:
    """One ``write``; a short one raises (the caller starts its next line on a fresh one)."""
    written = os.write(fd, line)
    if written != len(line):
        raise OSError(errno.ENOSPC, f"a claims log line was cut short ({written} of {len(line)} bytes)")


# ---------------------------------------------------------------------------- writing


@dataclass(eq=False, slots=True)
class _Log:
    """One log this process writes: its fd (locked), name, size so far and claims open in it."""

    fd: int
    name: str
    size: int = 0
    open: int = 0
    torn: bool = False

    def append(self, line: bytes) -> None:
        if self.torn:  # an earlier line may have been cut: ended unreadable, this one on its own
            line = TORN_END + line
        try:
            _write_line(self.fd, line)
        except BaseException:
            self.torn = True
            raise
        self.torn = False
        self.size += len(line)


_writers: weakref.WeakSet[ClaimsLogWriter] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A forked child shares its parent's logs (and their locks, through the same open files):
    # it forgets them without unlocking, and writes a log of its own.
    for writer in list(_writers):
        writer._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _own_logs() -> set[str]:
    """The logs this process writes: live whatever a lock says (a disk that emulates ``flock``
    with POSIX locks, NFS, lets a process take a lock its own other descriptor holds)."""
    return {name for writer in list(_writers) for name in list(writer._logs)}


def _close_all(logs: dict[str, _Log]) -> None:
    for log in logs.values():
        with contextlib.suppress(OSError):
            os.close(log.fd)
    logs.clear()


class ClaimsLogWriter:
    """This process's claims log under one capture root (thread-safe; one per store)."""

    def __init__(self, root: str, *, max_bytes: int | None = None) -> None:
        self._root = root
        self._max_bytes = MAX_LOG_BYTES if max_bytes is None else max_bytes
        self._lock = threading.Lock()
        self._current: _Log | None = None
        self._held: dict[str, _Log] = {}  # claim id -> the log its claim is in
        self._logs: dict[str, _Log] = {}  # every log still open, by name
        self._finalizer = weakref.finalize(self, _close_all, self._logs)
        _writers.add(self)

    @property
    def log_names(self) -> list[str]:
        """The logs this writer holds now (the newest last)."""
        with self._lock:
            return list(self._logs)

    def _forget(self) -> None:
        self._lock = threading.Lock()  # a lock held by another thread at the fork stays held
        for log in self._logs.values():
            with contextlib.suppress(OSError):
                os.close(log.fd)  # the parent's descriptor keeps the lock
        self._logs.clear()
        self._held.clear()
        self._current = None

    def _create(self) -> _Log:
        """A fresh log, locked before it is published under its name (never seen unlocked)."""
        nonce = os.urandom(6).hex()
        name = f"{socket.gethostname()}-{os.getpid()}-{nonce}{_SUFFIX}"
        temp = f".tmp-{nonce}"
        for attempt in range(3):
            folder = _open_folder(self._root, create=True)
            try:
                fd = os.open(temp, _NEW, 0o644, dir_fd=folder)
            except FileNotFoundError:  # the folder was removed after it was opened: again
                os.close(folder)
                if attempt == 2:
                    raise
                continue
            except BaseException:
                os.close(folder)
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                _reserve(fd)
                os.rename(temp, name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=folder)
                os.close(fd)
                raise
            finally:
                os.close(folder)
            log = _Log(fd, name)
            self._logs[name] = log
            return log
        raise AssertionError("unreachable")

    def _log_for_claim(self) -> _Log:
        current = self._current
        if current is not None:
            if current.size < self._max_bytes and os.fstat(current.fd).st_nlink:
                return current
            try:
                fresh = self._create()
            except OSError:
                if os.fstat(current.fd).st_nlink:
                    logger.warning("could not start a fresh claims log; %s grows on", current.name)
                    return current  # a full disk: the reserved space of the old one still serves
                raise
            self._current = fresh
            self._retire(current)
            return fresh
        self._current = self._create()
        return self._current

    def _retire(self, log: _Log) -> None:
        """Remove a log no longer written, once nothing in it is open (then close it: unlocked)."""
        if log.open or log is self._current:
            return
        self._logs.pop(log.name, None)
        try:
            folder = _open_folder(self._root, create=False)
        except OSError:
            folder = None
        try:
            if folder is not None:
                with contextlib.suppress(OSError):
                    os.unlink(log.name, dir_fd=folder)
        finally:
            if folder is not None:
                os.close(folder)
            os.close(log.fd)  # after the unlink: a reader never finds it unlocked under its name

    def claim(self, rollout_id: str, claim: Claim) -> None:
        """Append a claim; it is visible to readers when this returns (it raises if not written)."""
        line = orjson.dumps(["claim", rollout_id, claim_fields(claim)], option=orjson.OPT_APPEND_NEWLINE)
        with self._lock:
            log = self._log_for_claim()
            log.append(line)
            log.open += 1
            self._held[claim.claim_id] = log

    def release(self, rollout_id: str, claim_id: str) -> None:
        """Append the release of a claim this writer holds (nothing for one it does not)."""
        line = orjson.dumps(["release", rollout_id, claim_id], option=orjson.OPT_APPEND_NEWLINE)
        with self._lock:
            log = self._held.get(claim_id)
            if log is None:
                return
            log.append(line)  # a failed release keeps the claim open (abandoned once we are gone)
            del self._held[claim_id]
            log.open -= 1
            self._retire(log)  # once nothing in it is open, unless it is the current one

    def close(self) -> None:
        """Remove the logs in which nothing is open (a log with an open claim stays, locked)."""
        with self._lock:
            current, self._current = self._current, None
            for log in list(self._logs.values()):
                self._retire(log)
            if current is not None and current.name in self._logs:
                self._current = current  # still holds open claims: it stays the one written
            if not self._logs:
                with contextlib.suppress(OSError):
                    root_fd = os.open(self._root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    try:
                        os.rmdir(CLAIMS_LOG_DIR, dir_fd=root_fd)  # only when empty
                    finally:
                        os.close(root_fd)


# ---------------------------------------------------------------------------- reading


@dataclass(slots=True)
class _LogState:
    """What a reader knows of one log: how far it read, which claims are open, whether it is dead."""

    ino: int
    offset: int = 0
    held: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    dead_at: float | None = None

    def take(self, line: bytes, name: str) -> None:
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:
            if line.strip(b"\x00 \t\r"):
                logger.warning("claims log %s: a line that is not JSON is skipped", name)
            return
        if not isinstance(entry, list) or len(entry) < 2 or not isinstance(entry[1], str):
            logger.warning("claims log %s: a line of unknown shape is skipped", name)
            return
        op, rollout_id = entry[0], entry[1]
        if op == "claim" and len(entry) == 3 and isinstance(entry[2], dict):
            body = entry[2]
            claim_id = body.get("claim_id")
            self.held.setdefault(rollout_id, {})[claim_id if isinstance(claim_id, str) else line.hex()] = body
        elif op == "release" and len(entry) == 3:
            mine = self.held.get(rollout_id)
            if mine is not None and mine.pop(entry[2], None) is not None and not mine:
                del self.held[rollout_id]
        elif op == "clear":
            self.held.pop(rollout_id, None)
        else:
            logger.warning("claims log %s: an entry of unknown kind %r is skipped", name, op)

    def read(self, fd: int, size: int, name: str) -> None:
        """Take the whole lines written since the last read (a line being written waits)."""
        if size <= self.offset:
            return
        data = os.pread(fd, size - self.offset, self.offset)
        end = data.rfind(b"\n") + 1
        for line in data[:end].split(b"\n"):
            if line:
                self.take(line, name)
        self.offset += end


def _claim(body: dict[str, Any], dead_at: float | None) -> Claim:
    """An open claim as the log's lock tells it: live while its writer holds the lock, whatever
    its ``claimed_at`` or the reader's clock say (the TTL is for stores with no lock to try);
    abandoned from the moment the lock was found free, by the reader's clock alone."""
    try:
        claim = Claim.model_validate(body)
    except ValidationError:
        claim_id = body.get("claim_id")
        claim = Claim(
            claim_id=claim_id if isinstance(claim_id, str) else "unreadable",
            claimed_at=dead_at if dead_at is not None else current_time(),
        )
    claim.expires_at = math.inf if dead_at is None else dead_at
    return claim


def _try_lock(fd: int) -> bool:
    """Whether the log's lock is free (its writer is gone); the lock goes with the fd."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class ClaimsLogReader:
    """The open claims of a capture root's logs, read incrementally (one per store, thread-safe)."""

    def __init__(self, root: str) -> None:
        self._root = root
        self._lock = threading.Lock()
        self._logs: dict[str, _LogState] = {}

    def forget(self) -> None:
        """Forget every log (a listing of the root showed no ``_claims/``)."""
        with self._lock:
            self._logs.clear()

    def refresh(self) -> None:
        """Read every log from where it was left; new logs whole; gone logs forgotten."""
        with self._lock:
            try:
                folder = _open_folder(self._root, create=False)
            except (FileNotFoundError, NotADirectoryError):
                self._logs.clear()
                return
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # a planted link: never followed
                    logger.warning(
                        "%s/%s is a symbolic link; its claims are not read", self._root, CLAIMS_LOG_DIR
                    )
                    self._logs.clear()
                    return
                raise
            try:
                names = os.listdir(folder)
                seen = set()
                for name in names:
                    if name.startswith("."):
                        self._temp(folder, name)
                    elif name.endswith(_SUFFIX):
                        seen.add(name)
                        self._read_log(folder, name)
                for gone in set(self._logs) - seen:
                    del self._logs[gone]
            finally:
                os.close(folder)

    def _read_log(self, folder: int, name: str) -> None:
        try:
            fd = os.open(name, _READ, dir_fd=folder)
        except FileNotFoundError:  # removed since listed: nothing was open in it
            self._logs.pop(name, None)
            return
        except OSError as exc:  # a link planted under a log's name, say: never followed
            logger.warning("claims log %s/%s/%s is not read: %s", self._root, CLAIMS_LOG_DIR, name, exc)
            self._logs.pop(name, None)
            return
        try:
            st = os.fstat(fd)
            state = self._logs.get(name)
            if state is None or state.ino != st.st_ino or st.st_size < state.offset:
                state = self._logs[name] = _LogState(st.st_ino)  # new, or not the log it was: whole
            if state.dead_at is None and name not in _own_logs() and _try_lock(fd):
                state.dead_at = current_time()  # locked first, then read: a dead log is read to its end
                st = os.fstat(fd)
            state.read(fd, st.st_size, name)
            if state.dead_at is not None and not state.held:
                with contextlib.suppress(OSError):  # nothing open and nobody to write: removed
                    os.unlink(name, dir_fd=folder)
                del self._logs[name]
        finally:
            os.close(fd)

    @staticmethod
    def _temp(folder: int, name: str) -> None:
        """Remove a writer's unpublished log left by a writer killed before publishing it."""
        try:
            fd = os.open(name, _READ, dir_fd=folder)
        except OSError:
            return
        try:
            if time.time() - os.fstat(fd).st_mtime > _STALE_TEMP_S and _try_lock(fd):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=folder)
        finally:
            os.close(fd)

    def claims(self, rollout_ids: Iterable[str]) -> dict[str, list[Claim]]:
        """The open claims of these rollouts, as last read (a dead writer's are abandoned)."""
        out: dict[str, list[Claim]] = {}
        with self._lock:
            if not self._logs:
                return out
            for rollout_id in rollout_ids:
                found = [
                    _claim(body, state.dead_at)
                    for state in self._logs.values()
                    for body in state.held.get(rollout_id, {}).values()
                ]
                if found:
                    out[rollout_id] = found
        return out

    def holds(self, rollout_id: str) -> bool:
        """Whether any log held an open claim of the rollout when last read."""
        with self._lock:
            return any(rollout_id in state.held for state in self._logs.values())

    def rollout_ids(self) -> set[str]:
        """Every rollout with an open claim, as last read."""
        with self._lock:
            return {rollout_id for state in self._logs.values() for rollout_id in state.held}

    def clear(self, rollout_ids: Collection[str]) -> None:
        """Void the open claims of these rollouts: a ``clear`` line in each log holding one.

        A dead log left with nothing open is removed by the next read. Raises ``OSError`` when a
        claim survives (a log that could not be written).
        """
        wanted = set(rollout_ids)
        self.refresh()
        with self._lock:
            targets = {name: sorted(wanted.intersection(state.held)) for name, state in self._logs.items()}
        targets = {name: ids for name, ids in targets.items() if ids}
        if not targets:
            return
        try:
            folder = _open_folder(self._root, create=False)
        except FileNotFoundError:  # removed meanwhile: every log in it had nothing open
            return
        try:
            for name, ids in targets.items():
                lines = b"".join(orjson.dumps(["clear", r], option=orjson.OPT_APPEND_NEWLINE) for r in ids)
                try:
                    fd = os.open(name, _APPEND, dir_fd=folder)
                except FileNotFoundError:  # removed meanwhile: nothing was open in it
                    continue
                try:
                    view = memoryview(TORN_END + lines)  # a torn last line stays unread, the only damage
                    while view:
                        view = view[os.write(fd, view) :]
                finally:
                    os.close(fd)
        finally:
            os.close(folder)
        self.refresh()
        left = sorted(wanted.intersection(self.rollout_ids()))
        if left:
            raise OSError(f"{self._root}: claims of {len(left)} rollout(s) survived clearing: {left[:3]}")
