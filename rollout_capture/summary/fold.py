"""Evidence counted in bulk: :class:`AttachmentFold`, the batch path's twin of
:meth:`EvidenceSummary.add_attachment`, and :func:`count_columns`, the one count both share.

The summary's one-by-one way checks and coerces each call, then counts the rollout's calls
as columns with :func:`count_columns`; the fold copies the calls of many rollouts into the
same columns without looking at them one by one and counts them with the same function, so
both ways give the same counts, key order and float sums.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any

from rollout_capture.attachment import ATTACHMENT_KEY
from rollout_capture.summary.checks import (
    CALL_FIELDS,
    OTHER_MODELS,
    STATUS_CLASSES,
    TOKEN_SUMS,
    add_partial_sum,
    bump,
    count_field,
    gap_codes,
    model_name_of,
    server_of,
    status_class,
)

if TYPE_CHECKING:
    from rollout_capture.summary.evidence import EvidenceSummary

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
    """Twin of :meth:`EvidenceSummary.add_attachment` (the reference), proved equal by
    ``tests/test_summary.py::test_the_fold_counts_as_one_by_one`` and, for built attachments,
    ``tests/test_merge_fast_paths.py::test_built_attachments_fold_as_one_by_one``.

    Attachments counted into a summary in bulk, a batch at a time. :meth:`add` copies the
    fields a summary reads of each call into flat columns (one C-level pass, no per-call
    Python work); :meth:`flush` counts the columns in C-level passes (Counter, map, filter).
    One by one, a call cost ~2.6 us of dict and attribute churn. The result is the one-by-one
    result: counts, key order, the float sums added in the same order. An attachment or a
    value of another shape or type is counted the one-by-one way, in its turn (same
    coercions, same errors).
    """

    __slots__ = ("_holds", "_looked", "_rollouts", "_rows", "_summary")

    def __init__(self, summary: EvidenceSummary) -> None:
        self._summary = summary
        self._rows: list[tuple[Any, ...]] = []
        self._holds: list[Any] = []  # each held row's capture_hold_ms (None: not held)
        self._rollouts: list[_Rollout] = []
        self._looked = False  # whether rows other than add_built_calls' are held: their types are checked

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
        self._add_any_attachment(attachment, list(observation_gaps))

    def add_built_attachment(self, attachment: dict[str, Any]) -> None:
        """Fold an attachment :func:`~rollout_capture.attachment.build_attachment` made, as the
        merge folds it: one without gaps by :meth:`add_built_calls`, one with gaps by :meth:`add`."""
        if "gaps" in attachment:
            self.add(attachment)
            return
        verifiers = attachment.get("verifier_invocations")
        self.add_built_calls(
            attachment["rollout_id"],
            attachment["calls"],
            attachment["metrics"]["tokens_total"],
            len(verifiers) if verifiers else 0,
        )

    def add_built_calls(
        self, rollout_id: str, calls: list[dict[str, Any]], tokens_total: int | None, invocations: int
    ) -> None:
        """:meth:`add` of an attachment :func:`~rollout_capture.attachment.build_attachment` built
        without gaps, given as its parts: its rollout id, calls, ``metrics.tokens_total`` and how
        many verifier invocations it holds. What :meth:`add` and :meth:`flush` check is so by
        construction: each call is a dumped ModelCallRecord, every value of its field's type."""
        if not self._take(calls):  # not a call record after all: one by one
            attachment: dict[str, Any] = {"rollout_id": rollout_id, "calls": calls}
            attachment["metrics"] = {"tokens_total": tokens_total}
            if invocations:
                attachment["verifier_invocations"] = [None] * invocations
            self._add_any_attachment(attachment, [])
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

    def _add_any_attachment(self, attachment: Mapping[str, Any], observed: list[str]) -> None:
        """:meth:`add` of an attachment of any other shape: read as add_attachment reads it, or
        counted by it."""
        try:
            rollout = rollout_parts(attachment, observed)
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
            count_columns(self._summary, columns, holds, rollouts)  # a built record's values have their types
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


