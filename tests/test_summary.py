"""Evidence counted in bulk (AttachmentFold, Sketch.add_many) against the one-by-one way,
and the summary of a hand-built corpus whose every figure can be checked by hand.

The bulk way must leave the summary exactly as counting each attachment and value one by
one: the same counts, the same key order, the same float sums to the last bit, the same
errors. Summaries are compared by the repr of their dump (order and every float bit).
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from examples.samples import DIALECTS, capture_rows, corpus_records, jsonl_bytes
from rollout_capture import CaptureStore
from rollout_capture.batch import enrich_lines
from rollout_capture.names import jsonl_name
from rollout_capture.summary import (
    CALL_FIELDS,
    EXACT_LIMIT,
    AttachmentFold,
    EvidenceShapeError,
    EvidenceSummary,
    Sketch,
    capture_ids_from_names,
    orphans,
    summarize_file,
    summarize_records,
    tokens_text,
)
from rollout_capture.summary import fold as fold_module
from tests.conftest import CORPUS
from tests.test_report import MODEL_A, MODEL_B, _input_ids, build_corpus

FIELDS = CALL_FIELDS  # the fields of a call a summary reads


def dumped(model: Any) -> str:
    return repr(model.model_dump())


# ---------------------------------------------------------------- Sketch.add_many


def one_by_one(sketch: Sketch, values: list[Any]) -> None:
    """Sketch.add_many as it was: a Python loop, one value at a time (the reference)."""
    inv = 1 / math.log(1.02)
    for value in values:
        fields = sketch.__dict__
        if value <= 0:
            value = 0.0
            fields["zeros"] += 1
        else:
            key = math.floor(math.log(value) * inv)
            sketch.buckets[key] = sketch.buckets.get(key, 0) + 1
        fields["count"] += 1
        fields["total"] += value
        if sketch.min is None or value < sketch.min:
            fields["min"] = value
        if sketch.max is None or value > sketch.max:
            fields["max"] = value
        if sketch.values is not None:
            if sketch.count <= EXACT_LIMIT:
                sketch.values.append(float(value))
            else:
                fields["values"] = None


numbers = st.one_of(
    st.floats(min_value=-1e6, max_value=1e12, allow_nan=False),
    st.integers(min_value=-5, max_value=2**70),
    st.sampled_from([0, 0.0, -0.0, 1, 1.0, 5e-324, 1e-300]),
)


@given(st.lists(st.lists(numbers, max_size=40), max_size=6), st.integers(0, EXACT_LIMIT + 5))
@settings(max_examples=300, deadline=None)
def test_add_many_counts_as_one_by_one(chunks: list[list[Any]], already: int) -> None:
    bulk, reference = Sketch(), Sketch()
    warmup = [float(i % 97 + 1) for i in range(already)]  # near the exact limit, or past it
    bulk.add_many(warmup)
    one_by_one(reference, warmup)
    for chunk in chunks:
        bulk.add_many(iter(chunk))
        one_by_one(reference, chunk)
    assert dumped(bulk) == dumped(reference)
    assert bulk.percentiles() == reference.percentiles()


def test_an_infinite_value_fails_as_before() -> None:
    with pytest.raises(OverflowError):
        Sketch().add_many([1.0, math.inf])


# ---------------------------------------------------------------- AttachmentFold

status_codes = st.one_of(st.none(), st.sampled_from([200, 201, 404, 429, 500, 302, 99, 700]))
texts = st.one_of(st.none(), st.sampled_from(["", "timeout", "http_5xx", "chat", "responses"]))
counts = st.one_of(st.none(), st.integers(0, 10**6), st.just(0))
latencies = st.one_of(
    st.none(), st.floats(min_value=-10, max_value=1e7, allow_nan=False), st.integers(-2, 10**4)
)
models = st.one_of(st.none(), st.sampled_from(["", "m-a", "m-b", "m-c"]), st.integers(0, 2))
REF = {"type": "responses_api_models", "name": "policy"}
refs = st.one_of(st.none(), st.just(REF), st.just({"name": ""}))
odd = st.one_of(st.booleans(), st.floats(0, 1e4, allow_nan=False), st.text(max_size=2), st.just([1]))


@st.composite
def calls(draw: st.DrawFn) -> Any:
    call: dict[str, Any] = {
        "model_call_id": draw(st.one_of(st.none(), st.text(max_size=3))),
        "status_code": draw(status_codes),
        "error_category": draw(texts),
        "dialect": draw(texts),
        "verifier_invocation_id": draw(st.one_of(st.none(), st.sampled_from(["", "v-1"]))),
        "latency_total_ms": draw(latencies),
        "latency_ttft_ms": draw(latencies),
        "tokens_in": draw(counts),
        "tokens_out": draw(counts),
        "tokens_total": draw(counts),
        "model": draw(models),
        "model_ref": draw(refs),
    }
    if draw(st.booleans()):  # held by its producer: what capture cost the first byte
        call["capture_hold_ms"] = draw(latencies)
    shape = draw(st.integers(0, 60))
    if shape == 0:  # a value of another type: coerced, or an error
        call[draw(st.sampled_from(sorted(call)))] = draw(odd)
    elif shape == 1:  # a field left out: .get's None
        del call[draw(st.sampled_from(sorted(call)))]
    elif shape == 2:
        return draw(st.sampled_from([[], "call", 3]))  # not a mapping
    return call


@st.composite
def attachments(draw: st.DrawFn) -> tuple[Any, list[str]]:
    attachment: dict[str, Any] = {
        "rollout_id": draw(st.sampled_from(["r-1", "r-2", "r-3", "24-1"])),
        "metrics": {"tokens_total": draw(counts)},
        "calls": draw(st.lists(calls(), max_size=6)),
    }
    shape = draw(st.integers(0, 20))
    if shape == 0:
        odd_metrics = [None, {}, {"tokens_total": 2.5}, {"tokens_total": "x"}]
        attachment["metrics"] = draw(st.sampled_from(odd_metrics))
    elif shape == 1:
        attachment["calls"] = draw(st.sampled_from([None, (), {}]))
    elif shape == 2:
        attachment["gaps"] = draw(st.sampled_from([[{"code": 1}], "gaps"]))
    if draw(st.booleans()):
        codes = st.sampled_from(["model_call_capture_incomplete", "g-a", "g-b"])
        attachment["gaps"] = [{"code": c} for c in draw(st.lists(codes, max_size=3))]
    if draw(st.booleans()):
        attachment["verifier_invocations"] = draw(st.sampled_from([[], [{}], [{}, {}]]))
    observed = draw(st.lists(st.sampled_from(["agent_observation_join_failed", "g-a", "o-1"]), max_size=3))
    return attachment, observed


def count_both_ways(
    items: list[tuple[Any, list[str]]], flushes: set[int]
) -> tuple[tuple[str, str | None], tuple[str, str | None]]:
    """``((dump, error) one by one, (dump, error) in bulk)``, each stopping at its first error."""
    results = []
    for bulk in (False, True):
        summary = EvidenceSummary()
        fold = AttachmentFold(summary)
        error = None
        try:
            for index, (attachment, observed) in enumerate(items):
                if bulk:
                    fold.add(attachment, iter(observed))
                    if index in flushes:
                        fold.flush()
                else:
                    summary.add_attachment(attachment, observed)
            fold.flush()
        except (EvidenceShapeError, TypeError, AttributeError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        results.append((dumped(summary), error))
    return results[0], results[1]


@given(st.lists(attachments(), max_size=12), st.sets(st.integers(0, 12)))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_fold_counts_as_one_by_one(items: list[tuple[Any, list[str]]], flushes: set[int]) -> None:
    one, bulk = count_both_ways(items, flushes)
    assert bulk == one


def test_float_sums_keep_their_order_across_a_rollout_counted_one_by_one() -> None:
    """A model's latency total is added rollout by rollout, also around one counted apart."""
    call = dict.fromkeys(FIELDS)
    apart = {k: v for k, v in call.items() if k != "dialect"}  # a field left out: one by one
    items: list[tuple[Any, list[str]]] = [
        ({"rollout_id": "r-1", "calls": [apart | {"latency_total_ms": 2390091.7824230585}]}, []),
        ({"rollout_id": "r-2", "calls": [call | {"latency_total_ms": 5998517.067499143}]}, []),
        ({"rollout_id": "r-3", "calls": [call | {"latency_total_ms": 1.3205917284358293}]}, []),
    ]
    one, bulk = count_both_ways(items, set())
    assert "'latency_ms_total': 8388610.170513932" in one[0]
    assert bulk == one


