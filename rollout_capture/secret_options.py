"""Credentials where they do not belong: refused where given, redacted where recorded.

Storage options and URLs travel through config files and flow parameters, which end up in
logs and the Prefect UI, so a credential must never be an option (at any depth, in any case)
nor the userinfo of a URL (``s3://KEY:SECRET@bucket``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote_plus, urlsplit, urlunsplit

SECRET_KEY_WORDS = (
    "secret",
    "pass",
    "pwd",
    "token",
    "credential",
    "private",
    "signature",
    "authoriz",
    "cookie",
    "api[-_]?key",
    "access[-_]?key",
    "account[-_]?key",
    "sas",
    "connection[-_]?str",  # Azure's connection string carries the account key
    "^key$",
    "^sig$",  # a SAS token's signature (``?sv=...&sig=...``), as X-Amz-Signature is S3's
)
"""Patterns of option names that hold credentials (matched in any case, at any depth)."""
_SECRET_KEY_RE = re.compile("|".join(SECRET_KEY_WORDS), re.IGNORECASE)
# adlfs names a container and its account as userinfo and host (abfs://container@account.dfs...):
# no secret in it, so that form alone is let through.
_AZURE_SCHEMES, _AZURE_HOSTS = frozenset({"az", "abfs", "abfss", "adl"}), ".core.windows.net"
URL_CREDENTIALS = "credentials in the URL are not allowed; use storage options / a credentials block"


def _looks_secret(name: object, value: Any) -> bool:
    return _SECRET_KEY_RE.search(str(name)) is not None and value not in (None, "", False)


def _secret_query(rest: str) -> bool:
    """Whether a URL's query names a credential (``?api_key=...``, ``&token=...``, a SAS token's
    ``&sig=...``, its name percent-encoded or not), with a value."""
    query = rest.partition("?")[2].partition("#")[0]
    pairs = (p.partition("=") for p in query.split("&"))
    return any(_looks_secret(unquote_plus(name), value) for name, _, value in pairs)


def url_credentials(url: str | os.PathLike[str]) -> str | None:
    """``scheme://host`` of a URL that carries credentials (``user:password@``, ``user@``, or a
    query parameter named like one: ``?api_key=...``), else None.

    Every segment of a chained URL (``simplecache::s3://...``) is looked at. A ``user:secret``
    whose secret holds a ``/`` cuts the host short (``s3://KEY:ab/cd@bucket``): a colon there that
    is no port counts too, and then only the scheme is named.
    """
    text = os.fspath(url)
    if "://" not in text:
        return None
    for segment in text.split("::"):
        scheme, sep, rest = segment.partition("://")
        if not sep:
            continue
        authority = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
        if _secret_query(rest):
            return f"{scheme}://{authority.rpartition('@')[2]}"
        if "@" in authority:
            user, _, host = authority.rpartition("@")
            if scheme in _AZURE_SCHEMES and ":" not in user and host.endswith(_AZURE_HOSTS):
                continue
            return f"{scheme}://{host}"
        _, colon, port = authority.rpartition(":")
        if colon and port and not port.isdigit() and "]" not in port:
            return f"{scheme}://"
    return None


def refuse_url_credentials(url: str | os.PathLike[str], *, where: str | None = None) -> None:
    """Raise ``ValueError`` for a URL carrying credentials, naming its scheme and host only.

    The one check every URL goes through (the CLI, flows, tasks, ``Location``, the producers'
    settings, ``open_filesystem``): the secret is never echoed, not even in the error.
    """
    shown = url_credentials(url)
    if shown is not None:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}{URL_CREDENTIALS} ({shown})")


def bare_url(url: str) -> str:
    """``url`` as scheme, host (with its port) and path only: no userinfo, query or fragment, where
    credentials travel (``user:password@``, a SAS token's ``?sv=...&sig=...``). For naming an
    endpoint in a message, or a location where a query means nothing."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def shown_url(url: str) -> str:
    """``url`` as a run's name, an event or a recorded parameter may show it: one carrying
    credentials is replaced by a note naming its scheme and host (what the refusal names)."""
    shown = url_credentials(url)
    return url if shown is None else f"{REFUSED_URL} ({shown})"


def refuse_secret_options(options: Mapping[str, Any] | None, *, where: str = "storage_options") -> None:
    """Raise ``ValueError`` naming the first option that looks like a credential.

    Names are matched in any case, inside nested mappings and lists (``headers.Authorization``),
    and a string value that is a URL with credentials is refused too. Credentials belong to the
    standard provider chain (environment, profile, role) or a named Prefect block, never to
    parameters that are logged and shown in the UI.
    """
    if options:
        _refuse_in(options, where)


def _refuse_in(value: Any, path: str) -> None:
    if isinstance(value, Mapping):
        for name, item in value.items():
            inner = f"{path}.{name}"
            if _looks_secret(name, item):
                raise ValueError(
                    f"{inner} looks like a secret; pass credentials through the environment "
                    "(AWS_* or AZURE_STORAGE_* variables, GOOGLE_APPLICATION_CREDENTIALS, a profile, a role) "
                    "or a Prefect block instead"
                )
            _refuse_in(item, inner)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _refuse_in(item, f"{path}[{index}]")
    elif isinstance(value, str):
        refuse_url_credentials(value, where=path)


REDACTED = "<refused: looks like a secret>"
REFUSED_URL = "<refused: credentials in the URL>"


def redact_secret_options(value: Any) -> Any:
    """A copy of ``value`` with every secret-looking entry of every mapping, and every URL with
    credentials, replaced.

    For what is about to be recorded (flow parameters in the Prefect API), so a secret
    handed in by mistake is refused without being stored first.
    """
    if isinstance(value, Mapping):
        return {
            key: REDACTED if _looks_secret(key, item) else redact_secret_options(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [redact_secret_options(item) for item in value]
    if isinstance(value, str):
        return shown_url(value)
    return value
