"""Every layout through the one interface a store writes with (rollout_capture.layouts):
stage and finish a row, acquire and release a claim, read back, forget on clear."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import cast, get_args

import pytest

from rollout_capture import CaptureStore
from rollout_capture.backends import open_backend
from rollout_capture.claims import new_claim
from rollout_capture.layouts import (
    LAYOUTS,
    JournalLayout,
    JsonlLayout,
    Layout,
    LayoutStrategy,
    ObjectsLayout,
    StoreJournal,
    open_layout,
    producer_layout,
    resolve_layout,
)

CASES = [
    ("local", "jsonl", "files"),
    ("local", "jsonl", "log"),
    ("local", "objects", "files"),
    ("local", "objects", "log"),
    ("local", "journal", "files"),
    ("memory", "objects", "files"),
    ("memory", "journal", "files"),
]


def _url(where: str, tmp_path: Path) -> str:
    return str(tmp_path / "caps") if where == "local" else f"memory://caps-{uuid.uuid4().hex}"


def test_every_layout_name_has_its_strategy() -> None:
    assert sorted(LAYOUTS) == sorted(get_args(Layout))
    assert all(cls.name == name for name, cls in LAYOUTS.items())
    assert (LAYOUTS["jsonl"], LAYOUTS["objects"], LAYOUTS["journal"]) == (
        JsonlLayout,
        ObjectsLayout,
        JournalLayout,
    )


@pytest.mark.parametrize(("where", "layout", "claims"), CASES)
def test_a_layout_writes_rows_and_claims_that_any_store_reads(
    where: str, layout: str, claims: str, tmp_path: Path
) -> None:
    url = _url(where, tmp_path)
    store = CaptureStore(url, layout=cast(Layout, layout), claims=claims)  # type: ignore[arg-type]
    strategy: LayoutStrategy = store.layout_strategy
    assert type(strategy) is LAYOUTS[cast(Layout, layout)] and store.layout == layout
    assert strategy.submits is (layout == "journal")

    rows = [{"model_call_id": f"c{i}", "n": i} for i in range(3)]
    for row in rows:
        blocking, finish = strategy.stage_row("7-1", row)
        try:
            blocking()
        finally:
            finish()
    assert store.read("7-1") == rows
    assert CaptureStore(url).read("7-1") == rows  # a reader of the default layout reads it too

    claim = new_claim("c9", 60)
    strategy.acquire_claim("7-1", claim)
    assert [c.claim_id for c in CaptureStore(url).live_claims("7-1")] == [claim.claim_id]
    strategy.release_claim("7-1", claim.claim_id)
    assert CaptureStore(url).live_claims("7-1") == []
    assert strategy.releases_once() is (claims == "log" and layout != "journal")
    assert (strategy.claims_log_writer is not None) is (claims == "log" and layout != "journal")

    with store.claim("7-2", "c1"):  # the store's claim context goes through the same strategy
        assert len(CaptureStore(url).live_claims("7-2")) == 1
    assert CaptureStore(url).live_claims("7-2") == []

    store.clear(["7-1"])
    assert store.read("7-1") == []
    store.record("7-1", rows[0])  # what the layout learnt of 7-1 was forgotten with it
    assert store.read("7-1") == rows[:1]
    store.close_claims_log()


def test_a_journal_claim_can_be_submitted_and_waited_for(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "caps", layout="journal")
    claim = new_claim("c1", 60)
    future = store.layout_strategy.submit_claim("3-0", claim)
    assert future is not None and future.result(timeout=30) >= 0
    assert [c.claim_id for c in store.live_claims("3-0")] == [claim.claim_id]
    jsonl = CaptureStore(tmp_path / "other")
    assert jsonl.layout_strategy.submit_claim("3-0", claim) is None  # written by acquire_claim instead


def test_the_layout_is_picked_once_in_one_place(tmp_path: Path) -> None:
    local, memory = open_backend(str(tmp_path)), open_backend("memory://pick")
    assert resolve_layout("auto", local) == "jsonl" and resolve_layout("auto", memory) == "objects"
    assert resolve_layout("journal", local) == "journal"
    assert producer_layout("auto", local=True) == "auto" and producer_layout("auto", local=False) == "journal"
    assert producer_layout("objects", local=False) == "objects"
    journal = StoreJournal(memory)
    assert type(open_layout("memory://pick", memory, "auto", "files", journal)) is ObjectsLayout
    with pytest.raises(ValueError, match="the JSONL layout needs a local disk"):
        open_layout("memory://pick", memory, "jsonl", "files", journal)
    with pytest.raises(ValueError, match="the claims log needs a local disk"):
        open_layout("memory://pick", memory, "objects", "log", journal)
    with pytest.raises(ValueError, match="layout must be 'auto' or one of"):
        open_layout(str(tmp_path), local, "rows", "files", StoreJournal(local))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="claims must be 'files' or 'log'"):
        open_layout(str(tmp_path), local, "jsonl", "always", StoreJournal(local))  # type: ignore[arg-type]
