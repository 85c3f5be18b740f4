"""S3 (s3fs): the generic object-store backend with S3's own requests where they are quicker.

s3fs's ``find`` and ``ls`` do more than a capture reader needs (``ls`` of an empty folder lists
its parent too); ``_iterdir`` is one ``ListObjectsV2`` per page and nothing else, so flat and
delimited listings go through it. ``PutObject`` with ``If-None-Match: *`` creates only if
absent. An object is read in one GET, sent by obstore with s3fs's credentials and endpoint
(:mod:`.s3_gets`: a third of aiobotocore's CPU a request), else by s3fs without the HEAD its
chunked concurrent read would send first (``max_concurrency=1``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Hashable, Mapping, Sequence
from typing import Any, ClassVar

from fsspec.asyn import sync as fsspec_sync

from rollout_capture.backends.base import Named
from rollout_capture.backends.capabilities import CONDITIONAL_STORE
from rollout_capture.backends.object_store import ListingTooLarge, ObjectStoreBackend, mtime_of, named_entries
from rollout_capture.backends.s3_gets import ObstoreGets
from rollout_capture.secret_options import bare_url


class S3Backend(ObjectStoreBackend):
    """A capture root in an S3 bucket (or any S3-compatible endpoint: MinIO, moto...)."""

    capabilities = CONDITIONAL_STORE  # AWS, MinIO, moto keep it; rclone's serve s3 does not (proven)
    conditional_request = "PutObject with If-None-Match: *"
    _read_kwargs: ClassVar[Mapping[str, Any]] = {"max_concurrency": 1}  # one GET, no HEAD first
    _gets: ObstoreGets | None = None

    def _obstore(self) -> ObstoreGets:
        if self._gets is None:
            self._gets = ObstoreGets(self.fs, super()._get)
        return self._gets

    async def _before_reads(self) -> None:
        await self._obstore().refresh()

    def _blocking_get(self) -> Callable[[str], bytes | None] | None:
        gets = self._obstore()
        return gets.get if gets.active else None  # else s3fs's coroutines (obstore failed, or is absent)

    async def _get_range(self, path: str, start: int, end: int) -> bytes | None:
        async def by_s3fs() -> bytes | None:
            return await super(S3Backend, self)._get_range(path, start, end)

        return await self._obstore().get_range(path, start, end, by_s3fs)

    def _configured_endpoint(self) -> str | None:
        """The endpoint the options or botocore's environment variables name; None: AWS's own."""
        options = getattr(self.fs, "endpoint_url", None) or (self.fs.client_kwargs or {}).get("endpoint_url")
        return options or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None

    def endpoint(self) -> str:
        client = getattr(self.fs, "_s3", None)  # connected: the client's own
        connected = getattr(getattr(client, "meta", None), "endpoint_url", None)
        url = self._configured_endpoint() or connected
        return bare_url(str(url)) if url else "AWS S3 (the region's default endpoint)"

    def store_key(self) -> Hashable:
        return (type(self).__name__, self._configured_endpoint(), self.root.split("/", 1)[0])

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

    def remove(self, paths: Sequence[str]) -> None:
        """DeleteObjects, 1,000 keys a request, raising for the keys its answer says were not
        deleted: s3fs drops them, so a store refusing deletes (no ``s3:DeleteObject``) would leave
        objects behind in silence. ``PermissionError`` when every one was refused as access denied."""
        if not paths:
            return
        refused: list[tuple[str, str, str]] = fsspec_sync(self.fs.loop, self._delete, list(paths))
        if refused:
            codes = sorted({code for _, code, _ in refused})
            shown = ", ".join(f"s3://{path}" for path, _, _ in refused[:3])
            more = f" and {len(refused) - 3} more" if len(refused) > 3 else ""
            message = (
                f"{refused[0][2]} ({', '.join(codes)}): {len(refused)} object(s) not deleted: {shown}{more}"
            )
            raise (PermissionError if codes == ["AccessDenied"] else OSError)(message)

    async def _delete(self, paths: list[str]) -> list[tuple[str, str, str]]:
        by_bucket: dict[str, list[str]] = {}
        for path in paths:
            bucket, key, _ = self.fs.split_path(path)
            by_bucket.setdefault(bucket, []).append(key)
            self.fs.invalidate_cache(path)
        refused = []
        for bucket, keys in by_bucket.items():
            for start in range(0, len(keys), 1000):
                objects = [{"Key": key} for key in keys[start : start + 1000]]
                answer = await self.fs._call_s3(
                    "delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True}
                )
                refused += [
                    (
                        f"{bucket}/{error.get('Key', '?')}",
                        error.get("Code", "?"),
                        error.get("Message", "not deleted"),
                    )
                    for error in answer.get("Errors", [])
                ]
        return refused

    def _page_from(self, bucket: str, folder: str, first: str, limit: int) -> tuple[set[str], bool]:
        listed: dict[str, Any] = fsspec_sync(
            self.fs.loop,
            self.fs._call_s3,
            "list_objects_v2",
            Bucket=bucket,
            Prefix=f"{folder}/",
            Delimiter="/",  # a subfolder's keys (the claims stream's beside the rows') come as one prefix
            StartAfter=first[:-1],  # sorts just before the first name, and nothing else does
            MaxKeys=limit,
        )
        return {item["Key"] for item in listed.get("Contents", [])}, bool(listed.get("IsTruncated"))

    def modified(self, paths: Sequence[str]) -> list[float | None]:
        return [None if (head := self._head(path)) is None else mtime_of(head) for path in paths]

    def _listed_files(self, prefix: str, limit: int | None) -> list[tuple[str, dict[str, Any]]]:
        if not prefix:  # the whole root, a folder: obstore lists by whole path segments
            bucket, key, _ = self.fs.split_path(self.root)
            listed: list[tuple[str, dict[str, Any]]] | None = fsspec_sync(
                self.fs.loop, self._obstore().listed, bucket, key, limit
            )
            if listed is not None:
                if limit is not None and len(listed) > limit:
                    raise ListingTooLarge
                return listed
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
