"""Backend's generic defaults (listing, fetching, exists, root_found, clearing, append), built on the
byte operations alone, agree with the object-store backend's own fast paths on the same root."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import fsspec
import pytest

from rollout_capture import CaptureStore
from rollout_capture.backends import Backend, Named, open_backend
from rollout_capture.backends.object_store import ProcessLocalBackend
from rollout_capture.names import RolloutListing

IDS = ["1-1", "1-10", "2-0", "3-3"]


class BytesOnly(Backend):
    """A backend giving only what Backend requires, each by the memory backend's byte operation."""

    default_layout = "objects"
    supports_append = False
    trust_mtime = True

    def __init__(self, inner: ProcessLocalBackend) -> None:
        self.inner = inner
        self.root = inner.root

    @classmethod
    def from_filesystem(cls, fs: fsspec.AbstractFileSystem, root: str, concurrency: int) -> BytesOnly:
        return cls(ProcessLocalBackend(fs, root, concurrency))

    def path(self, name: str) -> str:
        return self.inner.path(name)

    def read_many(self, paths: Sequence[str]) -> list[bytes | None]:
        return self.inner.read_many(paths)

    def list_names(self, folders: Sequence[str]) -> list[dict[str, Named]]:
        return self.inner.list_names(folders)

    def create(self, path: str, data: bytes) -> None:
        self.inner.create(path, data)

    def put(self, path: str, data: bytes) -> None:
        self.inner.put(path, data)

    def remove(self, paths: Sequence[str]) -> None:
        self.inner.remove(paths)


def _shape(listing: RolloutListing) -> tuple[Any, ...]:
    return (
        listing.found,
        None if listing.jsonl is None else listing.jsonl.path,
        None if listing.marker is None else listing.marker.path,
        [(seq, e.path, e.size) for seq, e in listing.objects],
        [(cid, e.path, e.size) for cid, e in listing.claims],
    )


@pytest.fixture
def roots() -> tuple[ProcessLocalBackend, BytesOnly]:
    url = f"memory://caps-{uuid.uuid4().hex}"
    store = CaptureStore(url)
    for n in range(3):
        store.record("1-1", {"model_call_id": f"c{n}", "n": n})
    store.record("1-10", {"model_call_id": "c0"})
    store.mark_incomplete("1-1")
    store.claim("3-3", "c5").__enter__()  # held: a claim file
    fast = open_backend(url)
    assert isinstance(fast, ProcessLocalBackend)
    return fast, BytesOnly(fast)


def test_the_generic_listing_and_reads_agree_with_the_fast_ones(
    roots: tuple[ProcessLocalBackend, BytesOnly],
) -> None:
    fast, generic = roots
    listed, expected = generic.list_rollouts(IDS), fast.list_rollouts(IDS)
    assert {r: _shape(v) for r, v in listed.items()} == {r: _shape(v) for r, v in expected.items()}
    assert listed["1-1"].found and not listed["2-0"].found and listed["3-3"].claims
    batch, fast_batch = generic.fetch(IDS), fast.fetch(IDS)
    for rollout_id in IDS:
        snap, want = batch.snapshot(rollout_id), fast_batch.snapshot(rollout_id)
        assert (snap.rows, snap.incomplete, snap.found) == (want.rows, want.incomplete, want.found)
        assert batch.found(rollout_id) is fast_batch.found(rollout_id)
    assert {r: [c.claim_id for c in cs] for r, cs in batch.claims().items()} == {
        r: [c.claim_id for c in cs] for r, cs in fast_batch.claims().items()
    }
    paths = [fast.path("1-1.capture/000000000000.json"), fast.path("1-1.capture.incomplete"), fast.path("no")]
    assert [generic.exists(p) for p in paths] == [fast.exists(p) for p in paths] == [True, True, False]
    assert (
        generic.root_found() and not BytesOnly(ProcessLocalBackend(fast.fs, fast.root + "-none")).root_found()
    )


def test_the_generic_clear_and_append(roots: tuple[ProcessLocalBackend, BytesOnly]) -> None:
    fast, generic = roots
    generic.clear_rollouts(IDS)
    assert not any(listing.found for listing in fast.list_rollouts(IDS).values())
    with pytest.raises(OSError, match="no safe append"):
        generic.append_line(generic.path("1-1.capture.jsonl"), b"{}\n")