def test_the_fold_of_many_models_caps_them_as_one_by_one() -> None:
    items = [
        (
            {
                "rollout_id": f"r-{k}",
                "metrics": {"tokens_total": k},
                "calls": [
                    {
                        "status_code": 200 if i % 3 else 500,
                        "error_category": None if i % 3 else "http_5xx",
                        "dialect": "chat",
                        "verifier_invocation_id": None,
                        "latency_total_ms": 0.1 * i + k,
                        "latency_ttft_ms": None,
                        "tokens_in": i,
                        "tokens_out": 1,
                        "tokens_total": i + 1,
                        "model": f"m-{(k * 7 + i) % 60}",
                        "model_ref": None,
                    }
                    for i in range(4)
                ],
            },
            [],
        )
        for k in range(40)
    ]
    one, bulk = count_both_ways(items, set())
    assert one[1] is None and bulk == one
    assert "'(other models)'" in one[0]


def test_a_value_of_another_type_fails_in_bulk_naming_the_call_as_one_by_one() -> None:
    call = dict.fromkeys(FIELDS) | {"status_code": 200, "tokens_in": 3}
    good = {"rollout_id": "r-1", "calls": [call]}
    bad = {"rollout_id": "r-2", "calls": [call, call | {"tokens_in": "3"}]}
    summary = EvidenceSummary()
    fold = AttachmentFold(summary)
    fold.add(good)
    fold.add(bad)
    with pytest.raises(EvidenceShapeError, match=r"ng_model_call_capture\.calls\[1\]\.tokens_in"):
        fold.flush()
    assert (summary.rollouts, summary.calls, summary.tokens_in) == (1, 1, 3)  # r-1 only, as one by one


