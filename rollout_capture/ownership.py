"""Which agent invocation made which captured call (spec section 8).

References are resolved by identity only (``model_call_id``, or the exact
``(model_ref, response_id)`` pair); timestamps and list positions never decide, so a
wrong guess is impossible and every doubt becomes an explicit gap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

JOIN_CODES = frozenset(
    {"model_call_reference_unmatched", "model_call_reference_ambiguous", "model_call_reference_conflict"}
)
UNOWNED_CODE = "model_call_ownership_unavailable"
# The join's own unowned-call gaps carry a ``capture:`` detail and no invocation (NeMo Gym's rule:
# any such detail, not only today's ``capture:<id>:call_index=<n>``); others are someone else's.
_JOIN_DETAIL_PREFIX = "capture:"


class ObservationError(ValueError):
    """The record's ``ng_agent_observations`` does not have the shape the join needs."""


def _ref_key(ref: Any) -> tuple[str, str] | None:
    if ref is None:
        return None
    if not (
        isinstance(ref, Mapping) and isinstance(ref.get("type"), str) and isinstance(ref.get("name"), str)
    ):
        raise ObservationError(f"model_ref must be {{type, name}}; got {ref!r}")
    return ref["type"], ref["name"]


def _check_ref(ref: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(ref, Mapping):
        raise ObservationError(f"{where}: a model call reference must be an object")
    call_id, response_id = ref.get("model_call_id"), ref.get("response_id")
    for name, value in (("model_call_id", call_id), ("response_id", response_id)):
        if value is not None and not isinstance(value, str):
            raise ObservationError(f"{where}.{name} must be a string")
    key = _ref_key(ref.get("model_ref"))
    if not call_id and not (key is not None and response_id):
        raise ObservationError(f"{where}: needs model_call_id, or both model_ref and response_id")
    return ref


def _invocations(observations: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Invocations in the spec's ``invocations`` list, or NeMo Gym's typed ``records``."""
    found: list[dict[str, Any]] = []
    listed = observations.get("invocations", [])
    if not isinstance(listed, list):
        raise ObservationError("ng_agent_observations.invocations must be a list")
    found.extend(listed)
    records = observations.get("records", [])
    if not isinstance(records, list):
        raise ObservationError("ng_agent_observations.records must be a list")
    found.extend(r for r in records if isinstance(r, dict) and r.get("kind") == "agent_invocation")
    seen: set[str] = set()
    for index, invocation in enumerate(found):
        if not isinstance(invocation, dict) or not isinstance(invocation.get("invocation_id"), str):
            raise ObservationError(f"invocation #{index} needs a string invocation_id")
        if invocation["invocation_id"] in seen:
            raise ObservationError(f"invocation_id {invocation['invocation_id']!r} is not unique")
        seen.add(invocation["invocation_id"])
        if not isinstance(invocation.get("model_calls", []), list):
            raise ObservationError(f"invocation {invocation['invocation_id']!r}: model_calls must be a list")
    return found


def _gap(code: str, invocation_id: str | None, detail: str | None) -> dict[str, Any]:
    gap: dict[str, Any] = {"code": code}
    if invocation_id is not None:
        gap["invocation_id"] = invocation_id
    if detail is not None:
        gap["detail"] = detail
    return gap


def _written_by_join(gap: Any) -> bool:
    if not isinstance(gap, Mapping):
        return False
    code = gap.get("code")
    if code in JOIN_CODES:
        return True
    detail = gap.get("detail")
    return (
        code == UNOWNED_CODE
        and gap.get("invocation_id") is None
        and isinstance(detail, str)
        and detail.startswith(_JOIN_DETAIL_PREFIX)
    )


def join_ownership(observations: Any, calls: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A new ``ng_agent_observations`` with refs resolved against ``calls`` and gaps updated.

    ``calls`` are dumped call records. Calls made by a verifier (they carry a
    ``verifier_invocation_id``) are owned by it and never reported as unowned. As NeMo Gym
    0.7.0's join, a call whose ``client_session_id`` names an invocation is referenced by it
    (the agent declared the session), and context compactions' references are resolved against
    the calls their invocation owns. Raises :class:`ObservationError` when the observations
    are malformed.
    """
    if not isinstance(observations, Mapping):
        raise ObservationError("ng_agent_observations must be an object")
    gaps_in = observations.get("gaps", [])
    if not isinstance(gaps_in, list):
        raise ObservationError("ng_agent_observations.gaps must be a list")
    result = dict(observations)
    index = _CallIndex(calls)
    owners: dict[int, str] = {}
    join_gaps: list[dict[str, Any]] = []
    invocations = _with_session_calls(_invocations(observations), calls)
    new_records = {
        id(invocation): _resolved(with_calls, index, owners, join_gaps)
        for invocation, with_calls in invocations
    }
    compactions = [
        r
        for r in observations.get("records", [])
        if isinstance(r, dict) and r.get("kind") == "context_compaction"
    ]
    new_records.update(
        {
            id(compaction): _compaction_resolved(compaction, index, owners, join_gaps)
            for compaction in compactions
        }
    )
    for key in ("invocations", "records"):
        if key in observations:
            result[key] = [new_records.get(id(item), item) for item in observations[key]]

    gaps = [gap for gap in gaps_in if not _written_by_join(gap)]
    gaps.extend(join_gaps)
    for position, call in enumerate(calls):
        if position in owners or call.get("verifier_invocation_id"):
            continue
        label = call.get("model_call_id") or call.get("response_id") or "unknown"
        gaps.append(_gap(UNOWNED_CODE, None, f"capture:{label}:call_index={call['call_index']}"))
    result["gaps"] = _dedupe(gaps)
    return result


def _with_session_calls(
    invocations: list[dict[str, Any]], calls: Sequence[Mapping[str, Any]]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each invocation with a reference added for every call whose ``client_session_id`` is its
    id and which none of its references names yet (NeMo Gym 0.7.0's join)."""
    by_id = {invocation["invocation_id"]: invocation for invocation in invocations}
    added: dict[str, list[dict[str, Any]]] = {}
    known: dict[str, set[tuple[Any, Any, Any]]] = {}
    for call in calls:
        session, call_id = call.get("client_session_id"), call.get("model_call_id")
        if not session or not call_id or session not in by_id:
            continue
        if session not in known:
            known[session] = {
                (ref.get("model_call_id"), _ref_key(ref.get("model_ref")), ref.get("response_id"))
                for ref in by_id[session].get("model_calls", [])
                if isinstance(ref, Mapping)
            }
        model_ref, response_id = call.get("model_ref"), call.get("response_id")
        ref_key = _ref_key(model_ref)
        names = {
            (call_id, None, None),
            (call_id, ref_key, None),
            (call_id, None, response_id),
            (call_id, ref_key, response_id),
        }
        if ref_key is not None and response_id is not None:
            names.add((None, ref_key, response_id))
        if names & known[session]:
            continue
        added.setdefault(session, []).append(
            {"model_call_id": call_id, "model_ref": model_ref, "response_id": response_id}
        )
        known[session].add((call_id, ref_key, response_id))
    return [
        (
            invocation,
            {
                **invocation,
                "model_calls": [*invocation.get("model_calls", []), *added[invocation["invocation_id"]]],
            }
            if invocation["invocation_id"] in added
            else invocation,
        )
        for invocation in invocations
    ]


def _compaction_resolved(
    compaction: dict[str, Any], index: _CallIndex, owners: dict[int, str], join_gaps: list[dict[str, Any]]
) -> dict[str, Any]:
    """A context compaction with its references resolved: its compaction calls only to calls its
    own invocation owns, the calls before and after it to calls no other invocation owns."""
    invocation_id = compaction.get("invocation_id")
    resolved: list[Any] = []
    for n, ref in enumerate(compaction.get("model_calls", []) or []):
        _check_ref(ref, f"context compaction of {invocation_id!r} model_calls[{n}]")
        candidates = index.matches(ref)
        if len(candidates) != 1:
            code = "model_call_reference_ambiguous" if candidates else "model_call_reference_unmatched"
            detail = f"model_calls:{ref.get('model_call_id') or ref.get('response_id')}"
            join_gaps.append(_gap(code, invocation_id, detail))
            resolved.append(ref)
            continue
        call = index.calls[candidates[0]]
        owner = owners.get(candidates[0])
        if owner != invocation_id:
            code = "model_call_reference_conflict" if owner is not None else UNOWNED_CODE
            detail = f"model_calls:{call.get('model_call_id') or call.get('response_id')}"
            join_gaps.append(_gap(code, invocation_id, detail))
            resolved.append(ref)
            continue
        resolved.append(_canonical(call))
    result = {**compaction, "model_calls": resolved}
    for field in ("before_model_call", "after_model_call"):
        ref = compaction.get(field)
        if ref is None:
            continue
        _check_ref(ref, f"context compaction of {invocation_id!r} {field}")
        candidates = index.matches(ref)
        if len(candidates) == 1:
            call = index.calls[candidates[0]]
            owner = owners.get(candidates[0])
            if owner is not None and owner != invocation_id:
                detail = f"{field}:{call.get('model_call_id') or call.get('response_id')}"
                join_gaps.append(_gap("model_call_reference_conflict", invocation_id, detail))
                continue
            result[field] = _canonical(call)
        else:
            code = "model_call_reference_ambiguous" if candidates else "model_call_reference_unmatched"
            detail = f"{field}:{ref.get('model_call_id') or ref.get('response_id')}"
            join_gaps.append(_gap(code, invocation_id, detail))
    return result


def _canonical(call: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "model_call_id": call.get("model_call_id"),
        "model_ref": call.get("model_ref"),
        "response_id": call.get("response_id"),
    }


class _CallIndex:
    """The captured calls by identity: ``model_call_id``, and ``(model_ref, response_id)``."""

    __slots__ = ("by_call_id", "by_response", "calls")

    def __init__(self, calls: Sequence[Mapping[str, Any]]) -> None:
        self.calls = calls
        self.by_call_id: dict[str, list[int]] = {}
        self.by_response: dict[tuple[str, str, str], list[int]] = {}
        for position, call in enumerate(calls):
            call_id = call.get("model_call_id")
            if call_id:
                self.by_call_id.setdefault(call_id, []).append(position)
            ref = call.get("model_ref")
            response_id = call.get("response_id")
            if ref is not None and response_id:
                self.by_response.setdefault((ref["type"], ref["name"], response_id), []).append(position)

    def matches(self, ref: Mapping[str, Any]) -> list[int]:
        """The positions of the calls a (checked) reference names: one, or a gap."""
        calls = self.calls
        key = _ref_key(ref.get("model_ref"))
        if ref.get("model_call_id"):
            return [
                p
                for p in self.by_call_id.get(ref["model_call_id"], [])
                if (key is None or key == _ref_key(calls[p].get("model_ref")))
                and (ref.get("response_id") is None or ref["response_id"] == calls[p].get("response_id"))
            ]
        assert key is not None
        return self.by_response.get((*key, ref["response_id"]), [])


def _resolved(
    invocation: dict[str, Any], index: _CallIndex, owners: dict[int, str], join_gaps: list[dict[str, Any]]
) -> dict[str, Any]:
    """The invocation with each reference resolved to the one call it names (its owner recorded
    in ``owners``), or left as it was with a gap in ``join_gaps`` saying why."""
    resolved: list[Any] = []
    invocation_id = invocation["invocation_id"]
    for position_in_list, ref in enumerate(invocation.get("model_calls", [])):
        _check_ref(ref, f"invocation {invocation_id!r} model_calls[{position_in_list}]")
        candidates = index.matches(ref)
        if len(candidates) != 1:
            code = "model_call_reference_ambiguous" if candidates else "model_call_reference_unmatched"
            join_gaps.append(_gap(code, invocation_id, ref.get("model_call_id") or ref.get("response_id")))
            resolved.append(ref)
            continue
        position = candidates[0]
        call = index.calls[position]
        if position in owners:
            detail = call.get("model_call_id") or call.get("response_id")
            join_gaps.append(_gap("model_call_reference_conflict", invocation_id, detail))
            resolved.append(ref)
            continue
        owners[position] = invocation_id
        resolved.append(
            {
                **ref,
                "model_call_id": call.get("model_call_id"),
                "model_ref": call.get("model_ref"),
                "response_id": call.get("response_id"),
            }
        )
    return {**invocation, "model_calls": resolved}


def _dedupe(gaps: list[Any]) -> list[Any]:
    seen: set[Any] = set()
    out = []
    for gap in gaps:
        key: Any = (
            (gap.get("code"), gap.get("invocation_id"), gap.get("detail"))
            if isinstance(gap, Mapping)
            else repr(gap)
        )
        try:
            hash(key)
        except TypeError:
            key = repr(gap)
        if key not in seen:
            seen.add(key)
            out.append(gap)
    return out
