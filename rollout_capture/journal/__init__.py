"""The journal layout (spec 2, 3 and 11, extension): many calls' claims, rows and releases in one
object, written put-if-absent, so an object store sees a request per group of calls, not several
per call.

``_journal/{seq:012d}.jsonl`` under the capture root holds one *commit*: a header line naming each
entry (``[op, rollout_id]`` or ``[op, rollout_id, claim_id]``), then one line per entry (a row, a
claim body, or ``null``). Commits form one put-if-absent sequence a stream for the whole root. A
rollout's rows are in commit order, then line order: one total order across hosts, with no
clock, that respects which call finished first, because a writer keeps a few commits in flight
(group commit: whatever is submitted meanwhile goes into the next one) under two rules: two
commits in flight never hold one rollout, and a commit is acknowledged only once every number
below it exists, so a later call can only land above it. A lost acknowledgement is told by the
commit's nonce, as for row objects.

A writer killed with commits in flight can leave a number missing below a later commit; a
writer or reader that finds such a hole older than :data:`HOLE_GRACE_S` fills it with an empty
tombstone, put-if-absent (a late put there then lands higher, as any taken number does).
Readers read commits in order from where they stopped (no listing: the first missing number is
the end), index each rollout's entries by their header alone and keep a bounded cache of
bodies, so a rollout's rows cost one GET per commit holding them.

A row lands above every commit that existed when its call began: the writer's look
(:meth:`JournalWriter.look`, a listing above its next number) is taken at the call's start,
beside its claim, and shared by the calls that start meanwhile; the row's commit is then one put
(a submission without a look looks above its number before its put).
"""

from rollout_capture.journal.commits import (
    FORMAT,
    HOLE_GRACE_S,
    LOOK_AHEAD,
    MAX_COMMIT_BYTES,
    MAX_COMMIT_ENTRIES,
    SEQ_WIDTH,
    STREAMS,
    BadCommit,
    Commit,
    Entry,
    Op,
    Stream,
    claim_entry,
    clear_entry,
    commit_name,
    decode_commit,
    encode_commit,
    release_entry,
    row_entry,
    tombstone_body,
)
from rollout_capture.journal.reader import JournalReadBatch, JournalReader, JournalView
from rollout_capture.journal.writer import (
    DEFAULT_IN_FLIGHT,
    IN_FLIGHT_ENV,
    LOOK_DELAY_S,
    SETTLE_TIMEOUT_S,
    JournalCommitter,
    JournalWriter,
    first_free,
    in_flight_bound,
    in_flight_setting,
)
from rollout_capture.names import JOURNAL_DIR

__all__ = [
    "DEFAULT_IN_FLIGHT",
    "FORMAT",
    "HOLE_GRACE_S",
    "IN_FLIGHT_ENV",
    "JOURNAL_DIR",
    "LOOK_AHEAD",
    "LOOK_DELAY_S",
    "MAX_COMMIT_BYTES",
    "MAX_COMMIT_ENTRIES",
    "SEQ_WIDTH",
    "SETTLE_TIMEOUT_S",
    "STREAMS",
    "BadCommit",
    "Commit",
    "Entry",
    "JournalCommitter",
    "JournalReadBatch",
    "JournalReader",
    "JournalView",
    "JournalWriter",
    "Op",
    "Stream",
    "claim_entry",
    "clear_entry",
    "commit_name",
    "decode_commit",
    "encode_commit",
    "first_free",
    "in_flight_bound",
    "in_flight_setting",
    "release_entry",
    "row_entry",
    "tombstone_body",
]
