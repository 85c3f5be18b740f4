"""Layouts as strategies: how a store writes rows and claims, chosen once when it opens.

One module a layout (:mod:`.jsonl`, :mod:`.objects`, :mod:`.journal`), each a
:class:`~.base.LayoutStrategy`; :data:`LAYOUTS` and :func:`open_layout` are the one place that
picks one. Adding a layout is a module here, its name in ``Layout`` and a line in :data:`LAYOUTS`.
"""

from __future__ import annotations

from rollout_capture.backends import Backend
from rollout_capture.layouts.base import ClaimsMode, Layout, LayoutChoice, LayoutStrategy, StagedWrite
from rollout_capture.layouts.journal import JournalLayout, StoreJournal
from rollout_capture.layouts.jsonl import JsonlLayout, row_line
from rollout_capture.layouts.objects import ObjectsLayout

__all__ = [
    "LAYOUTS",
    "ClaimsMode",
    "JournalLayout",
    "JsonlLayout",
    "Layout",
    "LayoutChoice",
    "LayoutStrategy",
    "ObjectsLayout",
    "StagedWrite",
    "StoreJournal",
    "open_layout",
    "producer_layout",
    "resolve_layout",
    "row_line",
]

LAYOUTS: dict[Layout, type[LayoutStrategy]] = {
    "jsonl": JsonlLayout,
    "objects": ObjectsLayout,
    "journal": JournalLayout,
}
"""Layout name -> the strategy a store of that layout writes with."""


def resolve_layout(choice: LayoutChoice, backend: Backend) -> Layout:
    """The layout ``choice`` means on this backend: ``auto`` is the backend's default."""
    return backend.default_layout if choice == "auto" else choice


def producer_layout(choice: LayoutChoice, *, local: bool) -> LayoutChoice:
    """A producer's layout: ``auto`` writes JSONL on a local disk (NeMo Gym's layout) and the
    journal on object stores, where a request per call is what a run costs (spec 2)."""
    return "journal" if choice == "auto" and not local else choice


def open_layout(
    url: str, backend: Backend, choice: LayoutChoice, claims: ClaimsMode, journal: StoreJournal
) -> LayoutStrategy:
    """The strategy a store on ``backend`` writes with; ``ValueError`` naming ``url`` when the
    backend cannot hold the layout (JSONL needs an append) or the claims (a log needs a local disk)."""
    layout = resolve_layout(choice, backend)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'auto' or one of {sorted(LAYOUTS)}; got {layout!r}")
    if layout == "jsonl" and not backend.supports_append:
        raise ValueError(f"{url}: the JSONL layout needs a local disk (object stores have no append)")
    if claims not in ("files", "log"):
        raise ValueError(f"claims must be 'files' or 'log'; got {claims!r}")
    if claims == "log" and not backend.writes_in_place:
        raise ValueError(f"{url}: the claims log needs a local disk (object stores write claim files)")
    return LAYOUTS[layout](backend, claims, journal)
