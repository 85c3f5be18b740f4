"""What a run's evidence says, counted: failed calls, latency, tokens, models, gaps, orphans.

An :class:`EvidenceSummary` is built one enriched record at a time (:meth:`~EvidenceSummary.add`)
and batches are summed (:meth:`~EvidenceSummary.merge`), so a flow never keeps its records.
Memory is bounded whatever the corpus size (1M rollouts x 20 calls is 20M latencies):
distributions are kept in a :class:`Sketch`, exact values while there are at most
:data:`EXACT_LIMIT` of them, else log-spaced buckets 2 % wide (any percentile within 1 % of the
true value, at most ~1,100 buckets for 1 ms .. 10 h); models beyond :data:`MAX_MODELS` fold into
``(other models)``; only the first :data:`MAX_EXAMPLES` rollout ids of each gap are named.

Percentiles use the nearest-rank rule: p50 of ``n`` values is the ``ceil(0.5 n)``-th smallest.
"""

from __future__ import annotations

import math
import operator
import re
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial, reduce
from itertools import chain, repeat
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, Field

from rollout_capture.attachment import ATTACHMENT_KEY, OBSERVATIONS_KEY
from rollout_capture.names import parse_capture_name

EXACT_LIMIT = 1024
"""A sketch keeps its values (exact percentiles) while it holds at most this many."""
GAMMA = 1.02
"""Ratio between the edges of one bucket: a bucket's value is within 1 % of any value in it."""
_LOG_GAMMA = math.log(GAMMA)
_MID = 2 * GAMMA / (1 + GAMMA)  # representative of [g^i, g^(i+1)) is g^i * _MID
MAX_MODELS = 50
"""Distinct models counted by name; the rest are summed as ``(other models)``."""
OTHER_MODELS = "(other models)"
UNKNOWN_MODEL = "(unknown)"
MAX_EXAMPLES = 5
"""Rollout ids named for each gap code, and orphan captures named."""
NO_STATUS = "no status"
"""The status class of a call that got no HTTP status (connection refused, cancelled)."""
FAIL_SHARE_WARN = 0.05
"""Above this share of failed calls or gapped rollouts a report shows the figure in red."""
PERCENTILES = (50, 90, 99)
MAX_ROWS = 30
"""Rows of a table (markdown, the report's tables and charts): the rest summed in one."""


class EvidenceShapeError(ValueError):
    """An enriched record whose attachment does not have the shape the summary reads."""


class Sketch(BaseModel):
    """A distribution of non-negative numbers in bounded memory, mergeable.

    Exact while ``count <= EXACT_LIMIT`` (``values`` kept), else bucketed on a log scale
    (``buckets``: index ``floor(log_GAMMA(v))`` -> count; ``zeros`` counts the values <= 0).
    ``min``/``max``/``total`` are always exact.
    """

    count: int = 0
    total: float = 0.0
    min: float | None = None
    max: float | None = None
    zeros: int = 0
    buckets: dict[int, int] = Field(default_factory=dict)
    values: list[float] | None = Field(default_factory=list)

    def add(self, value: float) -> None:
        """Count one value (negative values count as 0: a clock step, not a duration)."""
        self.add_many((value,))

    def add_many(self, values: Iterable[float]) -> None:
        """Count several values in a few C-level passes over them (this runs for every batch).

        The same result as adding them one by one: buckets in first-seen order, the total
        added in order, the first smallest and largest value kept, ``values`` kept exactly.
        """
        values = values if type(values) is list else list(values)
        if not values:
            return
        smallest = min(values)
        if smallest <= 0:  # rare: values <= 0 count as 0.0, and in no bucket
            zeros = self.zeros + sum(1 for value in values if value <= 0)
            values = [0.0 if value <= 0 else value for value in values]
            positive = [value for value in values if not value <= 0]
            smallest = min(values)
        else:
            zeros, positive = self.zeros, values
        buckets = self.buckets
        if positive:
            keys = map(math.floor, map(operator.mul, map(math.log, positive), repeat(1 / _LOG_GAMMA)))
            for key, n in Counter(keys).items():
                buckets[key] = buckets.get(key, 0) + n
        count = self.count + len(values)
        total = reduce(operator.add, values, self.total)  # in order, as one by one
        low, high = self.min, self.max
        largest = max(values)
        if low is None or smallest < low:
            low = smallest
        if high is None or largest > high:
            high = largest
        # Straight into the fields (no validation runs on assignment anyway): pydantic's
        # __setattr__ costs more than the counting.
        fields = self.__dict__
        fields["count"], fields["total"], fields["zeros"], fields["min"], fields["max"] = (
            count,
            total,
            zeros,
            low,
            high,
        )
        kept = self.values
        if kept is not None:
            if count <= EXACT_LIMIT:
                kept.extend(map(float, values))
            else:
                fields["values"] = None

    def merge(self, other: Sketch) -> Sketch:
        """Add another sketch's values into this one; returns self."""
        if other.count == 0:
            return self
        for key, n in other.buckets.items():
            self.buckets[key] = self.buckets.get(key, 0) + n
        self.zeros += other.zeros
        self.count += other.count
        self.total += other.total
        if other.min is not None and (self.min is None or other.min < self.min):
            self.min = other.min
        if other.max is not None and (self.max is None or other.max > self.max):
            self.max = other.max
        if self.values is not None and other.values is not None and self.count <= EXACT_LIMIT:
            self.values.extend(other.values)
        else:
            self.values = None
        return self

    @property
    def exact(self) -> bool:
        """True when percentiles come from the values themselves."""
        return self.values is not None

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def percentile(self, q: float) -> float | None:
        """The nearest-rank ``q``-th percentile (0 < q <= 100); ``None`` when empty."""
        if not self.count:
            return None
        rank = max(1, math.ceil(q / 100 * self.count))
        if self.values is not None:
            return sorted(self.values)[rank - 1]
        if rank <= self.zeros:
            return 0.0
        seen = self.zeros
        for key in sorted(self.buckets):
            seen += self.buckets[key]
            if seen >= rank:
                value = GAMMA**key * _MID
                return min(max(value, self.min or 0.0), self.max or value)
        return self.max

    def p50_p99(self, unit: str = "") -> str:
        """``p50/p99`` for a log line or a terminal (``120/990 ms``); ``unknown`` when empty."""
        p = self.percentiles()
        if p["p50"] is None or p["p99"] is None:
            return "unknown"
        return f"{p['p50']:,}/{p['p99']:,}" + (f" {unit}" if unit else "")

    def percentiles(self) -> dict[str, int | None]:
        """p50, p90, p99 rounded to whole units (ms, tokens), as the summary shows them."""
        out: dict[str, int | None] = {}
        for q in PERCENTILES:
            value = self.percentile(q)
            out[f"p{q}"] = None if value is None else round(value)
        return out

    def histogram(self, bins: int = 24) -> Histogram:
        """Bins for a chart: log-spaced when the positive values span 10x or more, else linear.

        Values <= 0 are counted apart (``zeros``). Once bucketed, each bucket's count is spread
        over the bins its range overlaps, so bins finer than a bucket show no false comb.
        """
        if self.values is not None:
            spans = [(v, v, 1) for v in self.values if v > 0]
        else:
            lowest, highest = self.min or 0.0, self.max or 0.0
            spans = [
                (max(GAMMA**k, lowest), min(GAMMA ** (k + 1), highest), n)
                for k, n in sorted(self.buckets.items())
            ]
        if not spans:
            return Histogram(zeros=self.zeros)
        low = min(lo for lo, _, _ in spans)
        high = max(hi for _, hi, _ in spans)
        if high <= low:
            return Histogram(zeros=self.zeros, edges=[low, high], counts=[sum(n for _, _, n in spans)])
        log = high / low >= 10

        def position(value: float) -> float:  # 0 at low, bins at high
            if log:
                return math.log(value / low) / math.log(high / low) * bins
            return (value - low) / (high - low) * bins

        counts = [0.0] * bins
        for lo, hi, n in spans:
            start, stop = position(lo), position(max(hi, lo))
            if stop - start < 1e-9:
                counts[min(bins - 1, max(0, int(start)))] += n
                continue
            for index in range(max(0, int(start)), min(bins, math.ceil(stop))):
                overlap = min(stop, index + 1) - max(start, index)
                if overlap > 0:
                    counts[index] += n * overlap / (stop - start)
        steps = [i / bins for i in range(bins + 1)]
        edges = [low * (high / low) ** t for t in steps] if log else [low + (high - low) * t for t in steps]
        return Histogram(zeros=self.zeros, edges=edges, counts=[round(c) for c in counts], log=log)


