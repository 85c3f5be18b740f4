"""S3 (s3fs): the generic object-store backend with S3's own requests where they are quicker.

s3fs's ``find`` and ``ls`` do more than a capture reader needs (``ls`` of an empty folder lists
its parent too); ``_iterdir`` is one ``ListObjectsV2`` per page and nothing else, so flat and
delimited listings go through it. ``PutObject`` with ``If-None-Match: *`` creates only if
absent, and an object is read in one GET, without the HEAD that s3fs's chunked concurrent
read would send first (``max_concurrency=1``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, ClassVar

from fsspec.asyn import sync as fsspec_sync

from rollout_capture.backends.base import Named
from rollout_capture.backends.object_store import ListingTooLarge, ObjectStoreBackend, mtime_of, named_entries


class S3Backend(ObjectStoreBackend):
    """A capture root in an S3 bucket (or any S3-compatible endpoint: MinIO, moto...)."""

    atomic_create = True  # PutObject If-None-Match: *
    _read_kwargs: ClassVar[Mapping[str, Any]] = {"max_concurrency": 1}  # one GET, no HEAD first

    def _head(self, path: str) -> dict[str, Any] | None:
        """One HEAD of a file; None when it is not there. (s3fs's ``exists``/``info`` list the
        prefix after a miss, to tell a folder: every path asked here is a file.)"""
        bucket, key, _ = self.fs.split_path(path)
        if not key:
            return None
        try:
            found: dict[str, Any] = fsspec_sync(
                self.fs.loop, self.fs._call_s3, "head_object", Bucket=bucket, Key=key
            )
        except FileNotFoundError:
            return None
        return found

    def exists(self, path: str) -> bool:
        return self._head(path) is not None

    def existing(self, paths: Sequence[str]) -> list[bool]:
        """One ``ListObjectsV2`` from just before the first name, where the paths share a folder
        (S3 lists keys in order, consistently): the names that sort among them come back in one
        page; what the page did not reach is asked by HEAD."""
        split = [self.fs.split_path(path) for path in paths]
        keys = [key for _, key, _ in split]
        folder = keys[0].rpartition("/")[0] if keys else ""
        if (
            len(paths) < 2
            or not folder
            or any(b != split[0][0] or k.rpartition("/")[0] != folder for b, k, _ in split)
        ):
            return [self.exists(path) for path in paths]
        listed: dict[str, Any] = fsspec_sync(
            self.fs.loop,
            self.fs._call_s3,
            "list_objects_v2",
            Bucket=split[0][0],
            Prefix=f"{folder}/",
            StartAfter=min(keys)[:-1],  # sorts just before the first name, and nothing else does
            MaxKeys=len(keys) + 8,
        )
        found = {item["Key"] for item in listed.get("Contents", [])}
        reached = max(found, default="")
        if listed.get("IsTruncated") and reached < max(keys):  # the page stopped short of the last
            return [
                key in found or (key > reached and self.exists(path))
                for key, path in zip(keys, paths, strict=True)
            ]
        return [key in found for key in keys]

    def modified(self, paths: Sequence[str]) -> list[float | None]:
        return [None if (head := self._head(path)) is None else mtime_of(head) for path in paths]

    def _listed_files(self, prefix: str, limit: int | None) -> list[tuple[str, dict[str, Any]]]:
        if not hasattr(self.fs, "_iterdir"):  # an s3fs too old for it: fsspec's find
            return super()._listed_files(prefix, limit)
        result: list[tuple[str, dict[str, Any]]] = fsspec_sync(self.fs.loop, self._iter_flat, prefix, limit)
        return result

    async def _iter_flat(self, prefix: str, limit: int | None) -> list[tuple[str, dict[str, Any]]]:
        bucket, key, _ = self.fs.split_path(self.root)
        pages: AsyncIterator[dict[str, Any]] = self.fs._iterdir(
            bucket, delimiter="", prefix=f"{key}/{prefix}" if key else prefix
        )
        out = []
        try:
            async for info in pages:
                out.append((info["name"], info))
                if limit is not None and len(out) > limit:
                    raise ListingTooLarge
        finally:
            await pages.aclose()  # type: ignore[attr-defined]
        return out

    def _list_names_of(self, folders: list[str]) -> list[dict[str, Named]]:
        if not hasattr(self.fs, "_iterdir"):
            return super()._list_names_of(folders)
        result: list[dict[str, Named]] = fsspec_sync(self.fs.loop, self._list_delimited, folders)
        return result

    async def _list_delimited(self, folders: list[str]) -> list[dict[str, Named]]:
        # s3fs's own ls() lists the parent too when a folder is empty; _iterdir is one
        # delimiter listing per page and nothing else.
        gate = asyncio.Semaphore(self.concurrency)

        async def one(folder: str) -> dict[str, Named]:
            bucket, key, _ = self.fs.split_path(folder)
            async with gate:
                try:
                    found = [
                        info
                        async for info in self.fs._iterdir(
                            bucket, prefix=f"{key}/" if key else "", delimiter="/"
                        )
                    ]
                except FileNotFoundError:
                    return {}
            return named_entries(folder, found)

        return list(await asyncio.gather(*(one(f) for f in folders)))
