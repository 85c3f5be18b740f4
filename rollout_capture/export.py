"""Enriched rollouts as two Parquet tables, to query calls with DuckDB, pandas or polars.

Needs pyarrow: ``pip install 'rollout-capture[export]'``. Rows are written in row groups of
:data:`ROWS_PER_GROUP` as the input is read, so memory stays bounded whatever its size.

Calls table (one row per captured model call)

=========================  =====================  ===================================================
column                     type                   meaning
=========================  =====================  ===================================================
rollout_id                 string, not null       the rollout (``ng_model_call_capture.rollout_id``)
line                       int64, not null        line of the enriched JSONL holding the rollout
call_index                 int32                  position of the call's row in the capture
model_call_id              string                 the producer's id of the call
response_id                string                 the response's id
model                      string, not null       the response's model, else the request's, else the
                                                  model server's name, else ``(unknown)``: the name
                                                  the summary counts calls per model under
model_server               string                 ``model_ref.name`` (which server answered)
dialect                    string                 ``responses`` | ``chat`` | ``messages``
status_code                int32                  HTTP status; null when the call got no answer
status_class               string, not null       ``2xx``, ``4xx``, ``5xx``, ... or ``no status``
error_category             string                 ``rate_limit``, ``upstream_error``, ... (null: none)
failed                     bool, not null         error category set, or status not 2xx
finish_reason              string                 the response's stop / finish reason
started_at, completed_at   timestamp[us, UTC]     when the call started and ended
latency_ms                 float64                forward to last byte (``latency_total_ms``)
ttft_ms                    float64                forward to first byte (``latency_ttft_ms``)
upstream_attempted         bool                   whether the model server called its upstream (NeMo
                                                  Gym 0.7's servers, our proxy); null: not said
response_source            string                 ``upstream`` | ``local`` (who made the answer)
upstream_status_code       int32                  the upstream's HTTP status, when it answered
local_response_reason      string                 why a server answered itself (``context_length_
                                                  exceeded``, ``upstream_unreachable``, ...)
tokens_in, tokens_out,     int64                  usage as the call reported it; null: unknown
tokens_reasoning,
tokens_total,
cached_tokens,
cache_creation_tokens
cache_hit                  bool                   ``cached_tokens > 0``; null when unknown
tool_calls                 int32, not null        number of tool calls in the response
verifier_invocation_id     string                 set when a verifier (judge) made the call
owner_invocation_id        string                 the agent invocation owning the call
                                                  (``ng_agent_observations``), when resolved
=========================  =====================  ===================================================

Rollouts table (one row per enriched rollout)

=========================  =====================  ===================================================
rollout_id                 string, not null       the rollout id
line                       int64, not null        its line in the enriched JSONL
reward                     float64                the record's ``reward`` when a number
num_calls                  int32, not null        captured calls (``metrics.num_calls``)
failed_calls               int32, not null        calls counted ``failed`` above
tokens_in, tokens_out,     int64                  ``metrics``: sums over the calls that report a
tokens_reasoning,                                 value; null when none does
tokens_total,
cached_tokens
latency_total_ms           float64                ``metrics.latency_total_ms``
gap_codes                  list<string>, not null the capture gap codes (``ng_model_call_capture.gaps``)
observation_gap_codes      list<string>, not null the ownership gap codes (``ng_agent_observations.gaps``)
verifier_invocations       int32, not null        verifier invocations recorded
=========================  =====================  ===================================================

Example (DuckDB): ``SELECT model, count(*), sum(tokens_total), quantile_disc(latency_ms, 0.99)
FROM 'calls.parquet' GROUP BY model``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_capture.attachment import ATTACHMENT_KEY, OBSERVATIONS_KEY
from rollout_capture.summary import (
    EvidenceShapeError,
    attachment_of,
    count_field,
    gap_codes,
    is_failed,
    iter_enriched,
    model_of,
    no_attachment_error,
    number_field,
    observation_gap_codes,
    status_class,
    text_field,
)

ROWS_PER_GROUP = 32_768
"""Rows buffered before a row group is written."""


class ExportUnavailable(RuntimeError):
    """pyarrow is not installed."""


@dataclass(frozen=True, slots=True)
class ExportCounts:
    """What an export wrote."""

    calls: int
    rollouts: int
    lines_skipped: int
    """Lines that are not JSON objects, or records without an attachment."""


def _pyarrow() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ExportUnavailable(
            "exporting Parquet tables needs pyarrow: pip install 'rollout-capture[export]'"
        ) from exc
    return pa, pq


def calls_schema() -> Any:
    """The calls table's ``pyarrow.Schema``."""
    pa, _ = _pyarrow()
    ts = pa.timestamp("us", tz="UTC")
    return pa.schema(
        [
            pa.field("rollout_id", pa.string(), nullable=False),
            pa.field("line", pa.int64(), nullable=False),
            pa.field("call_index", pa.int32()),
            pa.field("model_call_id", pa.string()),
            pa.field("response_id", pa.string()),
            pa.field("model", pa.string(), nullable=False),
            pa.field("model_server", pa.string()),
            pa.field("dialect", pa.string()),
            pa.field("status_code", pa.int32()),
            pa.field("status_class", pa.string(), nullable=False),
            pa.field("error_category", pa.string()),
            pa.field("failed", pa.bool_(), nullable=False),
            pa.field("finish_reason", pa.string()),
            pa.field("started_at", ts),
            pa.field("completed_at", ts),
            pa.field("latency_ms", pa.float64()),
            pa.field("ttft_ms", pa.float64()),
            pa.field("upstream_attempted", pa.bool_()),
            pa.field("response_source", pa.string()),
            pa.field("upstream_status_code", pa.int32()),
            pa.field("local_response_reason", pa.string()),
            pa.field("tokens_in", pa.int64()),
            pa.field("tokens_out", pa.int64()),
            pa.field("tokens_reasoning", pa.int64()),
            pa.field("tokens_total", pa.int64()),
            pa.field("cached_tokens", pa.int64()),
            pa.field("cache_creation_tokens", pa.int64()),
            pa.field("cache_hit", pa.bool_()),
            pa.field("tool_calls", pa.int32(), nullable=False),
            pa.field("verifier_invocation_id", pa.string()),
            pa.field("owner_invocation_id", pa.string()),
        ]
    )


