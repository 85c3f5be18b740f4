"""Which backend a filesystem gets: a table keyed by fsspec protocol, as ``fsspec.registry``
picks a filesystem class by protocol. A store missing from it gets the generic object-store
backend, which reads anything fsspec reads and refuses writes it cannot make safe.

Adding a store with requests of its own is a subclass of
:class:`~rollout_capture.backends.object_store.ObjectStoreBackend` and a line here. What a
store can do (:class:`~rollout_capture.backends.capabilities.Capabilities`) is its class's to say,
asked of the opened backend (``backend.capabilities``).
"""

from __future__ import annotations

import os

import fsspec
from fsspec.implementations.local import LocalFileSystem

from rollout_capture.backends.azure import AzureBackend
from rollout_capture.backends.base import Backend
from rollout_capture.backends.capabilities import Capabilities
from rollout_capture.backends.gcs import GCSBackend
from rollout_capture.backends.object_store import ObjectStoreBackend, ProcessLocalBackend
from rollout_capture.backends.posix import PosixBackend
from rollout_capture.backends.s3 import S3Backend
from rollout_capture.filesystem import is_local, protocols_of, url_scheme

BACKENDS: dict[str, type[Backend]] = {
    **dict.fromkeys(LocalFileSystem.protocol, PosixBackend),  # file, local
    "s3": S3Backend,
    "s3a": S3Backend,
    "gs": GCSBackend,  # gcsfs creates with ifGenerationMatch=0: one conditional request
    "gcs": GCSBackend,
    "az": AzureBackend,  # Put Blob with If-None-Match: *
    "abfs": AzureBackend,
    "abfss": AzureBackend,
    "memory": ProcessLocalBackend,
}
"""fsspec protocol -> the backend class for a capture root on it."""

DEFAULT_BACKEND: type[Backend] = ObjectStoreBackend
"""The backend of any protocol not in :data:`BACKENDS` (SFTP, ``dir://``...): read-only."""


def backend_class(fs: fsspec.AbstractFileSystem) -> type[Backend]:
    """The backend class for an opened filesystem: the local disk's when it is local (decided by
    :func:`rollout_capture.filesystem.is_local`), else the first of its protocols in the table."""
    if is_local(fs):
        return BACKENDS["file"]
    for protocol in protocols_of(fs):
        if protocol in BACKENDS:
            return BACKENDS[protocol]
    return DEFAULT_BACKEND


def capabilities_of(where: str | os.PathLike[str] | fsspec.AbstractFileSystem) -> Capabilities:
    """What the store at a path or URL (or behind an opened filesystem) would declare, before any
    store is opened: its backend class's answer, found by protocol as :func:`backend_class` finds it.

    Decided from the URL's text (:func:`rollout_capture.filesystem.is_local` and the scheme), so
    it is no more than that; a caller holding an opened backend asks ``backend.capabilities``.
    """
    if isinstance(where, fsspec.AbstractFileSystem):
        return backend_class(where).capabilities
    if is_local(where):
        return PosixBackend.capabilities
    scheme = url_scheme(where) or "file"
    return BACKENDS.get(scheme, DEFAULT_BACKEND).capabilities
