"""The S3 backend's GETs and flat listings, sent by obstore (Rust) with what s3fs resolved: a GET
costs a quarter of aiobotocore's CPU (0.4-0.5 ms against 1.6-1.9 ms,
``benchmarks/bench_agent_enrich.py --clients``) and a listing page a twentieth, so a run's reads
go at the store's speed, not the client's. GETs are obstore's blocking calls, made by the
caller's threads (the backend's read pipeline runs one a request in flight): handing no future
from obstore's runtime to an event loop saves 0.1-0.2 ms of CPU a GET.

s3fs stays the backend's filesystem: its session resolves the credentials (the AWS chain, a
profile, a role, a Prefect credentials block's keys), the endpoint and the region; obstore is
handed the same, the credentials through a provider refreshed from botocore's before each read.
Anything obstore fails on is asked again through s3fs, which raises what it always raised (so a
refused key or a throttled store reads as before); after :data:`SWITCH_AFTER` objects s3fs read
where obstore failed (a redirect to another region, a proxy or TLS setting only botocore knows),
this filesystem's reads stay with s3fs, said once in the log. Without obstore installed, s3fs reads.
"""

from __future__ import annotations

import atexit
import gc
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from fsspec.asyn import sync as fsspec_sync

logger = logging.getLogger(__name__)

SWITCH_AFTER = 3
"""Objects s3fs had to read after obstore failed on them, before this filesystem's GETs stay with s3fs."""
_STATIC_FOR = timedelta(
    hours=12
)  # how long obstore may keep credentials that never expire before asking again
REFRESH_EVERY_S = 60.0
"""How old the credentials handed to obstore may get while reads go on (botocore renews expiring
ones well before they lapse, obstore asks for them 5 minutes before): not a round trip a GET."""
_WHOLE = 1 << 50  # a range from 0 this long is the whole object: one call, where a plain GET takes two


def _let_stores_go() -> None:
    """At exit, while the interpreter still runs everything: every obstore store let go. Dropped
    later, in the interpreter's teardown, a store's last reference went on one of obstore's own
    threads, whose call back into Python then aborted the process (a process that had done its
    work exiting -6 or -7: 5 of 360 short processes on a loaded machine, none with this)."""
    for gets in list(_LIVE):
        gets.let_go()
    gc.collect()  # and those a cycle still holds (a traceback's frames): freed now, not in the teardown


