"""The fast call records (:mod:`rollout_capture.call_records_fast`) against the reference (orjson).

Every test reads the same capture bytes both ways and compares the attachment byte for
byte: rows the typed path takes must give the same records, and every other row must
fall back to the full path, damage counting included.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from examples.samples import DIALECTS, capture_rows, corpus_records
from rollout_capture.attachment import build_attachment
from rollout_capture.call_records import BuiltCall, call_record_dict
from rollout_capture.call_records_fast import Untyped, typed_row
from rollout_capture.evidence import Evidence
from rollout_capture.rows import add_jsonl, add_object
from rollout_capture.snapshot import RolloutSnapshot
from tests.conftest import CORPUS

SHARED_CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "nemo-gym-example-rollouts"
REF = {"type": "responses_api_models", "name": "policy"}


def _snapshot(lines: Sequence[bytes], objects: Sequence[bytes]) -> RolloutSnapshot:
    snap = RolloutSnapshot("r", found=True)
    add_jsonl(snap.parsed, b"\n".join(lines), "r.jsonl")
    for seq, body in enumerate(objects):
        add_object(snap.parsed, body, f"r.objects/{seq}.json")
    return snap


def both_ways(lines: Sequence[bytes], objects: Sequence[bytes] = ()) -> tuple[bytes, bytes, int]:
    """``(full path's attachment, typed path's, rows the typed path built)``, serialized."""
    full = _snapshot(lines, objects)
    full.parsed.rows  # noqa: B018 - read whole first: record_rows then gives these rows
    typed = _snapshot(lines, objects)
    built = sum(type(row) is BuiltCall for _, row in typed.record_rows(False)[0])
    out = [
        orjson.dumps(build_attachment("r", Evidence(snap), include_payloads=False, now=0.0))
        for snap in (full, typed)
    ]
    return out[0], out[1], built


@contextmanager
def recursion_limit(limit: int) -> Iterator[None]:
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


# ---------------------------------------------------------------- row shapes

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),  # what orjson writes; beyond, see TRICKY
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=2), st.dictionaries(st.text(max_size=3), inner, max_size=2)
    ),
    max_leaves=5,
)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The usual shape most of the time, another scalar now and then, rarely any JSON value."""
    return st.integers(0, 9).flatmap(lambda pick: values if pick == 0 else scalars if pick < 3 else strategy)