@dataclass(slots=True)
class Histogram:
    """Chart bins: ``counts[i]`` values in ``[edges[i], edges[i+1])``, plus ``zeros`` (values <= 0)."""

    zeros: int = 0
    edges: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    log: bool = False


class TokenSums(BaseModel):
    """Token sums over the calls that report a value, null when none does (unknown is never
    counted as 0); ``*_unknown_calls`` says how many calls each leaves out."""

    tokens_in: int | None = None
    tokens_out: int | None = None
    tokens_total: int | None = None
    tokens_in_unknown_calls: int = 0
    tokens_out_unknown_calls: int = 0
    tokens_total_unknown_calls: int = 0

    def merge_sums(self, other: TokenSums) -> None:
        """Add another's sums and unknown calls into these."""
        for name in TOKEN_SUMS:
            _add_sum(self.__dict__, name, getattr(other, name), getattr(other, f"{name}_unknown_calls"))

    def token_sums(self) -> dict[str, int | None]:
        """The sums and their unknown-call counts, as JSON (``--json``, events, ``_ENRICHED``)."""
        return {name: getattr(self, name) for name in TokenSums.model_fields}


class ModelStats(TokenSums):
    """Calls and tokens of one model (the response's model, else the request's, else the server name)."""

    calls: int = 0
    failed_calls: int = 0
    latency_ms_total: float = 0.0
    latency_calls: int = 0

    def merge(self, other: ModelStats) -> ModelStats:
        self.calls += other.calls
        self.failed_calls += other.failed_calls
        self.merge_sums(other)
        self.latency_ms_total += other.latency_ms_total
        self.latency_calls += other.latency_calls
        return self

    @property
    def mean_latency_ms(self) -> float | None:
        return self.latency_ms_total / self.latency_calls if self.latency_calls else None


TOKEN_SUMS = ("tokens_in", "tokens_out", "tokens_total")
"""The token sums kept per model and in all, each beside its count of calls that did not report it."""


def _add_sum(fields: dict[str, Any], name: str, known: int | None, unknown_calls: int) -> None:
    """Add a partial sum (``None``: no call reported it) and its unknown calls to ``fields``."""
    if known is not None:
        mine = fields[name]
        fields[name] = known if mine is None else mine + known
    fields[f"{name}_unknown_calls"] += unknown_calls


def tokens_text(total: int | None, unknown_calls: int = 0) -> str:
    """A token sum as a person reads it: ``1,234 tokens``, ``1,234 tokens (3 calls unknown)``,
    ``tokens unknown``: the one wording of every terminal line, artifact and page."""
    if total is None:
        return "tokens unknown"
    return f"{total:,} tokens{unknown_calls_note(unknown_calls)}"


def figure(value: float | None, unit: str = "") -> str:
    """A figure in a log line or table: ``unknown`` for null (never Python's ``None``)."""
    if value is None:
        return "unknown"
    shown = f"{value:,.1f}" if isinstance(value, float) else f"{value:,}"
    return f"{shown} {unit}" if unit else shown


def _where(index: int) -> str:
    """Where a call is, for an error message (built only when one is raised)."""
    return f"{ATTACHMENT_KEY}.calls[{index}]"


def status_class(status_code: int | None) -> str:
    """``2xx``, ``4xx``, ``5xx``, ... or :data:`NO_STATUS` for a call that got no answer."""
    return NO_STATUS if status_code is None else f"{status_code // 100}xx"


_STATUS_CLASSES: dict[int | None, str] = {
    None: NO_STATUS,
    **{code: f"{code // 100}xx" for code in range(100, 600)},
}


def is_failed(status_code: int | None, error_category: str | None) -> bool:
    """A call failed when it has an error category or its status is not 2xx (no status included)."""
    return error_category is not None or status_code is None or not 200 <= status_code < 300


def model_of(call: Mapping[str, Any]) -> str:
    """The name a call is counted under per model."""
    model = call.get("model")
    if isinstance(model, str) and model:
        return model
    return _model_name(model, call.get("model_ref"))


