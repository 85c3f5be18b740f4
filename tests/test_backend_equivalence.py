"""Same rows, any backend: identical attachments from local JSONL, copies, and object writes."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import fsspec
import orjson
import pytest

from examples.samples import capture_rows, corpus_records, jsonl_bytes
from rollout_capture import CaptureStore, merge_model_call_capture_into_record
from rollout_capture.names import jsonl_name

from .conftest import S3

ROLLOUTS = [f"{i}-0" for i in range(6)]


@pytest.fixture
def rows_by_rollout(corpus_dir: Path) -> dict[str, list[dict[str, Any]]]:
    records = corpus_records(corpus_dir)
    out = {}
    for index, rollout_id in enumerate(ROLLOUTS):
        dialect = ("responses", "chat", "messages")[index % 3]
        out[rollout_id] = capture_rows(records[index], rollout_id, dialect=dialect, verifier=index == 1)  # type: ignore[arg-type]
    return out


def attachments(store: CaptureStore, *, payloads: bool) -> list[bytes]:
    out = []
    for rollout_id in ROLLOUTS:
        task, rollout = rollout_id.split("-")
        record: dict[str, Any] = {"_ng_task_index": int(task), "_ng_rollout_index": int(rollout)}
        merge_model_call_capture_into_record(record, [store], include_payloads=payloads)
        out.append(orjson.dumps(record["ng_model_call_capture"]))
    return out


def test_attachments_identical_on_every_backend(
    tmp_path: Path, s3: S3, rows_by_rollout: dict[str, list[dict[str, Any]]]
) -> None:
    local = tmp_path / "local"
    local.mkdir()
    for rollout_id, rows in rows_by_rollout.items():
        data = jsonl_bytes(rows)
        if rollout_id == "2-0":
            data += b'{"torn'  # damage travels with the file
        (local / jsonl_name(rollout_id)).write_bytes(data)
    (local / f"{ROLLOUTS[3]}.capture.incomplete").write_bytes(b"")

    memory_url = f"memory://copy-{uuid.uuid4().hex}"
    fsspec.filesystem("memory").put(str(local), memory_url, recursive=True)
    s3.fs().put(str(local), f"{s3.bucket}/copy", recursive=True)

    written: list[CaptureStore] = [
        CaptureStore(f"memory://written-{uuid.uuid4().hex}"),
        CaptureStore(s3.url("written"), storage_options=s3.storage_options),
        CaptureStore(tmp_path / "objects", layout="objects"),
    ]
    for store in written:
        for rollout_id, rows in rows_by_rollout.items():
            for row in rows:
                store.record(rollout_id, row)
            if rollout_id == "2-0":
                store._backend.create(
                    store._backend.path(f"{rollout_id}.capture/{len(rows):012d}.json"), b'{"torn'
                )
        store.mark_incomplete(ROLLOUTS[3])

    stores = [
        CaptureStore(local),
        CaptureStore(memory_url),
        CaptureStore(s3.url("copy"), storage_options=s3.storage_options),
        *written,
    ]
    for payloads in (False, True):
        expected = attachments(stores[0], payloads=payloads)
        assert b"model_call_capture_records_unreadable" in expected[2]
        assert b"model_call_capture_incomplete" in expected[3]
        assert b"verifier_invocations" in expected[1]
        for store in stores[1:]:
            assert attachments(store, payloads=payloads) == expected, store
