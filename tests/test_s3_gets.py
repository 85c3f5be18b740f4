"""The S3 backend's GETs through obstore: s3fs's credentials and endpoint, s3fs's answer and errors
wherever obstore fails, and s3fs for good once obstore keeps failing (moto, counted on the wire)."""

from __future__ import annotations

from typing import Any

import pytest
from fsspec.asyn import sync

from rollout_capture.backends import S3Backend, open_backend, s3_gets

from .conftest import S3


def _backend(s3: S3, **options: Any) -> S3Backend:
    backend = open_backend(s3.url("caps"), {**s3.storage_options, **options})
    assert isinstance(backend, S3Backend)
    return backend


def test_obstore_signs_with_what_s3fs_resolved(s3: S3) -> None:
    """A credentials block's keys reach s3fs as options: obstore is handed the same; the environment's
    otherwise; nothing to sign with when s3fs was told anonymous."""
    block = open_backend(
        s3.url("caps"), s3.storage_options, credentials={"key": "AKIDBLOCK", "secret": "s3cr3t"}
    )
    assert isinstance(block, S3Backend)
    assert sync(block.fs.loop, s3_gets.credentials_of, block.fs) == {
        "access_key_id": "AKIDBLOCK",
        "secret_access_key": "s3cr3t",
    }
    env = _backend(s3)
    assert sync(env.fs.loop, s3_gets.credentials_of, env.fs)["access_key_id"] == "testing"
    anonymous = _backend(s3, anon=True)
    assert sync(anonymous.fs.loop, s3_gets.credentials_of, anonymous.fs) == {}


def test_obstore_reads_what_s3fs_reads_and_none_for_a_missing_object(s3: S3) -> None:
    backend = _backend(s3)
    paths = [backend.path(f"x/{n}.json") for n in range(40)]
    for n, path in enumerate(paths[:-1]):
        backend.put(path, b"%d" % n * n)  # one of them empty
    assert backend.read_many(paths) == [b"%d" % n * n for n in range(39)] + [None]
    assert list(backend.read_iter(paths)) == backend.read_many(paths)
    assert backend._gets is not None and backend._gets.active  # obstore read them all


def test_what_obstore_fails_on_s3fs_reads_and_after_a_few_s3fs_reads_alone(
    s3: S3, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    import obstore

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("PermanentRedirect: the bucket is in another region")

    backend = _backend(s3)
    paths = [backend.path(f"y/{n}.json") for n in range(10)]
    for n, path in enumerate(paths):
        backend.put(path, b"row %d" % n)
    monkeypatch.setattr(obstore, "get_range", refused)
    monkeypatch.setattr(obstore, "get", refused)
    with caplog.at_level("WARNING"):
        assert backend.read_many(paths) == [b"row %d" % n for n in range(10)]
    assert backend._gets is not None and not backend._gets.active
    assert caplog.text.count("through s3fs from now on") == 1 and "PermanentRedirect" in caplog.text


def test_a_refused_get_raises_s3fss_own_error(flaky_s3: tuple[S3, Any]) -> None:
    """A key without the right (403) is s3fs's PermissionError, as the tasks' retry policy and the
    credentials block's message expect, never obstore's."""
    via, proxy = flaky_s3
    backend = open_backend(via.url("caps"), via.storage_options)
    backend.put(backend.path("z.json"), b"{}")
    proxy.deny_on(b"GET /")
    with pytest.raises(PermissionError):
        backend.read_many([backend.path("z.json")])


@pytest.mark.parametrize(
    ("retries", "expected"),
    [
        (None, 3),
        ({"max_attempts": 0}, 0),
        ({"max_attempts": 2, "mode": "standard"}, 2),
        ({"total_max_attempts": 1}, 0),
    ],
)
def test_obstore_retries_as_often_as_s3fs_was_told(retries: dict[str, Any] | None, expected: int) -> None:
    """The retries a user gives s3fs (botocore's ``retries``) are obstore's too: a caller that
    asked for none (it retries itself, or fails fast) is not held up by obstore's own (no request
    is sent: the client is only made)."""
    import s3fs

    config = {"retries": retries} if retries is not None else {}
    fs = s3fs.S3FileSystem(
        key="k", secret="s", endpoint_url="http://127.0.0.1:9", config_kwargs=config, skip_instance_cache=True
    )
    client = sync(fs.loop, fs.set_session)
    assert s3_gets._retries_of(client) == expected


def test_a_pipelined_read_hands_an_error_over_in_its_place_and_asks_nothing_once_closed(
    flaky_s3: tuple[S3, Any],
) -> None:
    """GETs run on threads of their own (obstore's blocking GET): the bodies before a refused
    object are handed over, then its error; a read closed early has asked at most its window
    ahead (``READ_AHEAD`` a request in flight, counted on the wire) and asks nothing more."""
    from rollout_capture.backends.object_store import READ_AHEAD

    via, proxy = flaky_s3
    backend = open_backend(via.url("piped"), via.storage_options, concurrency=2)
    paths = [backend.path(f"p/{n:03d}.json") for n in range(100)]
    for n, path in enumerate(paths):
        backend.put(path, b"%d" % n)
    proxy.deny_on(b"p/005.json")
    stream = backend.read_iter(paths)
    assert [next(stream) for _ in range(5)] == [b"%d" % n for n in range(5)]
    with pytest.raises(PermissionError):
        next(stream)
    proxy.deny_on(None)
    proxy.reset_counts()
    stream = backend.read_iter(paths)
    assert next(stream) == b"0"
    stream.close()  # waits for the requests in flight
    asked = proxy.reset_counts().get("GET", 0)
    assert 1 <= asked <= READ_AHEAD * 2 + 1
    assert proxy.reset_counts() == {}


def test_credentials_are_taken_afresh_once_they_are_a_while_old_not_each_get(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blocking GET asks s3fs for the credentials again (a round trip to its loop) only once the
    last were taken ``REFRESH_EVERY_S`` ago: reads go on with rotating credentials at no cost a GET."""
    backend = _backend(s3)
    paths = [backend.path(f"c/{n}.json") for n in range(5)]
    for path in paths:
        backend.put(path, b"{}")
    taken: list[int] = []
    original = s3_gets.credentials_of

    async def counted(fs: Any) -> dict[str, Any]:
        taken.append(1)
        return await original(fs)

    monkeypatch.setattr(s3_gets, "credentials_of", counted)
    for path in paths:
        assert backend.read_many([path]) == [b"{}"]
    assert list(backend.read_iter(paths)) == [b"{}"] * 5
    assert len(taken) == 1
    monkeypatch.setattr(s3_gets, "REFRESH_EVERY_S", 0.0)  # every take is old at once
    for path in paths:
        assert backend.read_many([path]) == [b"{}"]
    assert len(taken) == 1 + 5