# ---------------------------------------------------------------- batches


@pytest.mark.parametrize("held", [3, fold_module._FLUSH_ROWS])
def test_a_batch_counts_its_evidence_as_summarizing_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: int
) -> None:
    """enrich_lines counts in bulk (counting every ``held`` calls); summarizing the lines it
    wrote counts one by one."""
    monkeypatch.setattr(fold_module, "_FLUSH_ROWS", held)
    captures = tmp_path / "captures"
    captures.mkdir()
    records = corpus_records(CORPUS)
    lines = []
    for index in range(60):
        record = dict(records[index % len(records)])
        record.pop("ng_model_call_capture", None)
        record["_ng_task_index"], record["_ng_rollout_index"] = index // 4, index % 4
        rollout_id = f"{index // 4}-{index % 4}"
        rows = capture_rows(
            record, rollout_id, dialect=DIALECTS[index % 3], seed=index, repeat=2, verifier=index % 5 == 0
        )
        data = jsonl_bytes(rows) + (b'{"torn": ' if index % 7 == 0 else b"")
        if index % 11 != 3:  # some rollouts have no captures: a gap
            (captures / jsonl_name(rollout_id)).write_bytes(data)
        if index % 9 == 0:  # observations: merged in full, their gaps counted too
            record["ng_agent_observations"] = {"source": "t", "invocations": [], "gaps": [{"code": "o-1"}]}
        lines.append(orjson.dumps(record))
    store = CaptureStore(captures)
    batched = EvidenceSummary()
    for start in range(0, len(lines), 25):
        batched.merge(enrich_lines(lines[start : start + 25], [store], first_line=start + 1).stats.evidence)
    expected = EvidenceSummary()
    for start in range(0, len(lines), 25):
        out = enrich_lines(lines[start : start + 25], [store], first_line=start + 1).lines
        expected.merge(summarize_records(orjson.loads(line) for line in out))
    assert batched.calls > 100 and batched.gaps and batched.observation_gaps
    assert dumped(batched) == dumped(expected)


