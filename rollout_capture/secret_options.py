"""Storage options that look like credentials: refused where given, redacted where recorded.

Storage options travel through config files and flow parameters, which end up in logs
and the Prefect UI, so a credential must never be one of them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

SECRET_KEY_WORDS = (
    "secret",
    "passw",
    "token",
    "credential",
    "private",
    "signature",
    "api_?key",
    "access_?key",
    "account_?key",
    "sas",
    "^key$",
)
"""Patterns of option names that hold credentials (matched in any case)."""
_SECRET_KEY_RE = re.compile("|".join(SECRET_KEY_WORDS), re.IGNORECASE)


def refuse_secret_options(options: Mapping[str, Any] | None, *, where: str = "storage_options") -> None:
    """Raise ``ValueError`` naming the first option that looks like a credential.

    Credentials belong to the standard provider chain (environment, profile, role) or a
    named Prefect block, never to parameters that are logged and shown in the UI.
    """
    if not options:
        return
    for name, value in options.items():
        path = f"{where}.{name}"
        if _SECRET_KEY_RE.search(str(name)) and value not in (None, "", False):
            raise ValueError(
                f"{path} looks like a secret; pass credentials through the environment "
                "(AWS_* variables, a profile or a role) or a Prefect block instead"
            )
        if isinstance(value, Mapping):
            refuse_secret_options(value, where=path)


REDACTED = "<refused: looks like a secret>"


def redact_secret_options(value: Any) -> Any:
    """A copy of ``value`` with every secret-looking entry of every mapping replaced.

    For what is about to be recorded (flow parameters in the Prefect API), so a secret
    handed in by mistake is refused without being stored first.
    """
    if isinstance(value, Mapping):
        return {
            key: REDACTED
            if _SECRET_KEY_RE.search(str(key)) and item not in (None, "", False)
            else redact_secret_options(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [redact_secret_options(item) for item in value]
    return value
