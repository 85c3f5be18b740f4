"""Fast path of :func:`identity.rollout_id_of` of a whole parsed line (the reference); test_identity_fast.

tests/test_identity_fast.py proves the two decide alike on any line. Rollout lines are
identified by a typed decoder that reads only their identity keys: a batch reads every
rollout line to find its capture key and whether our key or agent observations are
already there, nothing else of the record. msgspec decodes those few keys and skips the
rest unbuilt (see :mod:`rollout_capture.call_records_fast` for what the typed path
takes); a line it does not take is read whole (the reference way, ``batch._identify``).
"""

from __future__ import annotations

from typing import TypedDict

import msgspec
from msgspec import Raw

from rollout_capture.call_records_fast import Scalar, Untyped, orjson_reads
from rollout_capture.identity import rollout_id_of


# The keys as written (a TypedDict names them); tests/test_identity_fast.py pins them to
# the constants of identity and attachment.
class _RolloutLine(TypedDict, total=False):
    _ng_rollout_id: Scalar
    _ng_task_index: Scalar
    _ng_rollout_index: Scalar
    _ng_attempt_index: Scalar
    ng_model_call_capture: Raw
    ng_agent_observations: Raw
    ng_trajectory: Raw
    ng_perf: Raw


_decode_line = msgspec.json.Decoder(_RolloutLine).decode


def identify_line(line: bytes) -> tuple[str, bool] | None:
    """Fast path of ``rollout_id_of(orjson.loads(line))`` (the reference); tests/test_identity_fast.py.

    ``(rollout id, whether merging only adds our key)`` of a rollout line, None if it has no id.
    Raises :class:`Untyped` for any line the typed path does not take (not JSON, not an
    object, an id that is not valid, values of another shape): the full path decides
    and says why.
    """
    try:
        record = _decode_line(line)
    except (msgspec.DecodeError, RecursionError):
        raise Untyped from None
    if not orjson_reads(line):
        raise Untyped
    try:
        rollout_id = rollout_id_of(record)
    except ValueError:
        raise Untyped from None
    if rollout_id is None:
        return None
    observations = record.get("ng_agent_observations")
    only_added = (
        "ng_model_call_capture" not in record
        and (observations is None or bytes(observations) == b"null")
        and "ng_trajectory" not in record
        and "ng_perf" not in record
    )
    return rollout_id, only_added