class ObstoreGets:
    """GETs of one s3fs filesystem's objects through obstore, one store per bucket; ``None`` for
    a missing object. :meth:`get` blocks its caller's thread; the rest are coroutines of the
    filesystem's own loop (``fs.loop``)."""

    def __init__(self, fs: Any, fallback: Callable[[str], Awaitable[bytes | None]]) -> None:
        self._fs = fs
        self._fallback = fallback  # s3fs's read of one path: None when missing
        self._stores: dict[str, Any] = {}
        self._credential: dict[str, Any] | None = None
        self._failed = 0
        self._whole_by_range = True  # a whole object asked as a range: one wait for its body
        self._refused_ranges = 0
        self._lock = threading.Lock()
        self._refreshing = threading.Lock()
        self._refreshed = float("-inf")  # monotonic time of the last refresh()
        self.active = _obstore_installed()
        _LIVE.add(self)

    def let_go(self) -> None:
        """Drop the stores (the process is ending: see :func:`_let_stores_go`); later reads make them anew."""
        self._stores.clear()

    def get(self, path: str) -> bytes | None:
        """The object's bytes, ``None`` when it does not exist: obstore's blocking GET, from the
        caller's thread (never the filesystem's loop, which s3fs's answer may need)."""
        if not self.active:
            return self._s3fs(path)
        import obstore
        from obstore.exceptions import NotFoundError

        self._fresh()
        bucket, key, _ = self._fs.split_path(path)
        try:
            store = self._stores.get(bucket) or fsspec_sync(self._fs.loop, self._store, bucket)
            if self._whole_by_range:
                try:  # the range answer is the body itself: one call instead of two
                    return bytes(obstore.get_range(store, key, start=0, length=_WHOLE))
                except (FileNotFoundError, NotFoundError):
                    raise
                except Exception:  # an empty object has no range (416), or the store refused it
                    whole = _plain(store, key)
                    self._range_refused(whole)
                    return whole
            return _plain(store, key)
        except (FileNotFoundError, NotFoundError):  # obstore raises the built-in one for a GET
            return None
        except Exception as exc:
            failure = exc
        data = self._s3fs(path)  # s3fs's own answer, or its own error
        self._note(failure)
        return data

    def _s3fs(self, path: str) -> bytes | None:
        data: bytes | None = fsspec_sync(self._fs.loop, self._fallback, path)
        return data

    def _range_refused(self, data: bytes) -> None:
        """A whole object's range read failed where a plain GET of it gave bytes: a store that does
        not answer ranges as asked (``rclone serve s3`` answers 200 with the range's bytes). After
        :data:`SWITCH_AFTER` such, whole objects are read by plain GETs (one request each, not two)."""
        if data:
            with self._lock:
                self._refused_ranges += 1
                if self._refused_ranges >= SWITCH_AFTER and self._whole_by_range:
                    self._whole_by_range = False
                    logger.info("the store refuses ranged GETs of whole objects: reading them by plain GETs")

    async def get_range(
        self, path: str, start: int, end: int, fallback: Callable[[], Awaitable[bytes | None]]
    ) -> bytes | None:
        """Bytes ``[start, end)`` of the object, ``None`` when it does not exist (``fallback``: s3fs's
        own ranged read, asked when obstore fails)."""
        if not self.active or end <= start:
            return await fallback()
        import obstore
        from obstore.exceptions import NotFoundError

        bucket, key, _ = self._fs.split_path(path)
        try:
            store = await self._store(bucket)
            return bytes(await obstore.get_range_async(store, key, start=start, end=end))
        except (FileNotFoundError, NotFoundError):
            return None
        except Exception as exc:
            failure = exc
        data = await fallback()
        self._note(failure)
        return data

    async def listed(
        self, bucket: str, prefix: str, limit: int | None
    ) -> list[tuple[str, dict[str, Any]]] | None:
        """``(bucket/key, info)`` of every object under the folder ``prefix`` (whole path segments),
        at most ``limit`` + 1 of them; ``None`` where obstore could not list (s3fs will)."""
        if not self.active:
            return None
        import obstore

        out: list[tuple[str, dict[str, Any]]] = []
        try:
            store = await self._store(bucket)
            async for page in obstore.list(store, prefix or None, chunk_size=1000):
                for meta in page:
                    name = f"{bucket}/{meta['path']}"
                    info: dict[str, Any] = {
                        "name": name,
                        "size": meta["size"],
                        "LastModified": meta["last_modified"],
                    }
                    out.append((name, info))
                if limit is not None and len(out) > limit:
                    break
        except Exception as exc:
            self._note(exc)
            return None
        return out

    def _note(self, failure: BaseException) -> None:
        with self._lock:
            self._failed += 1
            if self._failed < SWITCH_AFTER or not self.active:
                return
            self.active = False
        logger.warning(
            "reading %s through s3fs from now on: obstore failed on %d objects s3fs then read (last: %s: %s)",
            self._fs.protocol if isinstance(self._fs.protocol, str) else self._fs.protocol[0],
            self._failed,
            type(failure).__name__,
            str(failure).split("\n", 1)[0][:200],  # its first line: the rest is a debug dump
        )

    async def refresh(self) -> None:
        """Take the credentials s3fs's client signs with now (botocore refreshes expiring ones); a
        failure leaves the last ones (obstore's requests then fail over to s3fs, which says why)."""
        if self.active:
            self._refreshed = time.monotonic()
            try:
                self._credential = await credentials_of(self._fs)
            except Exception as exc:
                logger.debug("credentials not taken afresh for obstore: %s", exc)

    def _fresh(self) -> None:
        """:meth:`refresh` once the last is :data:`REFRESH_EVERY_S` old (from a thread not the loop's)."""
        if time.monotonic() - self._refreshed < REFRESH_EVERY_S:
            return
        with self._refreshing:
            if time.monotonic() - self._refreshed >= REFRESH_EVERY_S:
                fsspec_sync(self._fs.loop, self.refresh)

    def _provide(self) -> dict[str, Any]:
        """The credentials, until when they hold (obstore asks again 5 minutes before; asked each
        request if that moment were closer, so credentials that never expire get 12 hours)."""
        credential = self._credential
        if credential is None:  # asked before refresh(): nothing to sign with
            raise RuntimeError("no credentials resolved yet")
        expiry = credential.get("expires_at") or datetime.now(UTC) + _STATIC_FOR
        return {**credential, "expires_at": expiry}

    async def _store(self, bucket: str) -> Any:
        store = self._stores.get(bucket)
        if store is None:
            if self._credential is None:
                await self.refresh()
            store = self._stores[bucket] = await self._new_store(bucket)
        return store

    async def _new_store(self, bucket: str) -> Any:
        from obstore.store import S3Store

        client = await self._fs.set_session()
        endpoint = str(client.meta.endpoint_url)
        options: dict[str, Any] = {
            "endpoint": endpoint,
            "region": client.meta.region_name or "us-east-1",
            "virtual_hosted_style_request": False,  # the endpoint names no bucket: path style
            "client_options": {"allow_http": endpoint.startswith("http://")},
            "retry_config": {"max_retries": _retries_of(client), "retry_timeout": timedelta(seconds=20)},
        }  # then s3fs's own retries
        if self._credential == {}:
            options["skip_signature"] = True  # anonymous, as s3fs was asked (anon=True)
        else:
            options["credential_provider"] = self._provide
        return S3Store(bucket, **options)


