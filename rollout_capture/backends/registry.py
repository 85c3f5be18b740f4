"""Which backend a filesystem gets: a table keyed by fsspec protocol, as ``fsspec.registry``
picks a filesystem class by protocol. A store missing from it gets the generic object-store
backend, which reads anything fsspec reads and refuses writes it cannot make safe.

Adding a store with requests of its own (Azure's conditional puts, say) is a subclass of
:class:`~rollout_capture.backends.object_store.ObjectStoreBackend` and a line here.
"""

from __future__ import annotations

import fsspec
from fsspec.implementations.local import LocalFileSystem

from rollout_capture.backends.base import Backend
from rollout_capture.backends.object_store import AtomicCreateBackend, ObjectStoreBackend, ProcessLocalBackend
from rollout_capture.backends.posix import PosixBackend
from rollout_capture.backends.s3 import S3Backend
from rollout_capture.filesystem import is_local, protocols_of

BACKENDS: dict[str, type[Backend]] = {
    **dict.fromkeys(LocalFileSystem.protocol, PosixBackend),  # file, local
    "s3": S3Backend,
    "s3a": S3Backend,
    "gs": AtomicCreateBackend,  # gcsfs creates with ifGenerationMatch=0: one conditional request
    "gcs": AtomicCreateBackend,
    "memory": ProcessLocalBackend,
}
"""fsspec protocol -> the backend class for a capture root on it."""

DEFAULT_BACKEND: type[Backend] = ObjectStoreBackend
"""The backend of any protocol not in :data:`BACKENDS` (Azure, SFTP, ``dir://``...): read-only."""

ATOMIC_CREATE_PROTOCOLS = frozenset(p for p, c in BACKENDS.items() if getattr(c, "atomic_create", False))
"""Stores whose fsspec filesystem creates a file only if absent in one request (safe for many writers)."""
PROCESS_LOCAL_PROTOCOLS = frozenset(p for p, c in BACKENDS.items() if getattr(c, "process_local", False))
"""Stores that live in one process: creating under a lock is atomic there (tests, one-process tools)."""


def backend_class(fs: fsspec.AbstractFileSystem) -> type[Backend]:
    """The backend class for an opened filesystem: the local disk's when it is local (decided by
    :func:`rollout_capture.filesystem.is_local`), else the first of its protocols in the table."""
    if is_local(fs):
        return BACKENDS["file"]
    for protocol in protocols_of(fs):
        if protocol in BACKENDS:
            return BACKENDS[protocol]
    return DEFAULT_BACKEND
