"""Orphan captures: rollout ids under a capture root that no input line names, and the input
id each was probably meant to be."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable

from rollout_capture.names import parse_capture_name

_ATTEMPT = re.compile(r"(.+)-a\d+")


def orphans(listed_ids: Iterable[str], input_ids: Collection[str]) -> list[str]:
    """Rollout ids found under a capture root that no input line names, sorted.

    A harness that named its rollout ``24-1`` where the input says ``24-1-a1`` leaves
    captures no enrichment will ever read; they are counted, never ignored in silence.
    """
    wanted = input_ids if isinstance(input_ids, set | frozenset | dict) else set(input_ids)
    return sorted({r for r in listed_ids if r not in wanted})


def near_candidates(orphan: str) -> list[str]:
    """The input ids an orphan may have been meant to be, the likeliest first: the same id without
    its ``-aN``, then with ``-a1``, ``-a2``, ``-a3``."""
    match = _ATTEMPT.fullmatch(orphan)
    without = [match.group(1)] if match is not None else []
    return without + [f"{orphan}-a{attempt}" for attempt in range(1, 4)]


def near_input_id(orphan: str, input_ids: Collection[str]) -> str | None:
    """The input id an orphan was probably meant to be: the same id with or without ``-aN``."""
    return next((candidate for candidate in near_candidates(orphan) if candidate in input_ids), None)


def capture_ids_from_names(names: Iterable[str]) -> set[str]:
    """The rollout ids that names relative to a capture root belong to (foreign names ignored)."""
    out: set[str] = set()
    for name in names:
        parsed = parse_capture_name(name)
        if parsed is not None:
            out.add(parsed.rollout_id)
    return out