def _model_name(model: Any, ref: Any) -> str:
    """:func:`model_of` of a call's ``model`` and ``model_ref``."""
    if isinstance(model, str) and model:
        return model
    if isinstance(ref, Mapping) and isinstance(ref.get("name"), str) and ref["name"]:
        return str(ref["name"])
    return UNKNOWN_MODEL


def _bump(counts: dict[str, int], key: str, n: int = 1) -> None:
    counts[key] = counts.get(key, 0) + n


def _sorted_counts(counts: Mapping[str, int]) -> dict[str, int]:
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def _number(call: Mapping[str, Any], name: str, where: str) -> float | None:
    value = call.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EvidenceShapeError(f"{where}.{name}: expected a number or null, got {value!r}")
    return float(value)


def _count(call: Mapping[str, Any], name: str, where: str, bits: int = 64) -> int | None:
    """A whole number that fits a signed ``bits``-bit integer (a Parquet column), or null;
    3.7 tokens or 10^30 tokens are refused naming the field, never cut to 3 or overflowed."""
    value = _number(call, name, where)
    if value is None:
        return None
    if not value.is_integer():
        raise EvidenceShapeError(f"{where}.{name}: expected a whole number or null, got {call.get(name)!r}")
    whole = int(value) if type(call.get(name)) is not int else call[name]
    if not -(2 ** (bits - 1)) <= whole < 2 ** (bits - 1):
        raise EvidenceShapeError(f"{where}.{name}: {call.get(name)!r} does not fit a {bits}-bit integer")
    return whole


def _text(call: Mapping[str, Any], name: str, where: str) -> str | None:
    value = call.get(name)
    if value is None or isinstance(value, str):
        return value
    raise EvidenceShapeError(f"{where}.{name}: expected a string or null, got {value!r}")


def _gap_codes(gaps: Any, where: str) -> list[str]:
    if gaps is None:
        return []
    if not isinstance(gaps, list):
        raise EvidenceShapeError(f"{where}: expected a list of gaps")
    codes: list[str] = []
    for index, gap in enumerate(gaps):
        code = gap.get("code") if isinstance(gap, Mapping) else None
        if not isinstance(code, str):
            raise EvidenceShapeError(f"{where}[{index}]: a gap needs a string code")
        codes.append(code)
    return list(dict.fromkeys(codes))


