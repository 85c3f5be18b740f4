"""The evidence summary: what a run's evidence says, counted (failed calls, latency, tokens,
models, gaps, orphans), built one rollout at a time and summed across batches.

Memory is bounded whatever the corpus size (1M rollouts x 20 calls is 20M latencies):
distributions are kept in a :class:`~rollout_capture.summary.sketch.Sketch`; models beyond
:data:`MAX_MODELS` fold into ``(other models)``; only the first :data:`MAX_EXAMPLES` rollout
ids of each gap are named.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

from pydantic import BaseModel, Field

from rollout_capture.summary.checks import (
    CALL_FIELDS,
    OTHER_MODELS,
    TOKEN_SUMS,
    add_partial_sum,
    attachment_of,
    bump,
    call_where,
    count_field,
    number_field,
    observation_gap_codes,
    text_field,
)
from rollout_capture.summary.fold import count_columns, rollout_parts
from rollout_capture.summary.orphans import near_input_id, orphans
from rollout_capture.summary.sketch import Sketch

MAX_MODELS = 50
"""Distinct models counted by name; the rest are summed as ``(other models)``."""
UNKNOWN_MODEL = "(unknown)"
MAX_EXAMPLES = 5
"""Rollout ids named for each gap code, and orphan captures named."""
FAIL_SHARE_WARN = 0.05
"""Above this share of failed calls or gapped rollouts a report shows the figure in red."""
PERCENTILES = (50, 90, 99)
MAX_ROWS = 30
"""Rows of a table (markdown, the report's tables and charts): the rest summed in one."""


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
            unknown = getattr(other, f"{name}_unknown_calls")
            add_partial_sum(self.__dict__, name, getattr(other, name), unknown)

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


def _answered_as(served: list[str]) -> str:
    """`` (answered as a, b)`` beside a model asked for, when other names answered for it."""
    return f" (answered as {', '.join(map(_escape, served))})" if served else ""


def _sorted_counts(counts: Mapping[str, int]) -> dict[str, int]:
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


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
    model_servers: dict[str, dict[str, list[int]]] = Field(default_factory=dict)
    """Model name -> model server (``""``: none named) -> ``[calls without a response id, calls
    with one]``: a name on a call without one is the name asked for (no answer named a model), on
    one with one the name that answered. :meth:`model_groups` puts a served name with the asked one."""
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
            where = call_where(index)
            status = call.get("status_code")
            if status is not None and type(status) is not int:
                status = count_field(call, "status_code", where)
            category = call.get("error_category")
            if category is not None and type(category) is not str:
                category = text_field(call, "error_category", where)
            dialect = call.get("dialect")
            if dialect is not None and type(dialect) is not str:
                dialect = text_field(call, "dialect", where)
            latency = call.get("latency_total_ms")
            if latency is not None and type(latency) is not float and type(latency) is not int:
                latency = number_field(call, "latency_total_ms", where)
            ttft = call.get("latency_ttft_ms")
            if ttft is not None and type(ttft) is not float and type(ttft) is not int:
                ttft = number_field(call, "latency_ttft_ms", where)
            tokens = [call.get(name) for name in TOKEN_SUMS]
            for position, name in enumerate(TOKEN_SUMS):
                if tokens[position] is not None and type(tokens[position]) is not int:
                    tokens[position] = count_field(call, name, where)
            hold = call.get("capture_hold_ms")
            if hold is not None and type(hold) is not float and type(hold) is not int:
                hold = number_field(call, "capture_hold_ms", where)
            verifier, model, ref = (
                call.get("verifier_invocation_id"),
                call.get("model"),
                call.get("model_ref"),
            )
            rows.append(
                (
                    status,
                    category,
                    dialect,
                    verifier,
                    latency,
                    ttft,
                    *tokens,
                    model,
                    ref,
                    call.get("response_id"),
                )
            )
            holds.append(hold)
        rollout = rollout_parts(attachment, list(observation_gaps))
        columns = list(zip(*rows, strict=True)) if rows else [()] * len(CALL_FIELDS)
        count_columns(self, columns, holds, [rollout])

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
                bump(mine, key, n)
        for key, n in other.observation_gaps.items():
            bump(self.observation_gaps, key, n)
        self.latency_ms.merge(other.latency_ms)
        self.ttft_ms.merge(other.ttft_ms)
        self.tokens_per_rollout.merge(other.tokens_per_rollout)
        self.calls_per_rollout.merge(other.calls_per_rollout)
        self.capture_hold_ms.merge(other.capture_hold_ms)
        for name, stats in other.models.items():
            if name not in self.models and len(self.models) >= MAX_MODELS:
                name = OTHER_MODELS
            self.models.setdefault(name, ModelStats()).merge(stats)
        for name, servers in other.model_servers.items():
            key = name if name in self.models else OTHER_MODELS
            mine_servers = self.model_servers.setdefault(key, {})
            for server, (asked, served) in servers.items():
                counts = mine_servers.setdefault(server, [0, 0])
                counts[0] += asked
                counts[1] += served
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
        near = {orphan: near_input_id(orphan, input_ids) for orphan in found[:MAX_EXAMPLES]}
        self.set_orphan_figures(len(found), found, {o: n for o, n in near.items() if n is not None})

    def set_orphan_figures(self, count: int, examples: list[str], near: Mapping[str, str]) -> None:
        """The orphan captures as counted elsewhere (an input's ids spilled to disk): how many, the
        first few (sorted), and the input id each of those was probably meant to be."""
        self.orphan_captures = count
        self.orphan_examples = examples[:MAX_EXAMPLES]
        self.orphan_near = {orphan: near[orphan] for orphan in self.orphan_examples if orphan in near}

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

    def model_groups(self) -> list[tuple[str, list[str], ModelStats]]:
        """One row per model asked for: ``(name asked, names that answered for it, its calls)``,
        most calls first.

        A call that got no answer naming a model counts under the name it asked for; one that did,
        under the answer's name (``policy-model-2026-01`` for ``policy-model``). A served name goes
        with the asked one when, through some model server, that one name alone was asked for and
        the served name never was: one model is one row. Otherwise (no server named, several names
        asked through one) each name keeps its row.
        """
        asked_anywhere = {
            name for name, servers in self.model_servers.items() if any(c[0] for c in servers.values())
        }
        asked_through: dict[str, set[str]] = {}
        served_through: dict[str, set[str]] = {}
        for name, servers in self.model_servers.items():
            for server, (asked, served) in servers.items():
                if server and asked:
                    asked_through.setdefault(server, set()).add(name)
                if server and served:
                    served_through.setdefault(server, set()).add(name)
        under: dict[str, set[str]] = {}  # served name -> the asked names it could belong to
        for server, served_names in served_through.items():
            asked_names = asked_through.get(server, set())
            for name in served_names - asked_anywhere:
                under.setdefault(name, set()).update(asked_names if len(asked_names) == 1 else {""})
        parent = {name: next(iter(to)) for name, to in under.items() if len(to) == 1 and "" not in to}
        groups: dict[str, tuple[list[str], ModelStats]] = {}
        for name, stats in sorted(self.models.items()):
            head = parent.get(name, name) if name != OTHER_MODELS else name
            answered_as, total = groups.setdefault(head, ([], ModelStats()))
            total.merge(stats)
            if head != name:
                answered_as.append(name)
        rows = [(head, names, total) for head, (names, total) in groups.items()]
        return sorted(rows, key=lambda row: (-row[2].calls, row[0]))

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
            lines += [  # a model as asked for, the names that answered for it beside (model_groups)
                f"| {_escape(name)}{_answered_as(served)} | {m.calls} | {m.failed_calls} "
                f"| {_md(m.tokens_in)} | {_md(m.tokens_out)} | {_md(m.tokens_total)} "
                f"| {m.tokens_total_unknown_calls} |"
                for name, served, m in self.model_groups()[:MAX_ROWS]
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
