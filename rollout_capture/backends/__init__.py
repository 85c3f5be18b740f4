"""Byte-level access to capture roots, behind one interface (:class:`Backend`).

:func:`open_backend` is the only place that looks at which filesystem a URL resolved to; the
protocol table (:data:`BACKENDS`, in :mod:`rollout_capture.backends.registry`) says which
backend class serves it, and so what the store can do (``backend.capabilities``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rollout_capture.backends.azure import AzureBackend
from rollout_capture.backends.base import Backend, ListingScope, Named, ReadBatch
from rollout_capture.backends.capabilities import Capabilities, PutIfAbsent, UnsafeStoreError
from rollout_capture.backends.gcs import GCSBackend
from rollout_capture.backends.object_store import ObjectStoreBackend
from rollout_capture.backends.posix import PosixBackend
from rollout_capture.backends.registry import BACKENDS, DEFAULT_BACKEND, backend_class, capabilities_of
from rollout_capture.backends.s3 import S3Backend
from rollout_capture.filesystem import DEFAULT_READ_CONCURRENCY, open_filesystem

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "AzureBackend",
    "Backend",
    "Capabilities",
    "GCSBackend",
    "ListingScope",
    "Named",
    "ObjectStoreBackend",
    "PosixBackend",
    "PutIfAbsent",
    "ReadBatch",
    "S3Backend",
    "UnsafeStoreError",
    "backend_class",
    "capabilities_of",
    "open_backend",
]


def open_backend(
    url: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    concurrency: int = DEFAULT_READ_CONCURRENCY,
    credentials: Mapping[str, Any] | None = None,
) -> Backend:
    """The backend for a path or URL, of the class the protocol table names for its filesystem."""
    fs, root = open_filesystem(url, storage_options, concurrency=concurrency, credentials=credentials)
    return backend_class(fs).from_filesystem(fs, root, concurrency)
