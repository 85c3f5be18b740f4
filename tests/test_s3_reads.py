"""The object-store read path, counted on the wire: one listing, no HEADs, one GET per object;
throttling backs off instead of failing the batch."""

from __future__ import annotations

from typing import Any

import orjson

from rollout_capture import CaptureStore
from rollout_capture.batch import enrich_lines

from .conftest import S3

ROW = {"model_call_id": "c", "dialect": "chat", "response": {"usage": {"prompt_tokens": 3}}}


def fill(s3: S3, rollouts: int, rows: int) -> list[bytes]:
    """Write the object layout directly (not through the proxy: it is not what is measured)."""
    s3.fs().pipe(
        {
            f"{s3.bucket}/caps/{r}-0.capture/{seq:012d}.json": orjson.dumps(
                {**ROW, "model_call_id": f"{r}-{seq}"}
            )
            for r in range(rollouts)
            for seq in range(rows)
        }
    )
    return [orjson.dumps({"_ng_task_index": r, "_ng_rollout_index": 0}) for r in range(rollouts)]


def test_a_batch_costs_one_listing_and_one_get_per_object(flaky_s3: tuple[S3, Any], s3: S3) -> None:
    via, proxy = flaky_s3
    lines = fill(s3, rollouts=300, rows=4)
    store = CaptureStore(via.url("caps"), storage_options=via.storage_options)
    proxy.reset_counts()
    batch = enrich_lines(lines, [store])
    assert batch.stats.calls == 1200 and not batch.stats.gaps
    assert proxy.reset_counts() == {"LIST": 2, "GET": 1200}  # 1,200 keys: two pages of a flat listing


def test_throttling_backs_off_instead_of_failing(flaky_s3: tuple[S3, Any], s3: S3) -> None:
    via, proxy = flaky_s3
    lines = fill(s3, rollouts=40, rows=2)
    store = CaptureStore(via.url("caps"), storage_options=via.storage_options)
    expected = enrich_lines(lines, [CaptureStore(s3.url("caps"), storage_options=s3.storage_options)])
    proxy.throttle(6)  # the listing and some GETs meet 503 SlowDown
    batch = enrich_lines(lines, [store])
    assert proxy.throttled == 6
    assert batch.lines == expected.lines and batch.stats.calls == 80
