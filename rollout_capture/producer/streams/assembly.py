"""What every dialect's assembler is: the protocol the relay drives, and the delta rule they share."""

from __future__ import annotations

from typing import Any, Protocol

from rollout_capture.producer.classify import ErrorCategory

JsonObject = dict[str, Any]


class Assembler(Protocol):
    """Builds one dialect's complete response object from its stream events."""

    complete: bool
    """The dialect's terminal event was seen."""
    error: ErrorCategory | None
    """An error reported inside the stream."""
    lean: bool
    """Past the body cap: keep ids, status and usage, stop accumulating content."""

    def feed(self, event: str | None, data: JsonObject) -> bool:
        """Apply one event; True when it is the terminal one."""
        ...

    def result(self) -> JsonObject | None:
        """The response object as far as the stream went (None before any event)."""
        ...


def append(target: JsonObject, key: str, value: Any) -> None:
    """Concatenate string deltas; take anything else as the latest value."""
    current = target.get(key)
    if isinstance(value, str) and isinstance(current, str):
        target[key] = current + value
    elif value is not None or key not in target:
        target[key] = value
