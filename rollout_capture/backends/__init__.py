"""Byte-level access to capture roots, behind one interface (:class:`Backend`).

:func:`open_backend` is the only place that looks at which filesystem a URL resolved to.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from rollout_capture.backends.base import Backend, Fetched, ListingScope, Named, RowLayout
from rollout_capture.backends.object_store import ObjectStoreBackend
from rollout_capture.backends.posix import PosixBackend
from rollout_capture.filesystem import DEFAULT_READ_CONCURRENCY, open_filesystem

__all__ = [
    "Backend",
    "Fetched",
    "ListingScope",
    "Named",
    "ObjectStoreBackend",
    "PosixBackend",
    "RowLayout",
    "open_backend",
]


def open_backend(
    url: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    concurrency: int = DEFAULT_READ_CONCURRENCY,
    credentials: Mapping[str, Any] | None = None,
) -> Backend:
    """The backend for a path or URL: the local disk directly, anything else through fsspec."""
    fs, root = open_filesystem(url, storage_options, concurrency=concurrency, credentials=credentials)
    if isinstance(fs, LocalFileSystem):
        return PosixBackend(root)
    return ObjectStoreBackend(fs, root, concurrency)