# ---------------------------------------------------------------- figures people read


def _call(**fields: Any) -> dict[str, Any]:
    return dict.fromkeys(FIELDS) | {"status_code": 200, "dialect": "chat"} | fields


def _summed(*attachments: dict[str, Any]) -> tuple[EvidenceSummary, EvidenceSummary]:
    """The summary of ``attachments`` counted one by one, and in bulk."""
    one, bulk = EvidenceSummary(), EvidenceSummary()
    fold = AttachmentFold(bulk)
    for attachment in attachments:
        one.add_attachment(attachment)
        fold.add(attachment)
    fold.flush()
    return one, bulk


def test_tokens_no_call_reported_are_unknown_never_zero() -> None:
    """A model whose calls all reported no usage has null sums; a mixed sum says how many
    calls it leaves out; batches merge the same way."""
    silent = [_call(model="m-silent", status_code=None, error_category="connection") for _ in range(15)]
    mixed = [_call(model="m-mixed", tokens_in=3, tokens_out=4, tokens_total=7), _call(model="m-mixed")]
    for summary in _summed({"rollout_id": "r-1", "calls": silent}, {"rollout_id": "r-2", "calls": mixed}):
        models = summary.digest()["models"]
        assert models["m-silent"] == {
            "calls": 15,
            "failed_calls": 15,
            "tokens_in": None,
            "tokens_out": None,
            "tokens_total": None,
            "tokens_in_unknown_calls": 15,
            "tokens_out_unknown_calls": 15,
            "tokens_total_unknown_calls": 15,
        }
        assert (models["m-mixed"]["tokens_total"], models["m-mixed"]["tokens_total_unknown_calls"]) == (7, 1)
        assert (summary.tokens_total, summary.tokens_total_unknown_calls) == (7, 16)
        rows = {row["name"]: row["value"] for row in summary.to_rows()}
        assert rows["m-silent"] == "15 calls, 15 failed, tokens unknown"
        assert rows["m-mixed"] == "2 calls, 0 failed, 7 tokens (1 call unknown)"
        assert "| m-silent | 15 | 15 | unknown | unknown | unknown | 15 |" in summary.to_markdown()
    only_silent = EvidenceSummary()
    only_silent.add_attachment({"rollout_id": "r-1", "calls": silent})
    merged = EvidenceSummary().merge(only_silent).merge(EvidenceSummary())
    assert merged.tokens_total is None and merged.models["m-silent"].tokens_in is None
    assert merged.digest()["tokens_total_unknown_calls"] == 15
    assert tokens_text(1234, 3) == "1,234 tokens (3 calls unknown)" and tokens_text(None) == "tokens unknown"


def test_the_nearest_rank_percentile_rounds_its_rank_up() -> None:
    """p50 of n values is the ceil(0.5 n)-th smallest, exact and bucketed alike."""
    sketch = Sketch()
    sketch.add_many([1.0, 2.0, 3.0])
    assert (sketch.percentile(50), sketch.percentile(34), sketch.percentile(33)) == (2.0, 2.0, 1.0)
    assert sketch.percentile(100) == 3.0
    big = Sketch()  # past the exact limit: 1000 x 10 ms then 1000 x 1000 ms, bucketed
    big.add_many([10.0] * 1000 + [1000.0] * 1000)
    assert not big.exact
    assert big.percentile(50) == pytest.approx(10.0, rel=0.01)
    assert big.percentile(50.05) == pytest.approx(1000.0, rel=0.01)  # rank 1001: the first 1000 ms


def test_capture_hold_is_counted_over_the_calls_that_carry_it() -> None:
    calls = [_call(capture_hold_ms=float(ms)) for ms in range(1, 101)] + [_call()]
    one, bulk = _summed({"rollout_id": "r-1", "calls": calls})
    assert dumped(one) == dumped(bulk)
    assert one.digest()["capture_hold_ms"] == {"p50": 50, "p99": 99, "calls": 100}
    assert EvidenceSummary().digest()["capture_hold_ms"] == {"p50": None, "p99": None, "calls": 0}
    assert "| capture hold (ms) | 50 | 90 | 99 |" in one.to_markdown()


