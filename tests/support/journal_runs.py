"""A finished run in the journal layout, written as producers' group commits leave it, and its
enrichment in batches of one job (tests of the journal's read plan on each store)."""

from __future__ import annotations

from typing import Any

import orjson

from examples.samples import capture_rows
from rollout_capture import CaptureStore
from rollout_capture.backends import ListingScope
from rollout_capture.batch import enrich_lines
from rollout_capture.claims import new_claim
from rollout_capture.journal import Entry, claim_entry, release_entry, row_entry

ROW = {"model_call_id": "c", "dialect": "chat", "response": {"usage": {"prompt_tokens": 3}}}


def journal_run(store: CaptureStore, rollouts: int, calls: int, group: int = 6) -> list[bytes]:
    """A finished run in the journal layout, as a proxy's group commits leave it: ``group`` calls of
    different rollouts a commit (their claims in one, their rows and releases in another), so a
    commit holds rows of several rollouts and a rollout's rows are in several commits."""
    ids = [f"{r}-0" for r in range(rollouts)]
    pending = [(rollout_id, call) for call in range(calls) for rollout_id in ids]
    for start in range(0, len(pending), group):
        chunk = pending[start : start + group]
        claims = [(rollout_id, new_claim(f"{rollout_id}-{call}", 60)) for rollout_id, call in chunk]
        store.journal_writer_of("claims").write([claim_entry(r, claim) for r, claim in claims])
        store.journal_writer_of("rows").write(
            [row_entry(r, {**ROW, "model_call_id": f"{r}-{call}"}) for r, call in chunk]
            + [release_entry(r, claim.claim_id) for r, claim in claims]
        )
    return [orjson.dumps({"_ng_task_index": r, "_ng_rollout_index": 0}) for r in range(rollouts)]


def enriched(lines: list[bytes], store: CaptureStore, job: str, batch: int = 10) -> list[bytes]:
    """Every line enriched in batches of one job (its listing shared), the job ended after."""
    scope = ListingScope(key=job, rollouts=len(lines))
    out: list[bytes] = []
    for start in range(0, len(lines), batch):
        out += enrich_lines(lines[start : start + batch], [store], scope=scope).lines
    store.end_scope(job)
    return out


def rich_run(store: CaptureStore, records: list[dict[str, Any]], rollouts: int) -> list[bytes]:
    """A finished run in the journal layout with what a compaction must keep as it was: corpus
    calls of each dialect (a verifier's among them), several rollouts a commit and a rollout in
    several commits; a rollout cleared midway and written again; a call whose writer died (its
    claim never released, its TTL out: abandoned); a damaged row; a rollout cleared for
    good. Its rollout lines, one a rollout (and one never captured)."""
    ids = [f"{r}-0" for r in range(rollouts)]
    rows = {
        rollout_id: capture_rows(
            records[index % len(records)],
            rollout_id,
            dialect=("responses", "chat", "messages")[index % 3],  # type: ignore[arg-type]
            verifier=index % 5 == 1,
        )
        for index, rollout_id in enumerate(ids)
    }
    claims_writer, rows_writer = store.journal_writer_of("claims"), store.journal_writer_of("rows")
    most = max(len(r) for r in rows.values())
    for step in range(most):
        chunk = [(r, rows[r][step]) for r in ids if step < len(rows[r])]
        # the dead writer's claim is out of its TTL at once: abandoned, so no read waits for it
        dead = ids[4] if step == 0 and len(ids) > 4 else None
        claims = [(r, new_claim(f"{r}-{step}", 0.001 if r == dead else 60)) for r, _ in chunk]
        claims_writer.write([claim_entry(r, claim) for r, claim in claims])
        entries = [row_entry(r, row) for r, row in chunk]
        releases = [release_entry(r, claim.claim_id) for r, claim in claims]
        if step == 0 and len(ids) > 4:  # the writer of this call died: its claim stays open
            releases = [e for e in releases if e.rollout_id != ids[4]]
            entries = [e for e in entries if e.rollout_id != ids[4]]
        rows_writer.write(entries + releases)
        if step == 1 and len(ids) > 3:
            store.clear([ids[3]])  # cleared midway: its later rows only
    if len(ids) > 6:
        rows_writer.write([Entry("row", ids[6], b'{"torn')])  # a damaged row, counted as one
    if len(ids) > 8:
        store.clear([ids[8]])
    return [orjson.dumps({"_ng_task_index": r, "_ng_rollout_index": 0}) for r in range(rollouts + 1)]
