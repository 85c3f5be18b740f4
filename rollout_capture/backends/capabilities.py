"""What a store can do: declared by its backend class, asked of the backend a store opened.

Every protocol of ours (rows numbered put-if-absent, journal commits, leases, ``_ENRICHED``)
rests on one promise: a create fails when the object exists. How a store keeps it is part of
its backend class (:attr:`Capabilities.put_if_absent`); a store that keeps it by one conditional
request is also *proven* to keep it, once per store and process, before the first write that
needs it (:mod:`rollout_capture.backends.proof`): an S3-compatible server may take the request
and ignore its condition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

PutIfAbsent: TypeAlias = Literal["exclusive-create", "process-lock", "conditional-request", "none"]
"""How a store creates a file only if it is absent:

- ``exclusive-create``: the OS does (a local disk: a link-based create);
- ``process-lock``: one process holds the whole store, so a lock does (``memory://``);
- ``conditional-request``: one request carries the condition (S3's ``If-None-Match: *``, GCS's
  ``ifGenerationMatch=0``, Azure's ``If-None-Match: *``), proven honoured before it is relied on;
- ``none``: it cannot (fsspec offers no such request for it): refused for writing, read as usual.
"""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a store can do; each backend class declares its own."""

    local: bool
    """This machine's disk: read with ``os``, locked with ``flock``, published by a rename."""
    put_if_absent: PutIfAbsent
    """How a create is made to fail when the file exists (see :data:`PutIfAbsent`)."""

    @property
    def writable(self) -> bool:
        """Whether writers may share the store at all (a put-if-absent of some kind)."""
        return self.put_if_absent != "none"

    @property
    def proven_before_use(self) -> bool:
        """Whether the put-if-absent is a request's condition, which a server may ignore: proven
        once per store and process before the first write that needs it."""
        return self.put_if_absent == "conditional-request"


LOCAL_DISK = Capabilities(local=True, put_if_absent="exclusive-create")
ONE_PROCESS = Capabilities(local=False, put_if_absent="process-lock")
CONDITIONAL_STORE = Capabilities(local=False, put_if_absent="conditional-request")
READ_ONLY_STORE = Capabilities(local=False, put_if_absent="none")


class UnsafeStoreError(ValueError):
    """A store that cannot create a file only if it is absent, asked to: refused, never emulated.

    Either its backend has no such request (``put_if_absent == "none"``), or its server was found
    to accept a second create of one object. Reading the store is unaffected.
    """
