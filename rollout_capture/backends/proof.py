"""Put-if-absent proven before it is relied on: once per store and process, a second create of one
object must be refused.

A conditional request is only as good as the server answering it: ``rclone serve s3`` answers
``PutObject`` with ``If-None-Match: *`` by overwriting, and two producers there lost a third of
their acknowledged rows without an error. So before the first write that needs put-if-absent
(a producer's startup probe, a lease, ``_ENRICHED``, a flow's first create under a root) a probe
object is created, created again (which must fail) and removed: three requests, once per store
(endpoint and bucket) in a process. A store that takes the second create is refused with
:class:`UnsafeStoreError` from then on, naming the store, its endpoint, the request it ignored
and what to do instead; nothing of the caller's is written first, and reading stays possible.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Hashable
from typing import TYPE_CHECKING

from rollout_capture.backends.capabilities import UnsafeStoreError
from rollout_capture.names import probe_name

if TYPE_CHECKING:
    from rollout_capture.backends.base import Backend

_SAFE_STORES = "AWS S3, MinIO, Google Cloud Storage, Azure Blob Storage or a local disk"

logger = logging.getLogger(__name__)
_outcomes: dict[Hashable, UnsafeStoreError | None] = {}  # store -> None (proven) or its refusal
_locks: dict[Hashable, threading.Lock] = {}
_guard = threading.Lock()


def no_put_if_absent(backend: Backend) -> UnsafeStoreError:
    """The refusal of a store whose backend has no put-if-absent request at all (fsspec's)."""
    protocol = backend.store_url().split("://", 1)[0]
    return UnsafeStoreError(
        f"capture store {backend.store_url()} cannot be written: {protocol} has no atomic "
        "create-if-absent (conditional put) in fsspec, so two writers (rows, journal commits, leases, "
        f"_ENRICHED) could replace each other's files; write to {_SAFE_STORES} instead "
        "(reading this store is fine)"
    )


def ignored_condition(backend: Backend) -> UnsafeStoreError:
    """The refusal of a store whose server took a second create of one object."""
    return UnsafeStoreError(
        f"capture store {backend.store_url()} cannot be written: its server (endpoint "
        f"{backend.endpoint()}) accepted a second create of one object ({backend.conditional_request}) "
        "and replaced the first, so it has no put-if-absent: writers sharing it (rows, journal commits, "
        f"leases, _ENRICHED) would silently replace each other's files; write to {_SAFE_STORES} "
        "instead, or to a server that refuses that request when the object exists "
        "(reading this store is fine)"
    )


def require_put_if_absent(backend: Backend) -> None:
    """Return once the store is known to refuse a second create; raise :class:`UnsafeStoreError` if not.

    Proven by a probe under the backend's root the first time a process asks of a store that
    creates by a conditional request; asked again, it is a dictionary lookup.
    """
    capabilities = backend.capabilities
    if not capabilities.writable:
        raise no_put_if_absent(backend)
    if not capabilities.proven_before_use:
        return
    key = backend.store_key()
    if key not in _outcomes:
        with _lock_of(key):
            if key not in _outcomes:  # another thread proved it meanwhile
                prove_put_if_absent(backend, backend.path(probe_name()))
    refusal = _outcomes[key]
    if refusal is not None:
        raise UnsafeStoreError(str(refusal))


def prove_put_if_absent(backend: Backend, path: str) -> None:
    """Create ``path``, create it again (which must fail), remove it; what was learnt is kept.

    The first create also proves the root writable (its error propagates as the store gave it);
    only the second one's success is a refusal. ``path`` is a fresh probe name.
    """
    if not backend.capabilities.writable:
        raise no_put_if_absent(backend)
    with contextlib.suppress(FileExistsError):  # a client's retry of our own landed create
        backend.create_unproven(path, b"")
    try:
        try:
            backend.create_unproven(path, b"second create: must be refused")
        except FileExistsError:
            refusal = None
        else:
            refusal = ignored_condition(backend)
    finally:
        _remove_probe(backend, path)
    if backend.capabilities.proven_before_use:
        _outcomes[backend.store_key()] = refusal
    if refusal is not None:
        raise refusal


def _remove_probe(backend: Backend, path: str) -> None:
    """The probe removed; a store refusing deletes (credentials without the right) leaves it, said
    in a warning naming it, rather than failing the proof it took no part in."""
    try:
        backend.remove([path])
    except PermissionError as exc:
        probe = f"{backend.store_url()}/{path.rsplit('/', 1)[-1]}"
        logger.warning(
            "put-if-absent of %s proven, but its probe %s could not be removed (%s): it stays there "
            "(nothing reads it; each process proving the store leaves one): delete it by hand, or let "
            "these credentials delete objects there",
            backend.store_url(),
            probe,
            exc,
        )


def forget_proofs() -> None:
    """Forget every store proven or refused in this process (a fresh process's state, for tests)."""
    with _guard:
        _outcomes.clear()


def _lock_of(key: Hashable) -> threading.Lock:
    with _guard:
        return _locks.setdefault(key, threading.Lock())
