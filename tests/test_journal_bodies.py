"""The commit bodies a journal reader keeps for an enrichment: memory up to a budget, then a file."""

from __future__ import annotations

import uuid

from rollout_capture.journal import encode_commit
from rollout_capture.journal.bodies import CommitBodies
from rollout_capture.journal.commits import decode_commit


def _commit(seq: int, size: int) -> bytes:
    return encode_commit("w", uuid.uuid4().hex, [["row", f"r-{seq}"]], [b'{"pad": "' + b"x" * size + b'"}'])


def test_bodies_past_the_budget_go_to_the_file_and_come_back_the_same() -> None:
    kept = CommitBodies(memory_budget=3000)
    written = {("rows", seq): _commit(seq, 1000) for seq in range(10)}
    for (stream, seq), body in written.items():
        kept.keep((stream, seq), decode_commit(seq, body))
    assert len(kept) == 10 and kept.spilled_bytes > 0  # most of them spilled
    for loc, body in written.items():
        commit = kept.get(loc)
        assert (
            commit is not None
            and commit.body == body
            and commit.line(0) == decode_commit(loc[1], body).line(0)
        )
    assert kept.get(("claims", 0)) is None


def test_a_body_is_kept_once_and_let_go_when_cleared() -> None:
    kept = CommitBodies(memory_budget=0)
    body = _commit(1, 10)
    kept.keep(("rows", 1), decode_commit(1, body))
    kept.keep(("rows", 1), decode_commit(1, body))
    assert len(kept) == 1
    kept.clear()
    assert len(kept) == 0 and kept.get(("rows", 1)) is None and kept.spilled_bytes == 0