def test_the_rollouts_that_failed_are_named_per_error_category() -> None:
    attachments = [
        {"rollout_id": f"r-{k}", "calls": [_call(), _call(status_code=429, error_category="rate_limit")]}
        for k in range(8)
    ] + [{"rollout_id": "r-x", "calls": [_call(status_code=None, error_category="connection")]}]
    one, bulk = _summed(*attachments)
    assert dumped(one) == dumped(bulk)
    assert one.failure_examples == {"rate_limit": ["r-0", "r-1", "r-2", "r-3", "r-4"], "connection": ["r-x"]}
    halves = EvidenceSummary()
    halves.add_attachment(attachments[-1])
    halves.merge(one)
    assert halves.failure_examples["connection"] == ["r-x"]
    assert one.digest()["failure_examples"]["rate_limit"][0] == "r-0"


def test_impossible_durations_are_left_out_of_percentiles_and_means() -> None:
    calls = [
        _call(model="m", latency_total_ms=-5000.0, latency_ttft_ms=-1.0, capture_hold_ms=-3.0),
        _call(model="m", latency_total_ms=100.0, latency_ttft_ms=10.0),
    ]
    one, bulk = _summed({"rollout_id": "r-1", "calls": calls})
    assert dumped(one) == dumped(bulk)
    assert (one.latency_ms.count, one.latency_ms.min, one.ttft_ms.count) == (1, 100.0, 1)
    assert one.capture_hold_ms.count == 0 and one.models["m"].mean_latency_ms == 100.0


def test_the_markdown_digest_stays_small_and_inert_whatever_the_names() -> None:
    """A 2 MB model name, markup and ``|`` in codes, 100 gap codes: each name cut and escaped,
    30 rows a table, the rest summed in one."""
    summary = EvidenceSummary()
    for k in range(100):
        call = _call(model="M" * 2_000_000 if k == 0 else f"m|{k}", error_category=f"<b>{k}</b>")
        summary.add_attachment({"rollout_id": f"r-{k}", "calls": [call], "gaps": [{"code": f"<i>g{k}|"}]})
    text = summary.to_markdown()
    assert len(text) < 30_000 and "<b>" not in text and "<i>" not in text
    assert "| &lt;i>g0\\| | 1 | r-0 |" in text and "| (70 more) | 70 |" in text


# ---------------------------------------------------------------- a hand-built corpus, summarized
# (moved from tests/test_report.py: its corpus is built there, for the report and export tests too)


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, Path]:
    return build_corpus(tmp_path / "bad")


def test_summary_counts_a_hand_built_corpus(corpus: tuple[Path, Path]) -> None:
    captures, enriched = corpus
    summary, unreadable = summarize_file(enriched)
    summary.set_orphans(capture_ids_from_names(os.listdir(captures)), _input_ids(enriched))

    assert unreadable == 1 and summary.records_without_capture == 1
    assert (summary.rollouts, summary.calls) == (22, 100)
    assert summary.failed_calls == 10 and summary.failed_share == pytest.approx(0.10)
    assert summary.calls_by_status_class == {"2xx": 91, "5xx": 6, "4xx": 2, "no status": 1}
    assert summary.calls_by_error_category == {
        "upstream_error": 6,
        "rate_limit": 2,
        "connection": 1,
        "stream_truncated": 1,
    }
    # latencies 10, 20, ..., 1000 ms: nearest rank p50 = 50th = 500, p90 = 900, p99 = 990
    assert summary.latency_ms.percentiles() == {"p50": 500, "p90": 900, "p99": 990}
    assert summary.ttft_ms.percentiles() == {"p50": 50, "p90": 90, "p99": 99}
    # 12 rollouts of 5 x 110 tokens, 8 of 5 x 220 (the two without captures report none)
    assert summary.tokens_per_rollout.count == 20
    assert summary.tokens_per_rollout.percentiles() == {"p50": 550, "p90": 1100, "p99": 1100}
    models = {
        name: (m.calls, m.failed_calls, m.tokens_in, m.tokens_out, m.tokens_total)
        for name, m in summary.models.items()
    }
    assert models == {MODEL_A: (60, 6, 6000, 600, 6600), MODEL_B: (40, 4, 8000, 800, 8800)}
    assert summary.gaps == {"model_call_capture_incomplete": 1, "model_call_capture_no_records": 2}
    assert summary.gap_examples["model_call_capture_no_records"] == ["r-20", "24-1-a1"]
    assert summary.gap_examples["model_call_capture_incomplete"] == ["r-3"]
    assert summary.observation_gaps == {"model_call_ownership_unavailable": 1}
    assert summary.gap_examples["model_call_ownership_unavailable"] == ["r-5"]
    assert summary.rollouts_with_gaps == 3
    assert (summary.orphan_captures, summary.orphan_examples) == (1, ["24-1"])
    assert summary.orphan_near == {"24-1": "24-1-a1"}

    text = summary.to_markdown()
    assert "10 failed (10.0%)" in text and "| latency (ms) | 500 | 900 | 990 |" in text
    assert "24-1 (input has 24-1-a1)" in text
    rows = {(r["section"], r["name"]): r["value"] for r in summary.to_rows()}
    assert rows[("calls by error category", "rate_limit")] == 2
    assert rows[("failed rollouts (first)", "rate_limit")] == "r-13, r-15"  # which rollouts failed
    assert rows[("TTFT (ms)", "p99")] == 99