def _plain(store: Any, key: str) -> bytes:
    """A whole object by a plain GET (two calls: the answer, then its body)."""
    import obstore

    return bytes(obstore.get(store, key).bytes())


_LIVE: weakref.WeakSet[ObstoreGets] = weakref.WeakSet()
atexit.register(_let_stores_go)


def _retries_of(client: Any) -> int:
    """The retries the user gave s3fs (``config_kwargs={"retries": ...}``, botocore's meaning:
    ``max_attempts`` retries, ``total_max_attempts`` tries), obstore's too; else 3. A user who asked
    for none (a test failing fast, a caller retrying itself) gets none from obstore either."""
    retries = getattr(client.meta.config, "retries", None) or {}
    tries, retried = retries.get("total_max_attempts"), retries.get("max_attempts")
    if isinstance(tries, int):
        return max(0, tries - 1)
    if isinstance(retried, int):
        return max(0, retried)
    return 3


async def credentials_of(fs: Any) -> dict[str, Any]:
    """The credentials s3fs's client signs with, as obstore takes them; ``{}`` when it signs nothing."""
    client = await fs.set_session()
    credentials = getattr(getattr(client, "_request_signer", None), "_credentials", None)
    if credentials is None or getattr(fs, "anon", False):
        return {}
    frozen = credentials.get_frozen_credentials()
    if hasattr(frozen, "__await__"):  # aiobotocore's refreshable credentials
        frozen = await frozen
    out: dict[str, Any] = {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key}
    if frozen.token:
        out["token"] = frozen.token
    expiry = getattr(credentials, "_expiry_time", None)  # refreshable (a role, SSO): when they lapse
    if isinstance(expiry, datetime):
        out["expires_at"] = expiry if expiry.tzinfo else expiry.replace(tzinfo=UTC)
    return out


def _obstore_installed() -> bool:
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True