strings = maybe(st.one_of(st.none(), st.text(max_size=6)))
counts = maybe(st.integers(-3, 10**6))
details = maybe(
    st.fixed_dictionaries(
        {}, optional={k: counts for k in ("reasoning_tokens", "cached_tokens", "cached_input_tokens", "x")}
    )
)
usage = maybe(
    st.fixed_dictionaries(
        {},
        optional={
            **{
                k: counts
                for k in (
                    "input_tokens", "prompt_tokens", "output_tokens", "completion_tokens", "total_tokens",
                    "cache_read_input_tokens", "cache_creation_input_tokens", "reasoning_output_tokens",
                    "cached_input_tokens", "service_tier",
                )
            },
            **{
                k: details
                for k in (
                    "output_tokens_details", "completion_tokens_details", "prompt_tokens_details",
                    "input_tokens_details",
                )
            },
        },
    )
)  # fmt: skip
arguments = st.one_of(
    values, st.just('{"q": "x"}'), st.just("not json"), st.dictionaries(st.text(max_size=2), values)
)
output_item = maybe(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function_call", "reasoning", "message", "other"])},
        optional={
            "call_id": strings,
            "id": strings,
            "name": strings,
            "arguments": arguments,
            "summary": maybe(
                st.lists(maybe(st.fixed_dictionaries({}, optional={"text": strings})), max_size=2)
            ),
            "content": values,
        },
    )
)
tool_call = maybe(
    st.fixed_dictionaries(
        {},
        optional={
            "id": strings,
            "function": maybe(st.fixed_dictionaries({}, optional={"name": strings, "arguments": arguments})),
        },
    )
)
choice = maybe(
    st.fixed_dictionaries(
        {},
        optional={
            "finish_reason": strings,
            "message": maybe(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "tool_calls": maybe(st.lists(tool_call, max_size=2)),
                        "reasoning_content": strings,
                        "reasoning": strings,
                        "content": values,
                    },
                )
            ),
        },
    )
)
chat_choice = st.fixed_dictionaries(
    {
        "message": st.fixed_dictionaries(
            {"tool_calls": st.lists(tool_call, min_size=1, max_size=3)},
            optional={"reasoning_content": strings, "reasoning": strings},
        )
    },
    optional={"finish_reason": strings},
)
block = maybe(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["tool_use", "thinking", "redacted_thinking", "text"])},
        optional={"id": strings, "name": strings, "input": arguments, "thinking": strings, "text": values},
    )
)
response_scalars = {
    "id": strings,
    "model": strings,
    "status": strings,
    "stop_reason": strings,
    "usage": usage,
    "incomplete_details": maybe(st.fixed_dictionaries({}, optional={"reason": strings})),
    "extra": values,
}
# One dialect's list at a time (the first list present wins), and all of them mixed.
response = maybe(
    st.one_of(
        st.fixed_dictionaries(
            {"output": st.lists(output_item, min_size=1, max_size=3)}, optional=response_scalars
        ),
        st.fixed_dictionaries(
            {"choices": st.lists(choice, min_size=1, max_size=2)}, optional=response_scalars
        ),
        st.fixed_dictionaries(
            {"choices": st.lists(chat_choice, min_size=1, max_size=2)}, optional=response_scalars
        ),
        st.fixed_dictionaries(
            {"content": st.lists(block, min_size=1, max_size=3)}, optional=response_scalars
        ),
        st.fixed_dictionaries(
            {},
            optional={
                **response_scalars,
                "output": maybe(st.lists(output_item, max_size=3)),
                "choices": maybe(st.lists(choice, max_size=2)),
                "content": maybe(st.lists(block, max_size=3)),
            },
        ),
    )
)
numbers = maybe(
    st.one_of(st.none(), st.integers(-5, 2**40), st.floats(allow_nan=False, allow_infinity=False))
)
model_call_rows = st.fixed_dictionaries(
    {},
    optional={
        "kind": st.sampled_from([None, "model_call"]),
        "model_call_id": strings,
        "dialect": strings,
        "model_ref": maybe(
            st.one_of(
                st.just(REF),
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["responses_api_models", "x"]), "name": strings}
                ),
                st.fixed_dictionaries(
                    {"type": st.just("responses_api_models"), "name": strings, "x": values}
                ),
            )
        ),
        "started_at": numbers,
        "completed_at": numbers,
        "latency_ms": numbers,
        "latency_ttft_ms": numbers,
        "status_code": maybe(st.one_of(st.none(), st.integers(100, 599))),
        "error_category": strings,
        "client_session_id": strings,
        "verifier_invocation_id": strings,
        "capture_hold_ms": numbers,
        # NeMo Gym 0.7's execution facts (issue 34)
        "upstream_attempted": maybe(st.one_of(st.none(), st.booleans())),
        "response_source": maybe(st.sampled_from([None, "upstream", "local", "other"])),
        "upstream_status_code": maybe(st.one_of(st.none(), st.integers(100, 599))),
        "local_response_reason": strings,
        "request": maybe(st.fixed_dictionaries({}, optional={"model": strings, "input": values})),
        "response": response,
        "request_raw": values,
        "response_raw": values,
        "_capture_nonce": strings,
    },
)
verifier_rows = st.fixed_dictionaries(
    {"kind": st.just("verifier_invocation"), "verifier_invocation_id": strings},
    optional={
        "verifier_ref": maybe(
            st.fixed_dictionaries({"type": st.sampled_from(["resources_servers", "x"]), "name": strings})
        ),
        "started_at": numbers,
        "completed_at": numbers,
        "latency_ms": numbers,
        "status_code": maybe(st.one_of(st.none(), st.integers(100, 599))),
        "error_category": strings,
        "reward": numbers,
        "request": values,
        "response": response,
    },
)
other_rows = st.fixed_dictionaries(
    {"kind": st.one_of(st.text(max_size=4), values)}, optional={"response": response}
)
junk_lines = st.sampled_from(
    [b"", b"  ", b'{"torn": ', b"[1, 2]", b'"text"', b"not json", b'{"a": 1} {"b": 2}', b'{"a": NaN}']
)
row_lines = st.one_of(
    st.one_of(model_call_rows, model_call_rows, model_call_rows, verifier_rows, other_rows).map(orjson.dumps),
    junk_lines,
)


@given(st.lists(row_lines, max_size=5), st.lists(row_lines, max_size=2))
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_typed_path_gives_the_full_paths_attachment(lines: list[bytes], objects: list[bytes]) -> None:
    full, typed, _ = both_ways(lines, objects)
    assert typed == full


def record_both_ways(row: dict[str, Any]) -> tuple[Any, Any]:
    """``(call_record_dict of the whole row or "invalid", the typed path's record or None)``."""
    line = orjson.dumps(row)
    try:
        full = call_record_dict(orjson.loads(line), 3, include_payloads=False)
    except ValidationError:
        full = "invalid"
    try:
        built = typed_row(line, 3)
    except Untyped:
        return full, None
    assert type(built) is BuiltCall
    return full, built.record