def rollouts_schema() -> Any:
    """The rollouts table's ``pyarrow.Schema``."""
    pa, _ = _pyarrow()
    return pa.schema(
        [
            pa.field("rollout_id", pa.string(), nullable=False),
            pa.field("line", pa.int64(), nullable=False),
            pa.field("reward", pa.float64()),
            pa.field("num_calls", pa.int32(), nullable=False),
            pa.field("failed_calls", pa.int32(), nullable=False),
            pa.field("tokens_in", pa.int64()),
            pa.field("tokens_out", pa.int64()),
            pa.field("tokens_reasoning", pa.int64()),
            pa.field("tokens_total", pa.int64()),
            pa.field("cached_tokens", pa.int64()),
            pa.field("latency_total_ms", pa.float64()),
            pa.field("gap_codes", pa.list_(pa.string()), nullable=False),
            pa.field("observation_gap_codes", pa.list_(pa.string()), nullable=False),
            pa.field("verifier_invocations", pa.int32(), nullable=False),
        ]
    )


_MAX_MICROS = 2**63 - 1
"""The largest ``timestamp[us]`` (year 294247)."""


def _micros(call: Mapping[str, Any], name: str, where: str) -> int | None:
    """A time in Unix seconds as the table's microseconds; one past the column's range is
    refused naming the field (never a bare ``OverflowError`` from pyarrow)."""
    seconds = number_field(call, name, where)
    if seconds is None:
        return None
    micros = round(seconds * 1_000_000)
    if not -_MAX_MICROS <= micros <= _MAX_MICROS:
        raise EvidenceShapeError(f"{where}.{name}: {call.get(name)!r} is not a time (Unix seconds)")
    return micros