def rollout_parts(attachment: Mapping[str, Any], observed: list[str]) -> _Rollout:
    """What :meth:`EvidenceSummary.add_attachment` reads of a rollout beside its calls (raises as it does)."""
    calls = attachment.get("calls") or []
    metrics = attachment.get("metrics") or {}
    verifiers = attachment.get("verifier_invocations")
    codes = gap_codes(attachment.get("gaps"), f"{ATTACHMENT_KEY}.gaps") if "gaps" in attachment else []
    return (
        str(attachment.get("rollout_id")),
        len(calls),
        count_field(metrics, "tokens_total", f"{ATTACHMENT_KEY}.metrics"),
        len(verifiers) if verifiers else 0,
        codes,
        list(dict.fromkeys(observed)),
    )


def _canonical(columns: Sequence[Sequence[Any]]) -> bool:
    """Whether every value has the type the one-by-one way takes as it is (no coercion, no error)."""
    status, category, dialect, _, latency, ttft, tokens_in, tokens_out, tokens_total, _, _, _ = columns
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


@dataclass(slots=True)
class _ModelTally:
    """One model's counts over the columns being counted, before they go into its ModelStats."""

    calls: int = 0
    failed: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    tokens_total: int = 0
    timed: int = 0  # calls with a possible latency
    knew_in: int = 0  # calls reporting tokens_in (and so on)
    knew_out: int = 0
    knew_total: int = 0


def count_columns(
    summary: EvidenceSummary,
    columns: Sequence[Sequence[Any]],
    holds: Sequence[Any],
    rollouts: Sequence[_Rollout],
) -> None:
    """Count canonical columns (and each call's ``capture_hold_ms``) into the summary: no twin,
    the one count of both ways, one rollout at a time (:meth:`EvidenceSummary.add_attachment`)
    or in bulk (:meth:`AttachmentFold.flush`).

    A negative duration (a clock step, not the model's time) is left out of the percentiles
    and the means: the attachment names the call in its ``model_call_timing_impossible`` gap.
    """
    (
        status,
        category,
        dialect,
        verifier,
        latency,
        ttft,
        tokens_in,
        tokens_out,
        tokens_total,
        model,
        ref,
        response_id,
    ) = columns
    plain = set(map(type, model)) <= _STR and "" not in model
    names: Sequence[str] = model if plain else list(map(model_name_of, model, ref))
    tallies, failed_calls = _count_classes(summary, status, category, dialect, names)
    latencies = _sum_per_model(tallies, rollouts, names, latency, tokens_in, tokens_out, tokens_total)
    _add_models(summary, tallies, latencies)
    _add_model_servers(summary, names, ref, response_id)
    fields = summary.__dict__
    fields["rollouts"] += len(rollouts)
    fields["calls"] += len(status)
    fields["failed_calls"] += failed_calls
    fields["verifier_calls"] += sum(map(operator.truth, verifier))
    summary.latency_ms.add_many(_durations(latency))
    summary.ttft_ms.add_many(_durations(ttft))
    summary.capture_hold_ms.add_many(_durations(holds))
    summary.calls_per_rollout.add_many([r[1] for r in rollouts])
    summary.tokens_per_rollout.add_many([r[2] for r in rollouts if r[2] is not None])
    _add_rollout_examples(summary, category, rollouts)


def _count_classes(
    summary: EvidenceSummary,
    status: Sequence[int | None],
    category: Sequence[str | None],
    dialect: Sequence[str | None],
    names: Sequence[str],
) -> tuple[dict[str, _ModelTally], int]:
    """Calls by status class, error category, dialect and model, in one C-level count of each
    (status, category, dialect, model); dicts get their keys in the order the calls first show
    them, as one by one. Returns each model's tally and the failed calls."""
    by_status, by_category, by_dialect = (
        summary.calls_by_status_class,
        summary.calls_by_error_category,
        summary.calls_by_dialect,
    )
    classes = STATUS_CLASSES
    tallies: dict[str, _ModelTally] = {}
    failed_calls = 0
    for (code, why, dialect_name, name), n in Counter(
        zip(status, category, dialect, names, strict=True)
    ).items():
        key = classes.get(code) or status_class(code)
        by_status[key] = by_status.get(key, 0) + n
        if why is not None:
            by_category[why] = by_category.get(why, 0) + n
        key = dialect_name or "(unknown)"
        by_dialect[key] = by_dialect.get(key, 0) + n
        tally = tallies.get(name)
        if tally is None:
            tally = tallies[name] = _ModelTally()
        tally.calls += n
        if why is not None or code is None or not 200 <= code < 300:
            tally.failed += n
            failed_calls += n
    return tallies, failed_calls