def attachment_of(record: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The record's ``ng_model_call_capture``, checked for the parts a summary reads."""
    attachment = record.get(ATTACHMENT_KEY)
    if attachment is None:
        return None
    if not isinstance(attachment, Mapping):
        raise EvidenceShapeError(f"{ATTACHMENT_KEY}: expected an object")
    if not isinstance(attachment.get("rollout_id"), str):
        raise EvidenceShapeError(f"{ATTACHMENT_KEY}.rollout_id: expected a string")
    calls = attachment.get("calls")
    if not isinstance(calls, list) or not all(isinstance(c, Mapping) for c in calls):
        raise EvidenceShapeError(f"{ATTACHMENT_KEY}.calls: expected a list of objects")
    if not isinstance(attachment.get("metrics", {}), Mapping):
        raise EvidenceShapeError(f"{ATTACHMENT_KEY}.metrics: expected an object")
    return attachment


def observation_gap_codes(record: Mapping[str, Any]) -> list[str]:
    """The distinct codes of ``ng_agent_observations.gaps`` (ownership), in first-seen order."""
    observations = record.get(OBSERVATIONS_KEY)
    if not isinstance(observations, Mapping):
        return []
    return _gap_codes(observations.get("gaps"), f"{OBSERVATIONS_KEY}.gaps")


class EvidenceSummary(TokenSums):
    """The counted evidence of enriched rollouts: built record by record, summed across batches."""

    rollouts: int = 0
    records_without_capture: int = 0
    """JSON records that carry no ``ng_model_call_capture`` (no id, or capture off)."""
    calls: int = 0
    failed_calls: int = 0
    """Calls with an error category or a status that is not 2xx (see :func:`is_failed`)."""
    calls_by_status_class: dict[str, int] = Field(default_factory=dict)
    calls_by_error_category: dict[str, int] = Field(default_factory=dict)
    calls_by_dialect: dict[str, int] = Field(default_factory=dict)
    verifier_calls: int = 0
    verifier_invocations: int = 0
    latency_ms: Sketch = Field(default_factory=Sketch)
    ttft_ms: Sketch = Field(default_factory=Sketch)
    tokens_per_rollout: Sketch = Field(default_factory=Sketch)
    """``metrics.tokens_total`` of each rollout that reports one."""
    calls_per_rollout: Sketch = Field(default_factory=Sketch)
    capture_hold_ms: Sketch = Field(default_factory=Sketch)
    """``capture_hold_ms`` of each call that carries one: what capture cost the answer's first byte."""
    models: dict[str, ModelStats] = Field(default_factory=dict)
    rollouts_with_gaps: int = 0
    gaps: dict[str, int] = Field(default_factory=dict)
    """Rollouts having each capture gap code (``ng_model_call_capture.gaps``)."""
    observation_gaps: dict[str, int] = Field(default_factory=dict)
    """Rollouts having each ownership gap code (``ng_agent_observations.gaps``)."""
    gap_examples: dict[str, list[str]] = Field(default_factory=dict)
    """The first few rollout ids having each gap code (capture and ownership codes)."""
    failure_examples: dict[str, list[str]] = Field(default_factory=dict)
    """The first few rollout ids having a call of each error category: which rollouts failed."""
    orphan_captures: int = 0
    """Rollout ids under the capture root that no input line names (set by :meth:`set_orphans`)."""
    orphan_examples: list[str] = Field(default_factory=list)
    orphan_near: dict[str, str] = Field(default_factory=dict)
    """For a named orphan, the input id it was probably meant to be (``24-1`` -> ``24-1-a1``)."""

    # ------------------------------------------------------------------ building

    def add(self, record: Mapping[str, Any]) -> None:
        """Count one enriched rollout record (a line of an enriched JSONL, parsed).

        Raises :class:`EvidenceShapeError` naming the field when the attachment is malformed.
        """
        attachment = attachment_of(record)
        if attachment is None:
            self.records_without_capture += 1
            return
        self.add_attachment(attachment, observation_gap_codes(record))

    def add_attachment(self, attachment: Mapping[str, Any], observation_gaps: Iterable[str] = ()) -> None:
        """Count one rollout from its attachment (the flows hold it before it is spliced in).

        Each call's fields are checked and coerced first (an error names the call and field,
        and nothing of the rollout is counted), then counted by the same fold as in bulk.
        """
        calls = attachment.get("calls") or []
        rows: list[tuple[Any, ...]] = []
        holds: list[Any] = []
        for index, call in enumerate(calls):
            where = _where(index)
            status = call.get("status_code")
            if status is not None and type(status) is not int:
                status = _count(call, "status_code", where)
            category = call.get("error_category")
            if category is not None and type(category) is not str:
                category = _text(call, "error_category", where)
            dialect = call.get("dialect")
            if dialect is not None and type(dialect) is not str:
                dialect = _text(call, "dialect", where)
            latency = call.get("latency_total_ms")
            if latency is not None and type(latency) is not float and type(latency) is not int:
                latency = _number(call, "latency_total_ms", where)
            ttft = call.get("latency_ttft_ms")
            if ttft is not None and type(ttft) is not float and type(ttft) is not int:
                ttft = _number(call, "latency_ttft_ms", where)
            tokens = [call.get(name) for name in TOKEN_SUMS]
            for position, name in enumerate(TOKEN_SUMS):
                if tokens[position] is not None and type(tokens[position]) is not int:
                    tokens[position] = _count(call, name, where)
            hold = call.get("capture_hold_ms")
            if hold is not None and type(hold) is not float and type(hold) is not int:
                hold = _number(call, "capture_hold_ms", where)
            verifier, model, ref = (
                call.get("verifier_invocation_id"),
                call.get("model"),
                call.get("model_ref"),
            )
            rows.append((status, category, dialect, verifier, latency, ttft, *tokens, model, ref))
            holds.append(hold)
        rollout = _rollout_parts(attachment, list(observation_gaps))
        columns = list(zip(*rows, strict=True)) if rows else [()] * len(CALL_FIELDS)
        _fold(self, columns, holds, [rollout])

    def _model_stats(self, name: str) -> ModelStats:
        stats = self.models.get(name)
        if stats is None:
            if len(self.models) >= MAX_MODELS:
                name = OTHER_MODELS
                stats = self.models.get(name)
            if stats is None:
                stats = self.models[name] = ModelStats()
        return stats

    def _example(self, code: str, rollout_id: str) -> None:
        self._named(self.gap_examples, code, rollout_id)

    @staticmethod
    def _named(examples: dict[str, list[str]], key: str, rollout_id: str) -> None:
        """Name ``rollout_id`` under ``key`` if it is among the first :data:`MAX_EXAMPLES`."""
        named = examples.setdefault(key, [])
        if len(named) < MAX_EXAMPLES and rollout_id not in named:
            named.append(rollout_id)

    def merge(self, other: EvidenceSummary) -> EvidenceSummary:
        """Add another summary (another batch) into this one; returns self."""
        for name in (
            "rollouts",
            "records_without_capture",
            "calls",
            "failed_calls",
            "verifier_calls",
            "verifier_invocations",
            "rollouts_with_gaps",
            "orphan_captures",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.merge_sums(other)
        for name in ("calls_by_status_class", "calls_by_error_category", "calls_by_dialect", "gaps"):
            mine: dict[str, int] = getattr(self, name)
            for key, n in getattr(other, name).items():
                _bump(mine, key, n)
        for key, n in other.observation_gaps.items():
            _bump(self.observation_gaps, key, n)
        self.latency_ms.merge(other.latency_ms)
        self.ttft_ms.merge(other.ttft_ms)
        self.tokens_per_rollout.merge(other.tokens_per_rollout)
        self.calls_per_rollout.merge(other.calls_per_rollout)
        self.capture_hold_ms.merge(other.capture_hold_ms)
        for name, stats in other.models.items():
            if name not in self.models and len(self.models) >= MAX_MODELS:
                name = OTHER_MODELS
            self.models.setdefault(name, ModelStats()).merge(stats)
        for named, theirs in (
            (self.gap_examples, other.gap_examples),
            (self.failure_examples, other.failure_examples),
        ):
            for code, ids in theirs.items():
                for rollout_id in ids:
                    self._named(named, code, rollout_id)
        for rollout_id in other.orphan_examples:
            if len(self.orphan_examples) < MAX_EXAMPLES and rollout_id not in self.orphan_examples:
                self.orphan_examples.append(rollout_id)
        self.orphan_near.update({k: v for k, v in other.orphan_near.items() if k in self.orphan_examples})
        return self

    def __add__(self, other: EvidenceSummary) -> EvidenceSummary:
        return self.model_copy(deep=True).merge(other)

    def set_orphans(self, listed_ids: Iterable[str], input_ids: Collection[str]) -> None:
        """Count the capture root's rollout ids that no input line names (see :func:`orphans`)."""
        found = orphans(listed_ids, input_ids)
        self.orphan_captures = len(found)
        self.orphan_examples = found[:MAX_EXAMPLES]
        self.orphan_near = {}
        for orphan in self.orphan_examples:
            near = near_input_id(orphan, input_ids)
            if near is not None:
                self.orphan_near[orphan] = near

    # ------------------------------------------------------------------ reading

    @property
    def failed_share(self) -> float:
        """Failed calls over all calls (0 when there are none)."""
        return self.failed_calls / self.calls if self.calls else 0.0

    @property
    def gap_share(self) -> float:
        """Rollouts with any capture gap over all rollouts (0 when there are none)."""
        return self.rollouts_with_gaps / self.rollouts if self.rollouts else 0.0

    def digest(self) -> dict[str, Any]:
        """The summary's figures as plain JSON (an event's payload, ``--json``, a run marker).

        Percentiles are rounded to whole ms / tokens; no sketch internals, no payloads.
        """
        tokens = self.tokens_per_rollout.percentiles()
        hold = self.capture_hold_ms.percentiles()
        return {
            "failed_calls": self.failed_calls,
            "failed_share": round(self.failed_share, 6),
            "calls_by_status_class": _sorted_counts(self.calls_by_status_class),
            "calls_by_error_category": _sorted_counts(self.calls_by_error_category),
            "failure_examples": {why: list(ids) for why, ids in sorted(self.failure_examples.items())},
            "latency_ms": self.latency_ms.percentiles(),
            "ttft_ms": self.ttft_ms.percentiles(),
            "capture_hold_ms": {"p50": hold["p50"], "p99": hold["p99"], "calls": self.capture_hold_ms.count},
            "tokens_per_rollout": {"p50": tokens["p50"], "p99": tokens["p99"]},
            **self.token_sums(),
            "models": {
                name: {"calls": m.calls, "failed_calls": m.failed_calls, **m.token_sums()}
                for name, m in self.models_by_calls()
            },
            "gap_examples": {code: list(ids) for code, ids in sorted(self.gap_examples.items())},
            "orphan_captures": self.orphan_captures,
            "orphan_examples": list(self.orphan_examples),
        }

    def models_by_calls(self) -> list[tuple[str, ModelStats]]:
        return sorted(self.models.items(), key=lambda item: (-item[1].calls, item[0]))

    def to_rows(self) -> list[dict[str, Any]]:
        """The summary as ``{section, name, value}`` rows (a table artifact, a CSV)."""
        rows: list[dict[str, Any]] = []

        def row(section: str, name: str, value: Any) -> None:
            rows.append({"section": section, "name": name, "value": value})

        row("totals", "rollouts", self.rollouts)
        row("totals", "calls", self.calls)
        row("totals", "failed calls", self.failed_calls)
        row("totals", "failed share", round(self.failed_share, 4))
        row("totals", "rollouts with gaps", self.rollouts_with_gaps)
        row("totals", "gap share", round(self.gap_share, 4))
        row("totals", "tokens in / out / total", self.tokens_line())
        if self.records_without_capture:
            row("totals", "records without capture", self.records_without_capture)
        if self.verifier_invocations or self.verifier_calls:
            row(
                "totals",
                "verifier invocations / judge calls",
                f"{self.verifier_invocations} / {self.verifier_calls}",
            )
        for key, n in _sorted_counts(self.calls_by_status_class).items():
            row("calls by status class", key, n)
        for key, n in _sorted_counts(self.calls_by_error_category).items():
            row("calls by error category", key, n)
        for key in _sorted_counts(self.calls_by_error_category):
            row("failed rollouts (first)", key, ", ".join(self.failure_examples.get(key, [])))
        for label, sketch, unit in (
            ("latency", self.latency_ms, "ms"),
            ("TTFT", self.ttft_ms, "ms"),
            ("capture hold", self.capture_hold_ms, "ms"),
            ("tokens per rollout", self.tokens_per_rollout, "tokens"),
        ):
            for key, value in sketch.percentiles().items():
                row(f"{label} ({unit})", key, value)
        for name, stats in self.models_by_calls():
            row(
                "per model",
                name,
                f"{stats.calls} calls, {stats.failed_calls} failed, "
                f"{tokens_text(stats.tokens_total, stats.tokens_total_unknown_calls)}",
            )
        for code, n in _sorted_counts({**self.gaps, **self.observation_gaps}).items():
            row("gaps (rollouts)", code, f"{n}: {', '.join(self.gap_examples.get(code, []))}")
        row("orphan captures", "count", self.orphan_captures)
        if self.orphan_examples:
            row("orphan captures", "first", ", ".join(self._orphan_labels()))
        return rows

    def tokens_line(self) -> str:
        """``in / out / total`` as a person reads them, unknown sums and calls said so."""
        return " / ".join(figure(getattr(self, name)) for name in TOKEN_SUMS) + unknown_calls_note(
            self.tokens_total_unknown_calls if self.tokens_total is not None else 0
        )

    def _orphan_labels(self) -> list[str]:
        return [
            f"{o} (input has {self.orphan_near[o]})" if o in self.orphan_near else o
            for o in self.orphan_examples
        ]

    def to_markdown(self) -> str:
        """A markdown digest (a Prefect markdown artifact, a PR comment)."""
        lines = [
            f"**{self.rollouts} rollouts, {self.calls} calls**: {self.failed_calls} failed "
            f"({self.failed_share:.1%}), {self.rollouts_with_gaps} rollouts with gaps "
            f"({self.gap_share:.1%}), {self.orphan_captures} orphan captures",
            "",
            "| | p50 | p90 | p99 |",
            "| --- | ---: | ---: | ---: |",
        ]
        for label, sketch in (
            ("latency (ms)", self.latency_ms),
            ("TTFT (ms)", self.ttft_ms),
            ("capture hold (ms)", self.capture_hold_ms),
            ("tokens per rollout", self.tokens_per_rollout),
        ):
            p = sketch.percentiles()
            lines.append(f"| {label} | {_md(p['p50'])} | {_md(p['p90'])} | {_md(p['p99'])} |")
        lines += ["", "| status class | calls |", "| --- | ---: |"]
        lines += [f"| {_escape(k)} | {n} |" for k, n in top_counts(self.calls_by_status_class)]
        if self.calls_by_error_category:
            lines += ["", "| error category | calls | first rollout ids |", "| --- | ---: | --- |"]
            lines += [
                f"| {_escape(k)} | {n} | {', '.join(map(_escape, self.failure_examples.get(k, [])))} |"
                for k, n in top_counts(self.calls_by_error_category)
            ]
        if self.models:
            lines += [
                "",
                "| model | calls | failed | tokens in | tokens out | tokens total | tokens unknown (calls) |",
            ]
            lines += ["| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
            lines += [
                f"| {_escape(name)} | {m.calls} | {m.failed_calls} | {_md(m.tokens_in)} "
                f"| {_md(m.tokens_out)} | {_md(m.tokens_total)} | {m.tokens_total_unknown_calls} |"
                for name, m in self.models_by_calls()[:MAX_ROWS]
            ]
        all_gaps = {**self.gaps, **self.observation_gaps}
        if all_gaps:
            lines += ["", "| gap | rollouts | first rollout ids |", "| --- | ---: | --- |"]
            lines += [
                f"| {_escape(code)} | {n} | {', '.join(map(_escape, self.gap_examples.get(code, [])))} |"
                for code, n in top_counts(all_gaps)
            ]
        if self.orphan_captures:
            lines += [
                "",
                f"Orphan captures (no input line names them): {self.orphan_captures}, first: "
                + ", ".join(self._orphan_labels()),
            ]
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- in bulk

CALL_FIELDS = (
    "status_code",
    "error_category",
    "dialect",
    "verifier_invocation_id",
    "latency_total_ms",
    "latency_ttft_ms",
    "tokens_in",
    "tokens_out",
    "tokens_total",
    "model",
    "model_ref",
)
"""Every field of a call :meth:`EvidenceSummary.add_attachment` reads."""
_CALL_FIELDS = operator.itemgetter(*CALL_FIELDS)  # all of them in one C call
_NONE = type(None)
_INT_OR_NONE = frozenset((int, _NONE))
_STR_OR_NONE = frozenset((str, _NONE))
_NUMBER_OR_NONE = frozenset((int, float, _NONE))
_STR = frozenset((str,))
_not_none = partial(operator.is_not, None)
_HOLD = operator.methodcaller("get", "capture_hold_ms")  # the key is there only when the row was held
_Rollout = tuple[str, int, int | None, int, Sequence[str], Sequence[str]]
"""(rollout id, calls, metrics.tokens_total, verifier invocations, gap codes, observation gap codes)"""
_FLUSH_ROWS = 256
"""Calls held before they are counted: enough for the C-level passes to pay, few enough
that the values they keep alive add nothing to a batch's peak memory (1024 added 0.5 MB
to the peak of bench_merge and saved under 1 %)."""


class AttachmentFold:
    """Attachments counted into a summary in bulk: :meth:`EvidenceSummary.add_attachment`'s
    counts, a batch at a time.

    :meth:`add` copies the fields a summary reads of each call into flat columns (one
    C-level pass, no per-call Python work); :meth:`flush` counts the columns in C-level
    passes (Counter, map, filter). One by one, a call cost ~2.6 us of dict and attribute
    churn. The result is the one-by-one result: counts, key order, the float sums added
    in the same order. An attachment or a value of another shape or type is counted the
    one-by-one way, in its turn (same coercions, same errors).
    """

    __slots__ = ("_holds", "_looked", "_rollouts", "_rows", "_summary")

    def __init__(self, summary: EvidenceSummary) -> None:
        self._summary = summary
        self._rows: list[tuple[Any, ...]] = []
        self._holds: list[Any] = []  # each held row's capture_hold_ms (None: not held)
        self._rollouts: list[_Rollout] = []
        self._looked = False  # whether rows other than add_built's are held: their types are checked

    def add(self, attachment: Mapping[str, Any], observation_gaps: Iterable[str] = ()) -> None:
        """Count one rollout's attachment (counted for good at the next :meth:`flush`)."""
        get = attachment.get
        calls, metrics, rollout_id = get("calls"), get("metrics"), get("rollout_id")
        tokens = metrics.get("tokens_total") if type(metrics) is dict else None
        verifiers = get("verifier_invocations")
        if (  # the shape build_attachment gives: no check that could fail, nothing coerced
            type(calls) is list
            and type(metrics) is dict
            and type(rollout_id) is str
            and (tokens is None or type(tokens) is int)
            and (verifiers is None or type(verifiers) is list)
            and "gaps" not in attachment
            and not observation_gaps
            and all(map(operator.is_, map(type, calls), repeat(dict)))
            and self._take(calls)  # else a call without some field: .get's None, one by one
        ):
            self._looked = True
            invocations = len(verifiers) if verifiers else 0
            self._rollouts.append((rollout_id, len(calls), tokens, invocations, (), ()))
            if len(self._rows) >= _FLUSH_ROWS:  # what the rows hold stays alive until counted
                self.flush()
            return
        self._add_checked(attachment, list(observation_gaps))

    def add_made(self, attachment: dict[str, Any]) -> None:
        """Fold an attachment :func:`~rollout_capture.attachment.build_attachment` made, as the
        merge folds it: one without gaps by :meth:`add_built`, one with gaps by :meth:`add`."""
        if "gaps" in attachment:
            self.add(attachment)
            return
        verifiers = attachment.get("verifier_invocations")
        self.add_built(
            attachment["rollout_id"],
            attachment["calls"],
            attachment["metrics"]["tokens_total"],
            len(verifiers) if verifiers else 0,
        )

    def add_built(
        self, rollout_id: str, calls: list[dict[str, Any]], tokens_total: int | None, invocations: int
    ) -> None:
        """:meth:`add` of an attachment :func:`~rollout_capture.attachment.build_attachment` built
        without gaps: its rollout id, calls, ``metrics.tokens_total`` and how many verifier
        invocations it holds. What :meth:`add` and :meth:`flush` check is so by construction:
        each call is a dumped ModelCallRecord, every value of its field's type."""
        if not self._take(calls):  # not a call record after all: one by one
            attachment: dict[str, Any] = {"rollout_id": rollout_id, "calls": calls}
            attachment["metrics"] = {"tokens_total": tokens_total}
            if invocations:
                attachment["verifier_invocations"] = [None] * invocations
            self._add_checked(attachment, [])
            return
        self._rollouts.append((rollout_id, len(calls), tokens_total, invocations, (), ()))
        if len(self._rows) >= _FLUSH_ROWS:
            self.flush()

    def _take(self, calls: Sequence[dict[str, Any]]) -> bool:
        """Copy the fields a summary reads of each call into the columns; False (nothing
        copied) when some call lacks one of :data:`CALL_FIELDS`."""
        rows = self._rows
        start = len(rows)
        try:
            rows.extend(map(_CALL_FIELDS, calls))
        except KeyError:
            del rows[start:]
            return False
        self._holds.extend(map(_HOLD, calls))
        return True

    def _add_checked(self, attachment: Mapping[str, Any], observed: list[str]) -> None:
        """:meth:`add` of any other attachment: read as add_attachment reads it, or counted by it."""
        try:
            rollout = _rollout_parts(attachment, observed)
        except Exception:  # the one-by-one way says what is wrong, in its turn
            rollout = None
        calls = attachment.get("calls") if rollout is not None else None
        if (
            rollout is not None
            and (
                not calls or (type(calls) is list and all(map(operator.is_, map(type, calls), repeat(dict))))
            )
            and self._take(calls or ())
        ):
            self._looked = True
            self._rollouts.append(rollout)
            return
        self.flush()
        self._summary.add_attachment(attachment, observed)

    def flush(self) -> None:
        """Count what was added into the summary."""
        rollouts, rows, holds = self._rollouts, self._rows, self._holds
        if not rollouts:
            return
        looked, self._rollouts, self._rows, self._holds, self._looked = self._looked, [], [], [], False
        columns = list(zip(*rows, strict=True)) if rows else [()] * len(CALL_FIELDS)
        if not looked or (_canonical(columns) and set(map(type, holds)) <= _NUMBER_OR_NONE):
            _fold(self._summary, columns, holds, rollouts)  # a built record's values have their types
            return
        start = 0  # a value of another type: each rollout one by one, as it was
        for rollout_id, count, tokens, verifiers, codes, observed in rollouts:
            calls = [dict(zip(CALL_FIELDS, row, strict=True)) for row in rows[start : start + count]]
            for call, hold in zip(calls, holds[start : start + count], strict=True):
                if hold is not None:
                    call["capture_hold_ms"] = hold
            attachment: dict[str, Any] = {
                "rollout_id": rollout_id,
                "calls": calls,
                "metrics": {"tokens_total": tokens},
            }
            if verifiers:
                attachment["verifier_invocations"] = [None] * verifiers
            if codes:
                attachment["gaps"] = [{"code": code} for code in codes]
            start += count
            self._summary.add_attachment(attachment, observed)


def _rollout_parts(attachment: Mapping[str, Any], observed: list[str]) -> _Rollout:
    """What :meth:`EvidenceSummary.add_attachment` reads of a rollout beside its calls (raises as it does)."""
    calls = attachment.get("calls") or []
    metrics = attachment.get("metrics") or {}
    verifiers = attachment.get("verifier_invocations")
    codes = _gap_codes(attachment.get("gaps"), f"{ATTACHMENT_KEY}.gaps") if "gaps" in attachment else []
    return (
        str(attachment.get("rollout_id")),
        len(calls),
        _count(metrics, "tokens_total", f"{ATTACHMENT_KEY}.metrics"),
        len(verifiers) if verifiers else 0,
        codes,
        list(dict.fromkeys(observed)),
    )


def _canonical(columns: Sequence[Sequence[Any]]) -> bool:
    """Whether every value has the type the one-by-one way takes as it is (no coercion, no error)."""
    status, category, dialect, _, latency, ttft, tokens_in, tokens_out, tokens_total, _, _ = columns
    return (
        set(map(type, status)) <= _INT_OR_NONE
        and set(map(type, category)) <= _STR_OR_NONE
        and set(map(type, dialect)) <= _STR_OR_NONE
        and set(map(type, latency)) <= _NUMBER_OR_NONE
        and set(map(type, ttft)) <= _NUMBER_OR_NONE
        and set(map(type, tokens_in)) <= _INT_OR_NONE
        and set(map(type, tokens_out)) <= _INT_OR_NONE
        and set(map(type, tokens_total)) <= _INT_OR_NONE
    )


def _fold(
    summary: EvidenceSummary,
    columns: Sequence[Sequence[Any]],
    holds: Sequence[Any],
    rollouts: Sequence[_Rollout],
) -> None:
    """Count canonical columns (and each call's ``capture_hold_ms``) into the summary: the one
    count of both ways, one rollout at a time (:meth:`EvidenceSummary.add_attachment`) or in bulk.

    A negative duration (a clock step, not the model's time) is left out of the percentiles
    and the means: the attachment names the call in its ``model_call_timing_impossible`` gap.
    """
    status, category, dialect, verifier, latency, ttft, tokens_in, tokens_out, tokens_total, model, ref = (
        columns
    )
    plain = set(map(type, model)) <= _STR and "" not in model
    names: Sequence[str] = model if plain else list(map(_model_name, model, ref))
    # What is counted per call in as few passes as there can be: one C-level count of each
    # (status, category, dialect, model) and one Python pass for the sums per model. Dicts
    # get their keys in the order the calls first show them, as one by one.
    by_status, by_category, by_dialect = (
        summary.calls_by_status_class,
        summary.calls_by_error_category,
        summary.calls_by_dialect,
    )
    classes = _STATUS_CLASSES
    # name -> [calls, failed, in, out, total, calls with a latency, calls knowing in, out, total]
    per_model: dict[str, list[int]] = {}
    failed_calls = 0
    combos = Counter(zip(status, category, dialect, names, strict=True))
    for (code, why, dialect_name, name), n in combos.items():
        key = classes.get(code) or status_class(code)
        by_status[key] = by_status.get(key, 0) + n
        if why is not None:
            by_category[why] = by_category.get(why, 0) + n
        key = dialect_name or "(unknown)"
        by_dialect[key] = by_dialect.get(key, 0) + n
        acc = per_model.get(name)
        if acc is None:
            acc = per_model[name] = [0, 0, 0, 0, 0, 0, 0, 0, 0]
        acc[0] += n
        if why is not None or code is None or not 200 <= code < 300:
            acc[1] += n
            failed_calls += n
    # Latency is summed per rollout and model, each sum then added to the model's total in
    # turn (float sums depend on their order): per (rollout, model) in first-call order.
    rollout_of = chain.from_iterable(map(repeat, range(len(rollouts)), (r[1] for r in rollouts)))
    partials: dict[tuple[int, str], float] = {}
    get = partials.get
    for pair, value, count_in, count_out, count_total in zip(
        zip(rollout_of, names, strict=True), latency, tokens_in, tokens_out, tokens_total, strict=True
    ):
        acc = per_model[pair[1]]
        if count_in is not None:
            acc[2] += count_in
            acc[6] += 1
        if count_out is not None:
            acc[3] += count_out
            acc[7] += 1
        if count_total is not None:
            acc[4] += count_total
            acc[8] += 1
        if value is not None and value >= 0:
            partials[pair] = get(pair, 0.0) + value
            acc[5] += 1
        elif pair not in partials:
            partials[pair] = 0.0
    models = {name: summary._model_stats(name).__dict__ for name in per_model}  # plain field writes
    fields = summary.__dict__
    for name, acc in per_model.items():
        stats = models[name]
        stats["calls"] += acc[0]
        stats["failed_calls"] += acc[1]
        stats["latency_calls"] += acc[5]
        for position, sum_name in enumerate(TOKEN_SUMS):
            known = acc[6 + position]
            total = acc[2 + position] if known else None
            _add_sum(stats, sum_name, total, acc[0] - known)
            _add_sum(fields, sum_name, total, acc[0] - known)
    for (_, name), value in partials.items():
        models[name]["latency_ms_total"] += value
    fields["rollouts"] += len(rollouts)
    fields["calls"] += len(status)
    fields["failed_calls"] += failed_calls
    fields["verifier_calls"] += sum(map(operator.truth, verifier))
    summary.latency_ms.add_many(_durations(latency))
    summary.ttft_ms.add_many(_durations(ttft))
    summary.capture_hold_ms.add_many(_durations(holds))
    summary.calls_per_rollout.add_many([r[1] for r in rollouts])
    summary.tokens_per_rollout.add_many([r[2] for r in rollouts if r[2] is not None])
    if by_category:  # which rollouts failed: the first few of each error category
        start = 0
        for rollout_id, count, *_ in rollouts:
            for why in category[start : start + count]:
                if why is not None:
                    summary._named(summary.failure_examples, why, rollout_id)
            start += count
    for rollout_id, _, _, verifiers, codes, observed in rollouts:
        if verifiers:
            fields["verifier_invocations"] += verifiers
        if codes:
            fields["rollouts_with_gaps"] += 1
            for code in codes:
                _bump(summary.gaps, code)
                summary._example(code, rollout_id)
        for code in observed:
            _bump(summary.observation_gaps, code)
            summary._example(code, rollout_id)


def _durations(values: Sequence[Any]) -> list[float]:
    """The known, possible durations among ``values``: null and negative ones left out."""
    known = list(filter(_not_none, values))
    if known and min(known) < 0:  # rare: an impossible value, named by the attachment's gap
        known = [value for value in known if value >= 0]
    return known


def _md(value: int | None) -> str:
    return "unknown" if value is None else str(value)


def unknown_calls_note(calls: int) -> str:
    """`` (3 calls unknown)`` beside a sum that leaves calls out; empty when none."""
    return f" ({calls:,} call{'' if calls == 1 else 's'} unknown)" if calls else ""


def shorten(text: str, limit: int) -> str:
    """The text cut in the middle: names differ at the end as often as at the start."""
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "\u2026" + text[len(text) - (limit - 1 - head) :]


def _escape(text: str) -> str:
    """A name in a markdown table cell: shortened, its ``|`` and markup inert."""
    return shorten(text, 120).replace("&", "&amp;").replace("<", "&lt;").replace("|", "\\|")


def top_counts(counts: Mapping[str, int]) -> list[tuple[str, int]]:
    """The :data:`MAX_ROWS` largest counts, the rest summed as ``(N more)``: a table's rows."""
    ranked = list(_sorted_counts(counts).items())
    rest = ranked[MAX_ROWS:]
    if not rest:
        return ranked
    return [*ranked[:MAX_ROWS], (f"({len(rest):,} more)", sum(n for _, n in rest))]


# ---------------------------------------------------------------------- orphans

_ATTEMPT = re.compile(r"(.+)-a\d+")


def orphans(listed_ids: Iterable[str], input_ids: Collection[str]) -> list[str]:
    """Rollout ids found under a capture root that no input line names, sorted.

    A harness that named its rollout ``24-1`` where the input says ``24-1-a1`` leaves
    captures no enrichment will ever read; they are counted, never ignored in silence.
    """
    wanted = input_ids if isinstance(input_ids, set | frozenset | dict) else set(input_ids)
    return sorted({r for r in listed_ids if r not in wanted})


def near_input_id(orphan: str, input_ids: Collection[str]) -> str | None:
    """The input id an orphan was probably meant to be: the same id with or without ``-aN``."""
    match = _ATTEMPT.fullmatch(orphan)
    if match is not None and match.group(1) in input_ids:
        return match.group(1)
    for attempt in range(1, 4):
        candidate = f"{orphan}-a{attempt}"
        if candidate in input_ids:
            return candidate
    return None


def capture_ids_from_names(names: Iterable[str]) -> set[str]:
    """The rollout ids that names relative to a capture root belong to (foreign names ignored)."""
    out: set[str] = set()
    for name in names:
        parsed = parse_capture_name(name)
        if parsed is not None:
            out.add(parsed.rollout_id)
    return out


# ---------------------------------------------------------------------- files


def iter_enriched(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """``(line number, record)`` for each non-blank line of an enriched JSONL; ``None`` for a
    line that is not a JSON object (enrichment passes such lines through unchanged).

    A line that is not JSON but names ``ng_model_call_capture`` (a NaN reward, a lone surrogate,
    a torn write) held calls that would vanish: it raises :class:`EvidenceShapeError` naming the
    file, line and the field where parsing stopped, rather than being skipped as a passed-through line.
    """
    key = ATTACHMENT_KEY.encode()
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                if key in line:
                    raise EvidenceShapeError(
                        f"{path}:{number}: {_field_at(line, exc.pos)}: not JSON ({exc.msg}), "
                        f"though the line carries {ATTACHMENT_KEY}: its calls would be lost"
                    ) from None
                yield number, None
                continue
            yield number, record if isinstance(record, dict) else None


_KEY_BEFORE = re.compile(rb'"((?:[^"\\]|\\.)*)"\s*:')


def _field_at(line: bytes, position: int) -> str:
    """The name of the last key before ``position`` in a JSON line (where parsing stopped)."""
    keys: list[bytes] = _KEY_BEFORE.findall(line[: max(position, 0)])
    if not keys:
        return "line"
    name = keys[-1].decode("utf-8", "replace")
    return name if len(name) <= 80 else name[:79] + "\u2026"


def no_attachment_error(path: str | Path) -> EvidenceShapeError:
    """The error of an enriched file in which no line carries an attachment (``report`` and
    ``export`` of the rollouts file itself, or of any other JSONL): an empty page is no evidence."""
    return EvidenceShapeError(
        f"{path}: no line carries an {ATTACHMENT_KEY} attachment; is it an enriched file "
        "(rollout-capture enrich writes <input>.enriched.jsonl)?"
    )


def summarize_records(records: Iterable[Mapping[str, Any]]) -> EvidenceSummary:
    """The summary of parsed enriched records."""
    summary = EvidenceSummary()
    for record in records:
        summary.add(record)
    return summary


def summarize_file(path: str | Path) -> tuple[EvidenceSummary, int]:
    """The summary of an enriched JSONL and its count of lines that are not JSON objects.

    A malformed attachment, or a line carrying one that is not JSON, raises
    :class:`EvidenceShapeError` naming the file, line and field.
    """
    summary = EvidenceSummary()
    unreadable = 0
    for number, record in iter_enriched(path):
        if record is None:
            unreadable += 1
            continue
        try:
            summary.add(record)
        except EvidenceShapeError as exc:
            raise EvidenceShapeError(f"{path}:{number}: {exc}") from None
    return summary, unreadable