def test_summaries_of_two_halves_merge_to_the_whole(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    _, enriched = corpus
    lines = enriched.read_bytes().splitlines(keepends=True)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_bytes(b"".join(lines[:11]))
    second.write_bytes(b"".join(lines[11:]))
    whole = summarize_file(enriched)[0]
    halves = summarize_file(first)[0] + summarize_file(second)[0]
    assert halves.model_dump() == whole.model_dump()
    # and through JSON, as batch results travel between processes
    again = EvidenceSummary.model_validate_json(summarize_file(first)[0].model_dump_json())
    assert again.merge(summarize_file(second)[0]).model_dump() == whole.model_dump()


def test_a_large_distribution_stays_bounded_and_within_one_percent() -> None:
    rng = random.Random(16)
    values = [rng.lognormvariate(7, 1.2) for _ in range(60_000)]
    halves = [Sketch(), Sketch()]
    for index, value in enumerate(values):
        halves[index % 2].add(value)
    sketch = halves[0].merge(halves[1])
    assert not sketch.exact and sketch.count == len(values) > EXACT_LIMIT
    assert len(sketch.buckets) < 1_000 and len(sketch.model_dump_json()) < 20_000
    ordered = sorted(values)
    for q in (50, 90, 99):
        exact = ordered[math.ceil(q / 100 * len(values)) - 1]
        assert sketch.percentile(q) == pytest.approx(exact, rel=0.0101)
    assert sketch.max == ordered[-1] and sketch.min == ordered[0]
    # zeros (and negative clock steps) count as 0 and sit in a bin of their own
    zeros = Sketch()
    zeros.add_many([0, -3.0, 0, 5.0])
    assert zeros.percentiles() == {"p50": 0, "p90": 5, "p99": 5} and zeros.histogram().zeros == 3


def test_orphans_are_the_listed_ids_no_input_names() -> None:
    names = ["24-1.capture.jsonl", "r-1.capture.jsonl", "r-2.capture/000000000000.json", "notes.txt"]
    listed = capture_ids_from_names(names)
    assert listed == {"24-1", "r-1", "r-2"}
    assert orphans(listed, {"r-1", "r-2", "24-1-a1"}) == ["24-1"]


def test_a_malformed_call_names_file_line_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    attachment = {"rollout_id": "x", "metrics": {}, "calls": [{"latency_total_ms": "fast"}]}
    bad.write_bytes(b'{"reward": 1}\n' + orjson.dumps({"ng_model_call_capture": attachment}) + b"\n")
    with pytest.raises(
        EvidenceShapeError, match=r"bad\.jsonl:2: ng_model_call_capture\.calls\[0\]\.latency_total_ms"
    ):
        summarize_file(bad)