def call_owners(record: Mapping[str, Any]) -> dict[str, str]:
    """model_call_id -> invocation_id, from the resolved refs of ``ng_agent_observations``."""
    observations = record.get(OBSERVATIONS_KEY)
    if not isinstance(observations, Mapping):
        return {}
    out: dict[str, str] = {}
    for key in ("invocations", "records"):
        items = observations.get(key)
        if not isinstance(items, list):
            continue
        for invocation in items:
            if not isinstance(invocation, Mapping) or not isinstance(invocation.get("invocation_id"), str):
                continue
            refs = invocation.get("model_calls")
            for ref in refs if isinstance(refs, list) else []:
                if isinstance(ref, Mapping) and isinstance(ref.get("model_call_id"), str):
                    out.setdefault(ref["model_call_id"], invocation["invocation_id"])
    return out


class _Table:
    """Column buffers for one table, flushed to a Parquet writer a row group at a time."""

    def __init__(self, path: Path, schema: Any, pa: Any, pq: Any) -> None:
        self.pa, self.schema = pa, schema
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        self.path, self.temp = path, Path(temp)
        self.writer = pq.ParquetWriter(str(self.temp), schema)
        self.columns: dict[str, list[Any]] = {name: [] for name in schema.names}
        self.rows = self.buffered = 0

    def append(self, row: dict[str, Any]) -> None:
        for name, column in self.columns.items():
            column.append(row[name])
        self.rows += 1
        self.buffered += 1
        if self.buffered >= ROWS_PER_GROUP:
            self.flush()

    def flush(self) -> None:
        if self.buffered:
            self.writer.write_table(self.pa.Table.from_pydict(self.columns, schema=self.schema))
            for column in self.columns.values():
                column.clear()
            self.buffered = 0

    def close(self) -> None:
        self.flush()
        self.writer.close()
        os.chmod(self.temp, 0o644)
        os.replace(self.temp, self.path)

    def abort(self) -> None:
        try:
            self.writer.close()
        finally:
            self.temp.unlink(missing_ok=True)


def _bool_field(call: Mapping[str, Any], name: str, where: str) -> bool | None:
    """A call's true/false field, or null (unknown stays null); anything else refused naming it."""
    value = call.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise EvidenceShapeError(f"{where}.{name}: expected true, false or null, got {value!r}")


def _call_row(
    rollout_id: str, line: int, call: Mapping[str, Any], owners: Mapping[str, str], where: str
) -> dict[str, Any]:
    status = count_field(call, "status_code", where, bits=32)
    category = text_field(call, "error_category", where)
    ref = call.get("model_ref")
    model_call_id = text_field(call, "model_call_id", where)
    tool_calls = call.get("tool_calls")
    cache_hit = call.get("cache_hit")
    return {
        "rollout_id": rollout_id,
        "line": line,
        "call_index": count_field(call, "call_index", where, bits=32),
        "model_call_id": model_call_id,
        "response_id": text_field(call, "response_id", where),
        "model": model_of(call),
        "model_server": ref.get("name")
        if isinstance(ref, Mapping) and isinstance(ref.get("name"), str)
        else None,
        "dialect": text_field(call, "dialect", where),
        "status_code": status,
        "status_class": status_class(status),
        "error_category": category,
        "failed": is_failed(status, category),
        "finish_reason": text_field(call, "finish_reason", where),
        "started_at": _micros(call, "started_at", where),
        "completed_at": _micros(call, "completed_at", where),
        "latency_ms": number_field(call, "latency_total_ms", where),
        "ttft_ms": number_field(call, "latency_ttft_ms", where),
        "upstream_attempted": _bool_field(call, "upstream_attempted", where),
        "response_source": text_field(call, "response_source", where),
        "upstream_status_code": count_field(call, "upstream_status_code", where, bits=32),
        "local_response_reason": text_field(call, "local_response_reason", where),
        "tokens_in": count_field(call, "tokens_in", where),
        "tokens_out": count_field(call, "tokens_out", where),
        "tokens_reasoning": count_field(call, "tokens_reasoning", where),
        "tokens_total": count_field(call, "tokens_total", where),
        "cached_tokens": count_field(call, "cached_tokens", where),
        "cache_creation_tokens": count_field(call, "cache_creation_tokens", where),
        "cache_hit": cache_hit if isinstance(cache_hit, bool) else None,
        "tool_calls": len(tool_calls) if isinstance(tool_calls, list) else 0,
        "verifier_invocation_id": text_field(call, "verifier_invocation_id", where),
        "owner_invocation_id": owners.get(model_call_id) if model_call_id else None,
    }