@given(usage)
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_typed_usage_counts_as_the_full_path(value: Any) -> None:
    full, typed = record_both_ways({"response": {"usage": value}})
    assert typed is None or typed == full


@given(response)
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_typed_response_parts_read_as_the_full_path(value: Any) -> None:
    full, typed = record_both_ways({"model_call_id": "c", "response": value, "request": {"model": "m"}})
    assert typed is None or (typed == full and list(typed) == list(full))


# ---------------------------------------------------------------- JSON text the decoders read differently

TRICKY = [
    b"18446744073709551616",  # beyond u64: orjson reads a float
    b"9223372036854775808",  # beyond i64: msgspec refuses an Int, orjson reads an int
    b"-9223372036854775809",
    b"1e-400",
    b"-0",
    b"-0.0",
    b"1E5",
    b'"\\ud800"',  # lone surrogate escapes: both refuse
    b'"\\udc00x"',
    b'"\\ud83d\\ude00"',
    b'"\\u00e9\\u0000"',
    b'"\xc3\xa9"',
    b'"\xff"',  # invalid UTF-8: msgspec skips it unread, orjson refuses the line
    b'"\xed\xa0\x80"',  # an encoded surrogate
    b'"\xc0\xaf"',  # overlong
    b'"\xe2\x82"',  # cut short
    b"NaN",
    b"Infinity",
    b'"a\x01b"',
    b"[1,]",
    b"01",
    b"tru",
    b'{"a": 1, "a": 2}',
    b'{"\xff": 1}',
]
BEYOND_DOUBLE = [b"1e400", b"-1.7976931348623159e308", b"1" + b"0" * 400]
"""Valid JSON numbers orjson refuses (the one difference where they sit in a skipped part)."""
SKIPPED_PATHS = [
    ("request", "input"),  # the conversation: never read
    ("response", "output", 1, "content"),  # the answer's text, inside a part that is read
]
READ_PATHS = [
    ("request",),
    ("response", "id"),
    ("response", "usage", "input_tokens"),
    ("response", "output", 0, "arguments"),
    ("status_code",),
    ("started_at",),
    ("model_call_id",),
]
BASE = {
    "model_call_id": "c1",
    "dialect": "responses",
    "model_ref": REF,
    "started_at": 1.5,
    "completed_at": 2,
    "latency_ms": 500,
    "latency_ttft_ms": None,
    "status_code": 200,
    "error_category": None,
    "request": {"model": "m", "input": [{"role": "user", "content": "hi"}]},
    "response": {
        "id": "resp_1",
        "model": "gpt",
        "status": "completed",
        "output": [
            {"type": "function_call", "call_id": "k", "name": "f", "arguments": '{"a": 1}'},
            {"type": "message", "content": [{"type": "output_text", "text": "done"}]},
        ],
        "usage": {"input_tokens": 10, "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 1}},
    },
}
PLACEHOLDER = "@@value@@"


def row_with(path: tuple[Any, ...], text: bytes) -> bytes:
    """``BASE`` with the value at ``path`` replaced by raw JSON text (possibly not valid JSON)."""
    row = orjson.loads(orjson.dumps(BASE))
    target = row
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = PLACEHOLDER
    return orjson.dumps(row).replace(b'"' + PLACEHOLDER.encode() + b'"', text)


@pytest.mark.parametrize(
    ("path", "text"),
    [(p, t) for p in SKIPPED_PATHS + READ_PATHS for t in TRICKY]
    + [(p, t) for p in READ_PATHS for t in BEYOND_DOUBLE],
    ids=lambda v: ".".join(map(str, v)) if isinstance(v, tuple) else repr(v)[:30],
)
def test_json_text_either_reads_alike_or_falls_back(path: tuple[Any, ...], text: bytes) -> None:
    line = row_with(path, text)
    full, typed, _ = both_ways([line, orjson.dumps(BASE)])
    assert typed == full


def test_the_canonical_row_is_read_typed() -> None:
    """Not a test of equality: it would hold if every row fell back. The typed path is taken."""
    full, typed, built = both_ways([orjson.dumps(BASE)] * 3)
    assert typed == full and built == 3


GOLDEN = [
    BASE,
    {
        "model_call_id": "c2",
        "dialect": "chat",
        "client_session_id": "s",
        "response": {
            "id": "chatcmpl-1",
            "choices": [
                {
                    "finish_reason": "tool_calls",
                    "message": {
                        "reasoning_content": "",
                        "reasoning": "vllm reasoning",
                        "tool_calls": [
                            {"id": "t1", "function": {"name": "f", "arguments": '{"a": [1, 2.5e3]}'}},
                            {"id": "t2", "function": "not an object"},
                            5,
                        ],
                    },
                },
                {"message": {"reasoning_content": "second"}},
            ],
            "usage": {
                "prompt_tokens": 50,
                "completion_tokens": 10,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        },
    },
    {
        "model_call_id": "c3",
        "dialect": "messages",
        "response": {
            "model": "claude",
            "stop_reason": "tool_use",
            "content": [
                {"type": "thinking", "thinking": "hmm"},
                {"type": "redacted_thinking", "thinking": "hidden"},
                {"type": "text", "text": "ok"},
                {"type": "tool_use", "id": "tu1", "name": "bash", "input": {"n": 2**62, "x": -0.0, "s": "é"}},
            ],
            "usage": {"input_tokens": 10, "output_tokens": 7, "cache_read_input_tokens": 90},
        },
    },
    {
        "model_call_id": "c4",
        "response": {
            "status": "incomplete",
            "incomplete_details": {"reason": "max_output_tokens"},
            "output": [{"type": "reasoning", "summary": [{"text": "a"}, {"text": ""}, "x", {"text": "b"}]}],
            "usage": {"input_tokens": 3, "output_tokens_details": {"reasoning_tokens": 2}},
        },
    },
    {**BASE, "model_call_id": "c-held", "capture_hold_ms": 118.5},
    {
        "model_call_id": "c5",
        "status_code": 429,
        "error_category": "rate_limit",
        "request": None,
        "response": None,
    },
]


def test_golden_rows_of_each_dialect_are_read_typed_and_alike() -> None:
    full, typed, built = both_ways([orjson.dumps(row) for row in GOLDEN])
    assert typed == full and built == len(GOLDEN)
    calls = orjson.loads(typed)["calls"]
    assert calls[2]["reasoning_content"] == "hmm\nhidden" and calls[3]["reasoning_content"] == "a\nb"


@pytest.mark.parametrize("depth", [1000, 1022, 1023, 1024, 1100])
def test_nesting_orjson_refuses_is_never_read_typed(depth: int) -> None:
    """msgspec's depth follows the recursion limit: raised, it would read what orjson refuses."""
    line = row_with(("request",), b"[" * depth + b"]" * depth)
    for limit in (1000, 5000):
        with recursion_limit(limit):
            full, typed, _ = both_ways([line, orjson.dumps(BASE)])
        assert typed == full, limit


@pytest.mark.parametrize("path", SKIPPED_PATHS, ids=lambda p: ".".join(map(str, p)))
@pytest.mark.parametrize("text", BEYOND_DOUBLE, ids=lambda t: repr(t)[:30])
def test_a_number_beyond_double_range_in_a_skipped_part_is_the_one_difference(
    path: tuple[Any, ...], text: bytes
) -> None:
    """Valid JSON that orjson refuses: the full path counts the row damaged, the typed one reads it.

    Where such a number sits in a part that is read, the typed path falls back (the test
    above, for each part).
    """
    full, typed, built = both_ways([row_with(path, text)])
    assert b"model_call_capture_records_unreadable" in full and built == 1
    assert orjson.loads(typed)["calls"][0]["model_call_id"] == "c1"


# ---------------------------------------------------------------- real rollouts


def corpus_rows(corpus_dir: Path) -> Iterator[list[bytes]]:
    """The capture lines the benchmark corpus holds for each real record, all three dialects."""
    for index, record in enumerate(corpus_records(corpus_dir)):
        rows = capture_rows(
            record, f"r{index}", dialect=DIALECTS[index % 3], seed=index, repeat=2, verifier=index % 5 == 0
        )
        yield [orjson.dumps(row) for row in rows]


@pytest.mark.parametrize(
    "corpus_dir",
    [
        CORPUS,
        pytest.param(
            SHARED_CORPUS,
            marks=pytest.mark.skipif(
                not SHARED_CORPUS.is_dir(), reason="the shared corpus is not on this machine"
            ),
        ),
    ],
    ids=["tests-data", "shared"],
)
def test_real_rollouts_give_the_same_attachments_and_are_read_typed(corpus_dir: Path) -> None:
    built = total = 0
    for lines in corpus_rows(corpus_dir):
        full, typed, typed_rows = both_ways([*lines, b'{"torn": '])
        assert typed == full
        built += typed_rows
        total += sum(orjson.loads(line).get("kind") is None for line in lines)
    assert total and built == total  # every real model call is read typed
