"""Flows whose recorded parameters can never hold a secret.

Prefect stores a run's parameters when it creates the run, before the flow can refuse
them; this flow class redacts secret-looking storage options from what is stored, and
the flow body then fails with an error naming the option (``rollout_capture.location``, the
one place a location and its options are validated).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ParamSpec, TypeVar

from prefect import Flow
from prefect.client.schemas.objects import State
from prefect.futures import PrefectFuture
from pydantic import Field

from rollout_capture.flows.prefect_adapter import heartbeats_unjoined, rebuild
from rollout_capture.secret_options import SECRET_KEY_WORDS, redact_secret_options

P = ParamSpec("P")
R = TypeVar("R")


def _any_case(word: str) -> str:
    """A regex matching ``word`` in any case, without inline flags (JSON Schema regexes have none)."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in word)


_SECRET_NAME = "|".join(_any_case(word) for word in SECRET_KEY_WORDS)


def _no_secret_names(depth: int = 4) -> dict[str, Any]:
    """JSON Schema for a mapping whose keys (nested ``depth`` deep) never look like secrets.

    Unrolled, not recursive: pydantic cannot carry a ``$ref`` in ``json_schema_extra``.
    """
    level: dict[str, Any] = {"propertyNames": {"not": {"pattern": _SECRET_NAME}}}
    if depth > 1:
        level["additionalProperties"] = {"anyOf": [{"not": {"type": "object"}}, _no_secret_names(depth - 1)]}
    return level


StorageOptions = Annotated[
    dict[str, Any] | None,
    Field(
        description="fsspec options for every URL, without secrets (those come from credentials_block).",
        json_schema_extra=_no_secret_names(),
    ),
]
"""Storage options as a flow parameter: a deployment's schema refuses secret-looking keys, so the
server never stores such a run; direct calls are redacted before recording (GuardedFlow)."""


def _plain_json(value: Any) -> bool:
    """JSON's own types, nested (exact types: an enum or a str subclass is encoded by Prefect).

    Keys starting ``_sa`` are left to Prefect too (its encoder drops them, as SQLAlchemy's state).
    """
    if value is None or type(value) in (str, int, float, bool):
        return True
    if type(value) is list:
        return all(_plain_json(item) for item in value)
    if type(value) is dict:
        return all(
            type(key) is str and not key.startswith("_sa") and _plain_json(item)
            for key, item in value.items()
        )
    return False


class GuardedFlow(Flow[P, R]):
    """A flow that redacts secret-looking values from the parameters sent to the API.

    Relies on the engine serializing through ``serialize_parameters`` (see prefect_adapter).
    Its runs end without waiting out the heartbeat thread's last tick (``heartbeats_unjoined``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        heartbeats_unjoined()

    def serialize_parameters(self, parameters: dict[str, Any | PrefectFuture[Any] | State]) -> dict[str, Any]:
        if all(_plain_json(value) for value in parameters.values()):
            # What Prefect's jsonable_encoder gives for plain JSON, without importing FastAPI for it.
            serialized: dict[str, Any] = redact_secret_options(parameters)
        else:
            serialized = redact_secret_options(super().serialize_parameters(parameters))
        return serialized

    def with_options(self, *args: Any, **kwargs: Any) -> GuardedFlow[P, R]:
        """A copy with new options that still redacts (``Flow.with_options`` builds a plain Flow)."""
        return rebuild(GuardedFlow, super().with_options(*args, **kwargs))


def guarded_flow(**options: Any) -> Callable[[Callable[P, R]], GuardedFlow[P, R]]:
    """Like ``@flow(...)``, with parameters redacted before they are recorded."""

    def decorate(fn: Callable[P, R]) -> GuardedFlow[P, R]:
        return GuardedFlow(fn, **options)

    return decorate