def _rollout_row(
    record: Mapping[str, Any], attachment: Mapping[str, Any], line: int, failed: int
) -> dict[str, Any]:
    metrics = attachment.get("metrics") or {}
    where = f"{ATTACHMENT_KEY}.metrics"
    reward = record.get("reward")
    verifiers = attachment.get("verifier_invocations")
    return {
        "rollout_id": attachment["rollout_id"],
        "line": line,
        "reward": float(reward) if isinstance(reward, int | float) and not isinstance(reward, bool) else None,
        "num_calls": len(attachment["calls"]),
        "failed_calls": failed,
        "tokens_in": count_field(metrics, "tokens_in", where),
        "tokens_out": count_field(metrics, "tokens_out", where),
        "tokens_reasoning": count_field(metrics, "tokens_reasoning", where),
        "tokens_total": count_field(metrics, "tokens_total", where),
        "cached_tokens": count_field(metrics, "cached_tokens", where),
        "latency_total_ms": number_field(metrics, "latency_total_ms", where),
        "gap_codes": gap_codes(attachment.get("gaps"), f"{ATTACHMENT_KEY}.gaps"),
        "observation_gap_codes": observation_gap_codes(record),
        "verifier_invocations": len(verifiers) if isinstance(verifiers, list) else 0,
    }


def export_tables(
    path: str | Path, calls_out: str | Path | None = None, rollouts_out: str | Path | None = None
) -> ExportCounts:
    """Write the calls and/or rollouts Parquet tables of an enriched JSONL (schema: module doc).

    Each file is written whole (a temporary file renamed over it) or not at all. Lines that
    are not JSON objects (passed through by enrichment) and records without an attachment are
    skipped and counted. A malformed attachment, a line carrying one that is not JSON, a count
    that is not whole or does not fit its column, and a file in which no line carries an
    attachment raise :class:`EvidenceShapeError` naming the file (and line and field).
    """
    if calls_out is None and rollouts_out is None:
        raise ValueError("export_tables: name calls_out, rollouts_out or both")
    pa, pq = _pyarrow()
    tables: list[_Table] = []
    calls = rollouts = None
    try:
        if calls_out is not None:
            calls = _Table(Path(calls_out), calls_schema(), pa, pq)
            tables.append(calls)
        if rollouts_out is not None:
            rollouts = _Table(Path(rollouts_out), rollouts_schema(), pa, pq)
            tables.append(rollouts)
        skipped = enriched = 0
        for line, record in iter_enriched(path):
            try:
                attachment = attachment_of(record) if record is not None else None
                if record is None or attachment is None:
                    skipped += 1
                    continue
                enriched += 1
                rollout_id = attachment["rollout_id"]
                owners = call_owners(record)
                failed = 0
                for index, call in enumerate(attachment["calls"]):
                    row = _call_row(rollout_id, line, call, owners, f"{ATTACHMENT_KEY}.calls[{index}]")
                    failed += row["failed"]
                    if calls is not None:
                        calls.append(row)
                if rollouts is not None:
                    rollouts.append(_rollout_row(record, attachment, line, failed))
            except EvidenceShapeError as exc:
                raise EvidenceShapeError(f"{path}:{line}: {exc}") from None
        if not enriched:
            raise no_attachment_error(path)
        for table in tables:
            table.close()
    except BaseException:
        for table in tables:
            table.abort()
        raise
    return ExportCounts(
        calls=calls.rows if calls is not None else 0,
        rollouts=rollouts.rows if rollouts is not None else 0,
        lines_skipped=skipped,
    )
