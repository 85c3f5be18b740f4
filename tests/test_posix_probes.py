"""A local capture root's existence checks: what a listing already answers is not asked again.

A batch of rollouts under a root too large to list for it probes each rollout (its objects
folder, its marker, its claims folder: once, in the batch's claims pass), unless a listing an
earlier batch took still holds (the root unchanged since): then nothing is probed, and a root
changed since is probed afresh, never read through the stale listing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_capture import CaptureStore
from rollout_capture.backends.posix import PosixBackend

ROW = {"model_call_id": "c", "dialect": "chat", "response": {"usage": {"prompt_tokens": 3}}}


@pytest.fixture
def accesses(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The paths ``os.access`` is asked about (the probes), as they are asked."""
    asked: list[str] = []
    access = os.access

    def counted(path: str, *args: object, **kwargs: object) -> bool:
        asked.append(os.path.basename(path))
        return access(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", counted)
    yield asked


def _root(tmp_path: Path, rollouts: int) -> tuple[Path, CaptureStore]:
    root = tmp_path / "captures"
    store = CaptureStore(root)
    for task in range(rollouts):
        store.record(f"{task}-0", ROW)
    return root, CaptureStore(root)  # a fresh store: nothing learnt while writing


def _settle(root: Path) -> None:
    """Date the root's last change a minute back, as a finished run's root is."""
    moment = time.time() - 60
    os.utime(root, (moment, moment))


def _read(store: CaptureStore, ids: list[str]) -> dict[str, int]:
    batch = store.prefetch(ids)
    batch.claims()
    return {rollout_id: len(batch.snapshot(rollout_id).parsed.rows) for rollout_id in ids}


def test_a_listing_still_holding_answers_a_later_batch(tmp_path: Path, accesses: list[str]) -> None:
    root, store = _root(tmp_path, 200)
    _settle(root)
    assert _read(store, [f"{t}-0" for t in range(40)]) == {f"{t}-0": 1 for t in range(40)}  # listed
    accesses.clear()
    later = [f"{t}-0" for t in range(100, 105)] + ["999-0"]  # a few ids: too few to list the root for
    assert _read(store, later) == {**{f"{t}-0": 1 for t in range(100, 105)}, "999-0": 0}
    assert accesses == []  # the listing answered every check

    CaptureStore(root).record("999-0", ROW)  # the root changes: its listing no longer holds
    assert _read(store, later)["999-0"] == 1
    assert accesses  # probed afresh


def test_without_a_listing_each_rollout_is_probed_once_per_part(tmp_path: Path, accesses: list[str]) -> None:
    root, store = _root(tmp_path, 200)  # just written: a listing taken now would not be kept
    assert isinstance(store._backend, PosixBackend)
    _read(store, [f"{t}-0" for t in range(40)])
    later = [f"{t}-0" for t in range(100, 105)]
    with CaptureStore(root).claim("101-0", ttl_s=600):  # a call in flight: its claims folder exists
        accesses.clear()
        batch = store.prefetch(later)
        assert set(batch.claims()) == {"101-0"}
        snapshots = {rollout_id: batch.snapshot(rollout_id) for rollout_id in later}
    assert len(snapshots["101-0"].claims) == 1 and len(snapshots["100-0"].claims) == 0
    for rollout_id in later:
        asked = sorted(
            name.removeprefix(rollout_id) for name in accesses if name.startswith(f"{rollout_id}.")
        )
        if rollout_id == "101-0":  # its claims folder seen: the rollout is listed, not probed further
            assert asked == [".capture", ".capture.claims"], asked
        else:  # the claims folder once (the claims pass), the objects folder, the marker
            assert asked == [".capture", ".capture.claims", ".capture.incomplete"], asked
