"""What a summary reads of an attachment and its calls, checked: the one place both ways of
counting (one by one, in bulk) take a field's value, its class and its error from."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout_capture.attachment import ATTACHMENT_KEY, OBSERVATIONS_KEY

UNKNOWN_MODEL = "(unknown)"
NO_STATUS = "no status"
"""The status class of a call that got no HTTP status (connection refused, cancelled)."""
OTHER_MODELS = "(other models)"
"""The models beyond the summary's ``MAX_MODELS``, summed in one."""
TOKEN_SUMS = ("tokens_in", "tokens_out", "tokens_total")
"""The token sums kept per model and in all, each beside its count of calls that did not report it."""
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
    "response_id",
)
"""Every field of a call :meth:`EvidenceSummary.add_attachment` reads."""


class EvidenceShapeError(ValueError):
    """An enriched record whose attachment does not have the shape the summary reads."""


def add_partial_sum(fields: dict[str, Any], name: str, known: int | None, unknown_calls: int) -> None:
    """Add a partial sum (``None``: no call reported it) and its unknown calls to ``fields``."""
    if known is not None:
        mine = fields[name]
        fields[name] = known if mine is None else mine + known
    fields[f"{name}_unknown_calls"] += unknown_calls


def call_where(index: int) -> str:
    """Where a call is, for an error message (built only when one is raised)."""
    return f"{ATTACHMENT_KEY}.calls[{index}]"


def status_class(status_code: int | None) -> str:
    """``2xx``, ``4xx``, ``5xx``, ... or :data:`NO_STATUS` for a call that got no answer."""
    return NO_STATUS if status_code is None else f"{status_code // 100}xx"


STATUS_CLASSES: dict[int | None, str] = {
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
    return model_name_of(model, call.get("model_ref"))


def model_name_of(model: Any, ref: Any) -> str:
    """:func:`model_of` of a call's ``model`` and ``model_ref``."""
    if isinstance(model, str) and model:
        return model
    if isinstance(ref, Mapping) and isinstance(ref.get("name"), str) and ref["name"]:
        return str(ref["name"])
    return UNKNOWN_MODEL


def server_of(ref: Any) -> str:
    """The model server a call's ``model_ref`` names (``""``: none)."""
    if isinstance(ref, Mapping):
        name = ref.get("name")
        if isinstance(name, str):
            return name
    return ""


def bump(counts: dict[str, int], key: str, n: int = 1) -> None:
    """Add ``n`` to ``counts[key]`` (a new key goes last: dicts keep first-seen order)."""
    counts[key] = counts.get(key, 0) + n


def number_field(call: Mapping[str, Any], name: str, where: str) -> float | None:
    """A call's number field as a float, or null; anything else refused naming ``where``."""
    value = call.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EvidenceShapeError(f"{where}.{name}: expected a number or null, got {value!r}")
    return float(value)


def count_field(call: Mapping[str, Any], name: str, where: str, bits: int = 64) -> int | None:
    """A whole number that fits a signed ``bits``-bit integer (a Parquet column), or null;
    3.7 tokens or 10^30 tokens are refused naming the field, never cut to 3 or overflowed."""
    value = number_field(call, name, where)
    if value is None:
        return None
    if not value.is_integer():
        raise EvidenceShapeError(f"{where}.{name}: expected a whole number or null, got {call.get(name)!r}")
    whole = int(value) if type(call.get(name)) is not int else call[name]
    if not -(2 ** (bits - 1)) <= whole < 2 ** (bits - 1):
        raise EvidenceShapeError(f"{where}.{name}: {call.get(name)!r} does not fit a {bits}-bit integer")
    return whole


def text_field(call: Mapping[str, Any], name: str, where: str) -> str | None:
    """A call's string field, or null; anything else refused naming ``where``."""
    value = call.get(name)
    if value is None or isinstance(value, str):
        return value
    raise EvidenceShapeError(f"{where}.{name}: expected a string or null, got {value!r}")


def gap_codes(gaps: Any, where: str) -> list[str]:
    """The distinct codes of a list of gaps, in first-seen order; a malformed gap refused."""
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
    return gap_codes(observations.get("gaps"), f"{OBSERVATIONS_KEY}.gaps")