def _sum_per_model(
    tallies: dict[str, _ModelTally],
    rollouts: Sequence[_Rollout],
    names: Sequence[str],
    latency: Sequence[float | None],
    tokens_in: Sequence[int | None],
    tokens_out: Sequence[int | None],
    tokens_total: Sequence[int | None],
) -> dict[tuple[int, str], float]:
    """Token sums into each model's tally, in one Python pass; returns latency summed per
    (rollout, model) in first-call order, each sum then added to the model's total in turn
    (float sums depend on their order)."""
    rollout_of = chain.from_iterable(map(repeat, range(len(rollouts)), (r[1] for r in rollouts)))
    partials: dict[tuple[int, str], float] = {}
    get = partials.get
    for pair, value, count_in, count_out, count_total in zip(
        zip(rollout_of, names, strict=True), latency, tokens_in, tokens_out, tokens_total, strict=True
    ):
        tally = tallies[pair[1]]
        if count_in is not None:
            tally.tokens_in += count_in
            tally.knew_in += 1
        if count_out is not None:
            tally.tokens_out += count_out
            tally.knew_out += 1
        if count_total is not None:
            tally.tokens_total += count_total
            tally.knew_total += 1
        if value is not None and value >= 0:
            partials[pair] = get(pair, 0.0) + value
            tally.timed += 1
        elif pair not in partials:
            partials[pair] = 0.0
    return partials


def _add_models(
    summary: EvidenceSummary, tallies: dict[str, _ModelTally], latencies: dict[tuple[int, str], float]
) -> None:
    """Each model's tally into its ModelStats and the summary's token sums, then the latency sums."""
    models = {name: summary._model_stats(name).__dict__ for name in tallies}  # plain field writes
    fields = summary.__dict__
    for name, tally in tallies.items():
        stats = models[name]
        stats["calls"] += tally.calls
        stats["failed_calls"] += tally.failed
        stats["latency_calls"] += tally.timed
        for sum_name, total, known in zip(
            TOKEN_SUMS,
            (tally.tokens_in, tally.tokens_out, tally.tokens_total),
            (tally.knew_in, tally.knew_out, tally.knew_total),
            strict=True,
        ):
            known_total = total if known else None
            add_partial_sum(stats, sum_name, known_total, tally.calls - known)
            add_partial_sum(fields, sum_name, known_total, tally.calls - known)
    for (_, name), value in latencies.items():
        models[name]["latency_ms_total"] += value


def _add_model_servers(
    summary: EvidenceSummary, names: Sequence[str], refs: Sequence[Any], response_ids: Sequence[Any]
) -> None:
    """Which model server each model name was seen through, and how: on a call without a response id
    (its ``model`` is the request's: the name it asked for) or with one (the name that answered)."""
    seen = summary.model_servers
    models = summary.models
    for (name, server, answered), n in Counter(
        zip(names, map(server_of, refs), map(_not_none, response_ids), strict=True)
    ).items():
        key = name if name in models else OTHER_MODELS
        counts = seen.setdefault(key, {}).setdefault(server, [0, 0])
        counts[answered] += n


def _add_rollout_examples(
    summary: EvidenceSummary, category: Sequence[str | None], rollouts: Sequence[_Rollout]
) -> None:
    """Per rollout: the first few that failed in each error category, verifier invocations, gaps."""
    fields = summary.__dict__
    if summary.calls_by_error_category:  # which rollouts failed: the first few of each error category
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
                bump(summary.gaps, code)
                summary._example(code, rollout_id)
        for code in observed:
            bump(summary.observation_gaps, code)
            summary._example(code, rollout_id)


def _durations(values: Sequence[Any]) -> list[float]:
    """The known, possible durations among ``values``: null and negative ones left out."""
    known = list(filter(_not_none, values))
    if known and min(known) < 0:  # rare: an impossible value, named by the attachment's gap
        known = [value for value in known if value >= 0]
    return known
