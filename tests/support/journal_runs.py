"""A finished run in the journal layout, written as producers' group commits leave it, and its
enrichment in batches of one job (tests of the journal's read plan on each store)."""

from __future__ import annotations

import orjson

from rollout_capture import CaptureStore
from rollout_capture.backends import ListingScope
from rollout_capture.batch import enrich_lines
from rollout_capture.claims import new_claim
from rollout_capture.journal import claim_entry, release_entry, row_entry

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
