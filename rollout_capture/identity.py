"""Rollout identity: which capture key a rollout record owns (spec section 1).

The id is also the only user-controlled part of a capture file name, so validation
here is the single gate that keeps every store operation inside the capture root.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

ROLLOUT_ID_KEY = "_ng_rollout_id"
TASK_INDEX_KEY = "_ng_task_index"
ROLLOUT_INDEX_KEY = "_ng_rollout_index"
ATTEMPT_INDEX_KEY = "_ng_attempt_index"

# fullmatch, never match(): "$" would accept a trailing newline.
_ROLLOUT_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
NAME_MAX = 255
"""The longest file name the common local filesystems take (bytes; ids are ASCII)."""
LONGEST_SUFFIX = ".capture.incomplete"
"""The longest suffix a capture file name adds to a rollout id (layout.MARKER_SUFFIX)."""
MAX_ROLLOUT_ID_LENGTH = NAME_MAX - len(LONGEST_SUFFIX)
"""236: every capture file of the longest id still fits one name, so no write of it can fail
with ENAMETOOLONG after the call was served."""


def validate_rollout_id(rollout_id: object) -> str:
    """Return the id unchanged if it is a safe capture key, else raise ``ValueError``.

    Safe means non-empty ASCII letters, digits, ``.``, ``_``, ``-`` with an alphanumeric
    first character: no separators, no ``..`` escape, no hidden files, no NUL; and at most
    :data:`MAX_ROLLOUT_ID_LENGTH` characters, so each of its file names fits the filesystem.
    """
    if not isinstance(rollout_id, str) or _ROLLOUT_ID_RE.fullmatch(rollout_id) is None:
        raise ValueError(
            f"invalid rollout id {_shown(rollout_id)}: use ASCII letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if len(rollout_id) > MAX_ROLLOUT_ID_LENGTH:
        raise ValueError(
            f"invalid rollout id {_shown(rollout_id)}: {len(rollout_id)} characters, at most "
            f"{MAX_ROLLOUT_ID_LENGTH} fit in a capture file name"
        )
    return rollout_id


def _shown(rollout_id: object) -> str:
    """The id as an error names it: whole unless very long (a log line, not a dump)."""
    text = repr(rollout_id)
    return text if len(text) <= 80 else f"{text[:60]}...{text[-12:]}"


def _attempt_number(value: Any) -> int:
    """``int(value)``, refusing what only truncation or a bool would make an integer."""
    error = ValueError(f"{ATTEMPT_INDEX_KEY} must be an integer; got {value!r}")
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise error
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise error from None


def _as_mapping(body: object) -> Mapping[str, Any] | None:
    """The keys of a pydantic run request (agents receive ``extra="allow"`` models), else None.

    Extra keys such as ``_ng_task_index`` live in ``__pydantic_extra__``; fields are attributes.
    """
    extra = getattr(body, "__pydantic_extra__", None)
    fields = getattr(type(body), "model_fields", None)
    if not isinstance(fields, Mapping):
        return None
    keys = {name: getattr(body, name, None) for name in fields}
    if isinstance(extra, Mapping):
        keys.update(extra)
    return keys


def maybe_rollout_id_from_run_body(record: Mapping[str, Any] | object | None) -> str | None:
    """Derive the capture key of a rollout record, or ``None`` when it has none.

    An explicit ``_ng_rollout_id`` wins; otherwise ``"{task}-{rollout}"``; a positive
    ``_ng_attempt_index`` appends ``-a{n}`` so each retry gets its own capture.
    Malformed explicit ids raise instead of being rewritten (a rewritten id could not
    be looked up). Derived ids are validated by every store operation. A pydantic run
    request is read like the mapping it was built from, as NeMo Gym's reader does.
    """
    if not isinstance(record, Mapping):
        record = _as_mapping(record)
        if record is None:
            return None
    explicit = record.get(ROLLOUT_ID_KEY)
    if explicit is not None:
        rollout_id = validate_rollout_id(explicit)
    else:
        task = record.get(TASK_INDEX_KEY)
        rollout = record.get(ROLLOUT_INDEX_KEY)
        if task is None or rollout is None:
            return None
        rollout_id = f"{task}-{rollout}"
    attempt = record.get(ATTEMPT_INDEX_KEY)
    if attempt is not None:
        number = _attempt_number(attempt)
        if number > 0:
            rollout_id = f"{rollout_id}-a{number}"
    return rollout_id


def rollout_id_of(record: Mapping[str, Any] | None) -> str | None:
    """Like :func:`maybe_rollout_id_from_run_body`, but also validates derived ids.

    Used wherever the id is about to become a file name. A dict of integer indices takes a
    fast path of the general one (the reference); tests/test_identity.py proves them equal.
    """
    if type(record) is dict:  # the common shape, once per rollout line: no regex needed
        get = record.get
        task, rollout, attempt = get(TASK_INDEX_KEY), get(ROLLOUT_INDEX_KEY), get(ATTEMPT_INDEX_KEY)
        if (
            type(task) is int
            and type(rollout) is int
            and task >= 0
            and rollout >= 0
            and (attempt is None or type(attempt) is int)
            and get(ROLLOUT_ID_KEY) is None
        ):
            # Digits, "-", digits (and "-a", digits): a valid id unless absurdly long.
            derived = f"{task}-{rollout}"
            if attempt is not None and attempt > 0:
                derived = f"{derived}-a{attempt}"
            if len(derived) <= MAX_ROLLOUT_ID_LENGTH:
                return derived
    rollout_id = maybe_rollout_id_from_run_body(record)
    return None if rollout_id is None else validate_rollout_id(rollout_id)
