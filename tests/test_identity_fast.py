"""The fast identity read (:mod:`rollout_capture.identity_fast`) against reading the whole line.

A rollout line is identified by its identity keys alone when the typed decoder takes it;
these tests prove it decides exactly as ``batch._identify`` reading the whole line does
(the id, whether merging only adds our key), or hands the line to that full read.
"""

from __future__ import annotations

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_capture.attachment import ATTACHMENT_KEY, OBSERVATIONS_KEY
from rollout_capture.call_records_fast import Untyped
from rollout_capture.identity import rollout_id_of
from rollout_capture.identity_fast import _RolloutLine, identify_line
from rollout_capture.projections import PERF_KEY, TRAJECTORY_KEY
from tests.test_call_records_fast import TRICKY, values


def identify_whole(line: bytes) -> tuple[str, bool] | str | None:
    """What batch._identify decides reading the whole line: the id and whether only our key is added,
    None to pass it through, or "problem"."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return "problem"
    if type(record) is not dict:
        return "problem"
    try:
        rollout_id = rollout_id_of(record)
    except ValueError:
        return "problem"
    if rollout_id is None:
        return None
    return rollout_id, (
        ATTACHMENT_KEY not in record
        and record.get(OBSERVATIONS_KEY) is None
        and TRAJECTORY_KEY not in record
        and PERF_KEY not in record
    )


id_values = st.one_of(
    st.integers(-2, 2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["a-1", "../x", "", "7"]),
    values,
)
rollout_records = st.fixed_dictionaries(
    {},
    optional={
        "_ng_rollout_id": id_values,
        "_ng_task_index": id_values,
        "_ng_rollout_index": id_values,
        "_ng_attempt_index": id_values,
        ATTACHMENT_KEY: values,
        OBSERVATIONS_KEY: values,
        TRAJECTORY_KEY: values,
        PERF_KEY: values,
        "responses_create_params": values,
        "reward": values,
    },
)
rollout_lines = st.one_of(
    rollout_records.map(orjson.dumps),
    st.tuples(rollout_records.map(orjson.dumps), st.sampled_from(TRICKY)).map(
        lambda pair: pair[0][:-1] + (b', "x": ' if len(pair[0]) > 2 else b'"x": ') + pair[1] + b"}"
    ),
    st.sampled_from(
        [
            b"",
            b"[1]",
            b"{",
            b'{"_ng_task_index": 1, "_ng_rollout_index": 2, "ng_agent_observations" : null }\n',
        ]
    ),
)


def test_the_identity_keys_read_are_the_ones_identity_and_attachment_name() -> None:
    from rollout_capture import identity

    expected = {
        identity.ROLLOUT_ID_KEY,
        identity.TASK_INDEX_KEY,
        identity.ROLLOUT_INDEX_KEY,
        identity.ATTEMPT_INDEX_KEY,
        ATTACHMENT_KEY,
        OBSERVATIONS_KEY,
        TRAJECTORY_KEY,
        PERF_KEY,
    }
    assert set(_RolloutLine.__annotations__) == expected


@given(rollout_lines)
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_identify_line_decides_as_the_whole_read_or_falls_back(line: bytes) -> None:
    expected = identify_whole(line)
    try:
        got = identify_line(line)
    except Untyped:
        return
    assert got == expected
