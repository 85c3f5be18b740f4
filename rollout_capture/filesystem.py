"""URL to filesystem, with the defaults object stores need to be read correctly and fast.

s3fs, gcsfs and adlfs cache listings (stale reads of a capture being written) and botocore pools only
10 connections (concurrent reads queue behind them); both are fixed here, once. A store whose
filesystem is an extra of ours (``gs://``: gcsfs, ``az://``: adlfs) names that extra when missing.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from rollout_capture.secret_options import refuse_secret_options, refuse_url_credentials

DEFAULT_READ_CONCURRENCY = 32
_S3_PROTOCOLS = {"s3", "s3a"}
# Object stores whose fsspec filesystem caches listings (a stale listing misses new rows,
# leases and markers): S3 and the others that keep a dircache.
_LISTING_CACHES = _S3_PROTOCOLS | {"gs", "gcs", "az", "abfs", "abfss", "adl"}
# The extra that installs each store's filesystem (s3fs is a dependency of the core).
_EXTRAS = {"gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}


class MissingExtraError(ValueError):
    """A URL whose filesystem is not installed: names the extra that installs it."""


def protocol_of(fs: fsspec.AbstractFileSystem) -> str:
    """The filesystem's main protocol name (``file``, ``s3``, ``memory``...)."""
    proto = fs.protocol
    return proto if isinstance(proto, str) else proto[0]


def protocols_of(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    """Every protocol name the filesystem answers to (s3fs: ``s3``, ``s3a``), main one first."""
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def url_scheme(url: str | os.PathLike[str]) -> str | None:
    """The scheme of a URL (``s3``, ``file``...); ``None`` for a plain path."""
    text = os.fspath(url)
    return text.split("://", 1)[0] if "://" in text else None


def local_path(url: str | os.PathLike[str]) -> str | None:
    """The path on this machine that a plain path or a ``file://`` URL names; ``None`` for any
    other URL. The one place that decides whether a location is local (from its text)."""
    text = os.fspath(url)
    if text.startswith("file://"):
        return text[len("file://") :]
    return None if url_scheme(text) is not None else text


def absolute_location(url: str) -> str:
    """A path or URL that means the same on every worker: a local path made absolute here.

    Batches run in processes with working directories of their own (a Dask or Ray worker
    started in another folder); a relative path would name a different folder there.
    """
    path = local_path(url)
    if path is None:
        return url  # an object store's URL means the same everywhere
    absolute = os.path.abspath(path)
    return f"file://{absolute}" if url.startswith("file://") else absolute


def is_local(where: str | os.PathLike[str] | fsspec.AbstractFileSystem) -> bool:
    """Whether a path, URL or opened filesystem is this machine's disk (read with ``os``, locked
    with ``flock``, published by a rename); every local-or-not question is asked here."""
    if isinstance(where, fsspec.AbstractFileSystem):
        return isinstance(where, LocalFileSystem)
    return local_path(where) is not None


def with_defaults(url: str, storage_options: Mapping[str, Any] | None, concurrency: int) -> dict[str, Any]:
    """Storage options plus safe defaults for the URL's scheme (never overriding the caller)."""
    options = dict(storage_options or {})
    scheme = url_scheme(url) or "file"
    if scheme in _LISTING_CACHES:
        options.setdefault("use_listings_cache", False)
    if scheme in _S3_PROTOCOLS:
        config_kwargs = dict(options.get("config_kwargs") or {})
        config_kwargs.setdefault("max_pool_connections", max(10, concurrency + 8))
        options["config_kwargs"] = config_kwargs
    return options


def open_filesystem(
    url: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    concurrency: int = DEFAULT_READ_CONCURRENCY,
    credentials: Mapping[str, Any] | None = None,
) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve a path or URL to ``(filesystem, root path as that filesystem names it)``.

    ``storage_options`` may not carry secrets, nor ``url`` credentials; ``credentials`` (resolved
    at run time from a Prefect block, say) are passed to the filesystem and kept nowhere else.
    """
    refuse_secret_options(storage_options)
    refuse_url_credentials(url)
    text = os.fspath(url)
    local = local_path(text)
    if local is not None:
        return LocalFileSystem(), os.path.abspath(local)
    options = with_defaults(text, storage_options, concurrency)
    for name, value in (credentials or {}).items():  # nested dicts (client_kwargs) merge, not replace
        current = options.get(name)
        options[name] = (
            {**current, **value} if isinstance(current, dict) and isinstance(value, dict) else value
        )
    try:
        fs, root = fsspec.core.url_to_fs(text, **options)
    except ImportError as exc:
        scheme = url_scheme(text) or ""
        if scheme not in _EXTRAS:
            raise
        extra = _EXTRAS[scheme]
        raise MissingExtraError(
            f"{scheme}:// needs the {extra} extra ({exc}): pip install 'rollout-capture[{extra}]'"
        ) from None
    return fs, root.rstrip("/")


def join(root: str, name: str) -> str:
    """``root/name`` for fsspec paths (always ``/``-separated)."""
    return f"{root}/{name}" if root else name


@contextmanager
def local_copy(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    credentials: Mapping[str, Any] | None = None,
) -> Iterator[str]:
    """A local file holding ``url``: a local path as it is, a URL (an S3 run's output) copied to a
    temporary file, removed after. Readers that want a local file (the Parquet and trace
    exports) read a URL through it; an error naming the copy is renamed to name the URL."""
    local = local_path(url)
    if local is not None:
        yield local
        return
    fs, remote = open_filesystem(url, storage_options, credentials=credentials)
    with tempfile.TemporaryDirectory(prefix="rollout-capture-") as folder:
        copy = os.path.join(folder, remote.rstrip("/").rsplit("/", 1)[-1])
        fs.get_file(remote, copy)
        try:
            yield copy
        except Exception as exc:
            renamed = _naming(exc, copy, url)
            if renamed is None:
                raise
            raise renamed.with_traceback(exc.__traceback__) from None


def _naming(exc: Exception, copy: str, url: str) -> Exception | None:
    """``exc`` (of the same type) naming ``url`` where it names the temporary ``copy`` of it,
    so an error says which file the user gave; None when it does not name the copy."""
    if isinstance(exc, OSError):
        if exc.filename != copy:
            return None
        exc.filename = url
        return exc
    text = str(exc)
    if copy not in text:
        return None
    try:
        return type(exc)(text.replace(copy, url))
    except Exception:  # a type not built from one message: left as it was
        return None
